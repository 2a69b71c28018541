"""Verify the Hugging Face export with loaders no one here wrote; writes benchmarks/hf_export_verification.md.

    python scripts/verify_hf_export.py [--venv .cache/hf-client-venv] [--out benchmarks/hf_export_verification.md]
                                       [--cases mixtral qwen2_moe ...]

For every exported family's tiny preset (random weights, every parameter non-trivial): train-state
checkpoint written by llm_pretrain.checkpoint.checkpointer -> llm_pretrain.checkpoint.hf_export -> loaded by

  * Hugging Face transformers with torch on CPU (the reference client), in its own venv (created
    here with pip: torch's CPU wheel where pip finds one, else the default torch, and transformers;
    they are not in the test requirements: the default torch wheel pulls 5.6 GB of CUDA packages
    that `import torch` cannot do without), through scripts/hf_client_logits.py;
  * PaddleNLP 2.8.1's own Hugging Face conversion, `from_pretrained(dir, convert_from_torch=True)`
    (paddlenlp/transformers/model_utils.py: reads model.safetensors or the sharded index with its own
    deserializer, renames and transposes by the class's _get_name_mappings), for the classes 2.8.1
    has a mapping for and that run under Paddle 3.3.1: LlamaForCausalLM, GPTForCausalLM (from GPT-2's
    names), BloomForCausalLM (its MixtralForCausalLM does not run: see the report's notes).

The client's fp32 logits on fixed token ids are compared with our model's; the bar is 1e-4.
Baichuan's class is remote code (not in transformers, not loadable offline): its W_pack rows are
split into q/k/v (what modeling_baichuan.py does with unflatten(-1, (3, hidden))) and the rotary
variant (Baichuan-7B / Baichuan2-7B) is run by transformers' LlamaForCausalLM, the ALiBi variant
(Baichuan-13B / Baichuan2-13B) by PaddleNLP 2.8.1's LlamaForCausalLM with alibi=True.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np

from judge_digest import DIGEST_HEADER, DIGEST_POSITIONS, cross_entropy, digest, digest_row
from models.families.llama import LLAMA31_ROPE_SCALING

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOLERANCE = 1e-4
# scripts/verify_hf_import.py's section of the report (transformers' own directories trained from): kept here
IMPORT_SECTION = "## Trained from directories transformers wrote, judged by transformers"
DIGEST_SECTION = "## transformers' numbers, recomputed by the suite"
BATCH, SEQ = 2, 24
CLIENT_PACKAGES = ("transformers", "safetensors", "numpy")
# torch's CPU wheel first (192 MB; this machine's pip finds it): the default torch on PyPI pulls 15 nvidia-*
# CUDA packages and triton (a 5.6 GB venv, measured), and without them `import torch` fails (libcudnn.so.9).
TORCH_CHOICES = ("torch==2.13.0+cpu", "torch")

# llama3-tiny's rotary scaling (original length 64: the 24 tokens reach the scaled bands), given to Mixtral
TINY_LLAMA31_ROPE_SCALING = {**LLAMA31_ROPE_SCALING, "original_max_position_embeddings": 64}
# (case, preset, changes to its config, how transformers loads it, PaddleNLP 2.8.1 class or None, shard bytes)
CASES = [
    ("llama", "llama-tiny", {}, "auto", "LlamaForCausalLM", None),
    ("llama-sharded", "llama-tiny", {}, "auto", None, 100_000),  # model-0000N-of-0000M + index
    ("llama3.1", "llama3-tiny", {}, "auto", None, None),  # rope_scaling: PaddleNLP 2.8.1 has none
    ("qwen2", "qwen2-tiny", {}, "auto", None, None),      # PaddleNLP 2.8.1 has no Qwen2 class
    ("gpt3", "gpt3-tiny", {}, "auto", "GPTForCausalLM", None),
    ("bloom", "bloom-tiny", {}, "auto", "BloomForCausalLM", None),
    ("baichuan2-7b-style", "baichuan-tiny", {"position_embedding": "rope"}, "llama_from_w_pack", None, None),
    ("baichuan2-13b-style", "baichuan-tiny", {}, None, "LlamaForCausalLM", None),  # ALiBi: PaddleNLP only
    # PaddleNLP 2.8.1's MixtralForCausalLM does not run under Paddle 3.3.1 (see the notes in write_report)
    ("mixtral", "mixtral-tiny", {}, "auto", None, None),
    ("mixtral-llama3.1-rope", "mixtral-tiny", {"rope_scaling": TINY_LLAMA31_ROPE_SCALING}, "auto", None, None),
    ("qwen2_moe", "qwen2-moe-tiny", {}, "auto", None, None),  # PaddleNLP 2.8.1 has no Qwen2-MoE class
    # every switch on (models/families/deepseek_v3.py); the MTP layer is written (transformers ignores it)
    ("deepseek_v3", "deepseek-v3-tiny", {}, "auto", None, None),
    # ERNIE 4.5 MoE (issue 34): layers 1 and 3 MoE, correction biases drawn at random; no PaddleNLP class
    ("ernie4_5_moe", "ernie4_5_moe-tiny", {}, "auto", None, None),
    # issue 34's other families (audit s11: their export was never loaded by transformers): qwen3-tiny (q/k norms,
    # head_dim apart from hidden / heads, tied), qwen3-moe-tiny (16 experts, top 4), ernie4_5-tiny (interleaved
    # rotary pairs, tied)
    ("qwen3", "qwen3-tiny", {}, "auto", None, None),
    ("qwen3_moe", "qwen3-moe-tiny", {}, "auto", None, None),
    ("ernie4_5", "ernie4_5-tiny", {}, "auto", None, None),
]
# the cases whose transformers numbers tests/test_hf_export_verification.py recomputes in-process (issues 34, 35)
RECOMPUTED = ("qwen3", "qwen3_moe", "ernie4_5", "ernie4_5_moe", "deepseek_v3")


def ensure_client_venv(venv: str) -> str:
    python = os.path.join(venv, "bin", "python")
    if not os.path.isfile(python):
        subprocess.run([sys.executable, "-m", "venv", venv], check=True)
    probe = subprocess.run([python, "-c", "import torch, transformers, safetensors"], capture_output=True)
    if probe.returncode != 0:
        for torch in TORCH_CHOICES:
            if subprocess.run([python, "-m", "pip", "install", "-q", torch, *CLIENT_PACKAGES]).returncode == 0:
                break
        else:
            sys.exit("could not install torch and transformers into " + venv)
    return python


def randomize(model, seed: int) -> None:
    """Every parameter random (norm weights around 1, biases around 0) so that every tensor matters."""
    import paddle

    rng = np.random.default_rng(seed)
    with paddle.no_grad():
        for name, param in model.named_parameters():
            shape = list(param.shape)
            if len(shape) == 1:
                value = (1.0 if "norm" in name else 0.0) + 0.1 * rng.standard_normal(shape)
            elif "embeddings" in name:
                value = 0.25 * rng.standard_normal(shape)
            else:
                value = rng.standard_normal(shape) / np.sqrt(shape[0])
            param.set_value(value.astype("float32"))


def case_inputs(case: str):
    """(seed, config, input_ids, labels) of a case, the same whichever cases run (the suite draws them again);
    labels: the next token ids, the last -100."""
    from models.registry import ARCHITECTURES

    index = [c[0] for c in CASES].index(case)
    _, preset, changes = CASES[index][:3]
    seed, config = 11 + index, ARCHITECTURES[preset].replace(**changes)
    input_ids = np.random.default_rng(1000 + seed).integers(0, config.vocab_size, size=(BATCH, SEQ)).astype("int64")
    labels = np.concatenate([input_ids[:, 1:], np.full((BATCH, 1), -100)], axis=1)
    return seed, config, input_ids, labels


def build_model(config, seed: int):
    """Our model with the case's seeded random weights (the suite builds it again)."""
    import paddle

    from models.decoder import CausalLM

    paddle.seed(seed)
    model = CausalLM(config)
    randomize(model, seed)
    model.eval()
    return model


def make_checkpoint(work: str, name: str, config, seed: int):
    """A checkpoint-1 of random weights written by the trainer's checkpointer; (path, model)."""
    import paddle

    from llm_pretrain.checkpoint import checkpointer as ckpt
    from llm_pretrain.parallel.layout import Layout

    model = build_model(config, seed)
    optimizer = paddle.optimizer.AdamW(parameters=model.parameters())
    state = {"global_step": 1, "consumed_samples": 8, "layout": {}, "model_config": config.architecture_dict(),
             "args": {"model_name_or_path": name}}
    return ckpt.save_checkpoint(os.path.join(work, name, "output"), 1, model, optimizer, state, Layout(), None), model


def w_pack_split_as_hf_llama(export_dir: str, out_dir: str) -> None:
    """Baichuan's W_pack rows -> q/k/v in Hugging Face Llama names, config LlamaForCausalLM with alibi
    (PaddleNLP's switch for Baichuan-13B); the head is already normalized by the export."""
    from safetensors.numpy import load_file, save_file

    with open(os.path.join(export_dir, "config.json")) as f:
        config = json.load(f)
    weights = load_file(os.path.join(export_dir, "model.safetensors"))
    for name in [n for n in weights if n.endswith("self_attn.W_pack.weight")]:
        q, k, v = np.split(weights.pop(name), 3, axis=0)
        prefix = name[: -len("W_pack.weight")]
        weights.update({prefix + "q_proj.weight": q, prefix + "k_proj.weight": k, prefix + "v_proj.weight": v})
    os.makedirs(out_dir)
    save_file({k: np.ascontiguousarray(v) for k, v in weights.items()}, os.path.join(out_dir, "model.safetensors"),
              metadata={"format": "pt"})
    llama = {k: config[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                    "num_attention_heads", "rms_norm_eps")}
    llama.update(architectures=["LlamaForCausalLM"], model_type="llama", alibi=True,
                 max_position_embeddings=config["model_max_length"], num_key_value_heads=config["num_attention_heads"])
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(llama, f)


def paddlenlp_logits(class_name: str, model_dir: str, work: str, input_ids: np.ndarray) -> tuple[np.ndarray, str]:
    """PaddleNLP 2.8.1's from_pretrained(convert_from_torch=True) on a copy (it writes model_state.pdparams
    next to the safetensors it converts)."""
    import paddle
    import paddlenlp
    import paddlenlp.transformers as pdt

    copy = os.path.join(work, "paddlenlp_copy")
    shutil.copytree(model_dir, copy)
    model = getattr(pdt, class_name).from_pretrained(copy, convert_from_torch=True, dtype="float32")
    model.eval()
    with paddle.no_grad():
        out = model(input_ids=paddle.to_tensor(input_ids), return_dict=True)
    logits = out.logits if hasattr(out, "logits") else out[0]
    return logits.numpy(), f"paddlenlp {paddlenlp.__version__} ({type(model).__name__}, convert_from_torch)"


def run(venv: str, out_file: str, only: tuple = ()) -> list[dict]:
    """Every case of CASES (or those named in `only`; a case keeps its seed either way)."""
    import paddle

    from llm_pretrain.checkpoint.hf_export import export_hf

    python = ensure_client_venv(venv)
    work = tempfile.mkdtemp(prefix="verify_hf_")
    rows, jobs = [], []
    for case, preset, changes, how, paddlenlp_class, shard_bytes in CASES:
        if only and case not in only:
            continue
        seed, config, input_ids, labels = case_inputs(case)
        path, model = make_checkpoint(work, case, config, seed)
        export_dir = os.path.join(work, case, "hf")
        result = export_hf(path, export_dir, **({"max_shard_bytes": shard_bytes} if shard_bytes else {}))
        with paddle.no_grad():
            ours = model(paddle.to_tensor(input_ids)).numpy()
        np.save(os.path.join(work, case, "input_ids.npy"), input_ids)
        np.save(os.path.join(work, case, "ours.npy"), ours)
        shards = [f for f in result["files"] if f.endswith(".safetensors")]
        base = {"case": case, "preset": preset + (f" {changes}" if changes else ""), "exported": result["class"],
                "files": f"{len(shards)} safetensors" + (" + index" if len(shards) > 1 else "")}
        if how:
            jobs.append({"name": case, "model_dir": export_dir, "how": how,
                         "input_ids": os.path.join(work, case, "input_ids.npy"),
                         "logits_out": os.path.join(work, case, "transformers.npy")})
            rows.append({**base, "client": "transformers", "_ours": ours, "_theirs": jobs[-1]["logits_out"],
                         "_how": how, "_labels": labels})
        if paddlenlp_class:
            source = export_dir
            if result["class"] == "BaichuanForCausalLM":
                source = os.path.join(work, case, "w_pack_split")
                w_pack_split_as_hf_llama(export_dir, source)
            logits, client = paddlenlp_logits(paddlenlp_class, source, os.path.join(work, case), input_ids)
            rows.append({**base, "client": client, "_ours": ours, "_logits": logits})

    with open(os.path.join(work, "jobs.json"), "w") as f:
        json.dump(jobs, f)
    done = subprocess.run([python, os.path.join(REPO, "scripts", "hf_client_logits.py"),
                           os.path.join(work, "jobs.json")], capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"the transformers client failed:\n{done.stderr[-4000:]}")
    loaded = {r["name"]: r for r in map(json.loads, done.stdout.strip().splitlines())}
    for row in rows:
        if row["client"] == "transformers":
            info = loaded[row["case"]]
            row["_logits"] = np.load(row["_theirs"])
            via = " after splitting W_pack" if row["_how"] == "llama_from_w_pack" else ""
            row["client"] = f"transformers {info['transformers']}, torch {info['torch']} ({info['class']}{via})"
            # transformers' own numbers (its logits; the loss their cross entropy), recomputed by the suite
            row["judge"] = digest(row["_logits"], cross_entropy(row["_logits"], row["_labels"]))
        row["max_abs_diff"] = float(np.abs(row.pop("_logits") - row["_ours"]).max())
        row["logit_std"] = float(row.pop("_ours").std())
        row["ok"] = row["max_abs_diff"] <= TOLERANCE
        for key in [k for k in row if k.startswith("_")]:
            del row[key]
    write_report(rows, out_file)
    shutil.rmtree(work, ignore_errors=True)
    return rows


def previous_rows(out_file: str, replaced: set, digests: bool = False) -> list[tuple[str, str]]:
    """(case, row) of the export table (or of the digest table) as written last, for the cases of CASES not run
    again now."""
    if not os.path.isfile(out_file):
        return []
    with open(out_file) as f:
        export_part = f.read().split(IMPORT_SECTION)[0]
    before, _, after = export_part.partition(DIGEST_SECTION)
    export_part = after.split("Notes:")[0] if digests else before.split("Notes:")[0]
    names = {case[0] for case in CASES} - replaced
    rows = []
    for line in export_part.splitlines():
        case = line.strip().strip("|").split("|")[0].strip() if line.startswith("| ") else None
        if case in names:
            rows.append((case, line))
    return rows


def write_report(rows: list[dict], out_file: str) -> None:
    import paddle

    lines = [
        "# Hugging Face export: verified by loaders written elsewhere",
        "",
        "Written by `python scripts/verify_hf_export.py` (do not edit by hand). Each tiny preset gets random",
        "weights, is saved by the trainer's checkpointer, exported by `llm_pretrain/checkpoint/hf_export.py`, loaded by the",
        f"client and run on {BATCH} x {SEQ} fixed token ids in fp32; the bar is max |logit difference| <= {TOLERANCE}.",
        f"Our side: paddlepaddle {paddle.__version__} (CPU). transformers and torch (CPU wheel) run in their own venv.",
        "",
        "| case | preset | exported as | files | client (class loaded) | max abs logit diff | logit std | within 1e-4 |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    names = [case[0] for case in CASES]
    table = [(r["case"], f"| {r['case']} | {r['preset']} | {r['exported']} | {r['files']} | {r['client']} | "
                         f"{r['max_abs_diff']:.2e} | {r['logit_std']:.2f} | {'yes' if r['ok'] else 'NO'} |")
             for r in rows]
    table += previous_rows(out_file, {r["case"] for r in rows})  # a run of some cases (--cases) keeps the others'
    lines += [line for _, line in sorted(table, key=lambda row: names.index(row[0]))]
    digests = [(r["case"], digest_row(r["case"], r["judge"])) for r in rows if "judge" in r]
    digests += previous_rows(out_file, {r["case"] for r in rows}, digests=True)
    lines += [
        "",
        DIGEST_SECTION,
        "",
        "transformers' own numbers for each case it loads (scripts/judge_digest.py): the mean, root mean square and",
        f"values at {DIGEST_POSITIONS} fixed flat positions of its fp32 logits, and their cross entropy against the next",
        "token ids (the last position -100; transformers is given no labels, so this loss is computed from its",
        "logits on our side, in numpy). The weights are our seeded random ones and the token ids fixed per case, so",
        "`tests/test_hf_export_verification.py` rebuilds our model in-process for the cases of RECOMPUTED (Qwen3,",
        "Qwen3-MoE, ERNIE 4.5, ERNIE 4.5 MoE, DeepSeek-V3), recomputes these numbers and asserts each within 1e-5",
        "of transformers': a change of our model code after this report fails the suite.",
        "",
        DIGEST_HEADER,
        "| --- | --- | --- | --- | --- |",
    ]
    lines += [line for _, line in sorted(digests, key=lambda row: names.index(row[0]))]
    lines += [
        "",
        "Notes:",
        "- The client venv: torch's CPU wheel (192 MB) and transformers from pip (about 30 s to install). PyPI's",
        "  default torch (2.14.1+cu130 here) pulls 15 nvidia-* packages and triton (a 5.6 GB venv, measured), and",
        "  `import torch` fails without them (libcudnn.so.9): hence a script with its own venv, not a test requirement.",
        "- llama-sharded is exported sharded (`--max-shard-size` 100 kB: `model-0000N-of-0000M.safetensors` and",
        "  `model.safetensors.index.json`). PaddleNLP 2.8.1's conversion of a sharded index fails inside PaddleNLP",
        "  (\"The state dictionary of the model you are trying to load is corrupted\"): transformers verifies it.",
        "- PaddleNLP 2.8.1 `from_pretrained(..., convert_from_torch=True)` covers LlamaForCausalLM, GPT-2's names",
        "  (into GPTForCausalLM) and BloomForCausalLM; it has no Qwen2 class and no Llama 3.1 rope_scaling.",
        "- Baichuan's class is remote code (trust_remote_code; not shipped in transformers, not loadable offline).",
        "  Its W_pack rows are q, k, v (modeling_baichuan.py: `proj.unflatten(-1, (3, hidden_size))`); split so,",
        "  the rotary variant runs in transformers' LlamaForCausalLM and the ALiBi variant in PaddleNLP 2.8.1's",
        "  LlamaForCausalLM(alibi=True). The NormHead is written normalized (Baichuan2's code normalizes again:",
        "  no change), so neither client needs it.",
        "- Mixtral and Qwen2-MoE: transformers 5 keeps each layer's experts stacked in memory (`experts.gate_up_proj`,",
        "  `experts.down_proj`) but reads and writes the hub's per-expert names (its conversion_mapping.py:",
        "  `block_sparse_moe.experts.{e}.w1/w3/w2` for Mixtral, `mlp.experts.{e}.gate_proj/up_proj/down_proj` for",
        "  Qwen2-MoE), which is what the export writes. Logits only are compared (the router's auxiliary loss is",
        "  not part of them). mixtral-llama3.1-rope gives Mixtral llama3-tiny's rotary scaling (transformers'",
        "  Mixtral reads it from rope_scaling as Llama does). PaddleNLP 2.8.1 has a Mixtral conversion mapping, but",
        "  its MixtralSparseMoeBlock.forward fails under Paddle 3.3.1 (`routing_weights[top_x, idx]` is now [n], not",
        "  [n, 1]: \"Broadcast dimension mismatch\"), so it is no client here; it has no Qwen2-MoE class.",
        "- DeepSeek-V3: transformers' DeepseekV3ForCausalLM (latent attention with interleaved rotary pairs, YaRN with",
        "  mscale, the sigmoid router with its correction bias, group-limited top-k) computes the main model's logits.",
        "  It has no multi-token-prediction module: the exported MTP layer (model.layers.<num_hidden_layers>: enorm,",
        "  hnorm, eh_proj, the block, shared_head.norm, as the published files hold layer 61) is not loaded by it (an",
        "  unexpected key) and judged by the bitwise round trip only (tests/test_hf_export.py).",
        "- ERNIE 4.5 MoE: the correction bias goes out as `mlp.moe_statics.e_score_correction_bias` [1, E] (transformers",
        "  5 renames it into its router on reading: conversion_mapping.py \"ernie4_5_moe\"), q/k columns in ERNIE's",
        "  interleaved rotary order. PaddleFormers 0.4.1 judges its own format: paddleformers_parity.md.",
        "- GPT-3 is written as GPT-2's layout (GPT2LMHeadModel). The shapes allow it for this family as defined",
        "  (pre-norm LayerNorm, learned positions, tanh GELU, biases, tied head, any n_inner); they would not for",
        "  grouped-query attention, an untied head or rotary positions (GPT-NeoX-style), which export refuses.",
    ]
    kept = ""
    if os.path.isfile(out_file):
        with open(out_file) as f:
            old = f.read()
        if IMPORT_SECTION in old:
            kept = "\n" + IMPORT_SECTION + old.split(IMPORT_SECTION, 1)[1]
    with open(out_file, "w") as f:
        f.write("\n".join(lines) + "\n" + kept)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--venv", default=os.path.join(REPO, ".cache", "hf-client-venv"))
    parser.add_argument("--out", default=os.path.join(REPO, "benchmarks", "hf_export_verification.md"))
    parser.add_argument("--cases", nargs="*", default=(), choices=[case[0] for case in CASES],
                        help="only these cases (e.g. to check one family; the report keeps the other cases' rows "
                             "as written last)")
    args = parser.parse_args(argv)
    rows = run(args.venv, args.out, tuple(args.cases))
    for r in rows:
        print(f"{r['case']:22s} {r['client']:70s} {r['max_abs_diff']:.2e} {'ok' if r['ok'] else 'FAIL'}")
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
