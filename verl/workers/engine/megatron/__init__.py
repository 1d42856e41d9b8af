"""Upstream's Megatron engine package; ``MegatronEngine`` is in ``transformer_impl``, as upstream's."""

from .transformer_impl import MegatronEngine

__all__ = ["MegatronEngine"]
