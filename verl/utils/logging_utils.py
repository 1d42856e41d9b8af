"""Quiet the notices megatron-core, mbridge and torch print on every rank of a CPU-only or TE-less host."""

from __future__ import annotations

import warnings

# Each of these says something true but useless here, once per rank: TransformerEngine / apex are
# absent (local implementations are used), a CUDA-only tuning hint, a deprecated cuda-graph default,
# and torch collectives megatron-core 0.16 still calls by their deprecated names.
KNOWN_NOTICES = (
    r".*(Apex|Transformer Engine|TransformerEngine).*(not installed|Falling back).*",
    r".*full scope is deprecated.*",
    r".*CUDA_DEVICE_MAX_CONNECTIONS.*",
    r".*`torch\.distributed\.(reduce_scatter_tensor|all_gather_into_tensor)` is deprecated.*",
)


def silence_library_notices() -> None:
    for message in KNOWN_NOTICES:
        warnings.filterwarnings("ignore", message=message)
