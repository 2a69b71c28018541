"""Run inside PaddleFormers' venv (paddlepaddle 3.3.1 + paddleformers 0.4.1, not this repository): load our
exports with PaddleFormers' own classes, or make and save models of its own, and write their fp32 logits and
loss. Called by scripts/verify_paddleformers.py, never imported; it imports nothing of this repository.

    python paddleformers_client.py JOBS.json

JOBS.json: a list of jobs, each with "name", "input_ids" and "labels" (.npy), "logits_out" (.npy), and
  "load": a directory (config.json + weights in PaddleFormers' names) -> AutoModelForCausalLM.from_pretrained;
  "save": {"config": config.json dict, "dir": where to save_pretrained, "seed"} -> a model of PaddleFormers'
          own initialization (its norm weights drawn too, so that none is a no-op), saved by PaddleFormers.
Writes a JSON line per job to stdout: name, class, loss, paddleformers / paddle versions.

DeepseekV3ForCausalLM (model_type deepseek_v3) with num_nextn_predict_layers 1 reads S + 1 token ids (the main
model the first S, the MTP module the last S as its embeddings) and its criterion cannot compute the MTP loss
(0.4.1's mtp_sft_loss_forward calls sft_loss_forward without `self`): the client runs its model.model, applies its
lm_head to the main and the MTP hidden states, and takes both cross entropies itself (mean over labels != -100;
the MTP's labels are the main ones shifted by one): loss = main + 0.3 x MTP (multi_token_pred_lambda's default).
Its own models get random router correction biases (a buffer, so not drawn with the parameters) and a zero
eh_proj bias (the published weights have none: models/decoder.py MTPLayer). Its attention runs the "sdpa"
interface: the default "eager" one scales the scores twice (`with_mtp_depth`).
"""

import json
import sys

import numpy as np
import paddle
import paddleformers
from paddleformers.transformers import AutoConfig, AutoModelForCausalLM


def with_mtp_depth(config, raw: dict):
    """PaddleFormers 0.4.1's DeepseekV2Config takes num_nextn_predict_layers as its own argument, then its
    PretrainedConfig.__init__ sets the field again to its mtp_attributes default 0 (configuration_utils.py), so a
    config.json's MTP depth is lost: set it back from the file."""
    if "num_nextn_predict_layers" in raw:
        config.num_nextn_predict_layers = raw["num_nextn_predict_layers"]
    if raw.get("model_type") == "deepseek_v3":
        # DeepSeek's scaled_dot_product_attention (deepseek_v2/modeling.py) multiplies q by softmax_scale x sqrt(d)
        # and passes scaling=softmax_scale on: the "sdpa" interface ignores `scaling` (Paddle's kernel divides by
        # sqrt(d): softmax_scale in all), the default "eager" one multiplies by it again (softmax_scale^2 sqrt(d)).
        config._attn_implementation = "sdpa"
    return config


def for_cpu(config, raw: dict):
    """Ernie4_5_MoeForCausalLM on this CPU build: stand-ins of the GPU-only kernels its MoE layer calls
    (scripts/paddleformers_cpu_kernels.py), and its router losses off. Those (moe_aux_loss_lambda,
    moe_z_loss_lambda, moe_orthogonal_loss_lambda) reach training only as gradients (its decoder layer's
    FakeMoERouterLoss returns the hidden states unchanged and injects them in backward; Ernie4_5_MoeModel's
    all_router_loss stays 0.0), so no logit and no loss value compared here depends on them; computing them calls
    two more GPU-only kernels (int_bincount, cal_aux_loss, nn/moe/topk_gate.py _cal_aux_loss)."""
    if raw.get("model_type") == "ernie4_5_moe":
        import paddleformers_cpu_kernels  # beside this script, which runs as a file: its directory is sys.path[0]

        paddleformers_cpu_kernels.install()
        config.moe_aux_loss_lambda = config.moe_z_loss_lambda = config.moe_orthogonal_loss_lambda = 0.0
    return config


def build_own(spec: dict):
    import tempfile

    config_dir = tempfile.mkdtemp(prefix="pf_config_")
    with open(f"{config_dir}/config.json", "w") as f:
        json.dump(spec["config"], f)
    config = for_cpu(with_mtp_depth(AutoConfig.from_pretrained(config_dir), spec["config"]), spec["config"])
    paddle.seed(spec["seed"])
    model = AutoModelForCausalLM.from_config(config, dtype="float32")
    rng = np.random.default_rng(spec["seed"])
    with paddle.no_grad():
        for name, param in model.named_parameters():
            if len(param.shape) == 1:  # norms around 1 (never exactly 1), so that each one matters
                param.set_value((1.0 + 0.1 * rng.standard_normal(param.shape)).astype("float32"))
            else:  # PaddleFormers' initializer may leave some at 0 on CPU: draw every matrix
                param.set_value((rng.standard_normal(param.shape) / np.sqrt(param.shape[0])).astype("float32"))
            if name.endswith("eh_proj.bias"):
                param.set_value(np.zeros(param.shape, "float32"))
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.set_value((0.05 * rng.standard_normal(buffer.shape)).astype("float32"))
    model.save_pretrained(spec["dir"])
    return model


def main(jobs_file: str) -> None:
    with open(jobs_file) as f:
        jobs = json.load(f)
    for job in jobs:
        if "load" in job:
            with open(f"{job['load']}/config.json") as f:
                raw = json.load(f)
            config = for_cpu(with_mtp_depth(AutoConfig.from_pretrained(job["load"]), raw), raw)
            model = AutoModelForCausalLM.from_pretrained(job["load"], config=config, dtype="float32")
        else:
            model = build_own(job["save"])
        model.eval()
        router_logits = []  # every MoE layer's gate output, in layer order
        for name, layer in model.named_sublayers():
            if name.endswith("mlp.gate") and model.config.model_type == "qwen3_moe":
                layer.register_forward_post_hook(lambda layer, inputs, output: router_logits.append(output))
        input_ids = paddle.to_tensor(np.load(job["input_ids"]))
        labels = paddle.to_tensor(np.load(job["labels"]))
        extra = {}
        if model.config.model_type in ("ernie4_5", "ernie4_5_moe"):
            # Ernie4_5Model builds a causal mask only from an attention_mask (transformers/ernie4_5/modeling.py
            # forward: none given -> none, and its eager attention then lets every token see the whole sequence;
            # its pretraining runs flash attention, causal by itself). All ones: no padding, just the causal mask.
            extra["attention_mask"] = paddle.ones_like(input_ids)
        if model.config.model_type == "deepseek_v3" and model.config.num_nextn_predict_layers:
            print(json.dumps(deepseek_v3_outputs(job, model, input_ids, labels)))
            continue
        with paddle.no_grad():
            out = model(input_ids=input_ids, labels=labels, return_dict=True, **extra)
        loss, aux = float(out.loss), None
        if router_logits:
            # PaddleFormers 0.4.1's Qwen3MoeModel.forward returns no router_logits, so Qwen3MoeForCausalLM's
            # load_balancing_loss_func(None, ...) gives 0 and its loss has no load-balancing term
            # (paddleformers/transformers/qwen3_moe/modeling.py): add it with PaddleFormers' own function on the
            # logits its gates computed, times router_aux_loss_coef, as its forward means to.
            from paddleformers.transformers.qwen3_moe.modeling import load_balancing_loss_func

            assert float(getattr(out, "aux_loss", None) or 0.0) == 0.0
            aux = float(load_balancing_loss_func(tuple(router_logits), model.config.num_experts,
                                                 model.config.num_experts_per_tok))
            loss += model.config.router_aux_loss_coef * aux
        np.save(job["logits_out"], out.logits.astype("float32").numpy())
        print(json.dumps({"name": job["name"], "class": type(model).__name__, "loss": loss, "aux_loss": aux,
                          "paddleformers": paddleformers.__version__, "paddle": paddle.__version__}))


def cross_entropy(logits, labels) -> float:
    per_token = paddle.nn.functional.cross_entropy(logits, labels.unsqueeze(-1), ignore_index=-100, reduction="none")
    keep = (labels != -100).astype("float32")
    return float((per_token.squeeze(-1) * keep).sum() / keep.sum())


def deepseek_v3_outputs(job, model, input_ids, labels) -> dict:
    with paddle.no_grad():
        out = model.model(input_ids=input_ids, return_dict=True)
        logits = model.lm_head(out.last_hidden_state)
        mtp_logits = model.lm_head(out.mtp_outputs[0])
    mtp_labels = paddle.concat([labels[:, 1:], paddle.full_like(labels[:, :1], -100)], axis=1)
    main, mtp = cross_entropy(logits, labels), cross_entropy(mtp_logits, mtp_labels)
    np.save(job["logits_out"], logits.astype("float32").numpy())
    np.save(job["mtp_logits_out"], mtp_logits.astype("float32").numpy())
    return {"name": job["name"], "class": type(model).__name__, "loss": main + 0.3 * mtp, "main_loss": main,
            "mtp_loss": mtp, "paddleformers": paddleformers.__version__, "paddle": paddle.__version__}


if __name__ == "__main__":
    main(sys.argv[1])
