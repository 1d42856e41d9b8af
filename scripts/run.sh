#!/usr/bin/env bash
# The main job on its embedded default: `python -m verl.trainer.main_ppo` with the config in
# verl/trainer/config/ppo_megatron_trainer.yaml (a tiny Qwen3-MoE the project makes itself, 8 ranks at
# TP2 PP2 EP2 ETP2, GRPO for 150 steps, checkpoints every 50). Any Hydra override can follow, e.g.
#   bash scripts/run.sh trainer.total_training_steps=6 actor_rollout_ref.actor.megatron.param_offload=True
# It runs on requirements.txt's stack (Python 3.11), which has no Megatron-Bridge: the model is built through
# mbridge, named first (vanilla_mbridge=True; upstream's default False is refused there in one line). On a host
# with Megatron-Bridge, pass actor_rollout_ref.actor.megatron.vanilla_mbridge=False to build through it.
# No rollout is named: the run samples with vLLM where `import vllm` works (the stack installed here has vLLM's
# CPU build) and with transformers' generate otherwise, and says which at start; pass
# actor_rollout_ref.rollout.name=hf (or =vllm) to choose.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/venv.sh
install_stack -e .  # the tested stack with vLLM's CPU build (setup.py declares ranges)
exec python -m verl.trainer.main_ppo actor_rollout_ref.actor.megatron.vanilla_mbridge=True "$@"
