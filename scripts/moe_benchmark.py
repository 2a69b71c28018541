"""CPU speed of a mixture-of-experts model: this toolkit vs PaddleNLP 2.8.1's MixtralForCausalLM, trained the same way.

    python scripts/moe_benchmark.py [--steps 8 --warmup 2 --rounds 2 --out benchmarks/]

The same Mixtral (MODEL: mixtral-tiny's structure at width 256: 4 layers, 8 heads / 4 kv heads,
8 SwiGLU experts of width 688, top 2, load-balancing loss 0.02), batch, sequence length, AdamW (lr,
betas, eps, weight decay, clip 1.0, constant lr), fp32, initial weights (ours, models/weights.py,
converted to PaddleNLP's names) and token samples (our dataset, same order), trained by (a)
llm_pretrain/run_pretrain.py and (b) paddlenlp.trainer.Trainer with MixtralForCausalLM
(output_router_logits on, so that its loss has the same aux loss), --rounds times each, alternating,
both in the "tuned" environment of scripts/cpu_speed_benchmark.py (every core for Paddle's threads).
PaddleNLP 2.8.1's MixtralSparseMoeBlock.forward fails under Paddle 3.3.1 (an index shape, see
tests/test_reference_parity.py moe_block_forward): its loop runs with that one index reshaped.
Speed, both sides alike: tokens of a step / that step's wall time, median over the steps after each
run's warm-up, the runs of a side pooled (scripts/cpu_speed_benchmark.py's definitions and timers).
Beside them, in the same run and on the same budget (steps, batch x sequence, optimizer, environment,
rounds alternated with the Mixtral runs), ours alone trains the tiny presets of the MoE families that
PaddleNLP 2.8.1 has no class for (OURS_ONLY; --families picks some or none): their tokens/s, not a
comparison with a peer.
Writes OUT/moe.json and OUT/moe.md (a hand-written "## Findings" section at its end is kept).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
import cpu_speed_benchmark as csb  # scripts/ (this script's directory): run, timers, speed definitions; no Paddle
from llm_pretrain.observe import perf
from llm_pretrain.cli.benchmark import forced_arguments


def reference_moe_block_forward():
    """tests/test_reference_parity.py's moe_block_forward (PaddleNLP's block made runnable under Paddle
    3.3.1), loaded from its file in this checkout: one copy for the test and this benchmark."""
    import importlib.util

    path = os.path.join(REPO_ROOT, "tests", "test_reference_parity.py")
    spec = importlib.util.spec_from_file_location("test_reference_parity", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.moe_block_forward

ENVIRONMENT = "tuned"
MODEL = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
             intermediate_size=688, vocab_size=csb.VOCAB, num_experts=8, num_experts_per_tok=2,
             router_aux_loss_coef=0.02, rope_theta=1e6, norm_eps=1e-5)
SEQ, BATCH = 256, 8
# Ours only (PaddleNLP 2.8.1 has no Qwen3-MoE or ERNIE 4.5 MoE class): family -> (name in the file, built-in preset)
OURS_ONLY = {"qwen3_moe": ("Qwen3-MoE", "qwen3-moe-tiny"), "ernie4_5_moe": ("ERNIE-4.5-MoE", "ernie4_5_moe-tiny")}


def paddlenlp_worker(spec_path: str) -> None:
    """PaddleNLP's Trainer + MixtralForCausalLM on our samples from our initial weights."""
    import types

    import paddle
    from paddlenlp.transformers import MixtralConfig, MixtralForCausalLM

    from models.registry import make_config
    from models.decoder import CausalLM
    from models.paddlenlp_interop import to_paddlenlp_state
    from models.weights import init_weights
    moe_block_forward = reference_moe_block_forward()

    with open(spec_path, encoding="utf-8") as f:
        spec = json.load(f)
    seq, m = spec["seq"], MODEL
    config = MixtralConfig(vocab_size=m["vocab_size"], hidden_size=m["hidden_size"],
                           intermediate_size=m["intermediate_size"], num_hidden_layers=m["num_hidden_layers"],
                           num_attention_heads=m["num_attention_heads"], num_key_value_heads=m["num_key_value_heads"],
                           max_position_embeddings=seq, seq_length=seq, rms_norm_eps=m["norm_eps"],
                           rope_theta=m["rope_theta"], num_local_experts=m["num_experts"],
                           num_experts_per_tok=m["num_experts_per_tok"], router_aux_loss_coef=m["router_aux_loss_coef"],
                           output_router_logits=True, use_cache=False, use_flash_attention=False,
                           use_fused_rope=False, tensor_parallel_output=False, use_recompute=False,
                           sequence_parallel=False, tie_word_embeddings=False, dtype="float32")
    model = MixtralForCausalLM(config)
    for layer in model.mixtral.layers:
        layer.block_sparse_moe.forward = types.MethodType(moe_block_forward, layer.block_sparse_moe)
    ours_config = make_config("mixtral", **MODEL, max_position_embeddings=seq, seq_length=seq)
    ours = CausalLM(ours_config)
    init_weights(ours, ours_config, csb.SEED)
    state = to_paddlenlp_state(ours_config, {k: v.numpy() for k, v in ours.state_dict().items()})
    missing, unexpected = model.set_state_dict({k: paddle.to_tensor(v) for k, v in state.items()})
    assert not missing and not unexpected, (missing, unexpected)
    del ours
    csb.train_with_paddlenlp_trainer(model, spec)


def mixtral_dir(root: str) -> str:
    """MODEL as a model directory (a config.json without weights: trained from models/weights.py's init)."""
    model_dir = os.path.join(root, "model")
    os.makedirs(model_dir, exist_ok=True)
    with open(os.path.join(model_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump({"family": "mixtral", **MODEL, "max_position_embeddings": SEQ}, f)
    return model_dir


def train_ours(root: str, corpus: dict, steps: int, round_: int, model: str, name: str = "ours") -> dict:
    """run_pretrain.py on `model` (a directory or a built-in preset); the same arguments for every model."""
    out = os.path.join(root, "runs", f"{name}-{round_}")
    command = [sys.executable, csb.RUN_PRETRAIN, csb.ARGS_FILE, *forced_arguments(steps, out), "--model_name_or_path",
               model, "--tokenizer_name_or_path", corpus["tokenizer"], "--input_dir", corpus["input_dir"],
               "--data_cache", os.path.join(root, "cache"), "--max_seq_length", str(SEQ),
               "--per_device_train_batch_size", str(BATCH), "--gradient_accumulation_steps", "1",
               "--lr_scheduler_type", "constant", "--warmup_steps", "0",
               "--min_learning_rate", str(csb.OPTIM["learning_rate"]), "--seed", str(csb.SEED), "--device", "cpu"]
    for key, value in csb.OPTIM.items():
        command += [f"--{key}", str(value)]
    csb.run(command, ENVIRONMENT, out + ".log")
    train = [r for r in perf.last_run(perf.read_jsonl(os.path.join(out, perf.TRAIN_LOG))) if r["event"] == "train"]
    loop = [{"step": b["step"], "tokens_per_card_per_sec": b["global_tokens_per_step"] / (b["time"] - a["time"])}
            for a, b in zip(train, train[1:])]
    return {"step_records": train, "loop_records": loop, "losses": [r["loss"] for r in train],
            "effective_environment": csb.ours_effective_environment(ENVIRONMENT, out + ".log")}


def train_paddlenlp(root: str, corpus: dict, steps: int, round_: int) -> dict:
    out = os.path.join(root, "runs", f"paddlenlp-{round_}")
    os.makedirs(out, exist_ok=True)
    spec_path = os.path.join(out, "spec.json")
    with open(spec_path, "w", encoding="utf-8") as f:
        json.dump({"output_dir": out, "steps": steps, "batch": BATCH, "seq": SEQ, "input_dir": corpus["input_dir"],
                   "data_cache": os.path.join(root, "cache")}, f)
    csb.run([sys.executable, os.path.abspath(__file__), "--worker", spec_path], ENVIRONMENT, out + ".log")
    with open(os.path.join(out, "steps.json"), encoding="utf-8") as f:
        result = json.load(f)
    tokens = BATCH * SEQ
    steps_ = [{"step": s["step"], "tokens_per_card_per_sec": tokens / (s["end"] - s["begin"]),
               "step_time_s": s["end"] - s["begin"]} for s in result["steps"]]
    loop = [{"step": b["step"], "tokens_per_card_per_sec": tokens / (b["end"] - a["end"])}
            for a, b in zip(result["steps"], result["steps"][1:])]
    return {"step_records": steps_, "loop_records": loop, "losses": result["losses"], "params": result["params"],
            "effective_environment": result["effective_environment"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default=os.path.join(REPO_ROOT, "benchmarks"))
    parser.add_argument("--families", default=",".join(OURS_ONLY),
                        help=f"ours-only rows beside the Mixtral pair, comma-separated ({', '.join(OURS_ONLY)}; "
                             "'' for none)")
    parser.add_argument("--worker")
    options = parser.parse_args()
    families = [f for f in options.families.split(",") if f]
    for family in families:
        if family not in OURS_ONLY:
            parser.exit(2, f"error: --families: {family!r} is not one of {', '.join(OURS_ONLY)}\n")
    if options.worker:
        paddlenlp_worker(options.worker)
        return
    from llm_pretrain.data import ensure_embedded_corpus
    from models.registry import ARCHITECTURES, activated_parameter_count, make_config, parameter_count

    root = tempfile.mkdtemp(prefix="moe_benchmark_")
    corpus = ensure_embedded_corpus(os.path.join(root, "embedded"))
    load_before = list(os.getloadavg())  # other jobs on the machine: the same for every row (runs alternate)
    raws = {"ours": [], "paddlenlp": [], **{family: [] for family in families}}
    model_dir = mixtral_dir(root)
    for round_ in range(options.rounds):
        raws["ours"].append(train_ours(root, corpus, options.steps, round_, model_dir))
        raws["paddlenlp"].append(train_paddlenlp(root, corpus, options.steps, round_))
        for family in families:
            raws[family].append(train_ours(root, corpus, options.steps, round_, OURS_ONLY[family][1], family))
    load_after = list(os.getloadavg())
    speeds = {side: csb.speed(runs, options.warmup) for side, runs in raws.items()}
    others = {}
    for family in families:
        # the run's model: the preset with its vocabulary grown to the tokenizer's (llm_pretrain/parallel/layout.py)
        config = ARCHITECTURES[OURS_ONLY[family][1]].replace()
        config.vocab_size = max(config.vocab_size, csb.VOCAB)
        others[family] = {"preset": OURS_ONLY[family][1], "params": parameter_count(config),
                          "activated_params": activated_parameter_count(config), "hidden_size": config.hidden_size,
                          "num_hidden_layers": config.num_hidden_layers, "num_experts": config.num_experts,
                          "num_experts_per_tok": config.num_experts_per_tok,
                          "expert_intermediate_size": config.expert_intermediate_size,
                          "shared_expert_intermediate_size": config.shared_expert_intermediate_size,
                          "moe_layers": config.moe_layer_count}
    loss_diff = max(abs(a - b) for a, b in zip(raws["ours"][0]["losses"], raws["paddlenlp"][0]["losses"]))
    params = parameter_count(make_config("mixtral", **MODEL))
    from importlib.metadata import version

    env = {**perf.collect_environment(measure_cpu_peak=False), "paddlenlp_version": version("paddlenlp")}
    result = {"time": datetime.datetime.now().isoformat(timespec="seconds"), "model": MODEL, "params": params,
              "paddlenlp_params": raws["paddlenlp"][0]["params"], "seq": SEQ, "batch": BATCH, "optim": csb.OPTIM,
              "steps": options.steps, "warmup": options.warmup, "rounds": options.rounds, "speeds": speeds,
              "largest_loss_difference": loss_diff, "ours_only": others,
              "load_average_1_5_15_min": {"before": load_before, "after": load_after}, "environment": env, "raw": raws}
    os.makedirs(options.out, exist_ok=True)
    with open(os.path.join(options.out, "moe.json"), "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)
    ours, theirs = speeds["ours"], speeds["paddlenlp"]
    lines = [
        "# CPU speed of a mixture-of-experts model: this toolkit vs PaddleNLP's MixtralForCausalLM", "",
        f"`python scripts/moe_benchmark.py`, {result['time']}: Paddle {env.get('paddle_version')}, "
        f"PaddleNLP {env.get('paddlenlp_version')}; both sides with OMP_NUM_THREADS={csb.flops.cpu_count()} "
        f"(ours ran with {raws['ours'][0]['effective_environment']}, PaddleNLP with "
        f"{raws['paddlenlp'][0]['effective_environment']}). Raw figures: `moe.json`.", "",
        "DeepSeek-V3's auxiliary-loss-free balancing (the router bias rule on and off, 200 steps, expert load per "
        "layer and the loss): [moe_balance.md](moe_balance.md) (`scripts/moe_balance_benchmark.py`).", "",
        f"Mixtral: hidden {MODEL['hidden_size']}, {MODEL['num_hidden_layers']} layers, "
        f"{MODEL['num_attention_heads']} heads ({MODEL['num_key_value_heads']} kv), {MODEL['num_experts']} experts of "
        f"width {MODEL['intermediate_size']}, top {MODEL['num_experts_per_tok']}, aux loss coefficient "
        f"{MODEL['router_aux_loss_coef']}, vocab {MODEL['vocab_size']} ({params:,} parameters; PaddleNLP's model: "
        f"{result['paddlenlp_params']:,}); batch {BATCH} x {SEQ} tokens; AdamW lr {csb.OPTIM['learning_rate']} "
        f"constant, clip {csb.OPTIM['max_grad_norm']}; fp32; {options.rounds} alternating runs per side of "
        f"{options.steps} steps, medians after each run's {options.warmup} warm-up steps.", "",
        "| ours tokens/s | PaddleNLP tokens/s | ratio ours/PaddleNLP | step ms ours / PaddleNLP | loop tokens/s ours / PaddleNLP | largest loss difference |",
        "|---|---|---|---|---|---|",
        f"| {ours['tokens_per_sec']:.0f} | {theirs['tokens_per_sec']:.0f} | "
        f"**{ours['tokens_per_sec'] / theirs['tokens_per_sec']:.2f}** | {1000 * ours['step_time_s']:.0f} / "
        f"{1000 * theirs['step_time_s']:.0f} | {ours['loop_tokens_per_sec']:.0f} / {theirs['loop_tokens_per_sec']:.0f} "
        f"| {loss_diff:.1e} |", "",
        "The loss difference is over the first round's steps (same weights, samples and optimizer: the sides compute "
        "the same training; differences are float rounding amplified by the steps).", "",
        f"Load average (1, 5, 15 min) of the machine: {', '.join(f'{x:.1f}' for x in load_before)} before the runs, "
        f"{', '.join(f'{x:.1f}' for x in load_after)} after, on {csb.flops.cpu_count()} cores (other jobs shared "
        "them: absolute tokens/s are low; the runs alternate so that every row sees the same load).", "",
    ]
    if families:
        mixtral = make_config("mixtral", **MODEL)
        rows = [("Mixtral", "ours", speeds["ours"], raws["ours"][0], params, activated_parameter_count(mixtral)),
                ("Mixtral", f"PaddleNLP {env.get('paddlenlp_version')}", speeds["paddlenlp"], raws["paddlenlp"][0],
                 result["paddlenlp_params"], activated_parameter_count(mixtral))]
        rows += [(OURS_ONLY[f][0] + f" (`{others[f]['preset']}`)", "ours", speeds[f], raws[f][0], others[f]["params"],
                  others[f]["activated_params"]) for f in families]
        lines += [
            "## Our other MoE families on the same budget", "",
            "Ours alone (PaddleNLP 2.8.1 has no Qwen3-MoE or ERNIE 4.5 MoE class), in the same run, alternating "
            "with the Mixtral runs: same batch, sequence, optimizer, steps, warm-up and threads; the tiny presets "
            "(vocabulary grown to the tokenizer's, as run_pretrain.py does): " + "; ".join(
                f"{OURS_ONLY[f][0]}: hidden {o['hidden_size']}, {o['num_hidden_layers']} layers ({o['moe_layers']} MoE), "
                f"{o['num_experts']} experts of width {o['expert_intermediate_size']}, top {o['num_experts_per_tok']}"
                + (f", a shared expert of width {o['shared_expert_intermediate_size']}"
                   if o["shared_expert_intermediate_size"] else "")
                for f, o in others.items()) + ". Much smaller than the Mixtral: compare the rows' tokens/s as "
            "models of different sizes, not as implementations.", "",
            "| model | implementation | parameters (activated) | tokens/s | step ms | loop tokens/s | loss, first to last step (round 1) |",
            "|---|---|---|---|---|---|---|",
        ]
        lines += [f"| {model} | {side} | {total:,} ({active:,}) | {speed['tokens_per_sec']:.0f} | "
                  f"{1000 * speed['step_time_s']:.0f} | {speed['loop_tokens_per_sec']:.0f} | "
                  f"{raw['losses'][0]:.4f} to {raw['losses'][-1]:.4f} |"
                  for model, side, speed, raw, total, active in rows]
        lines.append("")
    perf.write_keeping_findings(os.path.join(options.out, "moe.md"), "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
