"""Rule-based rewards by data source, with upstream verl's ``default_compute_score`` signature.

The trainer scores every response through this function (or a user's ``custom_reward_function``), so a
parquet file in upstream's format gets the reward upstream would give it for the data sources listed here.
"""

from __future__ import annotations

from typing import Any

from verl.utils.reward_score import arithmetic, gsm8k

_SCORERS = {arithmetic.DATA_SOURCE: arithmetic.compute_score, gsm8k.DATA_SOURCE: gsm8k.compute_score}
KNOWN_DATA_SOURCES = tuple(sorted(_SCORERS))


def default_compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: str,
    extra_info: dict[str, Any] | None = None,
    sandbox_fusion_url: str | None = None,
    concurrent_semaphore: Any = None,
    memory_limit_mb: int | None = None,
    **kwargs: Any,
) -> float:
    """Score one decoded response with the rule of its ``data_source``; NotImplementedError for another source.

    ``extra_info``, the sandbox arguments and ``kwargs`` are upstream's; none of the rules here reads them.
    """
    scorer = _SCORERS.get(data_source)
    if scorer is None:
        raise NotImplementedError(
            f"no reward function for data_source={data_source!r}; known data sources: {list(KNOWN_DATA_SOURCES)} "
            "(or set custom_reward_function.path)"
        )
    return float(scorer(solution_str, ground_truth))
