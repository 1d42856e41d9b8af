"""Upstream's training-engine package: the interface (``BaseEngine``) and the Megatron engine, this overlay's
only backend (upstream's FSDP, TorchTitan, VeOmni, Automodel and MindSpeed engines are not here)."""

from .base import BaseEngine
from .megatron import MegatronEngine

__all__ = ["BaseEngine", "MegatronEngine"]
