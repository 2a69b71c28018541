"""Long sequences on CPU: peak memory and tokens/s against sequence length for 1 process, sep2 and cp2,
with the planner's prediction beside each, and the planner's GPU table of configs/long_context/.

    PYTHONPATH=$PWD python scripts/long_context_benchmark.py [--lengths 512,1024,2048,4096] [--out benchmarks/long_context.md]
    PYTHONPATH=$PWD python scripts/long_context_benchmark.py --gpu-only   # only the planner's GPU table (seconds)
    PYTHONPATH=$PWD python scripts/long_context_benchmark.py --documents-only [--document-lengths 4096,8192]

Packed documents (--documents-only: only that table, the rest of the file kept): the embedded corpus's tokens
(its end-of-text tokens dropped) cut into documents of DOCUMENT_TOKENS tokens, trained with and without
reset_attention_mask, in one process and cp2. A smaller model than above (DOCUMENT_MODEL: one layer, one head
of 64) so that 8,192 tokens stay within minutes on CPU: 3 steps of 1 micro-batch; tokens/s over steps 2-3.

Each run trains llama-tiny (hidden 64, 4 heads, 2 layers: attention dominates from ~1K tokens) for 2
steps of 2 micro-batches of 1 sequence on the embedded corpus; peak = Paddle's host allocator peak of
the run (max over ranks, train_log.jsonl peak_mem_allocated_mb), tokens/s = the global tokens of the
second step / its time (one core per process: 1 process uses 1 core, sep2/cp2 use 2). Per rank, cp2's
ring computes its own block in full (masked) and half of the other, 3/4 of sep2's attention scores.
Regenerates the tables; the "## Findings" section of an existing file is kept. --gpu-only keeps the CPU table
of the existing file (and the "cpu" rows of its .json) and regenerates the GPU table, e.g. after
`scripts/planned_configs.py --write` replaced configs/long_context/ files.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

LAYOUTS = {"1 process": (1, {}), "sep2": (2, {"sep_parallel_degree": 2}), "cp2": (2, {"context_parallel_degree": 2})}
MODEL = {"model_name_or_path": "llama-tiny", "num_hidden_layers": 2}


def measure(lengths: list[int], work: Path) -> list[dict]:
    from llm_pretrain.data import ensure_embedded_corpus
    from llm_pretrain.selfcheck.parity import argv, run_launch, run_single, train_records, write_json  # on CPU
    from llm_pretrain.selfcheck.planner_runs import BASE, predict

    corpus = ensure_embedded_corpus(str(work / "corpus"))
    rows = []
    for seq in lengths:
        base = dict(BASE, **MODEL, max_seq_length=seq, tokenizer_name_or_path=corpus["tokenizer"],
                    input_dir=corpus["input_dir"], data_cache=str(work / "cache"))
        args_file = write_json(work / f"seq{seq}.json", base)
        out = {name: work / f"seq{seq}-{name.replace(' ', '_')}" for name in LAYOUTS}
        run_single([argv(args_file, out["1 process"])], work, f"single{seq}")
        run_launch(2, [argv(args_file, out[name], **LAYOUTS[name][1]) for name in ("sep2", "cp2")], work,
                   f"seq2-{seq}", timeout=1800)
        for name, (nproc, overrides) in LAYOUTS.items():
            records = train_records(out[name])
            predicted = predict({"args_file": str(args_file), "overrides": overrides, "nproc": nproc})
            measured = max(r["peak_mem_allocated_mb"] for r in records)
            last = records[-1]
            rows.append({"seq": seq, "layout": name, "processes": nproc, "peak_mb": measured,
                         "predicted_mb": predicted["peak_mem_allocated_mb"],
                         "tokens_per_s": 2 * seq / last["step_time_s"]})
    return rows


DOCUMENT_TOKENS = 1000
DOCUMENT_HEADS = {"num_attention_heads": 1, "num_key_value_heads": 1}  # llama-tiny's 64 wide, in one head
DOCUMENT_MODEL = {"num_hidden_layers": 1, "gradient_accumulation_steps": 1, "max_steps": 3}
DOCUMENT_LAYOUTS = ("1 process", "cp2")
DOCS_HEADING = "## Packed documents"


def document_corpus(corpus: dict, work: Path) -> str:
    """A copy of the embedded corpus's tokens as documents of DOCUMENT_TOKENS tokens (no eod tokens inside, so
    the .idx documents are the only boundaries); returns its input_dir."""
    import numpy as np

    from llm_pretrain.data.documents import eod_token_of
    from llm_pretrain.data.embedded import PREFIX_NAME
    from llm_pretrain.data.indexed import IndexedDataset, write_documents

    source = IndexedDataset(os.path.join(corpus["input_dir"], PREFIX_NAME))
    tokens = np.asarray(source.tokens)
    tokens = tokens[tokens != eod_token_of(None, corpus["tokenizer"])]
    input_dir = work / "documents_of_1000"
    input_dir.mkdir(parents=True, exist_ok=True)
    pieces = (tokens[i:i + DOCUMENT_TOKENS] for i in range(0, len(tokens) - DOCUMENT_TOKENS + 1, DOCUMENT_TOKENS))
    write_documents(str(input_dir / PREFIX_NAME), pieces, source.dtype)
    return str(input_dir)


def one_head_model(work: Path) -> str:
    """A model directory (our config.json: models/registry.py config_from_dict) of llama-tiny with one head."""
    import dataclasses

    from models.registry import ARCHITECTURES

    config = ARCHITECTURES["llama-tiny"].replace(**DOCUMENT_HEADS)
    directory = work / "llama-tiny-one-head"
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(dataclasses.asdict(config), default=list))
    return str(directory)


def measure_documents(lengths: list[int], work: Path) -> list[dict]:
    from llm_pretrain.data import ensure_embedded_corpus
    from llm_pretrain.selfcheck.parity import argv, run_launch, run_single, train_records, write_json  # on CPU
    from llm_pretrain.selfcheck.planner_runs import BASE

    corpus = ensure_embedded_corpus(str(work / "corpus"))
    input_dir = document_corpus(corpus, work)
    model_dir = one_head_model(work)
    rows = []
    for seq in lengths:
        base = dict(BASE, **DOCUMENT_MODEL, model_name_or_path=model_dir, max_seq_length=seq, tokenizer_name_or_path=corpus["tokenizer"],
                    input_dir=input_dir, data_cache=str(work / "cache"))
        args_file = write_json(work / f"documents{seq}.json", base)
        out = {(name, masked): work / f"documents{seq}-{name.replace(' ', '_')}-{'masked' if masked else 'whole'}"
               for name in DOCUMENT_LAYOUTS for masked in (False, True)}
        keys = {False: {}, True: {"reset_attention_mask": True}}
        run_single([argv(args_file, out["1 process", masked], **keys[masked]) for masked in (False, True)], work,
                   f"documents-single{seq}", timeout=1800)
        run_launch(2, [argv(args_file, out["cp2", masked], context_parallel_degree=2, **keys[masked])
                       for masked in (False, True)], work, f"documents-cp2-{seq}", timeout=1800)
        for (name, masked), path in out.items():
            records = train_records(path)
            rows.append({"seq": seq, "layout": name, "masked": masked, "processes": 1 if name == "1 process" else 2,
                         "peak_mb": max(r["peak_mem_allocated_mb"] for r in records),
                         "tokens_per_s": seq * (len(records) - 1) / sum(r["step_time_s"] for r in records[1:])})
    return rows


def render_documents(rows: list[dict]) -> str:
    lines = [f"{DOCS_HEADING}: documents of {DOCUMENT_TOKENS:,} tokens, with and without document masks", "",
             "Generated by `scripts/long_context_benchmark.py --documents-only` (see its docstring). CPU, fp32, "
             "llama-tiny with 1 layer and its 64 channels in 1 head, micro-batch 1, the embedded corpus cut into documents of "
             f"{DOCUMENT_TOKENS:,} tokens; masked = reset_attention_mask (attention stops at the documents' "
             "boundaries). One process: the plain path computes every score and adds the document mask; cp2: the "
             "ring skips the blocks in which no query shares a document with any key.", "",
             "| tokens | layout | processes | document masks | peak MiB | tokens/s |",
             "|---:|---|---:|---|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['seq']} | {r['layout']} | {r['processes']} | {'yes' if r['masked'] else 'no'} | "
                     f"{r['peak_mb']:.1f} | {r['tokens_per_s']:,.0f} |")
    return "\n".join(lines) + "\n\n"


def gpu_table() -> list[dict]:
    """The planner's estimate of every configs/long_context/ file on the GPUs it was searched for (its name's
    device tag, llm_pretrain/planner/planned_files.py)."""
    from llm_pretrain.arguments import parse_arguments
    from llm_pretrain.planner.estimate import estimate
    from llm_pretrain.planner.planned_files import planned_files, search_request

    rows = []
    for path in planned_files(REPO / "configs"):
        if path.parent.name != "long_context":
            continue
        request = search_request(path)
        args, _ = parse_arguments([str(path)])
        result = estimate(args, request["gpus"], request["device"])
        rows.append({"file": f"configs/long_context/{path.name}", "device": request["device"],
                     "gpus": request["gpus"], "seq": args.max_seq_length,
                     "global_batch_size": request["global_batch_size"],
                     "recompute": args.recompute_granularity if args.recompute else "none",
                     "reserved_mb": result["peak_mem_reserved_mb"], "tokens_per_card_per_sec":
                     result["tokens_per_card_per_sec"], "mfu": result["mfu"], "bottleneck": result["bottleneck"]})
    return rows


GPU_HEADING = "## The planner's GPU table for configs/long_context/"


def render_gpu(gpu: list[dict]) -> str:
    lines = [f"{GPU_HEADING} (chosen by `scripts/plan.py search`)", "",
             "Predictions, not measurements (no GPU here). Each file is the first pick of `scripts/plan.py search` "
             "on 8 GPUs of the device in its name (`_a100`, `_h100`) for its model, length and global batch "
             "(~1M tokens: 2^20 / max_seq_length sequences), with search's defaults (10 % of the card kept free); "
             "`tests/test_planned_configs.py` reruns the search for each file. On GPU ring attention's blocks are "
             "flash attention (no block scores kept), as the dense path's.", "",
             "| file | device | tokens | global batch | recompute | reserved MiB | tokens/card/s | MFU | bottleneck |",
             "|---|---|---:|---:|---|---:|---:|---:|---|"]
    for r in gpu:
        lines.append(f"| {r['file']} | {r['device']} | {r['seq']} | {r['global_batch_size']} | {r['recompute']} | "
                     f"{r['reserved_mb']:,.0f} | {r['tokens_per_card_per_sec']:,.0f} | {r['mfu']:.1%} | "
                     f"{r['bottleneck']} |")
    return "\n".join(lines) + "\n"


def render_cpu(rows: list[dict]) -> str:
    lines = ["# Long sequences: segment parallelism (sep) and ring attention (cp)", "",
             "Generated by `scripts/long_context_benchmark.py` (see its docstring for the setup). CPU, fp32, "
             "llama-tiny with 2 layers, micro-batch 1; peak = Paddle's host allocator peak (max over ranks), "
             "predicted = `llm_pretrain/planner` for the same argument file (tests/test_planner.py checks "
             "sep2 and cp2 at 2048 tokens within 10 %).", "",
             "| tokens | layout | processes | peak MiB | predicted MiB | error | tokens/s |",
             "|---:|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        error = r["predicted_mb"] / r["peak_mb"] - 1
        lines.append(f"| {r['seq']} | {r['layout']} | {r['processes']} | {r['peak_mb']:.1f} | {r['predicted_mb']:.1f} "
                     f"| {error:+.1%} | {r['tokens_per_s']:,.0f} |")
    return "\n".join(lines) + "\n\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="512,1024,2048,4096")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "long_context.md"))
    parser.add_argument("--gpu-only", action="store_true",
                        help="regenerate only the planner's GPU table, keeping the file's CPU measurements")
    parser.add_argument("--documents-only", action="store_true",
                        help="measure only the packed-documents table, keeping the file's other tables")
    parser.add_argument("--document-lengths", default="4096,8192")
    options = parser.parse_args(argv)
    json_path = os.path.splitext(options.out)[0] + ".json"
    kept = {}
    if options.gpu_only or options.documents_only:
        with open(options.out, encoding="utf-8") as f:
            text = f.read()
        with open(json_path, encoding="utf-8") as f:
            kept = json.load(f)
        rows = kept["cpu"]
        cpu_text = text.split(DOCS_HEADING)[0].split(GPU_HEADING)[0]
    else:
        lengths = [int(x) for x in options.lengths.split(",")]
        with tempfile.TemporaryDirectory() as tmp:
            rows = measure(lengths, Path(tmp))
        cpu_text = render_cpu(rows)
    if options.gpu_only:
        documents = kept.get("documents", [])
    else:
        with tempfile.TemporaryDirectory() as tmp:
            documents = measure_documents([int(x) for x in options.document_lengths.split(",")], Path(tmp))
    gpu = kept["gpu"] if options.documents_only else gpu_table()
    from llm_pretrain.observe.perf import write_keeping_findings

    write_keeping_findings(options.out, cpu_text + (render_documents(documents) if documents else "")
                           + render_gpu(gpu))
    with open(json_path, "w", encoding="utf-8") as f:
        json.dump({"cpu": rows, "documents": documents, "gpu": gpu}, f, indent=1)
    print(f"wrote {options.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
