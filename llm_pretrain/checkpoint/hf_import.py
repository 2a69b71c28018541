"""Convert a Hugging Face model directory once into one of this toolkit's (`llm-import-hf`).

    python scripts/import_hf.py HF_DIR OUT_DIR [--overwrite]
    (console command `llm-import-hf`: llm_pretrain.checkpoint.hf_import:main)

Not needed to train: `model_name_or_path: HF_DIR` trains from the Hugging Face directory as it is
(models/hf_directory.py). This command is for those who want a directory of ours: OUT_DIR gets our
config.json (with "family") and model_state.pdparams in canonical names, plus the tokenizer files
of HF_DIR; train from it with model_name_or_path OUT_DIR and continue_training true.

HF_DIR: config.json in the transformers 4.x or 5.x form (every key read or refused:
models/families/hf_config_keys.py) and model.safetensors or a sharded model.safetensors.index.json,
for every family with a Hugging Face class (llm-export-hf writes these). Its tensors are read and
mapped one at a time by the same code training uses. PaddleNLP directories (.pdparams):
scripts/import_paddlenlp.py.

Bad input (one line `error: ...`, exit code 2, nothing written): no config.json or weights, a key
whose value cannot be honoured, an unknown rope type, a tensor missing or of the wrong shape.
"""

from __future__ import annotations

import argparse
import os
import sys

from llm_pretrain.errors import UsageArgumentParser, UsageError, exit_with_usage_error


def read_hf_directory(hf_dir: str) -> tuple:
    """(our ModelConfig, raw config.json, weights file) of a Hugging Face directory (else UsageError)."""
    from models.hf_directory import hf_weights_file
    from models.registry import config_from_dict, read_config_json

    if not os.path.isdir(hf_dir):
        raise UsageError(f"{hf_dir} is not a directory")
    config_file = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(config_file):
        raise UsageError(f"{hf_dir} has no config.json")
    raw = read_config_json(config_file)
    if "family" in raw:
        raise UsageError(f"{hf_dir} is already in this toolkit's format (its config.json has 'family')")
    weights_file = hf_weights_file(hf_dir)
    if weights_file is None:
        raise UsageError(f"{hf_dir} has no model.safetensors or model.safetensors.index.json (PaddleNLP's "
                         ".pdparams: scripts/import_paddlenlp.py)")
    return config_from_dict(raw, source=config_file), raw, weights_file


def import_hf(hf_dir: str, out_dir: str, overwrite: bool = False) -> dict:
    """Write our model directory for HF_DIR. Returns {"out_dir", "config" (ours), "tensors", "parameters"}."""
    from llm_pretrain.checkpoint.interchange import _check_out_dir, _copy_tokenizer, _save
    from models.hf_directory import SafetensorsFiles, plan_hf_tensors, stream_hf_weights

    config, raw, weights_file = read_hf_directory(hf_dir)
    _check_out_dir(out_dir, overwrite)
    files = SafetensorsFiles(weights_file)
    plan_hf_tensors(config, raw, files, weights_file)  # every tensor there and used, before any is read
    ours = dict(stream_hf_weights(config, raw, files, weights_file))
    our_config = config.architecture_dict()
    _save(out_dir, our_config, ours)
    _copy_tokenizer(hf_dir, out_dir)
    return {"out_dir": out_dir, "config": our_config, "tensors": len(ours),
            "parameters": int(sum(value.size for value in ours.values()))}


def main(argv=None) -> int:
    parser = UsageArgumentParser(prog="import_hf", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("hf_dir", help="a Hugging Face model directory (config.json + safetensors)")
    parser.add_argument("out_dir", help="directory to write the imported model into")
    parser.add_argument("--overwrite", action="store_true", help="replace a model already in OUT_DIR")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        result = import_hf(args.hf_dir, args.out_dir, overwrite=args.overwrite)
    except UsageError as error:
        exit_with_usage_error(error)
    print(f"{result['out_dir']}: {result['config']['family']}, {result['parameters']:,} parameters in "
          f"{result['tensors']} tensors; train from it with model_name_or_path {result['out_dir']} and "
          "continue_training true (or train from the Hugging Face directory itself)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
