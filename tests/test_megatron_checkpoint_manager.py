"""MegatronCheckpointManager: save order (fix 2), verified HF exports, exact resume, resharding."""

import glob
import os
import time

import pytest
import torch
from safetensors.torch import load_file

from tests.main_leg import TRAINING_STEPS, actor_configs, override
from tests.seed_layout_check import batches, seed_layout_problems, seed_layout_report
from verl.utils.checkpoint.megatron_checkpoint_manager import MegatronCheckpointManager
from verl.utils.distributed import RankFailure, run_on_ranks
from verl.utils.megatron.parallel import ParallelSizes

HF_ONLY = "checkpoint.save_contents=[model,hf_model]"
NO_HF = "checkpoint.save_contents=[model,optimizer,extra]"


def _actor(src: str, *overrides: str, wrap_bridge=None, manager_cls: type = MegatronCheckpointManager):
    from verl.workers.engine.megatron.transformer_impl import MegatronEngine

    configs = actor_configs(src, *overrides, total_training_steps=TRAINING_STEPS)
    return MegatronEngine(*configs, wrap_bridge=wrap_bridge, manager_cls=manager_cls)


def _hf_state(path: str) -> dict:
    state = {}
    for file in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        state.update(load_file(file))
    return state


# --------------------------------------------------------------------------- fix 2: save order


class ObservingBridge:
    """The real bridge, plus a note of what each rank finds on disk when its HF weight save starts."""

    def __init__(self, bridge):
        self.bridge = bridge
        self.seen_at_start = None

    def save_weights(self, models, weights_path, memory_efficient=False):
        names = ("config.json", "tokenizer.json", "tokenizer_config.json")
        self.seen_at_start = {name: os.path.exists(os.path.join(weights_path, name)) for name in names}
        return self.bridge.save_weights(models, weights_path, memory_efficient=memory_efficient)


class SlowConfigManager(MegatronCheckpointManager):
    """Rank 0 takes its time writing the HF config: the race of verl #6821, made certain."""

    def on_save_phase(self, phase):
        if phase == "hf_config":  # rank 0, just before it writes the config
            time.sleep(3.0)
        super().on_save_phase(phase)


class SlowConfigNoBarrierManager(SlowConfigManager):
    """Test-only variant without fix 2's barrier; it must be caught by the same check."""

    def wait_for_hf_config(self, config_failure=None):
        pass


def _save_and_observe(src: str, root: str, manager_cls: type) -> dict:
    observed = {}

    def wrap(bridge):
        observed["bridge"] = ObservingBridge(bridge)
        return observed["bridge"]

    actor = _actor(src, HF_ONLY, wrap_bridge=wrap, manager_cls=manager_cls)
    actor.save_checkpoint(os.path.join(root, "global_step_1", "actor"), global_step=1)
    return observed["bridge"].seen_at_start


def test_every_rank_finds_config_and_tokenizer_before_its_hf_weight_save(tiny_moe_path, tmp_path):
    seen = run_on_ranks(_save_and_observe, 8, ParallelSizes(2, 2, 2, 2), args=(tiny_moe_path, str(tmp_path), SlowConfigManager))
    assert all(all(found.values()) for found in seen), seen


def test_without_the_barrier_the_check_fails(tiny_moe_path, tmp_path):
    seen = run_on_ranks(
        _save_and_observe, 8, ParallelSizes(2, 2, 2, 2), args=(tiny_moe_path, str(tmp_path), SlowConfigNoBarrierManager)
    )
    assert not all(all(found.values()) for found in seen), "the no-barrier variant should have raced rank 0"
    assert all(seen[0].values())  # rank 0 itself always writes first


# --------------------------------------------------------------------------- completeness


class LastLayersExpertDroppingBridge:
    """Wraps the real bridge and silently drops the expert tensors of the last two layers (verl #6821)."""

    def __init__(self, bridge, num_layers: int):
        self.bridge = bridge
        self.dropped = tuple(f"model.layers.{n}.mlp.experts." for n in (num_layers - 2, num_layers - 1))

    def save_weights(self, models, weights_path, memory_efficient=False):
        real_export = self.bridge.export_weights

        def export_without_last_experts(chunks):
            for name, tensor in real_export(chunks):
                if not name.startswith(self.dropped):
                    yield name, tensor

        self.bridge.export_weights = export_without_last_experts
        try:
            return self.bridge.save_weights(models, weights_path, memory_efficient=memory_efficient)
        finally:
            del self.bridge.export_weights


def _save_with_dropping_bridge(src: str, root: str) -> None:
    actor = _actor(src, HF_ONLY, wrap_bridge=lambda b: LastLayersExpertDroppingBridge(b, 4))
    actor.save_checkpoint(os.path.join(root, "global_step_1", "actor"), global_step=1)


def test_missing_expert_tensors_fail_the_save_and_are_named(tiny_moe_path, tmp_path):
    with pytest.raises(RankFailure) as failure:
        run_on_ranks(_save_with_dropping_bridge, 4, ParallelSizes(tp=2, ep=2, etp=1), args=(tiny_moe_path, str(tmp_path)))
    message = str(failure.value)
    assert "HFCheckpointIncompleteError" in message
    assert "Nothing was committed" in message  # a CheckpointError: the rank discards the step and says so
    for layer in (2, 3):
        assert f"model.layers.{layer}.mlp.experts.0.gate_proj.weight" in message
    # nothing marks the half-written step as complete
    assert not os.path.exists(tmp_path / "global_step_1" / "actor" / "ckpt_contents.json")


def _save_hf(src: str, root: str) -> None:
    _actor(src, HF_ONLY).save_checkpoint(os.path.join(root, "global_step_1", "actor"), global_step=1)


# The seed layout's export: test_pp4_ep2_tp2_etp2_saves_everything_and_transformers_loads_it below (every tensor from
# disk, loaded by transformers, the Megatron model's logits) and tests/test_bridge_roundtrip.py (bit-exact at 16 ranks).
@pytest.mark.parametrize("sizes,world", [(ParallelSizes(), 1), (ParallelSizes(2, 2, 2, 2), 8)], ids=["1rank", "tp2pp2ep2etp2"])
def test_real_bridge_export_is_complete(tiny_moe_path, tmp_path, sizes, world):
    run_on_ranks(_save_hf, world, sizes, args=(tiny_moe_path, str(tmp_path)))
    hf = tmp_path / "global_step_1" / "actor" / "model" / "huggingface"
    exported, source = _hf_state(str(hf)), _hf_state(tiny_moe_path)
    assert set(exported) == set(source)
    assert all(torch.equal(exported[k], source[k]) for k in source)
    for name in ("config.json", "tokenizer.json", "generation_config.json", "model.safetensors.index.json"):
        assert (hf / name).exists(), name


# --------------------------------------------------------------------------- PP4 EP2 TP2 ETP2 end to end


def test_pp4_ep2_tp2_etp2_saves_everything_and_transformers_loads_it(tiny_moe_path, tmp_path):
    """The seed layout through mbridge: one step trained, saved with a verified HF export that transformers
    loads and whose logits are the Megatron model's (tests/seed_layout_check.py; Megatron-Bridge's run of it:
    tests/checks/check_seed_layout.py)."""
    report = seed_layout_report(tiny_moe_path, str(tmp_path), vanilla_mbridge=True)
    assert seed_layout_problems(report, "mbridge") == []
    assert report["hf_tensors_verified_from_disk"] == 135


# --------------------------------------------------------------------------- resume


def _train_save_continue_then_resume(src: str, root: str, use_distributed_optimizer: bool):
    path = os.path.join(root, "global_step_2", "actor")
    first = _actor(src, override("megatron.use_distributed_optimizer", use_distributed_optimizer), NO_HF)
    for step in range(2):
        first.train_step(batches(step))
    first.save_checkpoint(path, global_step=2)
    continued = [first.train_step(batches(10 + step))["loss"] for step in range(2)]
    expected = first.parameters_snapshot()

    resumed_actor = _actor(src, override("megatron.use_distributed_optimizer", use_distributed_optimizer), NO_HF)
    resumed_actor.load_checkpoint(path)
    resumed = [resumed_actor.train_step(batches(10 + step))["loss"] for step in range(2)]
    actual = resumed_actor.parameters_snapshot()
    return continued, resumed, [name for name in expected if not torch.equal(expected[name], actual[name])]


@pytest.mark.parametrize("use_distributed_optimizer", [False, True], ids=["DO=False", "DO=True"])
def test_resume_continues_bit_exactly(tiny_moe_path, tmp_path, use_distributed_optimizer):
    results = run_on_ranks(
        _train_save_continue_then_resume, 8, ParallelSizes(2, 2, 2, 2), args=(tiny_moe_path, str(tmp_path), use_distributed_optimizer)
    )
    for continued, resumed, differing in results:
        assert continued == resumed
        assert differing == []


# --------------------------------------------------------------------------- resharding


def _train_and_save(src: str, root: str, use_distributed_optimizer: bool) -> None:
    actor = _actor(src, override("megatron.use_distributed_optimizer", use_distributed_optimizer))
    actor.train_step(batches(0))
    actor.save_checkpoint(os.path.join(root, "global_step_1", "actor"), global_step=1)


def _load_and_export(src: str, ckpt: str, out: str, load_contents: tuple, use_distributed_optimizer: bool) -> float:
    actor = _actor(src, override("megatron.use_distributed_optimizer", use_distributed_optimizer), override("checkpoint.load_contents", load_contents))
    actor.load_checkpoint(ckpt)
    actor.export_hf(out)
    return actor.train_step(batches(1))["loss"]


def test_checkpoint_reshards_to_other_layouts(tiny_moe_path, tmp_path):
    run_on_ranks(_train_and_save, 8, ParallelSizes(2, 2, 2, 2), args=(tiny_moe_path, str(tmp_path), False))
    ckpt = str(tmp_path / "global_step_1" / "actor")
    original = _hf_state(os.path.join(ckpt, "model", "huggingface"))
    losses = {}
    for name, sizes, world in (("1rank", ParallelSizes(), 1), ("ep4", ParallelSizes(ep=4, etp=1), 4)):
        out = str(tmp_path / f"export_{name}")
        # model and (per-parameter, hence reshardable) optimizer state both load at the new layout
        losses[name] = run_on_ranks(
            _load_and_export, world, sizes, args=(tiny_moe_path, ckpt, out, ("model", "optimizer"), False)
        )[0]
        exported = _hf_state(out)
        assert set(exported) == set(original)
        assert all(torch.equal(exported[k], original[k]) for k in original), name
    assert abs(losses["1rank"] - losses["ep4"]) < 1e-5


def test_distributed_optimizer_state_at_another_layout_is_refused_clearly(tiny_moe_path, tmp_path):
    run_on_ranks(_train_and_save, 8, ParallelSizes(2, 2, 2, 2), args=(tiny_moe_path, str(tmp_path), True))
    ckpt = str(tmp_path / "global_step_1" / "actor")
    with pytest.raises(RankFailure, match="use_distributed_optimizer=False"):
        run_on_ranks(_load_and_export, 1, ParallelSizes(), args=(tiny_moe_path, ckpt, str(tmp_path / "x"), ("model", "optimizer"), True))
    # the model alone still loads at the new layout
    run_on_ranks(_load_and_export, 1, ParallelSizes(), args=(tiny_moe_path, ckpt, str(tmp_path / "y"), ("model",), True))
    assert set(_hf_state(str(tmp_path / "y"))) == set(_hf_state(os.path.join(ckpt, "model", "huggingface")))
