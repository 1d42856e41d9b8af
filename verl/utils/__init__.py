"""Upstream verl's ``verl.utils``: it re-exports ``omega_conf_to_dataclass`` (code written for upstream imports it here)."""

from .config import omega_conf_to_dataclass

__all__ = ["omega_conf_to_dataclass"]
