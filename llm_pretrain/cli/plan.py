"""Predict memory and speed of a layout before booking GPUs; search the best layout and write its argument file.

(The `llm-plan` command; `python scripts/plan.py` runs the same.)

    llm-plan estimate ARGS.json --nproc 8 --device A100-80G [--json] [--key value ...]
    llm-plan search --model meta-llama/Llama-2-70b --device A100-80G --gpus 64|LOW-HIGH \\
        --seq 4096 --global_batch_size 1024 [--gpus_per_node 8] [--top 5] [--json] [--write configs/llama/]
        [--mean_document_length L]
    llm-plan models [--json]
    llm-plan elastic ARGS.json --gpus 64 --gpus_per_node 8 --device A100-80G [--json] [--key value ...]

estimate: per-rank peak memory (the allocator's peak, as the trainer's peak_mem_allocated_mb; on GPU also
the allocator's reserve, which decides an out-of-memory), step time, tokens/card/s and MFU (GPU), each
term with the rank it applies to. The layout is checked by the trainer's own validation: a layout the
trainer refuses is its one-line error, exit code 2. `--key value` after the file overrides it, as for
run_pretrain.py.

search: every layout the trainer accepts (tensor parallelism inside a node unless
--allow_inter_node_tp), with sequence parallelism, recompute none/full/full_attn/core_attn and
micro-batch sizes; keeps those under the card's memory minus --headroom; ranks them by predicted
tokens/card/s (layouts whose weights and optimizer states alone exceed the limit are skipped before
validation; a progress bar on stderr after 2 s, none with --json); --write writes the best as an
argument file (a directory gets the configs/ name pretrain-<model>-<strategy>.json, the strategy
from llm_pretrain.parallel.layout.strategy_name). --gpus LOW-HIGH: the smallest count of whole nodes
(multiples of --gpus_per_node) from LOW to HIGH on which a layout fits, searched upwards; each smaller count's
closest miss, then that count's table (--write writes its first pick). --mean_document_length L: packed documents with document
masks, as estimate's option (every candidate gets reset_attention_mask, its cp candidates the ring's plain
blocks; the cp ring's skipped blocks expose their transfers, llm_pretrain/planner/speed.py ring_steps_kept).

elastic: for the job of ARGS.json on --gpus GPUs, and for each count left after losing whole nodes one at a
time (64, 56, 48 ...), the layout it would continue with (same model, sequence length, global batch and device;
tensor parallelism inside a node; the keys of elastic_keep held): search's first pick, its predicted reserved
memory, tokens/card/s and the job's tokens/s; a count on which nothing fits says the smallest count that does
(llm_pretrain/planner/elastic.py).

models: every built-in model name (what model_name_or_path and --model accept besides a local directory),
with its family, its parameter count and whether it needs a weights file (none does: a built-in name is an
architecture, trained from a random initialization; weights come from a local directory).

Bandwidths (GB/s per GPU, one direction): --intra_node_gbps (NVLink; default 240 for A100, 360 for H100,
llm_pretrain/planner/speed.py DEFAULT_LINKS) and --inter_node_gbps (InfiniBand; 25 = HDR 200 Gb/s per
GPU on A100 nodes, 50 = NDR 400 Gb/s on H100 nodes).
"""

from __future__ import annotations

import json
import sys

from llm_pretrain.errors import UsageArgumentParser, UsageError, closest_matches, exit_with_usage_error


def _cluster_options(opts) -> dict:
    return {"intra_node_gbps": opts.intra_node_gbps, "inter_node_gbps": opts.inter_node_gbps}


def _fmt(value, digits=1):
    if value is None:
        return "n/a"
    return f"{value:,.{digits}f}"


def format_estimate(result: dict) -> str:
    lines = [f"{result.get('strategy', '')} on {result['world_size']} x {result['device']}: "
             f"{result['params'] / 1e9:.3f}B parameters",
             f"peak memory allocated {_fmt(result['peak_mem_allocated_mb'], 0)} MB"
             + (f", reserved {_fmt(result['peak_mem_reserved_mb'], 0)} MB" if result["peak_mem_reserved_mb"] else "")
             + (f" of {_fmt(result['device_memory_mb'], 0)} MB" if result["device_memory_mb"] else "")
             + f" ({result['peak_rank']}, {result['peak_phase']}): " + ("fits" if result["fits"] else "DOES NOT FIT"),
             ]
    if result["step_time_s"] is not None:
        lines.append(f"step time {result['step_time_s']:.3f} s, {result['tokens_per_card_per_sec']:,.0f} tokens/card/s, "
                     f"{result['tflops_per_card']:.1f} TFLOPs/card, MFU {100 * result['mfu']:.1f} %, "
                     f"bottleneck: {result['bottleneck']}")
    else:
        lines.append("speed: no CPU speed model (measure with scripts/benchmark.py)")
    lines.append("")
    lines.append("| term | phase | rank | MB / s |")
    lines.append("|---|---|---|---:|")
    for row in result["breakdown"]:
        value = f"{row['mb']:,.1f} MB" if row["kind"] == "memory" else f"{row['s']:.4f} s"
        lines.append(f"| {row['term']} | {row.get('phase', 'step')} | {row['rank']} | {value} |")
    return "\n".join(lines)


def cmd_estimate(argv: list[str]) -> int:
    parser = UsageArgumentParser(prog="plan.py estimate", description="predicted memory and speed of an argument file")
    parser.add_argument("args_file")
    parser.add_argument("--nproc", type=int, required=True, help="number of processes (GPUs)")
    parser.add_argument("--device", required=True, help="cpu, or a GPU: A100-80G, A100-40G, H100-80G, H800, A800, V100")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--gpus_per_node", type=int, default=8)
    parser.add_argument("--intra_node_gbps", type=float, default=None)
    parser.add_argument("--inter_node_gbps", type=float, default=None)
    parser.add_argument("--mean_document_length", type=int, default=None,
                        help="with reset_attention_mask: the packed documents' mean length in tokens (attention "
                             "FLOPs counted within documents)")
    opts, overrides = parser.parse_known_args(argv)
    if opts.nproc < 1:
        raise UsageError(f"--nproc: must be >= 1, got {opts.nproc}")
    from llm_pretrain.arguments import parse_arguments
    from llm_pretrain.planner.estimate import estimate

    args, _ = parse_arguments([opts.args_file] + overrides)
    result = estimate(args, opts.nproc, opts.device,
                      dict(_cluster_options(opts), gpus_per_node=opts.gpus_per_node), opts.mean_document_length)
    print(json.dumps(result, indent=1) if opts.json else format_estimate(result))
    return 0


def cmd_search(argv: list[str]) -> int:
    parser = UsageArgumentParser(prog="plan.py search", description="the best valid layouts for a model and cluster")
    parser.add_argument("--model", required=True, help="a built-in name (models/registry.py) or a model directory")
    parser.add_argument("--device", required=True)
    parser.add_argument("--gpus", required=True, help="a count, or LOW-HIGH: the smallest count of whole nodes from "
                        "LOW to HIGH on which a layout fits (searched upwards)")
    parser.add_argument("--gpus_per_node", type=int, default=8)
    parser.add_argument("--seq", type=int, required=True)
    parser.add_argument("--global_batch_size", type=int, required=True)
    parser.add_argument("--top", type=int, default=5)
    parser.add_argument("--headroom", type=float, default=0.10, help="fraction of the card kept free (default 0.10)")
    parser.add_argument("--allow_inter_node_tp", action="store_true")
    parser.add_argument("--intra_node_gbps", type=float, default=None)
    parser.add_argument("--inter_node_gbps", type=float, default=None)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--write", default=None, help="write the best layout's argument file (a .json path or a directory)")
    parser.add_argument("--mean_document_length", type=int, default=None,
                        help="packed documents of this mean length with document masks: every layout gets "
                             "reset_attention_mask (its cp layouts the ring's plain blocks) and is timed as "
                             "estimate --mean_document_length times it")
    opts = parser.parse_args(argv)
    from llm_pretrain.planner import check_device, device_kind
    from llm_pretrain.planner.search import explain, node_counts, search, smallest, write_arguments
    from models.registry import resolve_model

    check_device(opts.device)
    if device_kind(opts.device) == "cpu":
        raise UsageError("--device: search needs a GPU (the speed model is for GPUs); got cpu")
    resolve_model(opts.model)  # an unknown model is a usage error before the search
    low, _, high = opts.gpus.partition("-")
    if not (low.isdigit() and (high.isdigit() or not _)):
        raise UsageError(f"--gpus: {opts.gpus!r} is neither a count nor a range LOW-HIGH (e.g. 8-512)")
    gpus = int(low)
    counts = node_counts(int(low), int(high), opts.gpus_per_node) if _ else None
    if gpus < 1 or opts.seq < 1 or opts.global_batch_size < 1 or opts.gpus_per_node < 1:
        raise UsageError("--gpus, --seq and --global_batch_size must be positive")
    if counts == []:
        raise UsageError(f"--gpus: {opts.gpus} holds no whole node of {opts.gpus_per_node} GPUs")
    if opts.mean_document_length is not None and opts.mean_document_length < 1:
        raise UsageError(f"--mean_document_length: must be >= 1, got {opts.mean_document_length}")
    options = dict(top=opts.top, headroom=opts.headroom, cluster_options=_cluster_options(opts),
                   allow_inter_node_tp=opts.allow_inter_node_tp, mean_document_length=opts.mean_document_length,
                   progress=not opts.json)  # a bar on stderr after 2 s; none with --json
    if counts:
        result = smallest(opts.model, opts.device, counts, opts.seq, opts.global_batch_size, opts.gpus_per_node,
                          **options)
    else:
        result = search(opts.model, opts.device, gpus, opts.seq, opts.global_batch_size, opts.gpus_per_node,
                        **options)
    written = None
    if opts.write and result["top"]:
        written = write_arguments(result["top"][0]["arguments"], opts.write)
    if opts.json:
        print(json.dumps(dict(result, written=written), indent=1))
    else:
        skipped = (f"{result['not_validated']} over the memory limit by their weights and optimizer states alone "
                   "(not validated), " if result["not_validated"] else "")
        if counts:
            for row in result["smaller"]:
                miss = row["closest"]
                print(f"{row['gpus']} GPUs: nothing fits ({row['valid']} layouts the trainer accepts"
                      + (f"; closest {miss['strategy']}, {miss['reserved_mb']:,.0f} MB reserved > "
                         f"{miss['limit_mb']:,.0f} MB)" if miss else ")"))
            print(f"the smallest count that fits: {result['gpus']} GPUs" if result["gpus"] else
                  f"no count of whole nodes from {counts[0]} to {counts[-1]} GPUs fits")
        print(f"{result['examined']} layouts examined, {skipped}{result['refused_by_trainer']} refused by the "
              f"trainer's validation, {result['fitting']} fit with {100 * opts.headroom:.0f} % headroom"
              + (f"; documents of {opts.mean_document_length} tokens with document masks"
                 if opts.mean_document_length else ""))
        print("| rank | strategy | micro-batch | acc | SP | recompute | reserved MB | step s | tokens/card/s | MFU | bottleneck |")
        print("|---:|---|---:|---:|---|---|---:|---:|---:|---:|---|")
        for i, r in enumerate(result["top"], 1):
            a = r["arguments"]
            recompute = a["recompute_granularity"] if a["recompute"] else "none"
            print(f"| {i} | {r['strategy']} | {a['per_device_train_batch_size']} | {a['gradient_accumulation_steps']} | "
                  f"{'yes' if a['sequence_parallel'] else 'no'} | {recompute} | {r['peak_mem_reserved_mb']:,.0f} | "
                  f"{r['step_time_s']:.2f} | {r['tokens_per_card_per_sec']:,.0f} | {100 * r['mfu']:.1f} % | "
                  f"{r['bottleneck']} |")
        if written:
            print(f"wrote {written}")
        if not result["top"]:
            print("no layout fits")
            print("\n".join(explain(result)))
    return 0 if result["top"] else 1


def cmd_elastic(argv: list[str]) -> int:
    parser = UsageArgumentParser(prog="plan.py elastic", description="the layout a job continues with after losing "
                                 "whole nodes, one at a time: predicted speed and memory")
    parser.add_argument("args_file")
    parser.add_argument("--gpus", type=int, required=True, help="GPUs of the whole job")
    parser.add_argument("--gpus_per_node", type=int, default=8)
    parser.add_argument("--device", required=True, help="a GPU: A100-80G, A100-40G, H100-80G, H800, A800, V100")
    parser.add_argument("--headroom", type=float, default=0.10, help="fraction of the card kept free (default 0.10)")
    parser.add_argument("--intra_node_gbps", type=float, default=None)
    parser.add_argument("--inter_node_gbps", type=float, default=None)
    parser.add_argument("--json", action="store_true")
    opts, overrides = parser.parse_known_args(argv)
    from llm_pretrain.planner import check_device, device_kind

    check_device(opts.device)
    if device_kind(opts.device) == "cpu":
        raise UsageError("--device: elastic needs a GPU (the speed model is for GPUs); got cpu")
    if opts.gpus_per_node < 1 or opts.gpus < opts.gpus_per_node or opts.gpus % opts.gpus_per_node:
        raise UsageError(f"--gpus: {opts.gpus} is not a positive multiple of --gpus_per_node {opts.gpus_per_node} "
                         "(whole nodes are lost)")
    from llm_pretrain.arguments import parse_arguments
    from llm_pretrain.planner.elastic import elastic_table

    args, _ = parse_arguments([opts.args_file] + overrides)
    table = elastic_table(args, opts.device, opts.gpus, opts.gpus_per_node, opts.headroom, _cluster_options(opts))
    if opts.json:
        return _print(json.dumps(table, indent=1))
    kept = ", ".join(f"{k} {v}" for k, v in table["kept"].items())
    lines = [f"{table['model']}, sequence {table['seq']}, global batch {table['global_batch_size']} on "
             f"{opts.device}, {opts.gpus_per_node} GPUs per node" + (f", kept: {kept}" if kept else ""),
             "| GPUs | nodes lost | layout | micro-batch | acc | recompute | reserved MB | tokens/card/s | "
             "tokens/s of the job |", "|---:|---:|---|---:|---:|---|---:|---:|---:|"]
    for row in table["rows"]:
        best = row["best"]
        if best is None:
            smallest = table["smallest_fitting"]
            where = (f"the smallest count that fits is {smallest} GPUs" if smallest is not None
                     else f"no count from {opts.gpus_per_node} to {opts.gpus} GPUs fits")
            lines.append(f"| {row['gpus']} | {row['nodes_lost']} | {row['why']}; {where} | | | | | | |")
            continue
        a = best["arguments"]
        recompute = a["recompute_granularity"] if a["recompute"] else "none"
        lines.append(f"| {row['gpus']} | {row['nodes_lost']} | {best['strategy']} | {a['per_device_train_batch_size']} | "
                     f"{a['gradient_accumulation_steps']} | {recompute} | {best['peak_mem_reserved_mb']:,.0f} | "
                     f"{best['tokens_per_card_per_sec']:,.0f} | {best['tokens_per_card_per_sec'] * row['gpus']:,.0f} |")
    return _print("\n".join(lines))


def human_count(n: int) -> str:
    """6738415616 -> '6.74B': three significant digits, K / M / B / T."""
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.3g}{suffix}"
    return str(n)


def cmd_models(argv: list[str]) -> int:
    parser = UsageArgumentParser(prog="plan.py models", description="every built-in model name: family, parameters, "
                                 "whether a weights file is needed")
    parser.add_argument("--json", action="store_true")
    opts = parser.parse_args(argv)
    from models.registry import built_in_models

    rows = built_in_models()
    if opts.json:
        return _print(json.dumps(rows, indent=1))
    lines = ["| name | family | parameters | weights file needed |", "|---|---|---:|---|"]
    for row in rows:
        weights = "yes" if row["weights_needed"] else "no (random init)"
        lines.append(f"| {row['name']} | {row['family']} | {human_count(row['parameters'])} | {weights} |")
    lines.append(f"{len(rows)} built-in names, each an architecture without weights: a run starts from a random "
                 "initialization. To start from weights, give model_name_or_path a local directory (config.json "
                 "and model_state.pdparams; PaddleNLP/Hugging Face weights converted once with "
                 "scripts/import_paddlenlp.py) and continue_training true.")
    return _print("\n".join(lines))


def _print(text: str) -> int:
    """Print, and end quietly when the reader has gone (`llm-plan models | head`)."""
    import os

    try:
        print(text, flush=True)
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    commands = {"estimate": cmd_estimate, "search": cmd_search, "models": cmd_models, "elastic": cmd_elastic}
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    if argv[0] not in commands:
        nearest = closest_matches(argv[0], list(commands), n=1, cutoff=0.6)
        hint = f"did you mean {nearest[0]!r}? " if nearest else ""
        exit_with_usage_error(UsageError(f"unknown command {argv[0]!r}; {hint}use estimate, search, elastic or models "
                                         "(see --help)"))
    try:
        return commands[argv[0]](argv[1:])
    except UsageError as error:
        exit_with_usage_error(error)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
