"""Rule-based reward of the arithmetic task: the response's leading integer against the ground truth."""

from __future__ import annotations

import re

DATA_SOURCE = "arithmetic"

_LEADING_INT = re.compile(r"\s*(-?\d+)")


def compute_score(solution_str: str, ground_truth: str, format_score: float = 0.0, score: float = 1.0) -> float:
    """``score`` if the leading integer of the response (leading whitespace ignored) equals ``ground_truth``
    numerically, ``format_score`` if there is a leading integer but it is wrong, 0.0 if there is none.

    Only the leading integer counts, so a short response budget never forces the model to learn to stop.
    No format credit by default: with any, a random-init model learns "emit some digit" long before it
    meets a right answer, collapses onto one digit and GRPO's groups stop differing (docs/grpo.md, "Why these
    defaults").
    """
    match = _LEADING_INT.match(solution_str)
    if match is None:
        return 0.0
    return score if int(match.group(1)) == int(ground_truth.strip()) else format_score
