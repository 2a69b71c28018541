"""Run inside the verification venv (torch + transformers, no Paddle): load exported models with
transformers and write their fp32 logits. Called by scripts/verify_hf_export.py, never imported.

    python hf_client_logits.py JOBS.json

JOBS.json: [{"name", "model_dir", "input_ids": .npy, "logits_out": .npy, "how": "auto" | "llama_from_w_pack"}]
"auto": AutoModelForCausalLM.from_pretrained(model_dir) -- the class config.json names.
"llama_from_w_pack": Baichuan's remote-code layout (its modeling_baichuan.py is not shipped, and
transformers loads no remote code offline): W_pack's rows are q, k, v (modeling_baichuan.py:
`proj = self.W_pack(hidden_states); proj = proj.unflatten(-1, (3, self.hidden_size))`), so they are
split into q_proj/k_proj/v_proj and loaded into transformers' LlamaForCausalLM, which is Baichuan-7B's
(rotary) computation. Writes a JSON line per job to stdout: name, class, transformers/torch versions.
"""

import json
import os
import sys
import tempfile

import numpy as np
import torch
import transformers
from safetensors.torch import load_file, save_file


def llama_dir_from_w_pack(model_dir: str) -> str:
    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    weights = load_file(os.path.join(model_dir, "model.safetensors"))
    for name in [n for n in weights if n.endswith("self_attn.W_pack.weight")]:
        q, k, v = weights.pop(name).chunk(3, dim=0)
        prefix = name[: -len("W_pack.weight")]
        weights.update({prefix + "q_proj.weight": q.contiguous(), prefix + "k_proj.weight": k.contiguous(),
                        prefix + "v_proj.weight": v.contiguous()})
    llama = {key: config[key] for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                          "num_attention_heads", "rms_norm_eps", "max_position_embeddings")}
    llama.update(architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu", rope_theta=10000.0,
                 tie_word_embeddings=False, num_key_value_heads=config["num_attention_heads"])
    out = tempfile.mkdtemp(prefix="baichuan_as_llama_")
    save_file(weights, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(llama, f)
    return out


def main(jobs_file: str) -> None:
    with open(jobs_file) as f:
        jobs = json.load(f)
    torch.manual_seed(0)
    for job in jobs:
        model_dir = job["model_dir"]
        if job["how"] == "llama_from_w_pack":
            model_dir = llama_dir_from_w_pack(model_dir)
        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
        model.eval()
        input_ids = torch.from_numpy(np.load(job["input_ids"]))
        with torch.no_grad():
            logits = model(input_ids=input_ids).logits
        np.save(job["logits_out"], logits.float().numpy())
        print(json.dumps({"name": job["name"], "class": type(model).__name__,
                          "transformers": transformers.__version__, "torch": torch.__version__}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
