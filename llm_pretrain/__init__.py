"""llm-pretrain: pretraining LLMs with Paddle's fleet hybrid-parallel API.

One sub-package per concern; each says in its __init__ what it holds and what it may import, and
tests/test_import_graph.py holds them to it (docs/architecture.md draws it):

    arguments.py, errors.py   the run's keys and the one error type: every package uses them
    run_pretrain.py, launch.py  the entry points (python llm_pretrain/run_pretrain.py, python -m llm_pretrain.launch)
    run/         preflight, the training loop, run control, loss spikes
    parallel/    the layout and what fleet is given: layout checks, fleet setup, precision, optimizers
    checkpoint/  checkpoints, the layout-free store, replica checks, PaddleNLP and Hugging Face weights
    observe/     metrics, the run record, FLOPs and MFU, performance tables
    data/        token files, sample indices, the embedded corpus, tokenizers
    planner/     predicted memory and speed of a layout; the layout search
    selfcheck/   the parity harness, the GPU self-check's rows, the planner's calibration runs
    cli/         the installed commands
    cpu/         the CPU compatibility layer and thread defaults
"""

import warnings

# `import paddle` warns about a missing ccache (it only matters for compiling C++
# extensions, which we never do); keep it from burying our one-line errors.
warnings.filterwarnings("ignore", message="No ccache found")
