"""``omega_conf_to_dataclass``: a Hydra/OmegaConf node (or a dict) -> one of the typed configs.

Upstream verl's name and signature. The typed configs validate themselves in ``__post_init__``; this
only turns the node into keyword arguments, so an unknown key is an error naming the key (Hydra's
struct mode catches misspellings on the command line, not in code that builds a config by hand).
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Mapping
from typing import Any

__all__ = ["omega_conf_to_dataclass"]


def _plain(value: Any) -> Any:
    """Resolved plain containers for a DictConfig / ListConfig (interpolations such as
    ``load_contents: ${.save_contents}`` resolved); anything else unchanged."""
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf
    except ImportError:  # omegaconf is a Hydra dependency; plain dicts need neither
        return value
    if isinstance(value, (DictConfig, ListConfig)):
        return OmegaConf.to_container(value, resolve=True)
    return value


def _import_target(target: str) -> type:
    module_name, _, name = target.rpartition(".")
    if not module_name:
        raise ValueError(f"_target_={target!r} is not a dotted path to a config class")
    return getattr(importlib.import_module(module_name), name)


def omega_conf_to_dataclass(config: Any, dataclass_type: type | None = None) -> Any:
    """Build ``dataclass_type`` (or the class the node's ``_target_`` names) from ``config``.

    An empty node gives the class's defaults (None without a class, as upstream); a config object that
    is already built is returned as it is when it is a ``dataclass_type`` (a wrong class is refused here,
    not later as a missing attribute).
    """
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        if dataclass_type is not None and not isinstance(config, dataclass_type):
            raise ValueError(f"got a built {type(config).__name__} where a {dataclass_type.__name__} is expected")
        return config
    if not config:
        return None if dataclass_type is None else dataclass_type()
    config = _plain(config)
    if not isinstance(config, Mapping):
        return config
    values = dict(config)
    target = values.get("_target_")
    if dataclass_type is None:
        if not target:
            raise ValueError(f"a config without _target_ needs dataclass_type; got keys {sorted(values)}")
        dataclass_type = _import_target(str(target))
    if not dataclasses.is_dataclass(dataclass_type):
        raise ValueError(f"{dataclass_type!r} is not a dataclass")
    fields = {f.name for f in dataclasses.fields(dataclass_type) if f.init}
    if "_target_" not in fields:
        values.pop("_target_", None)
    unknown = sorted(set(values) - fields)
    if unknown:
        raise ValueError(
            f"{dataclass_type.__name__} has no field(s) {unknown}; its fields: {sorted(fields - {'_target_'})}"
        )
    return dataclass_type(**values)
