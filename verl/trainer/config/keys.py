"""The prefixes of the trainer config's keys that messages name (one spelling for every module that names them)."""

ACTOR = "actor_rollout_ref.actor"
MEGATRON = f"{ACTOR}.megatron."
CHECKPOINT = f"{ACTOR}.checkpoint."
REF = "actor_rollout_ref.ref"
PARITY = "actor_rollout_ref.rollout.log_prob_parity_check"  # verl.trainer.ppo.log_prob_parity.GATE_KEY
