"""The error type for bad user input, defined where the lowest layer (models/) can raise it.

A model name, config.json, weights file or export target the user got wrong raises
`UsageError` with a single-line message naming the key, file or value and what is allowed.
models/ only raises it; llm_pretrain/errors.py re-exports this very class and holds what the
entry points do with it (one line `error: <message>` on stderr, exit code 2). One class, not
two: every `except UsageError` in the toolkit catches what models/ raises.

`closest_matches` is the one "did you mean" of the toolkit: unknown argument keys
(llm_pretrain/arguments.py), unknown model names, model types and families (models/registry.py).
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping


class UsageError(Exception):
    """Bad input from the user. The message is one line, shown as is."""


def closest_matches(value: str, choices: Iterable[str] | Mapping[str, str], n: int = 1,
                    cutoff: float = 0.5) -> list[str]:
    """Up to `n` of `choices` closest to `value`, best first.

    A choice equal to `value` but for letter case comes first; then difflib's ratio, compared
    without case (its `cutoff`). `choices` may be a mapping {spelling: choice}: several spellings
    (a hub name and its part after the "/") then lead to one choice, which is returned once.
    """
    spellings = choices.items() if isinstance(choices, Mapping) else ((c, c) for c in choices)
    by_folded: dict[str, list[str]] = {}
    for spelling, choice in spellings:
        by_folded.setdefault(str(spelling).casefold(), []).append(choice)
    folded = str(value).casefold()
    ordered = list(by_folded.get(folded, []))
    for match in difflib.get_close_matches(folded, list(by_folded), n=n + len(by_folded.get(folded, [])),
                                           cutoff=cutoff):
        ordered += by_folded[match]
    result: list[str] = []
    for choice in ordered:
        if choice not in result:
            result.append(choice)
    return result[:n]
