"""What a run reports: metrics, the record of what was built, FLOPs and MFU, performance tables.

    metrics.py     one log line and one train_log.jsonl record per logging step, VisualDL scalars
    run_record.py  what ran, read from the objects that were built (not from the arguments)
    flops.py       model FLOPs per token, device peaks (the CPU's measured), MFU; no Paddle at import
    perf.py        performance tables (markdown, CSV, PNG) from finished runs

May import: llm_pretrain.arguments, llm_pretrain.errors, models, cpu and parallel (the built layout).
Never run, checkpoint, planner, selfcheck or cli.
"""
