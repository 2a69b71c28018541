"""Build the embedded default corpus and tokenizer (offline, a few seconds; skipped when already built).

    python scripts/build_embedded_corpus.py [--out_dir data/embedded]

Text: the docstrings of the installed Python standard library. See llm_pretrain/data/embedded.py.
"""

import argparse
import sys
import time

# Run as a script: make the repository root importable.
from llm_pretrain.data.embedded import DEFAULT_OUT_DIR, ensure_embedded_corpus


def main(argv) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out_dir", default=DEFAULT_OUT_DIR, help=f"default: {DEFAULT_OUT_DIR}")
    args = parser.parse_args(argv)
    start = time.time()
    corpus = ensure_embedded_corpus(args.out_dir)
    print(f"embedded corpus: {corpus['documents']} documents, {corpus['tokens']} tokens, vocab {corpus['vocab_size']}; "
          f"input_dir={corpus['input_dir']} tokenizer={corpus['tokenizer']} ({time.time() - start:.1f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
