"""Whether Megatron-Bridge (``megatron.bridge``) is here, and what it needs on a host without TransformerEngine
or NVIDIA ModelOpt.

Megatron-Bridge 0.6 imports both unconditionally on paths verl takes, although neither runs there:
``megatron.bridge.peft.lora_layers`` imports ``transformer_engine.pytorch`` at module level (LoRA with TE
modules, which a model built from the local spec has none of), and the HF weight save imports
``modelopt.torch.quantization.utils.is_quantized`` (a model modelopt never quantized is not quantized). Each
answer is scoped to that one import, and given only where the real package cannot be imported: a host with
TransformerEngine or modelopt gets the real one.
"""

from __future__ import annotations

import builtins
import contextlib
import importlib.metadata
import importlib.util
import sys
import types
from collections.abc import Iterator
from typing import Any

VANILLA_MBRIDGE_KEY = "actor_rollout_ref.actor.megatron.vanilla_mbridge"


TESTED_MEGATRON_BRIDGE = "0.6"  # the release line the Megatron-Bridge path is proven with (tests/py312)


def megatron_bridge_install_problem(vanilla_mbridge: bool) -> str | None:
    """The one-line refusal of ``vanilla_mbridge=False`` on a host without Megatron-Bridge, or with a release other
    than the tested one, or None: never a silent switch to mbridge (a run's bridge is the one its config names)."""
    if vanilla_mbridge:
        return None
    fix = f"set {VANILLA_MBRIDGE_KEY}=True to build through mbridge, or install megatron-bridge {TESTED_MEGATRON_BRIDGE}.x (docs/models.md)"
    upstream = f"{VANILLA_MBRIDGE_KEY}=False (upstream verl's default) builds the model through NVIDIA's Megatron-Bridge"
    if not _importable("megatron.bridge"):
        return (
            f"{upstream}, which is not installed here (no module megatron.bridge; its tested release, "
            f"{TESTED_MEGATRON_BRIDGE}.x, needs Python 3.12): {fix}"
        )
    try:
        version = importlib.metadata.version("megatron-bridge")
    except importlib.metadata.PackageNotFoundError:
        version = None
    if version is not None and version.split(".")[:2] == TESTED_MEGATRON_BRIDGE.split("."):
        return None
    found = f"megatron-bridge {version}" if version else "a megatron.bridge of unknown version (no package metadata)"
    return f"{upstream}, and {found} is installed here, not the tested {TESTED_MEGATRON_BRIDGE}.x: {fix}"


_LORA_LAYERS = "megatron.bridge.peft.lora_layers"
_MODELOPT_UTILS = "modelopt.torch.quantization.utils"


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _transformer_engine_for_lora_layers() -> types.ModuleType:
    """The names ``lora_layers`` reads from ``transformer_engine.pytorch`` only when it wraps a TE module."""
    te = types.ModuleType("transformer_engine")
    te.pytorch = types.ModuleType("transformer_engine.pytorch")
    unused = type("NotTransformerEngine", (), {})  # no module of a local-spec model is an instance of it
    te.pytorch.Linear = te.pytorch.LayerNormLinear = unused
    te.pytorch.ops = types.SimpleNamespace(Sequential=unused)
    return te


def import_megatron_bridge() -> types.ModuleType:
    """``megatron.bridge``, imported where TransformerEngine is absent too (see the module docstring).

    The stand-in is handed only to ``lora_layers``' own import statement and never enters ``sys.modules``, so
    megatron-core and everything else still see that TransformerEngine is absent."""
    if "megatron.bridge" in sys.modules or _importable("transformer_engine"):
        return importlib.import_module("megatron.bridge")
    stand_in = _transformer_engine_for_lora_layers()
    real_import = builtins.__import__

    def scoped_import(name: str, globals: Any = None, locals: Any = None, fromlist: Any = (), level: int = 0) -> Any:
        if name.split(".")[0] == "transformer_engine" and (globals or {}).get("__name__") == _LORA_LAYERS:
            return stand_in
        return real_import(name, globals, locals, fromlist, level)

    builtins.__import__ = scoped_import
    try:
        return importlib.import_module("megatron.bridge")
    finally:
        builtins.__import__ = real_import


@contextlib.contextmanager
def hf_save_without_modelopt() -> Iterator[None]:
    """Around a Megatron-Bridge HF save: where modelopt is absent, its ``is_quantized`` answers False (nothing
    here was quantized by it); the stand-in modules leave ``sys.modules`` afterwards."""
    if _importable("modelopt"):
        yield
        return
    names = ("modelopt", "modelopt.torch", "modelopt.torch.quantization", _MODELOPT_UTILS)
    modules = {name: types.ModuleType(name) for name in names}
    modules[_MODELOPT_UTILS].is_quantized = lambda module: False
    added = [name for name in names if name not in sys.modules]
    sys.modules.update({name: modules[name] for name in added})
    try:
        yield
    finally:
        for name in added:
            sys.modules.pop(name, None)
