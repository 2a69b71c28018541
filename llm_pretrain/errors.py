"""The one error type for bad user input, and what the entry points do with it.

Anything the user can get wrong (argument files, keys, values, paths, data, models)
raises `UsageError` with a single-line message that names the key, file or
value and what is allowed. Entry points catch it, print `error: <message>`
to stderr and exit with code 2 -- never a traceback.

The class itself is models/errors.py's (models/ may not import llm_pretrain/, and what it
raises must be caught by every `except UsageError` here): this module re-exports that class.
"""

import argparse
import sys

from models.errors import UsageError  # noqa: F401 (the one class; llm_pretrain.errors.UsageError is it)
from models.errors import closest_matches  # noqa: F401 (the one "did you mean": keys, model names and types)

USAGE_EXIT_CODE = 2


def exit_with_usage_error(error: UsageError) -> None:
    message = " ".join(str(error).split())  # always one line
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(USAGE_EXIT_CODE)


class UsageArgumentParser(argparse.ArgumentParser):
    """argparse for the scripts: a bad command line is one line `error: ...` and exit code 2."""

    def error(self, message):
        exit_with_usage_error(UsageError(f"{message} (see --help)"))


class RunError(Exception):
    """A run that cannot go on (not bad input): one line `error: <message>`, exit code `exit_code`."""

    exit_code = 1


class DivergenceError(RunError):
    """A non-finite loss, gradient norm or weight: the run stops without saving that state."""

    exit_code = 3


def exit_with_run_error(error: RunError) -> None:
    print(f"error: {' '.join(str(error).split())}", file=sys.stderr, flush=True)
    sys.exit(error.exit_code)
