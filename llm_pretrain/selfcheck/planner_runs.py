"""Real CPU trainings of llama-real (hidden 1024) in every layout the planner is checked against (and, in the plain
process, mixtral-real and deepseek-v3-real).

Used by tests/test_planner.py and scripts/planner_accuracy.py (which writes
benchmarks/planner_accuracy.md). Runs sharing fleet's degrees share one launch: 1 plain
process, five 2-process launches and one 4-process launch, then one plain process and one 2-process
launch at 2048 tokens (sep2, cp2). Each run is 2 optimizer steps of
2 micro-batches (1 x 128 tokens): the second step's last backward, with the Adam moments
allocated, is where every layout peaks. No checkpoints (save_steps 0).
"""

from __future__ import annotations

import json
from pathlib import Path

from llm_pretrain.selfcheck.parity import argv, run_launch, run_single, train_records, write_json  # on CPU (their default)

BASE = {
    "model_name_or_path": "llama-real", "max_seq_length": 128, "per_device_train_batch_size": 1,
    "gradient_accumulation_steps": 2, "per_device_eval_batch_size": 1, "learning_rate": 0.001,
    "min_learning_rate": 0.0001, "warmup_steps": 1, "max_steps": 2, "logging_steps": 1, "save_steps": 0,
    "max_grad_norm": 1.0, "weight_decay": 0.01, "do_eval": False, "disable_tqdm": True, "seed": 7,
    "device": "cpu", "overwrite_output_dir": True,
}

# llama-tiny (hidden 64) with 2 layers at 2048 tokens: the scores (4 heads x 2048^2 floats per layer) dominate.
LONG = {"model_name_or_path": "llama-tiny", "num_hidden_layers": 2, "max_seq_length": 2048}

# launch name -> (processes, {run name: overrides}); a launch's runs share fleet's degrees.
LAUNCHES = {
    # deepseek-v3-real: latent attention (q/k and v at their own widths), a dense and a MoE layer, MTP (issue 35)
    "single": (1, {"single": {}, "mixtral-real": {"model_name_or_path": "mixtral-real"},
                   "deepseek-v3-real": {"model_name_or_path": "deepseek-v3-real", "gradient_accumulation_steps": 1}}),
    # expert parallelism runs on the data-parallel ranks: the same fleet layout as dp2
    "dp2": (2, {"dp2": {}, "mixtral-real ep2": {"model_name_or_path": "mixtral-real", "expert_parallel_degree": 2}}),
    "tp2": (2, {
        "tp2": {"tensor_parallel_degree": 2},
        "tp2 + SP": {"tensor_parallel_degree": 2, "sequence_parallel": True},
        "tp2 + SP, recompute full": {"tensor_parallel_degree": 2, "sequence_parallel": True, "recompute": True,
                                     "recompute_granularity": "full"},
        "tp2 + SP, recompute full_attn": {"tensor_parallel_degree": 2, "sequence_parallel": True, "recompute": True,
                                          "recompute_granularity": "full_attn"},
        "tp2 + SP, recompute core_attn": {"tensor_parallel_degree": 2, "sequence_parallel": True, "recompute": True,
                                          "recompute_granularity": "core_attn"},
    }),
    "pp2": (2, {"pp2 1F1B": {"pipeline_parallel_degree": 2}}),
    # Stages 2 and 3 end their launch: Paddle's group-sharded wrappers stay alive after the run (their
    # parameter hooks hold them, a cycle through C++ that gc cannot collect), so a run after them
    # would count their memory too.
    "sharding": (2, {
        "sharding 2, stage 1": {"sharding": "stage1"},
        "sharding 2, stage 2": {"sharding": "stage2"},
    }),
    "sharding3": (2, {"sharding 2, stage 3": {"sharding": "stage3"}}),
    "pp4": (4, {"pp4 vpp2 interleaved (8 layers)": {"pipeline_parallel_degree": 4, "virtual_pp_degree": 2,
                                                    "num_hidden_layers": 8, "gradient_accumulation_steps": 4}}),
    # Long sequences on a small width (issue 22): attention dominates; sep2 and cp2 share fleet's degrees.
    "long": (1, {"long, 1 process": LONG}),
    "long_seq2": (2, {"long, sep2": {**LONG, "sep_parallel_degree": 2},
                      "long, cp2": {**LONG, "context_parallel_degree": 2}}),
}


def _slug(name: str) -> str:
    return "".join(ch if ch.isalnum() else "_" for ch in name)


def run_all(corpus: dict, work_dir: Path) -> list[dict]:
    """Train every layout; returns [{name, nproc, args_file, overrides, output_dir, measured_mb, rss_mb}]."""
    work_dir = Path(work_dir)
    base = dict(BASE, tokenizer_name_or_path=corpus["tokenizer"], input_dir=corpus["input_dir"],
                data_cache=str(work_dir / "index-cache"))
    args_file = write_json(work_dir / "llama_real.json", base)
    results = []
    for launch, (nproc, runs) in LAUNCHES.items():
        commands = [argv(args_file, work_dir / _slug(name), **overrides) for name, overrides in runs.items()]
        if nproc == 1:
            run_single(commands, work_dir, launch)
        else:
            run_launch(nproc, commands, work_dir, launch, timeout=900)
        for name, overrides in runs.items():
            records = train_records(work_dir / _slug(name))
            results.append({
                "name": name, "nproc": nproc, "args_file": str(args_file), "overrides": overrides,
                "output_dir": str(work_dir / _slug(name)),
                "measured_mb": max(r["peak_mem_allocated_mb"] for r in records),
                "rss_mb": max(r["peak_rss_mb"] for r in records),
            })
    return results


def predict(run: dict) -> dict:
    """The planner's estimate for a measured run (its argument file, overrides and process count)."""
    from llm_pretrain.arguments import parse_arguments
    from llm_pretrain.planner.estimate import estimate

    overrides = []
    for key, value in run["overrides"].items():
        overrides += [f"--{key}", json.dumps(value) if isinstance(value, bool) else str(value)]
    args, _ = parse_arguments([run["args_file"]] + overrides)
    return estimate(args, run["nproc"], "cpu")
