"""HF model config -> Megatron-Core GPTModel through mbridge, with a local (non-TE) layer spec."""

from verl.models.mcore.mbridge import UnsupportedHFConfigError, make_bridge

__all__ = ["UnsupportedHFConfigError", "make_bridge"]
