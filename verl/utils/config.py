"""``omega_conf_to_dataclass``: a Hydra/OmegaConf node (or a dict) -> one of the typed configs.

Upstream verl's name and signature. The typed configs validate themselves in ``__post_init__``; this
only turns the node into keyword arguments (a field typed as a dataclass is built from its node too), so an
unknown key is an error naming the key (Hydra's struct mode catches misspellings on the command line, not in
code that builds a config by hand).
"""

from __future__ import annotations

import dataclasses
import importlib
import typing
from collections.abc import Mapping
from typing import Any

__all__ = ["omega_conf_to_dataclass", "nested_config"]


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


def _names_subclass(target: str, cls: type) -> bool:
    """Whether ``target`` is the dotted path of a subclass of ``cls`` (a path that does not import is not)."""
    try:
        named = _import_target(target)
    except (ImportError, AttributeError, ValueError):
        return False
    return isinstance(named, type) and issubclass(named, cls)


def _dataclass_fields(cls: type) -> dict[str, type]:
    """Field name -> its type, for the fields of ``cls`` typed as a dataclass (``X`` or ``X | None``)."""
    try:
        hints = typing.get_type_hints(cls)
    except (NameError, TypeError):  # an annotation that does not resolve: such fields are left as given
        return {}
    found = {}
    for name, hint in hints.items():
        options = [arg for arg in typing.get_args(hint) if arg is not type(None)] or [hint]
        if len(options) == 1 and isinstance(options[0], type) and dataclasses.is_dataclass(options[0]):
            found[name] = options[0]
    return found


def nested_config(owner: str, name: str, value: Any, cls: type) -> Any:
    """Field ``name`` of ``owner`` as ``cls`` (a node or an already built config); its errors name
    ``owner.name.<field>``, so the builder of ``owner`` can turn them into the Hydra key."""
    if isinstance(value, cls):
        return value
    if value is not None and not isinstance(value, Mapping):
        raise ValueError(f"{owner}.{name} must be a mapping of {cls.__name__}'s fields, got {value!r}")
    try:
        return omega_conf_to_dataclass(value or {}, cls)
    except (TypeError, ValueError) as exc:
        message = str(exc)
        for klass in cls.__mro__:
            message = message.replace(f"{klass.__name__}.", f"{owner}.{name}.")
        raise ValueError(message if message != str(exc) else f"{owner}.{name}: {message}") from exc


def omega_conf_to_dataclass(config: Any, dataclass_type: type | None = None) -> Any:
    """Build ``dataclass_type`` (or the class the node's ``_target_`` names) from ``config``.

    A ``_target_`` naming a subclass of ``dataclass_type`` builds that subclass (as Hydra's instantiation
    of upstream's nodes does, e.g. an ``optim`` node naming ``FSDPOptimizerConfig``). An empty node gives
    the class's defaults (None without a class, as upstream); a config object that is already built is
    returned as it is when it is a ``dataclass_type`` (a wrong class is refused here, not later as a
    missing attribute).
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
    elif target and _names_subclass(str(target), dataclass_type):
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
    for name, cls in _dataclass_fields(dataclass_type).items():
        if isinstance(values.get(name), Mapping):
            values[name] = nested_config(dataclass_type.__name__, name, values[name], cls)
    return dataclass_type(**values)
