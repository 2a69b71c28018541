"""`python scripts/prepare_data.py ...` is the `llm-prepare-data` command: llm_pretrain/cli/prepare_data.py."""

import sys

from llm_pretrain.cli.prepare_data import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
