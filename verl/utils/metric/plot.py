"""A PNG of one metric over the steps of a run, from the trainer's JSONL metrics file."""

from __future__ import annotations

import json
import os

_MIN_POINTS_FOR_AVERAGE = 10


def _read_curve(metrics_jsonl: str, key: str) -> tuple[list[float], list[float]]:
    steps, values = [], []
    with open(metrics_jsonl) as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            record = json.loads(line)
            if key not in record:
                continue
            if "step" not in record:
                raise ValueError(f"{metrics_jsonl}:{line_no} has {key!r} but no 'step' field")
            steps.append(float(record["step"]))
            values.append(float(record[key]))
    if not steps:
        raise ValueError(f"{metrics_jsonl} has no line with the key {key!r}; pass the metric name the trainer logs")
    return steps, values


def plot_metric_curve(
    metrics_jsonl: str, png_path: str, key: str = "critic/score/mean", title: str | None = None
) -> str:
    """Plot ``key`` against ``step`` (plus a trailing moving average from 10 points on, so the trend shows
    through the noise of small batches); write ``png_path`` and return it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps, values = _read_curve(metrics_jsonl, key)
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    ax.plot(steps, values, marker=".", linewidth=1, alpha=0.6, label=key)
    if len(values) >= _MIN_POINTS_FOR_AVERAGE:
        window = max(3, len(values) // 10)
        averages = [sum(values[i + 1 - window : i + 1]) / window for i in range(window - 1, len(values))]
        ax.plot(steps[window - 1 :], averages, linewidth=2, label=f"moving average ({window})")
    ax.set_xlabel("step")
    ax.set_ylabel(key)
    ax.set_title(title or key)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(png_path)), exist_ok=True)
    fig.savefig(png_path, format="png")
    plt.close(fig)
    return png_path
