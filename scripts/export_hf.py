"""Export a training checkpoint as a Hugging Face model directory (config.json + safetensors).

    python scripts/export_hf.py output/checkpoint-1000 hf_model [--max-shard-size 5GB] [--dtype bfloat16]

The same as the console command `llm-export-hf`; see llm_pretrain/checkpoint/hf_export.py for what is
written per family. Bad input is one line `error: ...` with exit code 2.
"""

import sys

from llm_pretrain.checkpoint.hf_export import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
