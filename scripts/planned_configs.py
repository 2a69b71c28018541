"""Re-run `plan.py search` for every planner-chosen argument file in configs/ and say which differ.

    PYTHONPATH=$PWD python scripts/planned_configs.py [--write]

A planner-chosen file is `pretrain-<model>_<a100|h100|h800>[x<gpus>]-<strategy>.json` (llm_pretrain/planner/planned_files.py:
the tag is the device searched, the file states model, length and global batch). --write replaces each file
that differs by search's first pick (renamed when the strategy changes); update the mentions of renamed files
in docs/, configs/README.md and benchmarks/ (scripts/long_context_benchmark.py --gpu-only regenerates its table).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def main(argv=None) -> int:
    from llm_pretrain.planner.planned_files import planned_files, rerun, search_command

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="rewrite the files that differ")
    options = parser.parse_args(argv)
    differing = 0
    for path in planned_files(REPO / "configs"):
        chosen = rerun(path)
        with open(path, encoding="utf-8") as f:
            same = chosen["text"] is not None and chosen["name"] == path.name and f.read() == chosen["text"]
        relative = path.relative_to(REPO)
        print(f"{relative}: `{search_command(chosen['request'])}` picks "
              + (", ".join(f"{p['strategy']} {p['tokens_per_card_per_sec']:,.0f} tokens/card/s "
                           f"{p['reserved_mb']:,.0f} MiB" for p in chosen["picks"]) or "nothing")
              + (": same" if same else ": DIFFERS"))
        if same:
            continue
        differing += 1
        if options.write and chosen["text"] is not None:
            os.remove(path)
            with open(path.parent / chosen["name"], "w", encoding="utf-8") as f:
                f.write(chosen["text"])
            print(f"  wrote {path.parent.relative_to(REPO) / chosen['name']}")
    return 1 if differing and not options.write else 0


if __name__ == "__main__":
    sys.exit(main())
