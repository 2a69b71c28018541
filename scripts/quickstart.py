"""The README's main job: build the embedded corpus, train a tiny LLaMA on CPU, print the performance table.

    python scripts/quickstart.py [--key value ...]     # extra keys override the argument file

Runs configs/llama/pretrain-llama_tiny-dp.json from the repository root (its paths are relative
to it) with a fresh output_dir (output/quickstart), so running it twice trains twice.
"""

import os
import shutil
import sys
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from llm_pretrain.data.embedded import ensure_embedded_corpus
from llm_pretrain.run_pretrain import main as run_pretrain

ARGS_FILE = "configs/llama/pretrain-llama_tiny-dp.json"
OUTPUT_DIR = "output/quickstart"


def main(argv: list[str]) -> int:
    os.chdir(REPO_ROOT)
    start = time.time()
    corpus = ensure_embedded_corpus()
    print(f"[1/3] embedded corpus: {corpus['documents']:,} documents, {corpus['tokens']:,} tokens, "
          f"vocab {corpus['vocab_size']} in {os.path.relpath(corpus['input_dir'])} ({time.time() - start:.1f} s)",
          flush=True)

    print(f"[2/3] training: python llm_pretrain/run_pretrain.py {ARGS_FILE} --output_dir {OUTPUT_DIR}",
          " ".join(argv), flush=True)
    shutil.rmtree(OUTPUT_DIR, ignore_errors=True)
    code = run_pretrain([ARGS_FILE, "--output_dir", OUTPUT_DIR, *argv])
    if code:
        return code

    from llm_pretrain.observe.perf import render_table_for_output_dir

    print(f"[3/3] performance table (python scripts/perf_table.py {OUTPUT_DIR}):\n", flush=True)
    print(render_table_for_output_dir(OUTPUT_DIR), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
