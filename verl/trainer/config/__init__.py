"""Typed trainer configs (upstream verl's ``verl.trainer.config``); the Hydra YAML sits beside them."""

from . import config
from .algorithm import AlgoConfig, KLControlConfig
from .config import *  # noqa: F401,F403
from .data import DataConfig
from .trainer import TrainerConfig

__all__ = [*config.__all__, "AlgoConfig", "DataConfig", "KLControlConfig", "TrainerConfig"]
