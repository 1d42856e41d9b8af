"""Measure how far Megatron's recomputed log-probs are from the HF rollout's, per dtype (the parity gate's tolerances).

    python -m benchmarks.measure_log_prob_parity [--world 1] [--tp 1] [--pp 1] [--ep 1] [--etp 1] [--rows 16] [--seeds 3]

On the embedded tiny Qwen3-MoE: the actor (Megatron, through mbridge) and the rollout model (transformers) are
built in the same dtype from the same weights; the rollout samples responses to left-padded prompts of mixed
lengths, Megatron recomputes their log-probs with the same attention mask, and the script prints one JSON line
per dtype with the largest and mean absolute difference over the response tokens (several sampling seeds).
docs/trainer.md ("The log-prob parity gate") quotes the numbers and the tolerances set from them.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import torch

from verl.utils.distributed import run_on_ranks
from verl.utils.megatron.parallel import ParallelSizes

RESPONSE_LENGTH = 12


def mixed_length_prompts(rows: int, longest: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask)``: random prompts of 2..longest tokens, left-padded with the pad id 0 as the trainer pads."""
    from verl.utils.dataset.rl_dataset import left_pad, left_pad_attention_mask

    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, longest + 1, (rows,), generator=generator).tolist()
    prompts = [{"input_ids": torch.randint(4, 99, (n,), generator=generator).tolist()} for n in lengths]
    return left_pad(prompts, longest, 0), left_pad_attention_mask(prompts, longest)


def _measure(model_path: str, dtype_name: str, rows: int, seeds: int) -> dict:
    from verl.models.mcore.parallel_hf_save import gather_hf_weights
    from verl.workers.actor.megatron_actor import MegatronPPOActor
    from verl.workers.config import McoreActorConfig, RolloutConfig, megatron_actor_configs_from_yaml
    from verl.workers.engine.megatron.transformer_impl import MegatronEngine
    from verl.workers.rollout.hf_rollout import InMemoryHFRollout, RolloutSettings

    dtype = getattr(torch, dtype_name)
    overrides = ("megatron.vanilla_mbridge=True", f"megatron.dtype={dtype_name}")
    actor = MegatronEngine(*megatron_actor_configs_from_yaml(model_path, overrides, total_training_steps=1))  # no step is trained
    ppo = MegatronPPOActor(McoreActorConfig(), RolloutConfig(response_length=RESPONSE_LENGTH), actor.model, actor.optimizer, actor.scheduler)
    rank0 = torch.distributed.get_rank() == 0
    tokenizer = actor.tokenizer
    rollout = InMemoryHFRollout(actor.hf_config, RolloutSettings(RESPONSE_LENGTH), tokenizer.eos_token_id, tokenizer.pad_token_id, dtype=dtype) if rank0 else None
    weights = gather_hf_weights(actor.bridge, actor.model, receivers=[0])
    if rollout is not None:
        rollout.load_weights(weights.items())
    diffs = []
    for seed in range(seeds):
        prompts, prompt_mask = mixed_length_prompts(rows, longest=10, seed=seed)
        holder = [rollout.generate_sequences(prompts, seed=seed, attention_mask=prompt_mask) if rollout is not None else None]
        torch.distributed.broadcast_object_list(holder, src=0)
        out = holder[0]
        sequences = torch.cat([prompts, out["responses"]], dim=1)
        attention_mask = torch.cat([prompt_mask, torch.ones_like(out["responses"])], dim=1)
        megatron = ppo.compute_log_prob(sequences, rows, attention_mask)
        diffs.append((megatron.float() - out["rollout_log_probs"].float()).abs()[out["response_mask"].bool()])
    diff = torch.cat(diffs)
    return {"dtype": dtype_name, "tokens": diff.numel(), "max_diff": diff.max().item(), "mean_diff": diff.mean().item()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("world", 1), ("tp", 1), ("pp", 1), ("ep", 1), ("etp", 1), ("rows", 16), ("seeds", 3)):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    args = parser.parse_args(argv)
    from verl.models.tiny import make_tiny_hf_model

    with tempfile.TemporaryDirectory() as tmp:
        model_path = make_tiny_hf_model(os.path.join(tmp, "tiny_moe"), kind="moe", seed=0)
        sizes = ParallelSizes(tp=args.tp, pp=args.pp, ep=args.ep, etp=args.etp)
        for dtype_name in args.dtypes.split(","):
            result = run_on_ranks(_measure, args.world, sizes, args=(model_path, dtype_name, args.rows, args.seeds), timeout_s=900)[0]
            print(json.dumps({**result, "layout": f"TP{args.tp} PP{args.pp} EP{args.ep} ETP{args.etp}"}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
