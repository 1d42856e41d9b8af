"""HF model config -> Megatron-Core GPTModel through mbridge, with a local (non-TE) layer spec."""

from verl.models.mcore.mbridge import (
    UnsupportedHFConfigError,
    check_hf_config_supported,
    load_hf_config,
    make_bridge,
)
from verl.utils.megatron.parallel import ParallelConfigError, ParallelSizes


def validate_model_build(hf_path: str, sizes: ParallelSizes, world_size: int):
    """Every check that can fail before a rank starts: the path, the config, the parallel layout.

    Returns the HF config. Raises FileNotFoundError, or UnsupportedHFConfigError naming every model and
    layout problem at once (``problems``), or ParallelConfigError when only the layout is wrong.
    """
    hf_config = load_hf_config(hf_path)
    try:
        check_hf_config_supported(hf_config, sizes.pp)
    except UnsupportedHFConfigError as exc:
        try:
            sizes.validate_for_hf_config(world_size, hf_config)
        except ParallelConfigError as layout:
            raise UnsupportedHFConfigError(exc.problems + layout.problems) from exc
        raise
    sizes.validate_for_hf_config(world_size, hf_config)
    return hf_config


__all__ = ["UnsupportedHFConfigError", "load_hf_config", "make_bridge", "validate_model_build"]
