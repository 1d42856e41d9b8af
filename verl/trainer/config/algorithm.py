"""``AlgoConfig`` (upstream verl's name and defaults): the ``algorithm`` node, typed and checked where it is defined.

The class keeps upstream's defaults (``adv_estimator="gae"``) so code that builds it by hand means what it means
upstream; ``validate`` says what this trainer runs (GRPO, the KL as a loss, not in the reward).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

from verl.base_config import BaseConfig

from .field_checks import FieldChecks

__all__ = ["AlgoConfig", "KLControlConfig"]


@dataclasses.dataclass
class KLControlConfig(BaseConfig):
    """The in-reward KL penalty's controller: ``fixed`` or ``adaptive`` (towards ``target_kl`` over ``horizon``)."""

    type: str = "fixed"
    kl_coef: float = 0.001
    horizon: int = 10000
    target_kl: float = 0.1


@dataclasses.dataclass
class AlgoConfig(BaseConfig):
    """The advantage estimator and the in-reward KL penalty.

    Args:
        adv_estimator: the advantage estimator ("grpo" here); norm_adv_by_std_in_grpo: GRPO divides by the
            group's std (False: Dr. GRPO's unnormalised advantages).
        gamma / lam: GAE's discount and lambda (GRPO reads neither).
        use_kl_in_reward / kl_penalty / kl_ctrl: the KL penalty in the reward and its controller.
        use_pf_ppo: preference-feedback reweighting.
    """

    _key: ClassVar[str] = "algorithm"

    gamma: float = 1.0
    lam: float = 1.0
    adv_estimator: str = "gae"
    norm_adv_by_std_in_grpo: bool = True
    use_kl_in_reward: bool = False
    kl_penalty: str = "kl"
    kl_ctrl: Any = dataclasses.field(default_factory=KLControlConfig)
    use_pf_ppo: bool = False

    def __post_init__(self) -> None:
        checks = FieldChecks(self, self._key)
        checks.numbers("gamma", "lam")
        checks.booleans("norm_adv_by_std_in_grpo", "use_kl_in_reward", "use_pf_ppo")
        if not isinstance(self.kl_ctrl, KLControlConfig):
            if self.kl_ctrl is not None and not isinstance(self.kl_ctrl, Mapping):
                checks.add(f"algorithm.kl_ctrl={self.kl_ctrl} must be a mapping of type, kl_coef, horizon, target_kl")
            else:
                fields = {f.name for f in dataclasses.fields(KLControlConfig)} - {"_target_"}
                unknown = sorted(set(self.kl_ctrl or {}) - fields)
                if unknown:
                    checks.add(f"algorithm.kl_ctrl has no key(s) {unknown}; its keys: {sorted(fields)}")
                else:
                    self._normalize("kl_ctrl", KLControlConfig(**dict(self.kl_ctrl or {})))
        checks.raise_problems()

    def validate(self) -> list[str]:
        """What this trainer implements of the node: GRPO, with the KL as the actor's loss rather than in the reward."""
        problems = []
        if self.adv_estimator != "grpo":
            problems.append(f"algorithm.adv_estimator={self.adv_estimator}: only grpo is implemented here; set algorithm.adv_estimator=grpo")
        if self.use_kl_in_reward:
            problems.append("algorithm.use_kl_in_reward=True: the KL penalty in the reward is not implemented here (the KL loss is); set it to False, or use actor_rollout_ref.actor.use_kl_loss=True")
        if self.use_pf_ppo:
            problems.append("algorithm.use_pf_ppo=True: preference-feedback reweighting is not implemented; set it to False")
        return problems
