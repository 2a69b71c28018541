"""`python scripts/plan.py ...` is the `llm-plan` command: llm_pretrain/cli/plan.py."""

import sys

from llm_pretrain.cli.plan import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
