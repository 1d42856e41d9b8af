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
    ``core_model_loading.revert_weight_conversion``, what transformers 5's save calls. A split tensor may be a
    view of the fused one (5.10) or a copy (5.19 makes each half of ``gate_up_proj`` contiguous): to write the
    model, use ``parameters_as_saved``. Before 5.0 nothing is converted. On 5.x without the internal:
    ``InternalsChangedError`` (no public path gives the file names)."""
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


def parameters_as_saved(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's parameters under the names and shapes its files hold, each a view of the model, so copying a
    file's tensor into it writes the model (the rollout's weight sync). Where the conversion returns a copy, the
    copy is replaced by the strided view of its parameter that holds the same elements, found by converting that
    parameter's element indices. ``InternalsChangedError`` where a file's tensor is no strided view of one
    parameter: a copy would take the weights and leave the model as it was."""
    params = {name: param.detach() for name, param in model.named_parameters()}
    saved = as_saved(model, params)
    model_storages = {param.untyped_storage().data_ptr() for param in params.values()}
    copied = {name for name, tensor in saved.items() if tensor.untyped_storage().data_ptr() not in model_storages}
    viewed = {tensor.untyped_storage().data_ptr() for name, tensor in saved.items() if name not in copied}
    for source, param in params.items():
        if not copied or param.untyped_storage().data_ptr() in viewed:
            continue
        indices = as_saved(model, {source: torch.arange(param.numel(), dtype=torch.float64).view(param.shape)})
        for name in copied & indices.keys():
            view = _strided_view(param, indices[name]) if indices[name].shape == saved[name].shape else None
            if view is not None:
                saved[name] = view
                copied.discard(name)
    if copied:
        raise REVERT_WEIGHT_CONVERSION.changed(f"returns {sorted(copied)[:3]} as copies that are no strided view of one parameter")
    return saved


def _strided_view(param: torch.Tensor, indices: torch.Tensor) -> torch.Tensor | None:
    """The view of the contiguous ``param`` whose elements are ``param.view(-1)[indices]``, or None if none is."""
    if not param.is_contiguous() or indices.numel() == 0:
        return None
    offset = int(indices.reshape(-1)[0])
    strides = [int(indices.select(dim, 1).reshape(-1)[0]) - offset if size > 1 else 1 for dim, size in enumerate(indices.shape)]
    last = offset + sum((size - 1) * stride for size, stride in zip(indices.shape, strides, strict=True))
    if min(strides, default=1) < 0 or last >= param.numel():
        return None
    every = torch.arange(param.numel(), dtype=torch.float64)
    if not torch.equal(every.as_strided(indices.shape, strides, offset), indices):
        return None
    return param.as_strided(indices.shape, strides, param.storage_offset() + offset)
