"""Pretrain a language model from a PaddleNLP-style JSON argument file.

    python llm_pretrain/run_pretrain.py configs/llama/pretrain-llama_tiny-dp.json [--key value ...]
    python -m paddle.distributed.launch --gpus 0,1,2,3,4,5,6,7 llm_pretrain/run_pretrain.py <file.json>

Bad input is reported as one line `error: ...` with exit code 2.
"""

import os
import sys

# Run as a script: make the repository root importable (llm_pretrain/ and models/).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from llm_pretrain.errors import UsageError, exit_with_usage_error  # noqa: E402


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        from llm_pretrain.arguments import format_key_help

        print(__doc__)
        print("Keys:\n" + format_key_help())
        return 0 if argv else 2
    try:
        from llm_pretrain.arguments import parse_arguments

        args, warnings = parse_arguments(argv)  # before importing Paddle: bad input fails fast
        from llm_pretrain.cpu_threads import apply_cpu_defaults

        message = apply_cpu_defaults(args.device)  # threads and MKL's fast path on CPU, before Paddle loads
        if message and os.environ.get("PADDLE_LOCAL_RANK", "0") == "0":
            print(message, flush=True)
        from llm_pretrain.trainer import train

        args_file = argv[0] if argv[0].endswith(".json") else None
        train(args, warnings, args_file)
    except UsageError as error:
        exit_with_usage_error(error)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
