"""Trained from directories transformers wrote: every family with a Hugging Face class, judged by transformers
(issue 37 item 3); adds its section to benchmarks/hf_export_verification.md.

    python scripts/verify_hf_import.py [--venv .cache/hf-client-venv] [--venv4 .cache/hf-client-venv-4]
                                       [--out benchmarks/hf_export_verification.md] [--cases llama qwen2 ...]

For every case and both config.json forms:

  5.x  transformers 5 (the newest 5.x pip finds; the venv of scripts/verify_hf_export.py) creates the model at
       random and saves it: the rotary settings inside "rope_parameters", no top-level "rope_theta";
  4.x  transformers 4 (the newest 4.x, a second venv) does the same: top-level "rope_theta" and "rope_scaling"
       as 4.x writes them (nothing here rewrites a config.json);

through scripts/hf_client_import.py (every parameter drawn at random from a seed, save_pretrained, loaded back
with from_pretrained, transformers' fp32 loss on the token ids). Our side then trains from the directory as it
is (run_pretrain, model_name_or_path: the directory, one step, learning rate 0, fp32, one process): the loss
logged at step 1 is computed at the initial weights, on the first global batch of our data pipeline (the
embedded corpus, 2 samples of 32 + 1 tokens), which are the token ids given to transformers. The bar:
|our loss - transformers' loss| <= 1e-5. Mixture-of-experts runs use router_aux_loss_coef 0 (transformers
adds no router loss unless output_router_logits is set): the language-model loss alone is compared. Dropout
is 0 on our side (transformers' loss is in eval mode; GPT-2's files keep 0.1).

The rotary cases also give the loss our model computes with the rotary settings the import lost before
(issue 37: rope_theta 10000, no scaling): far beyond the bar, so the comparison would catch the loss.
tests/test_hf_import_verification.py checks the report: every case in both forms, within the bar.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from verify_hf_export import IMPORT_SECTION, REPO, TORCH_CHOICES  # scripts/ is sys.path[0] when run as a script

TOLERANCE = 1e-5
BATCH, SEQ = 2, 32
FORMS = {"4.x": ("transformers<5", 4), "5.x": ("transformers>=5", 5)}  # (pip requirement, major version)
# The tiny sizes every case shares (vocab 512: the embedded corpus' tokenizer; grouped-query attention 4:2)
COMMON = dict(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=128, max_position_embeddings=128)
# Llama 3.1's rotary scaling (meta-llama/Llama-3.1-8B config.json: rope_theta 500000, llama3 factor 8, low 1,
# high 4), original length 64 here so that its bands fall inside these tiny heads' frequencies too.
LLAMA31_ROPE = {"rope_theta": 500000.0,
                "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                 "original_max_position_embeddings": 64}}
QWEN_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1)
# (case, Hugging Face model_type, config.json settings, rotary settings or None, our family). Rope bases are the
# published ones (Llama 2: 10000 is the default, so Llama here takes Llama 3's 500000; Qwen2/Qwen3, Mixtral: 1e6)
# so that a base silently defaulted shows; the switches are the published small models' (tied heads of
# Qwen2-0.5B and Qwen3-0.6B, Qwen3's head_dim apart from hidden / heads, Qwen3-MoE's renormalized top-k).
CASES = [
    ("llama", "llama", COMMON, {"rope_theta": 500000.0, "rope_scaling": None}, "llama"),
    ("llama3.1", "llama", COMMON, LLAMA31_ROPE, "llama"),
    ("llama-linear", "llama", COMMON, {"rope_theta": 10000.0, "rope_scaling": {"rope_type": "linear", "factor": 4.0}},
     "llama"),
    ("qwen2", "qwen2", {**COMMON, "tie_word_embeddings": True}, {"rope_theta": 1e6, "rope_scaling": None}, "qwen2"),
    ("mixtral", "mixtral", {**COMMON, "num_local_experts": 4, "num_experts_per_tok": 2},
     {"rope_theta": 1e6, "rope_scaling": None}, "mixtral"),
    ("mixtral-llama3.1-rope", "mixtral", {**COMMON, "num_local_experts": 4, "num_experts_per_tok": 2}, LLAMA31_ROPE,
     "mixtral"),
    ("qwen2_moe", "qwen2_moe", {**COMMON, **QWEN_MOE, "shared_expert_intermediate_size": 64},
     {"rope_theta": 1e6, "rope_scaling": None}, "qwen2_moe"),
    ("qwen3", "qwen3", {**COMMON, "head_dim": 32, "tie_word_embeddings": True},
     {"rope_theta": 1e6, "rope_scaling": None}, "qwen3"),
    # YaRN as Qwen2.5's and Qwen3's model cards set it for long contexts (factor 4 over the original length; 32 of
    # these 128 positions): the ramp of frequencies and the attention factor 0.1 ln 4 + 1 on cos and sin
    ("qwen2-yarn", "qwen2", {**COMMON, "tie_word_embeddings": True},
     {"rope_theta": 1e6, "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}},
     "qwen2"),
    ("qwen3-yarn", "qwen3", {**COMMON, "head_dim": 32, "tie_word_embeddings": True},
     {"rope_theta": 1e6, "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}},
     "qwen3"),
    ("qwen3_moe", "qwen3_moe", {**COMMON, **QWEN_MOE, "head_dim": 32, "norm_topk_prob": True},
     {"rope_theta": 1e6, "rope_scaling": None}, "qwen3_moe"),
    # ERNIE 4.5 (baidu/ERNIE-4.5-0.3B-Base-PT's switches: head_dim apart, tied head, no biases, base 500000): its
    # interleaved rotary pairs, which the import reorders into halves (models/families/ernie4_5.py)
    ("ernie4_5", "ernie4_5", {**COMMON, "head_dim": 32, "tie_word_embeddings": True, "use_bias": False},
     {"rope_theta": 500000.0, "rope_scaling": None}, "ernie4_5"),
    ("gpt3", "gpt2", dict(vocab_size=512, n_embd=64, n_layer=2, n_head=4, n_positions=128), None, "gpt3"),
    ("bloom", "bloom", dict(vocab_size=512, hidden_size=64, n_layer=2, n_head=4), None, "bloom"),
    # DeepSeek-V3 (deepseek-ai/DeepSeek-V3's switches at tiny sizes): latent attention with q_lora_rank, YaRN factor
    # 4 over 32 of these 128 positions with mscale_all_dim 1 (the softmax scale x mscale^2), the sigmoid router with
    # its correction bias (drawn too), 8 experts in 4 groups (top 2 of 2 groups), renormalized x 2.5, a shared
    # expert, one dense layer first. transformers has no MTP module: its directories hold none (trained without).
    ("deepseek_v3", "deepseek_v3", {**COMMON, "num_key_value_heads": 4, "moe_intermediate_size": 32,
                                    "n_shared_experts": 1, "n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 4,
                                    "topk_group": 2, "routed_scaling_factor": 2.5, "norm_topk_prob": True,
                                    "first_k_dense_replace": 1, "q_lora_rank": 32, "kv_lora_rank": 16,
                                    "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16},
     {"rope_theta": 10000.0, "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                                              "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}},
     "deepseek_v3"),
    # ERNIE 4.5 MoE (21B-A3B's switches: 2 shared experts, start 1, renormalized top-k, the correction bias drawn
    # at random so that it changes the choice); 5 layers, MoE where start 1 <= i <= end 3 and (i + 1) % 2 == 0:
    # layers 1 and 3, dense 0, 2 and 4 (the start, the interval and the end each decide a layer)
    ("ernie4_5_moe", "ernie4_5_moe",
     {**COMMON, "num_hidden_layers": 5, "head_dim": 32, "tie_word_embeddings": True, "use_bias": False,
      "moe_num_experts": 4, "moe_k": 2, "moe_intermediate_size": 32, "moe_num_shared_experts": 2,
      "moe_layer_start_index": 1, "moe_layer_interval": 2, "moe_layer_end_index": 3},
     {"rope_theta": 500000.0, "rope_scaling": None}, "ernie4_5_moe"),
]
MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "ernie4_5_moe")
# transformers computes its loss in eval mode; GPT-2's files keep dropout 0.1 (resid_pdrop, embd_pdrop, attn_pdrop),
# which the trainer would apply at step 1 (3.9e-2 apart, measured): our run's dropout is set to 0 for every case
NO_DROPOUT = {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}


def ensure_venv(venv: str, requirement: str, major: int) -> str:
    """A venv with torch's CPU wheel and transformers `major`.x (as verify_hf_export.py makes its venv)."""
    python = os.path.join(venv, "bin", "python")
    if not os.path.isfile(python):
        subprocess.run([sys.executable, "-m", "venv", venv], check=True)
    probe = f"import torch, safetensors, transformers; assert transformers.__version__.split('.')[0] == '{major}'"
    if subprocess.run([python, "-c", probe], capture_output=True).returncode != 0:
        for torch in TORCH_CHOICES:
            if subprocess.run([python, "-m", "pip", "install", "-q", torch, requirement, "safetensors",
                               "numpy"]).returncode == 0:
                break
        else:
            sys.exit(f"could not install torch and {requirement} into {venv}")
    return python


def first_batch_tokens(corpus: dict, arguments: dict) -> np.ndarray:
    """The samples of step 1 as the trainer reads them (llm_pretrain/run/trainer.py: num_samples = max_steps x
    global batch, same split, seed and index cache): [BATCH, SEQ + 1] token ids."""
    from llm_pretrain.data import build_pretraining_datasets

    train, _, _ = build_pretraining_datasets(corpus["input_dir"], arguments["split"], SEQ, arguments["seed"],
                                             (BATCH, 0, 0), data_cache=arguments["data_cache"])
    return np.stack([np.asarray(train[i]) for i in range(BATCH)]).astype("int64")


def loss_with_lost_rope(directory: str, tokens: np.ndarray) -> float:
    """Our fp32 loss on the directory's weights with rope_theta 10000 and no scaling (what the import read
    from a 5.x file before issue 37)."""
    import paddle

    from models.decoder import CausalLM
    from models.registry import resolve_model
    from models.weights import load_weights_file

    config, weights_file = resolve_model(directory)
    config = config.replace(rope_theta=10000.0, rope_scaling=None)
    model = CausalLM(config)
    load_weights_file(model, config, weights_file)
    model.eval()
    with paddle.no_grad():
        logits = model(paddle.to_tensor(tokens[:, :-1])).astype("float32")
    logp = paddle.nn.functional.log_softmax(logits, axis=-1).numpy()
    return float(-np.take_along_axis(logp, tokens[:, 1:, None], axis=-1).mean())


def run(venvs: dict, out_file: str, only: tuple = ()) -> list[dict]:
    from llm_pretrain.data import ensure_embedded_corpus
    from llm_pretrain.selfcheck import parity
    from models.families.hf_config_keys import classify

    work = tempfile.mkdtemp(prefix="verify_hf_import_")
    corpus = ensure_embedded_corpus(os.path.join(work, "embedded"))
    arguments = parity.base_arguments(corpus, Path(work), max_seq_length=SEQ,
                                      per_device_train_batch_size=BATCH, gradient_accumulation_steps=1,
                                      learning_rate=0.0, min_learning_rate=0.0, warmup_steps=0, max_steps=1,
                                      save_steps=0)  # fp32: bf16 and fp16 are off by default
    del arguments["num_hidden_layers"]  # the directory's
    args_file = parity.write_json(Path(work) / "run.json", arguments)
    tokens = first_batch_tokens(corpus, arguments)
    np.save(os.path.join(work, "tokens.npy"), tokens)

    cases = [c for c in CASES if not only or c[0] in only]
    rows, runs = [], []
    for form, (requirement, major) in FORMS.items():
        python = ensure_venv(venvs[form], requirement, major)
        jobs = [{"name": case, "model_type": model_type, "config": config, "rope": rope, "seed": seed,
                 "out_dir": os.path.join(work, form, case), "tokens": os.path.join(work, "tokens.npy")}
                for seed, (case, model_type, config, rope, _) in ((31 + CASES.index(c), c) for c in cases)]
        with open(os.path.join(work, f"jobs-{form}.json"), "w") as f:
            json.dump(jobs, f)
        done = subprocess.run([python, os.path.join(REPO, "scripts", "hf_client_import.py"),
                               os.path.join(work, f"jobs-{form}.json")], capture_output=True, text=True)
        if done.returncode != 0:
            sys.exit(f"the transformers {form} client failed:\n{done.stderr[-4000:]}")
        theirs = {r["name"]: r for r in map(json.loads, done.stdout.strip().splitlines())}
        for case, model_type, _, rope, family in cases:
            directory = os.path.join(work, form, case)
            with open(os.path.join(directory, "config.json")) as f:
                written = json.load(f)
            output = os.path.join(work, "runs", f"{case}-{form}")
            runs.append(parity.argv(args_file, output, model_name_or_path=directory, **NO_DROPOUT,
                                    **({"router_aux_loss_coef": 0.0} if family in MOE_FAMILIES else {}),
                                    **({"seq_aux_loss_coef": 0.0} if family == "deepseek_v3" else {})))
            # every key transformers wrote is one the import classifies (used, no effect or refused)
            unclassified = sorted(key for key in written if classify(model_type, key) is None)
            rows.append({"case": case, "form": form, "family": family, "theirs": theirs[case], "_dir": directory,
                         "_output": output, "rope_keys": rope_keys(written), "_rope": rope,
                         "unclassified": ", ".join(unclassified) or "none"})
    parity.run_single(runs, Path(work), "import", timeout=3600)
    for row in rows:
        ours = parity.train_records(row.pop("_output"))[0]["loss"]
        info = row.pop("theirs")
        row.update(client=f"transformers {info['transformers']}, torch {info['torch']} ({info['class']})",
                   ours=ours, transformers=info["loss"], diff=abs(ours - info["loss"]))
        row["ok"] = row["diff"] <= TOLERANCE
        rope, directory = row.pop("_rope"), row.pop("_dir")
        row["lost_rope"] = None if rope is None else loss_with_lost_rope(directory, tokens)
    write_section(rows, out_file)
    shutil.rmtree(work, ignore_errors=True)
    return rows


def rope_keys(config: dict) -> str:
    """Where config.json holds the rotary settings, as written."""
    if "rope_parameters" in config:
        return "rope_parameters " + json.dumps(config["rope_parameters"], sort_keys=True)
    if "rope_theta" in config:
        scaling = config.get("rope_scaling")
        return f"rope_theta {config['rope_theta']}" + (f", rope_scaling {json.dumps(scaling, sort_keys=True)}"
                                                         if scaling else "")
    return "none (no rotary positions)"


def previous_rows(text: str) -> dict:
    """(case, form) -> its row of the report's table as written last, for the cases still in CASES."""
    names = {case[0] for case in CASES}
    table = {}
    for line in text.split(IMPORT_SECTION)[1].splitlines() if IMPORT_SECTION in text else []:
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if line.startswith("| ") and len(cells) >= 10 and cells[0] in names and cells[1] in FORMS:
            table[(cells[0], cells[1])] = line
    return table


def write_section(rows: list[dict], out_file: str) -> None:
    """Replace (or add) this script's section of the report; the export's part above it stays."""
    import paddle

    with open(out_file) as f:
        text = f.read()
    head = text.split(IMPORT_SECTION)[0].rstrip("\n")
    lines = [
        head, "", IMPORT_SECTION, "",
        "Written by `python scripts/verify_hf_import.py` (do not edit by hand; issue 37). A tiny model of each case is",
        "created at random by transformers itself and saved with `save_pretrained`, by transformers 4 (config.json",
        "with top-level `rope_theta` / `rope_scaling`) and by transformers 5 (`rope_parameters`); run_pretrain then",
        "trains from the directory as it is (`model_name_or_path`: the directory, one step, learning rate 0, fp32) and",
        f"the loss it logs at step 1 (the initial weights, the first {BATCH} x {SEQ + 1} tokens of the embedded",
        "corpus) is compared with transformers' loss on the same token ids (fp32, eager attention). The bar is",
        f"{TOLERANCE}.",
        f"Our side: paddlepaddle {paddle.__version__} (CPU). \"lost rope\": our loss with rope_theta 10000 and no",
        "scaling, what a 5.x file gave before issue 37. \"keys in no list\": keys of the written config.json that",
        "models/families/hf_config_keys.py classifies neither as used, nor without effect, nor refused.",
        "",
        "| case | form | rotary settings in config.json | keys in no list | client (class) | our loss "
        "| transformers' loss | abs diff | lost rope | within 1e-5 |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    table = previous_rows(text)  # a run of some cases (--cases) replaces their rows and keeps the others'
    for r in rows:
        lost = "n/a" if r["lost_rope"] is None else f"{r['lost_rope']:.6f}"
        table[(r["case"], r["form"])] = (
            f"| {r['case']} | {r['form']} | {r['rope_keys']} | {r['unclassified']} | {r['client']} | "
            f"{r['ours']:.7f} | {r['transformers']:.7f} | {r['diff']:.2e} | {lost} | {'yes' if r['ok'] else 'NO'} |")
    names = [case[0] for case in CASES]
    lines += [table[key] for key in sorted(table, key=lambda k: (list(FORMS).index(k[1]), names.index(k[0])))]
    lines += [
        "",
        "Notes:",
        "- Each form is written by the transformers version that writes it: 4.x by transformers 4 in its own venv",
        "  (`--venv4`), not by rewriting a 5.x file; each is compared with the loss of the transformers that wrote it.",
        "  Both draw from the same seed: the dense classes get the same weights (the same losses in both forms);",
        "  transformers 5 keeps each layer's experts stacked, so the MoE cases draw other weights in 5.x.",
        "- transformers 5.24 writes a Qwen3-MoE's expert count as `num_local_experts` (Qwen3MoeConfig's attribute_map",
        "  maps num_experts to it); the import read only `num_experts` and took the default 128, so the 5.x directory",
        "  was refused for missing experts. Both spellings are read now (models/families/base.py read_expert_count;",
        "  tests/test_hf_config_keys.py).",
        "- Dropout is 0 on our side for every case: transformers' loss is computed in eval mode, and GPT-2's config",
        "  keeps resid/embd/attn dropout 0.1, which the trainer applies (with it, gpt3 was 3.9e-2 apart).",
        "- Every parameter is drawn again after transformers' own init (which leaves biases at 0 and norms at 1 and",
        "  would hide a mapping error); routers too, so the experts chosen differ per token.",
        "- Mixture of experts: router_aux_loss_coef 0 on our side; transformers adds no router loss by default",
        "  (output_router_logits false). The language-model loss alone is compared.",
        "- DeepSeek-V3: transformers' DeepseekV3ForCausalLM has no multi-token-prediction module, so its directories",
        "  hold no MTP layer (5.24 still writes num_nextn_predict_layers 1): the import then builds none and the run",
        "  says so in a note (models/hf_directory.py hf_config_for_weights). The router's correction bias is a buffer",
        "  there, drawn too (scripts/hf_client_import.py). seq_aux_loss_coef 0 on our side (transformers adds no",
        "  balance loss): the language-model loss alone is compared.",
        "- Baichuan's class is remote code (not in transformers): transformers cannot create it, so it has no row",
        "  here (its export is checked above through its W_pack split).",
    ]
    with open(out_file, "w") as f:
        f.write("\n".join(lines) + "\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--venv", default=os.path.join(REPO, ".cache", "hf-client-venv"),
                        help="transformers 5 (the venv of scripts/verify_hf_export.py)")
    parser.add_argument("--venv4", default=os.path.join(REPO, ".cache", "hf-client-venv-4"), help="transformers 4")
    parser.add_argument("--out", default=os.path.join(REPO, "benchmarks", "hf_export_verification.md"))
    parser.add_argument("--cases", nargs="*", default=(), choices=[case[0] for case in CASES],
                        help="only these cases; the report keeps the other cases' rows as written last")
    args = parser.parse_args(argv)
    rows = run({"4.x": args.venv4, "5.x": args.venv}, args.out, tuple(args.cases))
    for r in rows:
        print(f"{r['case']:22s} {r['form']} {r['client']:60s} {r['diff']:.2e} {'ok' if r['ok'] else 'FAIL'}")
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
