"""Which vLLM log-probs are the actor's: ``log_softmax(logits / temperature)`` of the sampled token, before top-p.

Torch-free, so the pre-start checks read it without loading torch or vLLM on the driver.
"""

from __future__ import annotations


def logprobs_mode(temperature: float) -> str:
    """vLLM's ``logprobs_mode`` for an engine sampling at ``temperature``: the raw log-probs at temperature 1 (any
    top-p); else the processed ones, which are taken after temperature and top-k / top-p, so they are the actor's
    only without top-p."""
    return "raw_logprobs" if temperature == 1.0 else "processed_logprobs"


def convention_problem(mode: str, do_sample: bool, temperature: float, top_p: float) -> str | None:
    """Why an engine in ``mode`` cannot return the actor's log-probs for this sampling; None when it can."""
    if not do_sample or (mode == "raw_logprobs" and temperature == 1.0):
        return None  # greedy: vLLM's log-probs are of the raw logits, the actor's at temperature 1
    if mode == "raw_logprobs":
        return f"the engine returns log-probs at temperature 1 (its training temperature), asked for {temperature}"
    if top_p < 1.0:
        return f"vLLM's log-probs at temperature {temperature} are taken after top-p={top_p}; the actor's are before it"
    return None
