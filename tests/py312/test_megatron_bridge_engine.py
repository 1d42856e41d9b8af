"""The engine built through Megatron-Bridge (``vanilla_mbridge=False``): dist checkpoints at PP2 EP2 on 4 CPU
ranks, one of them saved asynchronously, resumed bit for bit, resharded to TP2 EP2, and resumed across bridges.

One rank function does the saving and the same-layout resumes (the build dominates the cost), a second loads
the step at another layout. Both bridges build the same megatron-core modules where TransformerEngine is
absent, so a dist checkpoint written through one names what the other loads, and both read and write HF names:
each loads the other's checkpoint and HF export bit for bit.
"""

import json
import os

import torch

from tests.main_leg import TRAINING_STEPS, actor_configs
from tests.test_checkpoint_lifecycle import _batches, _differing, _params_and_optimizer, _step_path
from verl.utils.checkpoint.integrity import verify_checkpoint
from verl.utils.distributed import run_on_ranks
from verl.utils.megatron.parallel import ParallelSizes

SIZES = ParallelSizes(pp=2, ep=2)  # 4 ranks: TP1 PP2 EP2 ETP1
DIST = ("megatron.use_dist_checkpointing=True", "checkpoint.save_contents=[model,optimizer,extra]")


def _actor(src: str, vanilla_mbridge: bool, *overrides: str):
    """The engine through the bridge ``vanilla_mbridge`` names, the model checkpointed as a dist checkpoint."""
    from verl.workers.engine.megatron.transformer_impl import MegatronEngine

    chosen = (f"megatron.vanilla_mbridge={vanilla_mbridge}", *DIST, *overrides)
    return MegatronEngine(*actor_configs(src, *chosen, total_training_steps=TRAINING_STEPS))


def _export(engine, path: str) -> None:
    """The engine's HF export in fix 2's order, as the checkpoint manager's: rank 0's config, a barrier, the weights."""
    from verl.utils.checkpoint.megatron_metadata import write_hf_config

    if torch.distributed.get_rank() == 0:
        os.makedirs(path)
        write_hf_config(path, engine.tokenizer, engine.hf_config, None)
    torch.distributed.barrier()
    engine.export_hf(path)


def _save_and_resume(src: str, root: str) -> dict:
    """Megatron-Bridge: step 1 saved asynchronously while step 2 trains; then step 1 resumed through it and, in
    a fresh engine, through mbridge (each then trains step 2 again); then mbridge's own save of step 1 resumed
    through Megatron-Bridge; and each bridge's HF export of step 2's weights loaded through the other. Returns
    what differs, and rank 0's HF weights at step 1. (Training on from a
    cross-bridge resume is not compared: Megatron-Bridge's MoE providers add the router's load-balancing loss,
    mbridge's do not; docs/models.md.)"""
    actor, bridge_on_device = _built_on_device(lambda: _actor(src, False, "checkpoint.async_save=True"))
    assert type(actor.bridge).__name__ == "MegatronBridgeModel"
    actor.train_step(_batches(0))
    at_step_1 = _params_and_optimizer(actor)
    pending = actor.save_checkpoint(_step_path(os.path.join(root, "bridge"), 1), global_step=1)
    actor.train_step(_batches(1))  # while the step-1 write runs
    committed = actor.finalize_checkpoint()
    at_step_2 = _params_and_optimizer(actor)

    actor.load_checkpoint(committed)
    resumed = _params_and_optimizer(actor)
    # copies: a gathered tensor may be the parameter itself (the gather's contract), which step 2 changes
    hf_at_step_1 = {name: tensor.clone() for name, tensor in actor.bridge.gather_hf_weights(actor.model, receivers=[0]).items()}
    actor.train_step(_batches(1))
    resumed_step_2 = _params_and_optimizer(actor)
    _export(actor, os.path.join(root, "bridge_hf"))  # step 2's weights, through Megatron-Bridge's HF save

    other, mbridge_on_device = _built_on_device(lambda: _actor(src, True))
    assert type(other.bridge).__name__ != "MegatronBridgeModel"
    other.load_checkpoint(committed)
    mbridge_resumed = _params_and_optimizer(other)
    other.save_checkpoint(_step_path(os.path.join(root, "mbridge"), 1), global_step=1)
    other.bridge.load_weights(other.model, os.path.join(root, "bridge_hf"))  # step 1 -> Megatron-Bridge's step-2 HF
    mbridge_loaded_hf = _params(other)
    _export(other, os.path.join(root, "mbridge_hf"))
    actor.load_checkpoint(_step_path(os.path.join(root, "mbridge"), 1))
    back_through_megatron_bridge = _params_and_optimizer(actor)
    actor.bridge.load_weights(actor.model, os.path.join(root, "mbridge_hf"))  # step 1 -> mbridge's step-2 HF
    return {
        "on_device": {"megatron_bridge": bridge_on_device, "mbridge": mbridge_on_device},
        # upstream's checkpoint.strict (default true) reaches Megatron-Bridge's HF save; mbridge's takes no such flag
        "save_kwargs": {"megatron_bridge": actor.checkpoint_manager.bridge_save_kwargs, "mbridge": other.checkpoint_manager.bridge_save_kwargs},
        "pending": pending,
        "moved": len(_differing(at_step_1, at_step_2)),
        "resumed": _differing(resumed, at_step_1),
        "resumed_step_2": _differing(resumed_step_2, at_step_2),
        "mbridge_resumed": _differing(mbridge_resumed, at_step_1),
        "back_through_megatron_bridge": _differing(back_through_megatron_bridge, at_step_1),
        "mbridge_loaded_megatron_bridge_hf": _differing(mbridge_loaded_hf, _params(at_step_2)),
        "megatron_bridge_loaded_mbridge_hf": _differing(_params(actor), _params(at_step_2)),
        "hf": hf_at_step_1,
    }


def _built_on_device(build):
    """The engine ``build()`` makes, and whether its bridge moved every model chunk to the current device before
    the DDP wrap (a GPU host's ``.cuda()``). The CPU runtime makes the move a no-op, so the call is recorded."""
    from megatron.core.utils import unwrap_model

    moved, cuda = [], torch.nn.Module.cuda

    def recording_cuda(module, device=None):
        moved.append(module)
        return cuda(module, device)

    torch.nn.Module.cuda = recording_cuda
    try:
        engine = build()
    finally:
        torch.nn.Module.cuda = cuda
    return engine, all(any(module is unwrap_model(chunk) for module in moved) for chunk in engine.model)


def _params(state) -> dict:
    """The parameters of an engine, or of a ``_params_and_optimizer`` record."""
    state = state if isinstance(state, dict) else _params_and_optimizer(state)
    return {key: value for key, value in state.items() if key.startswith("param.")}


def _load_at_another_layout(src: str, step: str) -> dict:
    actor = _actor(src, False)
    actor.load_checkpoint(step)
    weights = {name: tensor.clone() for name, tensor in actor.bridge.gather_hf_weights(actor.model, receivers=[0]).items()}
    return {"hf": weights, "loss": actor.train_step(_batches(1))["loss"]}


def test_dist_checkpoints_save_resume_reshard_and_cross_bridges(tiny_moe_path, tmp_path):
    root = str(tmp_path)
    results = run_on_ranks(_save_and_resume, 4, SIZES, args=(tiny_moe_path, root))
    for rank, result in enumerate(results):
        assert result["on_device"] == {"megatron_bridge": True, "mbridge": True}, rank
        assert result["save_kwargs"] == {"megatron_bridge": {"strict": True}, "mbridge": {}}, rank
        assert result["pending"] is True  # the async save returned before its write was committed
        assert result["moved"] > 0, "step 2 must change the state"
        for key in (
            "resumed", "resumed_step_2", "mbridge_resumed", "back_through_megatron_bridge",
            "mbridge_loaded_megatron_bridge_hf", "megatron_bridge_loaded_mbridge_hf",
        ):
            assert result[key] == [], (rank, key, result[key][:5])
    for bridge, name in (("bridge", "Megatron-Bridge"), ("mbridge", "mbridge")):
        verify_checkpoint(_step_path(os.path.join(root, bridge), 1))
        # each step names the bridge that wrote it; each loaded through the other above (both build the local spec)
        manifest = json.loads(open(os.path.join(_step_path(os.path.join(root, bridge), 1), "manifest.json")).read())
        assert manifest["bridge"] == {"name": name, "layer_spec": "local"}
    saved_hf = results[0]["hf"]
    assert len(saved_hf) == 135 and all(not r["hf"] for r in results[1:])

    # TP2 EP2 (sequence parallel, PP1) loads the PP2 EP2 step: the same HF weights, whole, on rank 0.
    resharded = run_on_ranks(_load_at_another_layout, 4, ParallelSizes(tp=2, ep=2, etp=1), args=(tiny_moe_path, _step_path(os.path.join(root, "bridge"), 1)))
    weights = resharded[0]["hf"]
    assert sorted(weights) == sorted(saved_hf)
    assert [name for name in saved_hf if not torch.equal(weights[name], saved_hf[name])] == []
    assert torch.isfinite(torch.tensor(resharded[0]["loss"]))
