"""Run several trainings one after the other in this process (tests launch it once per layout).

    python tests/workers/train_runs.py runs.json
    python -m paddle.distributed.launch --nproc_per_node 2 tests/workers/train_runs.py runs.json

runs.json is a list of argument lists for llm_pretrain/run_pretrain.py, e.g.
[["base.json", "--tensor_parallel_degree", "2", "--output_dir", "out/tp2"], ...].
Every run of one launch must have the same parallel layout (fleet is initialized once).
"""

import json
import os
import sys

from llm_pretrain.run_pretrain import main

if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        runs = json.load(f)
    for argv in runs:
        code = main([str(a) for a in argv])
        if code:
            sys.exit(code)
        # fleet.distributed_optimizer keeps the run's optimizer (and through it every weight, gradient
        # and moment) in fleet's singleton until the next call: drop it, so that the next run's
        # allocator peak (metrics.peak_memory_mb) is its own.
        if "paddle.distributed.fleet" in sys.modules:
            sys.modules["paddle.distributed.fleet"].fleet.user_defined_optimizer = None
    if os.environ.get("LAUNCH_RESULT_DIR"):  # under tests/launch_utils.launch: report success
        from launch_utils import write_result

        write_result({"runs": len(runs)})
