"""megatron-core's dense/MoE layer pattern, torch-free: the layer spec builds from it and the checkpoint's
identity check compares it, so both read ``moe_layer_freq`` through this one definition."""

from __future__ import annotations


def megatron_moe_layers(moe_layer_freq: int | list[int], num_layers: int, num_moe_experts: int | None) -> list[int]:
    """megatron's MoE/dense pattern, one entry per layer (1: MoE), as its layer spec reads ``moe_layer_freq``
    (an int N: every N-th layer from the first; a list: as given); all 0 without experts."""
    if not num_moe_experts:
        return [0] * num_layers
    if isinstance(moe_layer_freq, int):
        return [int(i % moe_layer_freq == 0) for i in range(num_layers)]
    return list(moe_layer_freq)
