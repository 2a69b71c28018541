"""Pretrain a language model from a PaddleNLP-style JSON argument file.

    python llm_pretrain/run_pretrain.py configs/llama/pretrain-llama_tiny-dp.json [--key value ...]
    python -m paddle.distributed.launch --gpus 0,1,2,3,4,5,6,7 llm_pretrain/run_pretrain.py <file.json>

Exit codes: 0 finished, or stopped cleanly by SIGTERM/SIGINT with a checkpoint; 2 bad input (one line
`error: ...`, before any expensive work); 3 divergence (a non-finite loss or gradient norm; nothing
saved from that state); 1 other failures that are reported as one line (a checkpoint that cannot be
written, a dead rank); 130 a second Ctrl-C. A Python traceback means a bug.
"""

import sys

from llm_pretrain.errors import RunError, UsageError, exit_with_run_error, exit_with_usage_error


def run(args, argument_warnings: list[str], args_file: str | None = None) -> dict:
    """One run in this process: the preflight decides and checks it (llm_pretrain/run/preflight.py: every check
    before Paddle is imported), the trainer runs its loop (llm_pretrain/run/trainer.py)."""
    from llm_pretrain.run.preflight import plan_run

    plan = plan_run(args, argument_warnings, args_file)
    from llm_pretrain.run.trainer import train  # imports Paddle's training pieces: only for a checked run

    return train(plan)


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        from llm_pretrain.arguments import format_key_help

        print(__doc__)
        print("Keys:\n" + format_key_help())
        return 0 if argv else 2
    from llm_pretrain.run.run_control import die_with_parent, launched

    if launched():
        die_with_parent()  # no orphans: a worker ends when its launcher is killed
    try:
        from llm_pretrain.arguments import parse_arguments

        args, warnings = parse_arguments(argv)
        run(args, warnings, argv[0] if argv[0].endswith(".json") else None)
    except UsageError as error:
        exit_with_usage_error(error)
    except RunError as error:
        exit_with_run_error(error)
    except KeyboardInterrupt:
        print("error: interrupted (a second Ctrl-C); nothing was saved since the last checkpoint",
              file=sys.stderr, flush=True)
        return 130
    return 0


def exit_with(code: int) -> None:
    """A launched worker leaves without the interpreter's teardown, in which rank 0's TCP store daemon can abort
    (run_control.exit_after_results); one process exits normally."""
    from llm_pretrain.run.run_control import exit_after_results, launched

    if launched():
        exit_after_results(code)
    sys.exit(code)


def console_main() -> None:
    """The `llm-pretrain` command (pyproject.toml)."""
    exit_with(main(sys.argv[1:]))


if __name__ == "__main__":
    exit_with(main(sys.argv[1:]))
