"""Metric helpers: plots of the trainer's JSONL metrics."""

from verl.utils.metric.plot import plot_metric_curve

__all__ = ["plot_metric_curve"]
