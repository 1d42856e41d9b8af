"""How a worker method is called on a group: ``@register(dispatch_mode=...)`` (upstream verl's names)."""

from __future__ import annotations

import enum
from collections.abc import Callable

DISPATCH_ATTR = "_verl_dispatch_mode"


class Dispatch(enum.Enum):
    # The same arguments to every rank; the result is the list of every rank's return value.
    ONE_TO_ALL = "one_to_all"
    # Every argument is a list with one entry per rank; rank r gets entry r.
    ALL_TO_ALL = "all_to_all"
    # Every argument is a list with one entry per data-parallel rank; every rank of a DP group gets its
    # group's entry. The result holds one value per DP rank, from the group's output rank
    # (tensor-parallel rank 0, context-parallel rank 0, last pipeline stage).
    MEGATRON_COMPUTE = "megatron_compute"


def register(dispatch_mode: Dispatch = Dispatch.ALL_TO_ALL) -> Callable:
    """Mark a worker method as callable on the whole group; the worker group binds it by name.
    The default is upstream's, ALL_TO_ALL (one argument entry per rank)."""
    if not isinstance(dispatch_mode, Dispatch):
        raise TypeError(f"dispatch_mode must be a Dispatch, got {dispatch_mode!r}")

    def decorator(fn: Callable) -> Callable:
        setattr(fn, DISPATCH_ATTR, dispatch_mode)
        return fn

    return decorator


def registered_methods(cls: type) -> dict[str, Dispatch]:
    """Method name -> dispatch mode for every ``@register``-ed method of ``cls`` (inherited ones too)."""
    methods = {}
    for name in dir(cls):
        mode = getattr(getattr(cls, name, None), DISPATCH_ATTR, None)
        if isinstance(mode, Dispatch):
            methods[name] = mode
    return methods
