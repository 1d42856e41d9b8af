"""The parameters' dtype a step was saved in, and whether its optimizer state fits this run's.

A bf16 run's optimizer state holds fp32 master weights (``optimizer.state.fp32_param.*``, or the distributed
optimizer's ``...param`` buckets) that an fp32 run has no place for, and an fp32 run's has none a bf16 run
needs: loading across the two would drop the master weights or fail in megatron's load with a missing key.
The step's ``transformer_config.json`` (written with 'extra') records the dtype as megatron's ``params_dtype``.
"""

from __future__ import annotations

import json
import os

from verl.utils.checkpoint.names import TRANSFORMER_CONFIG_FILENAME

DTYPE_KEY = "actor_rollout_ref.actor.megatron.dtype"


def saved_param_dtype(step_path: str) -> str | None:
    """``bfloat16`` / ``float16`` / ``float32`` as the step at ``step_path`` (``global_step_N/actor``) was saved,
    or None when it does not say (saved without 'extra')."""
    path = os.path.join(step_path, TRANSFORMER_CONFIG_FILENAME)
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as handle:
        saved = json.load(handle)
    value = saved.get("params_dtype") if isinstance(saved, dict) else None
    return str(value).removeprefix("torch.") if value is not None else None


def optimizer_dtype_problem(step_path: str, dtype: str) -> str | None:
    """One line naming the fix when the step's optimizer state was saved in another parameter dtype than
    ``dtype`` (this run's, a torch dtype name); None when it fits or the step does not say."""
    saved = saved_param_dtype(step_path)
    if saved is None or saved == dtype:
        return None
    return (
        f"{step_path} optimizer state was saved with {DTYPE_KEY}={saved} (fp32 master weights exist only with bf16 "
        f"parameters), this run uses {dtype}; set {DTYPE_KEY}={saved}, or drop 'optimizer' from "
        "actor_rollout_ref.actor.checkpoint.load_contents to load the weights alone"
    )
