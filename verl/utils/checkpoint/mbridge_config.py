"""``checkpoint.mbridge_config``: the keyword arguments upstream passes to the bridge's HF weight save.

Torch-free and model-free (it reads only the save's signature), so the checkpoint manager and the pre-start
check share it without importing the model layer (docs/design.md, "Which package imports which").
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

# The HF save's own arguments: the caller passes them, ``checkpoint.mbridge_config`` never does.
_SAVE_OWN_ARGUMENTS = ("self", "models", "weights_path", "comm")


def save_weights_kwargs(
    save_weights: Callable,
    mbridge_config: Mapping,
    key: str = "checkpoint.mbridge_config",
    save_name: str = "mbridge's save_weights",
    strict: bool | None = None,
) -> dict[str, Any]:
    """The keyword arguments ``checkpoint.mbridge_config`` gives ``save_weights`` (upstream passes the entries the
    bridge's save takes by name). An entry it does not take is refused (upstream drops it silently, so a misspelt
    or another bridge's option would vanish): ValueError naming ``key.<entry>``, the save (``save_name``, as
    the user knows it) and what it takes. ``strict`` (``checkpoint.strict``) goes to a save that takes it
    (Megatron-Bridge's, as upstream passes it there, never from ``mbridge_config``: an entry naming it is refused)."""
    parameters = inspect.signature(save_weights).parameters
    given = dict(mbridge_config)
    if strict is not None and "strict" in parameters:
        if "strict" in given:
            raise ValueError(
                f"{key}.strict: the HF save's strictness is checkpoint.strict (upstream passes that to {save_name}); "
                f"set actor_rollout_ref.actor.checkpoint.strict instead and remove {key}.strict"
            )
        given["strict"] = bool(strict)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return given
    takes = [name for name in parameters if name not in _SAVE_OWN_ARGUMENTS]
    unknown = [name for name in mbridge_config if name not in takes]
    if unknown:
        raise ValueError(
            f"{key}.{unknown[0]}: the bridge's HF save ({save_name}) takes no such argument"
            + (f" (it takes: {', '.join(takes)})" if takes else " (it takes none)") + f"; remove {key}.{unknown[0]}"
        )
    return given
