"""The import path of the Ray actor worker before the engine layout (``verl.workers.engine_workers``; upstream
deleted this module in #6067). Kept for older callers; nothing is defined here."""

from verl.workers.engine_workers import ActorRolloutRefWorker

__all__ = ["ActorRolloutRefWorker"]
