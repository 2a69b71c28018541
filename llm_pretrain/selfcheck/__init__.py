"""Training under layouts and comparing with one process: the harness of the parity tests, the GPU
self-check and the planner's calibration runs.

    parity.py         launch trainings, read their records, compare losses and weights (TOLERANCE)
    parity_worker.py  several trainings in one process (a script the harness launches once per layout)
    rows.py           the GPU self-check's rows: what scripts/gpu_selfcheck.py runs and how each is judged
    planner_runs.py   CPU runs of llama-real in the planner's layouts, measured against its prediction
    ring_threads.py   ring attention's ranks as threads of one process (the one-GPU ring rows, tests/test_ring_blocks.py)

May import everything in llm_pretrain except cli; nothing imports it but cli, scripts and tests.
"""
