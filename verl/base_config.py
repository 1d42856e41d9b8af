"""``BaseConfig``: the root of the typed configs, with upstream verl's name and dict-like access.

Code written against upstream reads configs both ways (``cfg.get("save_contents")``, ``cfg["lr"]``
and ``cfg.lr``), so the dataclasses are also read-only mappings. Fields are frozen once set, except
the ones a class lists in ``_mutable_fields`` (upstream's trainer fills ``total_training_steps`` in
after construction), so a config handed down cannot drift from what was validated.
"""

from __future__ import annotations

import collections.abc
import dataclasses
from collections.abc import Iterator
from typing import Any, ClassVar

__all__ = ["BaseConfig"]


@dataclasses.dataclass
class BaseConfig(collections.abc.Mapping):
    """A dataclass that is also a read-only ``Mapping`` of its fields."""

    _mutable_fields: ClassVar[set[str]] = set()
    # Hydra's instantiation target; kept as a field (as upstream does) so a node that names it converts.
    _target_: str = ""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self.__dict__ and name not in type(self)._mutable_fields:
            raise dataclasses.FrozenInstanceError(f"{type(self).__name__}.{name} is frozen and cannot be modified")
        super().__setattr__(name, value)

    def _normalize(self, name: str, value: Any) -> None:
        """Replace a field's value while ``__post_init__`` validates it (e.g. a ListConfig -> list)."""
        object.__setattr__(self, name, value)

    def get(self, key: str, default: Any = None) -> Any:
        return getattr(self, key, default)

    def __getitem__(self, key: str) -> Any:
        """``cfg[key]`` is ``cfg.key``: an absent key raises AttributeError, as upstream."""
        if not isinstance(key, str):
            raise TypeError(f"{type(self).__name__} keys are field names (str), got {key!r}")
        return getattr(self, key)

    def __contains__(self, key: object) -> bool:
        # Mapping's own __contains__ expects a KeyError from __getitem__; the AttributeError would escape it.
        return isinstance(key, str) and hasattr(self, key)

    def __iter__(self) -> Iterator[str]:
        return (f.name for f in dataclasses.fields(self))

    def __len__(self) -> int:
        return len(dataclasses.fields(self))
