"""`python scripts/benchmark.py ...` is the `llm-benchmark` command: llm_pretrain/cli/benchmark.py."""

import sys

from llm_pretrain.cli.benchmark import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
