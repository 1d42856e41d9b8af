"""``FieldChecks``: how the trainer's own typed configs (``trainer``, ``data``, ``algorithm``) check their fields.

Unlike a worker's config, which stops at its first bad field, these collect every problem of their node: a
user who mistyped three keys of one command line learns of all three at once. Each problem is one line that
names the Hydra key, the value given and the override that fixes it; ``raise_problems`` raises them as one
ValueError, a line each, which the pre-start check splits back into lines.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

__all__ = ["FieldChecks", "is_int", "is_number"]


def is_int(value: Any) -> bool:
    """An integer, not a bool (YAML's ``true`` is no count)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """An int or a float other than NaN, not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value)


class FieldChecks:
    """The problems found in one node's fields; ``node`` is its Hydra key (``trainer``)."""

    def __init__(self, config: Any, node: str) -> None:
        self.config, self.node, self.problems = config, node, []

    def key(self, name: str) -> str:
        return f"{self.node}.{name}"

    def add(self, line: str) -> None:
        self.problems.append(line)

    def _typed(self, names: Iterable[str], accepts: Any, kind: str, example: str) -> None:
        for name in names:
            value = getattr(self.config, name)
            if not accepts(value):
                self.add(f"{self.key(name)}={value} must be {kind}; set {self.key(name)}={example}")

    def integers(self, *names: str, optional: bool = False) -> None:
        kind = "an integer or null" if optional else "an integer"
        self._typed(names, lambda v: (optional and v is None) or is_int(v), kind, "<n>")

    def numbers(self, *names: str, optional: bool = False) -> None:
        self._typed(names, lambda v: (optional and v is None) or is_number(v), "a number or null" if optional else "a number", "<x>")

    def booleans(self, *names: str) -> None:
        # bool("false") is True: a string that reached here would silently mean the opposite.
        self._typed(names, lambda v: isinstance(v, bool), "true or false", "<true|false>")

    def at_least_one(self, *names: str, null_means: str | None = None) -> None:
        """Integers >= 1, or null when ``null_means`` says what null does; a mistyped value was named already."""
        for name in names:
            value, key = getattr(self.config, name), self.key(name)
            if is_int(value) and value < 1:
                self.add(f"{key}={value} must be an integer >= 1; set {key}=<n>" if null_means is None else f"{key}={value} must be null ({null_means}) or >= 1")

    def strings(self, *names: str, optional: bool = False) -> None:
        """Text fields: a number YAML parsed from ``experiment_name=2024`` is taken as its text, as upstream's ``str()``
        reads would; anything else that is not a string (a list, a mapping) is named."""
        for name in names:
            value = getattr(self.config, name)
            if optional and value is None:
                continue
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self.config._normalize(name, str(value))
            elif not isinstance(value, str):
                self.add(f"{self.key(name)}={value} must be text{' or null' if optional else ''}; set {self.key(name)}=<text>")

    def choice(self, name: str, choices: Iterable[str], fix: str) -> None:
        value = getattr(self.config, name)
        if value not in tuple(choices):
            self.add(f"{self.key(name)}={value} is not one of {list(choices)}; set {self.key(name)}={fix}")

    def raise_problems(self) -> None:
        if self.problems:
            raise ValueError("\n".join(self.problems))
