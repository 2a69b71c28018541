"""Run inside PaddleFormers' venv (paddlepaddle 3.3.1 + paddleformers 0.4.1, not this repository): load our
exports with PaddleFormers' own classes, or make and save models of its own, and write their fp32 logits and
loss. Called by scripts/verify_paddleformers.py, never imported; it imports nothing of this repository.

    python paddleformers_client.py JOBS.json

JOBS.json: a list of jobs, each with "name", "input_ids" and "labels" (.npy), "logits_out" (.npy), and
  "load": a directory (config.json + weights in PaddleFormers' names) -> AutoModelForCausalLM.from_pretrained;
  "save": {"config": config.json dict, "dir": where to save_pretrained, "seed"} -> a model of PaddleFormers'
          own initialization (its norm weights drawn too, so that none is a no-op), saved by PaddleFormers.
Writes a JSON line per job to stdout: name, class, loss, paddleformers / paddle versions.
"""

import json
import sys

import numpy as np
import paddle
import paddleformers
from paddleformers.transformers import AutoConfig, AutoModelForCausalLM


def build_own(spec: dict):
    import tempfile

    config_dir = tempfile.mkdtemp(prefix="pf_config_")
    with open(f"{config_dir}/config.json", "w") as f:
        json.dump(spec["config"], f)
    config = AutoConfig.from_pretrained(config_dir)
    paddle.seed(spec["seed"])
    model = AutoModelForCausalLM.from_config(config, dtype="float32")
    rng = np.random.default_rng(spec["seed"])
    with paddle.no_grad():
        for name, param in model.named_parameters():
            if len(param.shape) == 1:  # norms around 1 (never exactly 1), so that each one matters
                param.set_value((1.0 + 0.1 * rng.standard_normal(param.shape)).astype("float32"))
            else:  # PaddleFormers' initializer may leave some at 0 on CPU: draw every matrix
                param.set_value((rng.standard_normal(param.shape) / np.sqrt(param.shape[0])).astype("float32"))
    model.save_pretrained(spec["dir"])
    return model


def main(jobs_file: str) -> None:
    with open(jobs_file) as f:
        jobs = json.load(f)
    for job in jobs:
        if "load" in job:
            model = AutoModelForCausalLM.from_pretrained(job["load"], dtype="float32")
        else:
            model = build_own(job["save"])
        model.eval()
        router_logits = []  # every MoE layer's gate output, in layer order
        for name, layer in model.named_sublayers():
            if name.endswith("mlp.gate"):
                layer.register_forward_post_hook(lambda layer, inputs, output: router_logits.append(output))
        input_ids = paddle.to_tensor(np.load(job["input_ids"]))
        labels = paddle.to_tensor(np.load(job["labels"]))
        extra = {}
        if model.config.model_type == "ernie4_5":
            # Ernie4_5Model builds a causal mask only from an attention_mask (transformers/ernie4_5/modeling.py
            # forward: none given -> none, and its eager attention then lets every token see the whole sequence;
            # its pretraining runs flash attention, causal by itself). All ones: no padding, just the causal mask.
            extra["attention_mask"] = paddle.ones_like(input_ids)
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


if __name__ == "__main__":
    main(sys.argv[1])
