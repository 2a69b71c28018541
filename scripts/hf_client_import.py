"""Run inside a verification venv (torch + transformers, no Paddle): models created at random by
transformers itself, saved with save_pretrained, and transformers' own loss on given token ids.
Called by scripts/verify_hf_import.py, never imported.

    python hf_client_import.py JOBS.json

JOBS.json: [{"name", "model_type", "config": {...}, "rope": {"rope_theta", "rope_scaling" or null} or null,
             "seed", "out_dir", "tokens": .npy}]
Each job: AutoConfig.for_model(model_type, **config) with the rotary settings passed as this transformers
version takes them (5.x: rope_parameters; 4.x: rope_theta and rope_scaling), a model built from it
(AutoModelForCausalLM.from_config), every parameter then drawn again from a fixed seed so that every tensor
matters (transformers' own init leaves biases at 0 and norms at 1, which would hide a mapping error), saved
(save_pretrained: the config.json form this version writes, safetensors), loaded back from the directory
(from_pretrained) and run on the tokens with labels = the tokens, in fp32: the loss is transformers' mean
next-token cross-entropy (its ForCausalLMLoss shifts the labels by one). Mixture-of-experts classes add no
router loss (output_router_logits is false by default). Writes a JSON line per job to stdout.
"""

import json
import math
import sys

import numpy as np
import torch
import transformers


def config_kwargs(job: dict) -> dict:
    kwargs = dict(job["config"])
    rope = job.get("rope")
    if rope is not None:
        if int(transformers.__version__.split(".")[0]) >= 5:
            kwargs["rope_parameters"] = {"rope_theta": rope["rope_theta"], "rope_type": "default",
                                         **(rope["rope_scaling"] or {})}
        else:
            kwargs["rope_theta"] = rope["rope_theta"]
            if rope["rope_scaling"]:
                kwargs["rope_scaling"] = dict(rope["rope_scaling"])
    return kwargs


def randomize(model, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
            if param.dim() == 1:
                param.copy_((1.0 if "norm" in name or "ln_" in name else 0.0) + 0.1 * noise)
            else:
                param.copy_(noise / math.sqrt(param.shape[-1]))
        # DeepSeek-V3's router correction bias is a buffer (saved, never trained by transformers): drawn after the
        # parameters (the other classes' draws unchanged), so that it changes which experts are chosen
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.1 * torch.randn(buffer.shape, generator=generator, dtype=torch.float32))


def dtype_key() -> str:
    return "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"  # 5.x renamed it


def main(jobs_file: str) -> None:
    with open(jobs_file) as f:
        jobs = json.load(f)
    for job in jobs:
        config = transformers.AutoConfig.for_model(job["model_type"], **config_kwargs(job))
        model = transformers.AutoModelForCausalLM.from_config(config, **{dtype_key(): torch.float32})
        randomize(model, job["seed"])
        model.save_pretrained(job["out_dir"])
        loaded = transformers.AutoModelForCausalLM.from_pretrained(job["out_dir"], **{dtype_key(): torch.float32},
                                                                   attn_implementation="eager")
        loaded.eval()
        tokens = torch.from_numpy(np.load(job["tokens"]))
        with torch.no_grad():
            loss = loaded(input_ids=tokens, labels=tokens).loss
        print(json.dumps({"name": job["name"], "loss": float(loss), "class": type(loaded).__name__,
                          "transformers": transformers.__version__, "torch": torch.__version__}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
