"""Interleaved-pipeline (VPP) checks shared by tests/test_vpp.py and tests/checks/check_vpp.py: what the ranks do
(train, save every chunk, resume, reshard) and what is then checked on disk and against transformers."""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint import FileSystemReader

from tests.main_leg import TRAINING_STEPS, actor_configs, override
from verl.utils.distributed import run_on_ranks
from verl.utils.megatron.parallel import ParallelSizes

CONTENTS = ("model", "optimizer", "extra", "hf_model")
STACKED_LAYER_KEY = "decoder.layers.self_attention.linear_proj.weight"  # one row per global layer


def batches(seed: int) -> list[torch.Tensor]:
    """Four microbatches of two rows: the interleaved schedule runs a multiple of PP (2 or 4 here)."""
    data = torch.randint(4, 90, (8, 17), generator=torch.Generator().manual_seed(seed))
    return list(data.split(2))


def check_tokens() -> torch.Tensor:
    return torch.randint(4, 90, (2, 16), generator=torch.Generator().manual_seed(3))


def _actor(src: str, use_distributed_optimizer: bool = False, vanilla_mbridge: bool = True):
    from verl.workers.engine.megatron.transformer_impl import MegatronEngine

    configs = actor_configs(
        src,
        override("megatron.use_distributed_optimizer", use_distributed_optimizer),
        "megatron.use_dist_checkpointing=True",
        override("checkpoint.save_contents", CONTENTS),
        override("megatron.vanilla_mbridge", vanilla_mbridge),
        total_training_steps=TRAINING_STEPS,
    )
    return MegatronEngine(*configs)


def hf_state(path: str) -> dict:
    state = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            state.update(load_file(os.path.join(path, name)))
    return state


def train_save_continue_then_resume(src: str, root: str, use_distributed_optimizer: bool = False, vanilla_mbridge: bool = True) -> dict:
    """On each rank: two steps, save step 2 (its logits of ``check_tokens()`` kept), two more; a fresh actor
    (built through the same bridge) loads step 2 and takes the same two steps."""
    first = _actor(src, use_distributed_optimizer, vanilla_mbridge)
    for step in range(2):
        first.train_step(batches(step))
    first.save_checkpoint(os.path.join(root, "global_step_2", "actor"), global_step=2)
    logits = first.logits(check_tokens())
    continued = [first.train_step(batches(10 + step))["loss"] for step in range(2)]
    expected = first.parameters_snapshot()

    resumed_actor = _actor(src, use_distributed_optimizer, vanilla_mbridge)
    resumed_actor.load_checkpoint(os.path.join(root, "global_step_2", "actor"))
    resumed = [resumed_actor.train_step(batches(10 + step))["loss"] for step in range(2)]
    actual = resumed_actor.parameters_snapshot()
    return {
        "chunks": len(first.model),
        "logits": logits,
        "continued": continued,
        "resumed": resumed,
        "differing": [name for name in expected if not torch.equal(expected[name], actual[name])],
    }


def load(src: str, ckpt: str, use_distributed_optimizer: bool) -> None:
    """On each rank: load ``ckpt`` whole at this run's layout."""
    _actor(src, use_distributed_optimizer).load_checkpoint(ckpt)


def load_export_save_and_train(src: str, ckpt: str, export: str, save_as: str | None) -> list[float]:
    """On each rank: load ``ckpt`` (model and optimizer) at this run's layout, export its weights, optionally
    save them as ``save_as`` (step 3), then train two steps: the second step's loss follows the first's
    update, which the loaded Adam moments shape."""
    actor = _actor(src)
    actor.load_checkpoint(ckpt)
    actor.export_hf(export)
    if save_as is not None:
        actor.save_checkpoint(save_as, global_step=3)
    return [actor.train_step(batches(20 + step))["loss"] for step in range(2)]


def missing_layer_rows(step: str, num_layers: int) -> dict[str, list[int]]:
    """Per dist checkpoint (model, optimizer), the global layers whose rows of the stacked layer tensor no
    chunk wrote; empty when every chunk's layers are on disk."""
    missing = {}
    for part in ("model", "optimizer"):
        metadata = FileSystemReader(os.path.join(step, part, "dist_ckpt")).read_metadata().state_dict_metadata
        key = next(k for k in metadata if k.endswith(STACKED_LAYER_KEY))
        rows = {chunk.offsets[0] for chunk in metadata[key].chunks}
        if metadata[key].size[0] != num_layers or rows != set(range(num_layers)):
            missing[part] = sorted(set(range(num_layers)) - rows)
    return missing


def logits_gap(hf_path: str, logits: torch.Tensor) -> float:
    """Largest difference between Megatron's logits of ``check_tokens()`` and transformers' on the HF export."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_path, dtype=torch.float32)
    with torch.no_grad():
        return (logits - model(check_tokens()).logits).abs().max().item()


def reshard_round_trip(src: str, step2: str, root: str, vpp: ParallelSizes, no_vpp: ParallelSizes, world: int) -> dict:
    """``step2`` (saved at ``vpp``) loaded at ``no_vpp`` and saved as step 3, which is loaded at ``vpp`` again:
    whether both loads give the saved weights bit for bit, and each layout's next two losses."""
    saved = hf_state(os.path.join(step2, "model", "huggingface"))
    step3 = os.path.join(root, "global_step_3", "actor")
    result = {"step3": step3}
    for name, sizes, ckpt, save_as in (("no_vpp", no_vpp, step2, step3), ("back", vpp, step3, None)):
        export = os.path.join(root, f"export_{name}")
        result[f"{name}_losses"] = run_on_ranks(load_export_save_and_train, world, sizes, args=(src, ckpt, export, save_as))[0]
        loaded = hf_state(export)
        result[f"{name}_exact"] = set(loaded) == set(saved) and all(torch.equal(loaded[k], saved[k]) for k in saved)
    return result


def num_hidden_layers(src: str) -> int:
    return json.loads(open(os.path.join(src, "config.json")).read())["num_hidden_layers"]
