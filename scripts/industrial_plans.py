"""Published industrial layouts through the planner: benchmarks/industrial_plans.md.

    python scripts/industrial_plans.py [--out benchmarks/industrial_plans.md] [--write-presets]

Per model: the published layout (validated by the trainer's own checks: refused ones are listed
with the trainer's reason), its predicted memory and TFLOP/s per GPU next to the published figure,
and the planner's best layout for the same GPUs (`planner.search`). --write-presets writes the best
layout of models whose published layout we refuse into configs/industrial/.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

from llm_pretrain.errors import UsageArgumentParser, UsageError

# Published runs. TFLOP/s per GPU as the papers report them (hardware FLOPs, recompute included), quoted
# from the papers named; `layout` is what we feed our trainer (None: the argument file in configs/industrial/).
PUBLISHED = [
    {"model": "BLOOM-176B", "name": "bigscience/bloom", "gpus": 384, "device": "A100-80G", "seq": 2048, "batch": 2048,
     "published": "DP 8 x TP 4 x PP 12, ZeRO-1, micro-batch 2, bf16 (Le Scao et al. 2022, BigScience)",
     "tflops": "156 in the fastest configuration (Le Scao et al. 2022, sec. 3.4); about 150 during training, "
               "~60 GB used per GPU (BigScience 176B training page, bigscience.notion.site)",
     "layout": {"tensor_parallel_degree": 4, "pipeline_parallel_degree": 12, "sharding": "stage1",
                "sharding_parallel_degree": 8, "per_device_train_batch_size": 2, "gradient_accumulation_steps": 128,
                "bf16": True},
     "note": "70 decoder layers on 12 stages: fleet's uniform split as PaddleNLP, [5, 6 x 10, 5] (Megatron-"
             "DeepSpeed likewise counts the embedding and head as pipeline layers: 72 = 12 x 6)"},
    {"model": "GPT-3 175B", "name": "gpt3-175B-en", "gpus": 1024, "device": "A100-80G", "seq": 2048, "batch": 1536,
     "published": "TP 8 x PP 8 x DP 16 on 1024 A100-80G, batch 1536 (Narayanan et al. 2021, the 175B estimate; "
                  "degrees of Table 1's 145.6B row)",
     "tflops": "140 (Narayanan et al. 2021)", "file": "configs/industrial/pretrain-gpt3_175b-pp8tp8.json"},
    {"model": "MT-NLG 530B", "name": "mt-nlg-530B-gpt3", "gpus": 4480, "device": "A100-80G", "seq": 2048,
     "batch": 1920, "published": "TP 8 x PP 35 x DP 16 on 4480 A100-80G, batch 1920 (Smith et al. 2022)",
     "tflops": "113-126 (Smith et al. 2022)", "file": "configs/industrial/pretrain-mt_nlg_530b-pp35tp8.json"},
    {"model": "GPT-NeoX-20B", "name": "gpt-neox-20B-gpt3", "gpus": 96, "device": "A100-40G", "seq": 2048,
     "batch": 1536, "published": "TP 2 x PP 4 x ZeRO-1 over 12 on 96 A100-40G (Black et al. 2022); batch 1538 "
                                 "there, 1536 here (divisible by 12 x micro-batch 4)",
     "tflops": "117 (Black et al. 2022)", "file": "configs/industrial/pretrain-gpt_neox_20b-pp4tp2sd12_stage1.json"},
    {"model": "OPT-175B", "name": "opt-175B-gpt3", "gpus": 992, "device": "A100-80G", "seq": 2048, "batch": 992,
     "published": "TP 8 with fully sharded data parallelism over 124 on 992 A100-80G (Zhang et al. 2022)",
     "tflops": "147 (Zhang et al. 2022)",
     "layout": {"tensor_parallel_degree": 8, "sharding": "stage3", "sharding_parallel_degree": 124,
                "per_device_train_batch_size": 8, "gradient_accumulation_steps": 1, "fp16": True}},
]


def _args(entry: dict):
    from llm_pretrain.arguments import Arguments, parse_arguments, validate_arguments
    from llm_pretrain.planner.search import base_arguments

    if "file" in entry:
        return parse_arguments([str(ROOT / entry["file"])])[0]
    values = dict(base_arguments(entry["name"], entry["seq"], entry["device"]), recompute=True,
                  recompute_granularity="full", fp16_opt_level="O2", amp_master_grad=True, **entry["layout"])
    values["bf16"], values["fp16"] = bool(values.get("bf16") and not entry["layout"].get("fp16")), \
        bool(entry["layout"].get("fp16"))
    args = Arguments(**values)
    validate_arguments(args)
    return args


def _cells(result: dict) -> str:
    return (f"{result['peak_mem_allocated_mb'] / 1024:,.1f} / {result['peak_mem_reserved_mb'] / 1024:,.1f} GiB"
            f" ({'fits' if result['fits'] else 'does not fit'}) | {result['hardware_tflops_per_card']:.0f}"
            f" ({result['tflops_per_card']:.0f} model) | {100 * result['mfu']:.0f} % | {result['bottleneck']}")


def main(argv: list[str]) -> int:
    parser = UsageArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "industrial_plans.md"))
    parser.add_argument("--write-presets", action="store_true")
    parser.add_argument("--top", type=int, default=1)
    opts = parser.parse_args(argv)
    from llm_pretrain.planner.estimate import estimate
    from llm_pretrain.planner.search import search, write_arguments

    lines = ["# Industrial layouts through the planner", "",
             "Written by `python scripts/industrial_plans.py`. Memory: predicted peak allocated / reserved per GPU "
             "(the rank with the highest peak). TFLOP/s per GPU: hardware FLOPs (recompute included, as the papers "
             "count) and model FLOPs; MFU from model FLOPs. Published figures as reported by the papers named "
             "(quoted, not re-derived). The GPT-NeoX and OPT shapes are our GPT-3 family with their sizes "
             "(models/registry.py says what differs). All runs: sequence 2048, full recompute, O2 with fp32 "
             "master gradients, flash attention, the planner's default links (NVLink 240 GB/s, InfiniBand 25 GB/s "
             "per GPU, 8 GPUs per node).", "",
             "| model | GPUs | published layout | our strategy | predicted memory | predicted TFLOP/s per GPU | "
             "MFU | bottleneck | published TFLOP/s per GPU |", "|---|---:|---|---|---|---:|---:|---|---|"]
    refused, best_rows = [], []
    for entry in PUBLISHED:
        try:
            args = _args(entry)
            result = estimate(args, entry["gpus"], entry["device"])
            lines.append(f"| {entry['model']} | {entry['gpus']} x {entry['device']} | {entry['published']} | "
                         f"{result['strategy']} | {_cells(result)} | {entry['tflops']} |")
        except UsageError as error:
            refused.append(f"- **{entry['model']}** ({entry['published']}): refused by the trainer's validation: "
                           f"`error: {error}`" + (f" ({entry['note']})" if entry.get("note") else ""))
            lines.append(f"| {entry['model']} | {entry['gpus']} x {entry['device']} | {entry['published']} | refused "
                         "(below) | - | - | - | - | " + entry["tflops"] + " |")
        found = search(entry["name"], entry["device"], entry["gpus"], entry["seq"], entry["batch"], top=opts.top)
        if found["top"]:
            best = found["top"][0]
            a = best["arguments"]
            recompute = a["recompute_granularity"] if a["recompute"] else "none"
            best_rows.append(f"| {entry['model']} | {best['strategy']} | micro-batch {a['per_device_train_batch_size']}"
                             f" x {a['gradient_accumulation_steps']}, SP {'on' if a['sequence_parallel'] else 'off'},"
                             f" recompute {recompute} | {_cells(best)} | {found['examined']} / "
                             f"{found['refused_by_trainer']} / {found['fitting']} |")
            if opts.write_presets and "file" not in entry:
                print("wrote", write_arguments(a, str(ROOT / "configs" / "industrial") + os.sep))
        else:
            best_rows.append(f"| {entry['model']} | no layout fits | - | - | - | - | - | - |")
    lines += ["", "## The planner's best layout for the same GPUs and global batch", "",
              "| model | strategy | batch | predicted memory | predicted TFLOP/s per GPU | MFU | bottleneck | "
              "examined / refused / fitting |", "|---|---|---|---|---:|---:|---|---|"] + best_rows
    lines += ["", "## Published layouts we refuse", ""] + (refused or ["(none)"])
    Path(opts.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
