"""The transformers internals this package touches, each checked where first used (``Internal``).

transformers 5 holds a MoE layer's experts fused in memory (``mlp.experts.gate_up_proj`` [E, 2I, H]) while its
files, the bridge's export and 4.x keep one tensor per expert. Two features need the names the files hold:
the HF export check (expected tensors from the config alone) and the rollout's in-memory weight sync (the
actor sends file names). Both go through the model's own save-time conversion.
Contract: tests/test_internals_contract.py.
"""

from __future__ import annotations

import contextlib

import torch
import transformers
from packaging.version import Version

from verl.utils.internals import Internal, InternalsChangedError

REVERT_WEIGHT_CONVERSION = Internal(
    "transformers",
    "transformers.core_model_loading:revert_weight_conversion",
    "the HF export check and the rollout's weight sync on transformers 5 (fused MoE experts)",
    params=("model", "state_dict"),
)
NO_INIT_WEIGHTS_5 = Internal("transformers", "transformers.initialization:no_init_weights", "the HF export check's meta model")
NO_INIT_WEIGHTS_4 = Internal("transformers", "transformers.modeling_utils:no_init_weights", "the HF export check's meta model")
INTERNALS = (REVERT_WEIGHT_CONVERSION, NO_INIT_WEIGHTS_5, NO_INIT_WEIGHTS_4)


def converts_weights_on_save() -> bool:
    """Whether this transformers renames or fuses weights between memory and its files (5.0 on)."""
    return Version(transformers.__version__).major >= 5


def as_saved(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` (the model's names) under the names and shapes ``save_pretrained`` writes:
    ``core_model_loading.revert_weight_conversion``, what transformers 5's save calls. The per-expert tensors
    it returns are views of the fused ones, so writing into them writes the model. Before 5.0 nothing is
    converted. On 5.x without the internal: ``InternalsChangedError`` (no public path gives the file names)."""
    if not converts_weights_on_save():
        return state
    return REVERT_WEIGHT_CONVERSION.get()(model, dict(state))


def no_init_weights() -> contextlib.AbstractContextManager:
    """transformers' context that skips weight initialisation (``transformers.initialization`` from 5.0,
    ``transformers.modeling_utils`` before): building a model on the meta device still walks every module's
    initialiser otherwise. Where neither exists, a null context: initialisation then only costs time."""
    internal = NO_INIT_WEIGHTS_5 if converts_weights_on_save() else NO_INIT_WEIGHTS_4
    try:
        return internal.get()()
    except InternalsChangedError:  # speed only, never correctness
        return contextlib.nullcontext()
