"""GSM8K's rule-based reward, as upstream verl scores ``data_source="openai/gsm8k"``.

The answer is the number after the last ``#### `` marker (strict: the response must state it in GSM8K's own
format) or the last number in the response (flexible). Only the response's final 300 characters are searched:
answers come last, and a regex over a long runaway response would cost more than the step.
"""

from __future__ import annotations

import re

DATA_SOURCE = "openai/gsm8k"
_TAIL_CHARS = 300
_STRICT = re.compile(r"#### (-?[0-9.,]+)")
_ANY_NUMBER = re.compile(r"(-?[0-9.,]+)")


def extract_solution(solution_str: str, method: str = "strict") -> str | None:
    """The response's final answer as text (commas and ``$`` removed for strict), or None if it has none."""
    if method not in ("strict", "flexible"):
        raise ValueError(f"method={method!r}: use 'strict' or 'flexible'")
    tail = solution_str[-_TAIL_CHARS:]
    if method == "strict":
        found = _STRICT.findall(tail)
        return found[-1].replace(",", "").replace("$", "") if found else None
    for candidate in reversed(_ANY_NUMBER.findall(tail)):
        if candidate not in ("", "."):
            return candidate
    return None


def compute_score(
    solution_str: str, ground_truth: str, method: str = "strict", format_score: float = 0.0, score: float = 1.0
) -> float:
    """``score`` when the extracted answer equals ``ground_truth`` as text, ``format_score`` when an answer was
    found but differs, 0 when there is none (upstream's rule: no numeric normalisation, so "72.0" != "72")."""
    answer = extract_solution(solution_str, method=method)
    if answer is None:
        return 0.0
    return score if answer == ground_truth else format_score
