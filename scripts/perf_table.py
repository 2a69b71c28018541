"""`python scripts/perf_table.py ...` is the `llm-perf-table` command: llm_pretrain/cli/perf_table.py."""

import sys

from llm_pretrain.cli.perf_table import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
