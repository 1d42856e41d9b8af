"""Typed trainer configs (upstream verl's ``verl.trainer.config``); the Hydra YAML sits beside them."""

from . import config
from .config import *  # noqa: F401,F403

__all__ = config.__all__
