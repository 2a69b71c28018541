"""Convert a Hugging Face model directory (config.json + safetensors) once into this toolkit's format.

    python scripts/import_hf.py hf_model imported_model [--overwrite]

The same as the console command `llm-import-hf`; see llm_pretrain/checkpoint/hf_import.py. Training
does not need it (model_name_or_path may be the Hugging Face directory itself). Bad input is one
line `error: ...` with exit code 2.
"""

import sys

from llm_pretrain.checkpoint.hf_import import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
