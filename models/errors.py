"""The error type for bad user input, defined where the lowest layer (models/) can raise it.

A model name, config.json, weights file or export target the user got wrong raises
`UsageError` with a single-line message naming the key, file or value and what is allowed.
models/ only raises it; llm_pretrain/errors.py re-exports this very class and holds what the
entry points do with it (one line `error: <message>` on stderr, exit code 2). One class, not
two: every `except UsageError` in the toolkit catches what models/ raises.
"""


class UsageError(Exception):
    """Bad input from the user. The message is one line, shown as is."""
