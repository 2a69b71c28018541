"""Export a training checkpoint (or an imported model directory) as a PaddleNLP model directory.

    python scripts/export_paddlenlp.py output/checkpoint-1000 exported_model [--overwrite]

SOURCE is output_dir/checkpoint-N (its tensor/pipeline shards are merged) or a directory
written by scripts/import_paddlenlp.py. OUT_DIR gets config.json in PaddleNLP's keys
(architectures, model_type, ...) and model_state.pdparams in PaddleNLP's parameter names,
plus the run's tokenizer files when its tokenizer is a local directory:

    from paddlenlp.transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained("exported_model")

LLaMA and Baichuan export as LlamaForCausalLM (alibi for the 13B Baichuans), Qwen as
QWenForCausalLM, GPT-3 as GPTForCausalLM, Bloom as BloomForCausalLM; see
llm_pretrain/checkpoint/interchange.py (directories) and models/paddlenlp_interop.py (the mapping).
Bad input is one line `error: ...` with exit code 2.
"""

import argparse
import sys

# Run as a script: make the repository root importable.
from llm_pretrain.errors import UsageArgumentParser, UsageError, exit_with_usage_error




def main(argv) -> int:
    parser = UsageArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", help="output_dir/checkpoint-N, or a model directory of this toolkit")
    parser.add_argument("out_dir", help="directory to write the PaddleNLP model into")
    parser.add_argument("--overwrite", action="store_true", help="replace a model already in OUT_DIR")
    args = parser.parse_args(argv)
    try:
        from llm_pretrain.checkpoint.interchange import export_to_paddlenlp

        result = export_to_paddlenlp(args.source, args.out_dir, overwrite=args.overwrite)
    except UsageError as error:
        exit_with_usage_error(error)
    config = result["config"]
    print(f"{result['out_dir']}: {config['architectures'][0]} ({config['model_type']}), "
          f"{result['parameters']:,} parameters in {result['tensors']} tensors", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
