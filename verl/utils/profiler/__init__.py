"""Upstream verl's ``verl.utils.profiler``: here only its config type, ``ProfilerConfig``; no profiler is wired in."""

from .config import ProfilerConfig

__all__ = ["ProfilerConfig"]
