"""Every layout the trainer accepts for a model on a GPU cluster, ranked by predicted tokens/card/s.

Candidates: tensor-parallel degree (inside a node unless allowed across), a sequence split (none,
segment parallelism sep or ring-attention context parallelism cp, of degrees dividing the rest),
pipeline degree with 1F1B or 2-4 virtual stages, sharding stage 0-3 with its degree, the data-parallel rest,
sequence parallelism with tensor parallelism, recompute none/full/full_attn/core_attn, and
micro-batch sizes dividing the global batch. Each candidate is an `Arguments` object checked by
the trainer's own functions (plan_layout, check_model_fits_layout, check_strategy): a layout
the trainer refuses never appears. Those whose predicted reserved memory stays under the card's
memory minus the headroom are kept and ranked.
"""

from __future__ import annotations

import heapq
import json
import re

from llm_pretrain.arguments import Arguments, validate_arguments
from llm_pretrain.errors import UsageError
from llm_pretrain.planner import device_memory_mb, estimate_setup
from llm_pretrain.planner.estimate import validated_setup

DEFAULT_HEADROOM = 0.10  # keep 10 % of the card free (CUDA context, NCCL buffers, allocator growth)
RECOMPUTE_CHOICES = (None, "full_attn", "core_attn", "full")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def base_arguments(model: str, seq: int, device: str) -> dict:
    """The run-independent keys of a written file, in configs/ style (bf16 O2 on GPUs with bf16)."""
    from llm_pretrain.observe.flops import PEAK_TFLOPS, match_device

    bf16 = "bf16" in PEAK_TFLOPS.get(match_device(device) or "", {})
    return {
        "model_name_or_path": model, "tokenizer_name_or_path": model, "input_dir": "./data",
        "output_dir": "./output", "split": "949,50,1", "max_seq_length": seq,
        "learning_rate": 3e-05, "min_learning_rate": 3e-06, "weight_decay": 0.01, "warmup_ratio": 0.01,
        "max_grad_norm": 1.0, "max_steps": 1000, "logging_steps": 1, "save_steps": 1000, "eval_steps": 1000,
        "bf16": bf16, "fp16": not bf16, "fp16_opt_level": "O2", "amp_master_grad": True,
        "use_flash_attention": True, "do_train": True, "disable_tqdm": True,
    }


def candidates(model: str, gpus: int, gpus_per_node: int, seq: int, global_batch: int, device: str,
               allow_inter_node_tp: bool = False, max_micro_batch: int = 8):
    """Arguments dicts of every combination (validity is checked by `search`)."""
    from models.registry import resolve_model

    config = resolve_model(model)[0]
    layers = config.num_hidden_layers
    base = base_arguments(model, seq, device)
    for tp in _divisors(gpus):
        if tp > gpus_per_node and not allow_inter_node_tp:
            continue
        splits = [("", 1)] + [(key, d) for d in _divisors(gpus // tp) if d > 1
                              for key in ("sep_parallel_degree", "context_parallel_degree")]
        for split_key, split in splits:
            # Pipeline degrees that do not divide the layers split them unevenly (layout.pipeline_split); one
            # that would leave a stage empty is refused by check_strategy.
            for pp in [p for p in _divisors(gpus // (tp * split)) if p <= layers]:
                for vpp in ([1] if pp <= 2 else [1, 2, 4]):
                    rest = gpus // (tp * pp * split)
                    for stage in (0, 1, 2, 3):
                        # Sharding over every data replica (PaddleNLP's default degree, world / (tp x pp)) or over
                        # part of them with data parallelism across the groups (small clusters only: the
                        # combinations multiply).
                        degrees = [d for d in _divisors(rest) if d > 1] if rest <= 64 else [rest]
                        for sd in ([1] if stage == 0 else degrees):
                            dp = rest // sd
                            for sp in ([False] if tp == 1 else [True]):
                                for recompute in RECOMPUTE_CHOICES:
                                    micro = 1
                                    while micro <= max_micro_batch:
                                        replicas = dp * sd
                                        if global_batch % (replicas * micro) == 0:
                                            args = dict(base, tensor_parallel_degree=tp, pipeline_parallel_degree=pp,
                                                        virtual_pp_degree=vpp, sequence_parallel=sp,
                                                        per_device_train_batch_size=micro,
                                                        per_device_eval_batch_size=micro,
                                                        gradient_accumulation_steps=global_batch // (replicas * micro),
                                                        recompute=recompute is not None,
                                                        recompute_granularity=recompute or "full")
                                            if stage:
                                                args.update(sharding=f"stage{stage}", sharding_parallel_degree=sd)
                                            if split_key:
                                                args[split_key] = split
                                            yield args
                                            if (config.is_moe and not stage and not split_key and dp > 1
                                                    and config.num_experts % dp == 0):
                                                # the experts split over the data-parallel ranks (models/moe.py)
                                                yield dict(args, expert_parallel_degree=dp)
                                        micro *= 2


def refusal_reason(message: str) -> str:
    """A refusal message with its numbers and lists replaced by N: one reason for many layouts."""
    return re.sub(r"\[[^\]]*\]|\d[\d,.]*", "N", message)


def search(model: str, device: str, gpus: int, seq: int, global_batch: int, gpus_per_node: int = 8,
           top: int = 5, headroom: float = DEFAULT_HEADROOM, cluster_options: dict | None = None,
           allow_inter_node_tp: bool = False, closest: int = 5) -> dict:
    """The fitting layouts, fastest first; and why the others were left out: `refusals` (the trainer's
    reasons, counted) and `closest` (the `closest` layouts that validate but miss the memory limit by the
    least: reserved and limit in MiB)."""
    capacity = device_memory_mb(device)
    options = dict(cluster_options or {}, gpus_per_node=gpus_per_node)
    fitting, examined, refused = [], 0, 0
    reasons: dict[str, dict] = {}
    too_large: list[tuple[float, int, dict]] = []  # heap of (-excess, order, entry): the `closest` smallest
    for values in candidates(model, gpus, gpus_per_node, seq, global_batch, device, allow_inter_node_tp):
        examined += 1
        try:
            args = Arguments(**values)
            validate_arguments(args)
            setup, layout, _ = validated_setup(args, gpus, device)
        except UsageError as error:
            refused += 1
            reason = reasons.setdefault(refusal_reason(str(error)), {"count": 0, "example": str(error)})
            reason["count"] += 1
            continue
        result = estimate_setup(setup, device, options)
        limit = capacity * (1 - headroom) if capacity is not None else None
        if limit is not None and result["peak_mem_reserved_mb"] > limit:
            excess = result["peak_mem_reserved_mb"] - limit
            entry = {"strategy": layout.strategy, "arguments": values, "reserved_mb": result["peak_mem_reserved_mb"],
                     "limit_mb": limit, "over_mb": excess, "peak_rank": result["peak_rank"]}
            heapq.heappush(too_large, (-excess, examined, entry))
            if len(too_large) > closest:
                heapq.heappop(too_large)
            continue
        result["strategy"] = layout.strategy + (f"ep{values['expert_parallel_degree']}"
                                                if values.get("expert_parallel_degree", 1) > 1 else "")
        result["arguments"] = values
        fitting.append(result)
    # Fastest first; among equally fast layouts the one with the most memory left.
    fitting.sort(key=lambda r: (-r["tokens_per_card_per_sec"], r["peak_mem_reserved_mb"]))
    refusals = sorted(({"reason": k, **v} for k, v in reasons.items()), key=lambda r: -r["count"])
    return {"examined": examined, "refused_by_trainer": refused, "fitting": len(fitting), "headroom": headroom,
            "too_large": examined - refused - len(fitting), "top": fitting[:top], "refusals": refusals,
            "closest": [entry for _, _, entry in sorted(too_large, key=lambda item: -item[0])]}


def explain(result: dict) -> list[str]:
    """Lines saying why no layout was kept: the trainer's reasons with counts, then the closest misses."""
    lines = [f"{result['refused_by_trainer']} refused by the trainer's validation:"] if result["refusals"] else []
    lines += [f"  {r['count']:>6} x {r['example']}" for r in result["refusals"]]
    if result["closest"]:
        lines.append(f"{result['too_large']} valid but over the memory limit ({100 * (1 - result['headroom']):.0f} % "
                     "of the card); the closest:")
        for c in result["closest"]:
            a = c["arguments"]
            recompute = a["recompute_granularity"] if a["recompute"] else "none"
            lines.append(f"  {c['strategy']} micro-batch {a['per_device_train_batch_size']}, recompute {recompute}: "
                         f"reserved {c['reserved_mb']:,.0f} MB > {c['limit_mb']:,.0f} MB by {c['over_mb']:,.0f} MB "
                         f"({100 * c['over_mb'] / c['limit_mb']:.1f} %) on {c['peak_rank']}")
    return lines


def file_strategy_name(arguments: dict) -> str:
    """The strategy part of a configs/ file name (data parallelism left out, as configs/README.md says)."""
    from llm_pretrain.parallel.layout import strategy_name

    stage = int(arguments["sharding"][-1]) if arguments.get("sharding") else 0
    return strategy_name(arguments.get("tensor_parallel_degree", 1), arguments.get("pipeline_parallel_degree", 1),
                         arguments.get("sharding_parallel_degree", 1) if stage else 1, stage,
                         arguments.get("virtual_pp_degree", 1), None, arguments.get("sep_parallel_degree", 1),
                         arguments.get("context_parallel_degree", 1))


def write_arguments(arguments: dict, path: str) -> str:
    """Write the chosen layout as an argument file. A directory (or a path ending in '/') gets the configs/
    name pretrain-<model>-<strategy>.json; the path written is returned."""
    import os

    if path.endswith(os.sep) or os.path.isdir(path):
        model = arguments["model_name_or_path"].rstrip("/").split("/")[-1].lower().replace("-", "_").replace(".", "_")
        path = os.path.join(path, f"pretrain-{model}-{file_strategy_name(arguments)}.json")
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(arguments, f, indent=4)
        f.write("\n")
    return path

