"""Where the trainer's metrics go: ``trainer.logger``, upstream verl's backend names.

- ``console``: the trainer's own progress bar and one line per step (printed by the trainer, not here);
- ``file``: one JSON line per step in ``<trainer.default_local_dir>/metrics.jsonl`` (with a ``time`` stamp);
- ``tensorboard``: event files of every numeric metric under ``$TENSORBOARD_DIR``, else
  ``tensorboard_log/<project_name>/<experiment_name>`` (relative to the working directory), as upstream;
- ``wandb``: ``wandb.init(project=project_name, name=experiment_name, entity=$WANDB_ENTITY)``, offline
  (``WANDB_MODE=offline``) unless the user set ``WANDB_MODE``; ``wandb sync`` uploads the run later.

The pre-start check (verl.trainer.validation) refuses a backend whose package is missing, so a run never
fails here at its first metric.
"""

from __future__ import annotations

import json
import numbers
import os
import time
from collections.abc import Iterable, Mapping
from typing import Any

BACKENDS = ("console", "file", "tensorboard", "wandb")
# The package each backend imports (the pre-start check looks for it without importing it).
BACKEND_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb"}


def tensorboard_dir(project_name: str, experiment_name: str) -> str:
    """Upstream's place for the event files: ``$TENSORBOARD_DIR`` or ``tensorboard_log/<project>/<experiment>``."""
    return os.environ.get("TENSORBOARD_DIR") or os.path.join("tensorboard_log", project_name, experiment_name)


def scalar_metrics(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The numeric entries of a step's metrics (a checkpoint record or other nested values are left out)."""
    return {key: float(value) for key, value in metrics.items() if isinstance(value, numbers.Real) and key != "step"}


class Tracking:
    """Log each step's metrics to every backend of ``default_backend``; ``finish`` flushes and closes them."""

    def __init__(
        self,
        project_name: str,
        experiment_name: str,
        default_backend: str | Iterable[str] = "console",
        config: Mapping[str, Any] | None = None,
        metrics_path: str | None = None,
    ) -> None:
        """``metrics_path``: the ``file`` backend's JSON-lines file (the trainer's ``metrics.jsonl``)."""
        backends = [default_backend] if isinstance(default_backend, str) else list(default_backend)
        unknown = [name for name in backends if name not in BACKENDS]
        if unknown:
            raise ValueError(f"trainer.logger has {unknown}; this trainer provides {list(BACKENDS)}")
        if "file" in backends and metrics_path is None:
            raise ValueError("the file logger needs metrics_path")
        self.backends = backends
        self.metrics_path = metrics_path
        self.writer = None
        self.wandb = None
        if "tensorboard" in backends:
            from torch.utils.tensorboard import SummaryWriter

            self.tensorboard_dir = os.path.abspath(tensorboard_dir(project_name, experiment_name))
            os.makedirs(self.tensorboard_dir, exist_ok=True)
            self.writer = SummaryWriter(self.tensorboard_dir)
        if "wandb" in backends:
            os.environ.setdefault("WANDB_MODE", "offline")  # no account or network needed; the user's choice wins
            import wandb

            wandb.init(project=project_name, name=experiment_name, entity=os.environ.get("WANDB_ENTITY"), config=dict(config or {}))
            self.wandb = wandb

    def log(self, data: Mapping[str, Any], step: int, backend: Iterable[str] | None = None) -> None:
        """Log one step's metrics to every backend, or only to those named in ``backend`` (upstream's filter)."""
        if backend is None:
            backends = self.backends
        else:
            names = {backend} if isinstance(backend, str) else set(backend)
            backends = [name for name in self.backends if name in names]
        if "file" in backends:
            os.makedirs(os.path.dirname(os.path.abspath(self.metrics_path)), exist_ok=True)
            with open(self.metrics_path, "a") as handle:
                handle.write(json.dumps({**data, "time": time.time()}) + "\n")
        writer = self.writer if "tensorboard" in backends else None
        run = self.wandb if "wandb" in backends else None
        scalars = scalar_metrics(data) if writer is not None or run is not None else {}
        if writer is not None:
            for key, value in scalars.items():
                writer.add_scalar(key, value, step)
        if run is not None:
            run.log(scalars, step=step)

    def finish(self, exit_code: int = 0) -> None:
        """Flush and close every backend (wandb records ``exit_code``, non-zero marks the run failed); a
        second call does nothing."""
        if self.writer is not None:
            self.writer.close()
            self.writer = None
        if self.wandb is not None:
            self.wandb.finish(exit_code=exit_code)
            self.wandb = None
