"""The run: everything decided before fleet.init, the training loop, and what ends or rescues a run.

    preflight.py    check_run (no Paddle: every bad input is one line) and prepare_run -> one RunPlan
    trainer.py      train(plan): fleet.init, model, optimizer, data, the loop, checkpoints, the summary
    run_control.py  signals, the launcher's death, dead and hung peers (heartbeat, watchdog)
    resilience.py   loss spikes (warn, skip, rollback, stop) and skipped data intervals

May import: llm_pretrain.arguments, llm_pretrain.errors, models, and the packages below it (cpu, data,
parallel, checkpoint, observe, planner). Imported by the entry points (llm_pretrain/run_pretrain.py,
llm_pretrain/launch.py), selfcheck and cli; never by the packages below it.
"""
