"""Import a PaddleNLP (or Hugging Face Baichuan) model directory so that training can continue from it.

    python scripts/import_paddlenlp.py paddlenlp_model_dir imported_model [--overwrite]

PADDLENLP_DIR holds config.json and weights: model_state.pdparams (as save_pretrained
writes it), a sharded model_state-*.pdparams with its index, or model.safetensors. Supported:
LlamaForCausalLM (LLaMA, Llama 2, Baichuan with alibi), QWenForCausalLM, GPTForCausalLM,
BloomForCausalLM, and Hugging Face Baichuan/Baichuan2 (W_pack) in safetensors. OUT_DIR gets
our config.json and model_state.pdparams in this toolkit's parameter names (and the tokenizer
files found next to the weights); train from it with

    "model_name_or_path": "imported_model", "continue_training": true

Bad input is one line `error: ...` with exit code 2.
"""

import argparse
import sys

# Run as a script: make the repository root importable.
from llm_pretrain.errors import UsageArgumentParser, UsageError, exit_with_usage_error




def main(argv) -> int:
    parser = UsageArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paddlenlp_dir", help="PaddleNLP model directory (config.json + weights)")
    parser.add_argument("out_dir", help="directory to write the imported model into")
    parser.add_argument("--overwrite", action="store_true", help="replace a model already in OUT_DIR")
    args = parser.parse_args(argv)
    try:
        from llm_pretrain.checkpoint.interchange import import_from_paddlenlp

        result = import_from_paddlenlp(args.paddlenlp_dir, args.out_dir, overwrite=args.overwrite)
    except UsageError as error:
        exit_with_usage_error(error)
    config = result["config"]
    print(f"{result['out_dir']}: {config['family']}, {result['parameters']:,} parameters in {result['tensors']} "
          f"tensors; train from it with model_name_or_path {result['out_dir']} and continue_training true",
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
