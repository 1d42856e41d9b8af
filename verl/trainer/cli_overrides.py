"""The command line's overrides, checked before Hydra composes them: each one it cannot compose is one line that
names the override and the fix, instead of Hydra's multi-line report, so a launch script written for upstream
verl learns every key this trainer lacks in one pass."""

from __future__ import annotations

import os

from hydra import compose, initialize_config_module
from hydra.errors import HydraException, MissingConfigException, OverrideParseException

CONFIG_MODULE = "verl.trainer.config"
CONFIG_NAME = "ppo_megatron_trainer"  # main_ppo's config
CONFIG_DIR = os.path.join(os.path.dirname(__file__), "config")


def _compose(overrides: list[str]) -> None:
    with initialize_config_module(CONFIG_MODULE, version_base=None):
        compose(CONFIG_NAME, overrides=overrides)


def override_key(override: str) -> str:
    return override.lstrip("+~").split("=", 1)[0]


def _why(override: str, err: HydraException) -> str:
    """The problem and its fix, in one line, from the kind of Hydra's error."""
    key = override_key(override)
    message = str(err)
    if isinstance(err, OverrideParseException):
        return f"override '{override}' is not valid Hydra override syntax: quote the value (key='value') or fix the brackets"
    if isinstance(err, MissingConfigException):
        options = [line.strip() for line in message.split("Available options")[-1].splitlines()[1:] if line.startswith("\t") and "=" not in line]
        return f"{key}: no such choice here (this trainer's options: {', '.join(options) or 'none'}): set one of them or drop the override"
    if "An item is already at" in message:
        return f"{key} is already in this trainer's config: drop the leading '+' ({override.lstrip('+')})"
    if "Could not delete" in message:
        return f"{key} is not in this trainer's config, so '~' has nothing to delete: drop the override"
    if "Could not override" in message:
        return f"{key} is not in this trainer's config ({CONFIG_NAME}.yaml): a misspelling, or an upstream feature this trainer does not have: drop the override"
    return f"override '{override}' does not compose with this trainer's config: {_first_line(err)}"


def _first_line(err: Exception) -> str:
    return next((line.strip() for line in str(err).splitlines() if line.strip()), type(err).__name__)


def config_arguments(argv: list[str]) -> tuple[list[str], str | None, str | None]:
    """(the overrides, --config-name, --config-path) of main_ppo's arguments; Hydra's other flags are not overrides."""
    overrides, options = [], {"name": None, "path": None}
    flags = {"--config-name": "name", "-cn": "name", "--config-path": "path", "-cp": "path"}
    args = iter(argv)
    for arg in args:
        flag, has_value, value = arg.partition("=")
        if flag in flags:
            options[flags[flag]] = (value if has_value else next(args, "")).strip("'\"")
        elif not arg.startswith("-"):
            overrides.append(arg)
    name = options["name"].removesuffix(".yaml") if options["name"] is not None else None
    return overrides, name, options["path"]


def _is_this_config_dir(path: str | None) -> bool:
    """--config-path is relative to main_ppo's folder, as in upstream's scripts (``--config-path=config``)."""
    return path is None or os.path.realpath(os.path.join(os.path.dirname(__file__), path)) == os.path.realpath(CONFIG_DIR)


def override_problems(argv: list[str]) -> list[str]:
    """One line per override (or --config-name) that would stop Hydra from composing this trainer's config.

    Every failing override is named, not just the first: each is composed alone once the set fails together. A
    config of the user's own (--config-path elsewhere) is left to Hydra."""
    overrides, name, path = config_arguments(argv)
    if not _is_this_config_dir(path):
        return []
    if name is not None and name != CONFIG_NAME:
        # upstream's main_ppo defaults to ppo_trainer and takes model_engine=megatron; here that is the default
        return [f"--config-name={name}: this trainer has one config, {CONFIG_NAME} (it takes model_engine=megatron as upstream's ppo_trainer does): drop --config-name"]
    try:
        _compose(overrides)
        return []
    except HydraException as together:
        problems = []
        for override in overrides:
            try:
                _compose([override])
            except HydraException as err:
                problems.append(_why(override, err))
        return problems or [f"the overrides compose one by one but not together: {_first_line(together)}"]
