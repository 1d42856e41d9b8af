"""Rule-based rewards by data source, as upstream verl's ``default_compute_score``."""

from __future__ import annotations

from typing import Any

from verl.utils.reward_score import arithmetic

_SCORERS = {"arithmetic": arithmetic.compute_score}


def default_compute_score(
    data_source: str, solution_str: str, ground_truth: str, extra_info: dict[str, Any] | None = None
) -> float:
    """Score one decoded response with the rule of its ``data_source``."""
    scorer = _SCORERS.get(data_source)
    if scorer is None:
        raise NotImplementedError(
            f"no reward function for data_source={data_source!r}; known data sources: {sorted(_SCORERS)}"
        )
    return float(scorer(solution_str, ground_truth))
