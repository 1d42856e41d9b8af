"""The parallel HF export on the model a CUDA host builds: megatron-core's TransformerEngine layer spec.

TransformerEngine cannot be installed without a GPU, so the cases run in an interpreter of their own (one for
the module) that imports the test-only stand-in as ``transformer_engine`` (tests/te_stand_in.py): megatron-core then builds its TE
spec, and mbridge's own bridge class (not the local-spec one) builds, loads and names the model, with the
TE spec's names: ``linear_qkv.layer_norm_weight``, a dense layer's ``linear_fc1.layer_norm_weight``,
grouped-GEMM experts' ``linear_fc1.weight{i}`` (``moe_grouped_gemm=True``, which mbridge sets for every MoE
family, as upstream's 30B script does) and an ``_extra_state`` beside every TE module. The names come from
the model megatron built; none is written down here. The whole save runs: the stand-in allocates TE's
parameters in host memory (it runs no kernel, which a save does not need).
"""

import os

import pytest
import torch

from tests.main_leg import TRAINING_STEPS, actor_configs, override
from tests.te_stand_in import TeHost
from tests.test_parallel_hf_export import _files, _tensors
from verl.utils.megatron.parallel import ParallelSizes


@pytest.fixture(scope="module")
def te_host(tmp_path_factory):
    host = TeHost(str(tmp_path_factory.mktemp("te_host")))
    yield host
    host.close()


def _export_on_te_spec(src: str, root: str) -> dict:
    """One rank: mbridge's bridge and TE-spec model, loaded by mbridge from ``src``, then exported by the
    parallel export and by mbridge's own gathered save, with and without the source's shard plan."""
    from mbridge.core.safetensor_io import SafeTensorIO
    from mbridge.core.util import unwrap_model
    from transformers import AutoConfig

    from verl.models.mcore import make_bridge
    from verl.models.mcore.model import build_megatron_model
    from verl.utils.internals import mbridge as mbridge_internals

    bridge = make_bridge(AutoConfig.from_pretrained(src), dtype=torch.float32)
    model = build_megatron_model(bridge, wrap_with_ddp=False)
    bridge.load_weights(model, src)  # mbridge's own load: the TE bridge has no load of ours
    bridge.save_weights(model, os.path.join(root, "parallel"))
    bridge.save_weights_gathered(model, os.path.join(root, "mbridge"))
    bridge.safetensor_io = SafeTensorIO(os.path.join(root, "no_such_dir"))
    bridge.save_weights(model, os.path.join(root, "parallel_noindex"))
    bridge.save_weights_gathered(model, os.path.join(root, "mbridge_noindex"))
    torch.distributed.barrier()
    keys, hf = [], {}
    for chunk in model:
        keys += list(unwrap_model(chunk).state_dict())
        for te_name in mbridge_internals.local_to_global_names(bridge, chunk).values():
            hf[te_name] = mbridge_internals.hf_names(bridge, te_name)
    return {"bridge": type(bridge).__name__, "parallel": bridge.saves_in_parallel, "state_keys": keys, "hf_names": hf}


CASES = {
    "moe-1rank": ("tiny_moe_path", ParallelSizes(1, 1, 1, 1), 1),
    "moe-tp2pp2ep2etp2": ("tiny_moe_path", ParallelSizes(tp=2, pp=2, ep=2, etp=2), 8),
    "dense-tp2": ("tiny_dense_path", ParallelSizes(tp=2), 2),
}


@pytest.mark.parametrize("case", list(CASES))
def test_parallel_export_of_the_te_spec_equals_mbridge_and_the_source(case, te_host, tmp_path, request):
    fixture, sizes, world = CASES[case]
    src = request.getfixturevalue(fixture)
    results = te_host.run(f"{__name__}:_export_on_te_spec", world, sizes, args=(src, str(tmp_path)))

    # The model is the TE spec's, built by mbridge's own bridge class, and saved by the parallel export.
    assert {r["bridge"] for r in results} == {"FaithfulQwen3MoEBridge" if "moe" in case else "FaithfulQwen3Bridge"}
    assert all(r["parallel"] for r in results)
    keys = {key for r in results for key in r["state_keys"]}
    assert any(key.endswith("self_attention.linear_qkv.layer_norm_weight") for key in keys)
    assert any(key.endswith("._extra_state") for key in keys), "TE modules save an _extra_state"
    if "moe" in case:
        per_rank = 8 // sizes.ep  # local expert numbers, one parameter each (grouped GEMM)
        experts = {key.rsplit("weight", 1)[1] for key in keys if ".mlp.experts.linear_fc1.weight" in key}
        assert experts == {str(i) for i in range(per_rank)}
    else:
        assert any(key.endswith("mlp.linear_fc1.layer_norm_weight") for key in keys)

    # Every TE-spec parameter maps to HF names, and together they are exactly the source's tensors.
    source = _tensors(src)
    mapped = {name for r in results for names in r["hf_names"].values() for name in names}
    assert mapped == set(source)

    # Same files as mbridge's own save, byte for byte; without a source plan the same tensors.
    parallel, reference = _files(str(tmp_path / "parallel")), _files(str(tmp_path / "mbridge"))
    assert sorted(parallel) == sorted(reference)
    for name in reference:
        assert parallel[name] == reference[name], name
    exported, gathered = _tensors(str(tmp_path / "parallel_noindex")), _tensors(str(tmp_path / "mbridge_noindex"))
    assert set(exported) == set(gathered) == set(source)
    for name, tensor in source.items():
        assert torch.equal(exported[name], tensor) and torch.equal(gathered[name], tensor), name


def _checkpoint_on_te_spec(src: str, root: str, async_mode: str | None, use_dist_checkpointing: bool = False) -> dict:
    """One rank: a TE-spec actor steps its optimizer once (gradients set directly: the stand-in runs no
    forward), saves the step through the worker's path (the manager, then the commit step), and a second
    actor loads it back."""
    from verl.workers.engine.megatron.transformer_impl import MegatronEngine

    configs = actor_configs(
        src,
        override("megatron.use_dist_checkpointing", use_dist_checkpointing),
        override("checkpoint.async_save", async_mode is not None),
        override("checkpoint.async_mode", async_mode or "background_write"),
        total_training_steps=TRAINING_STEPS,
    )
    actor = MegatronEngine(*configs)
    generator = torch.Generator().manual_seed(0)  # the same on every rank: replicas stay equal
    for chunk in actor.model:
        for param in chunk.parameters():
            param.main_grad.copy_(torch.randn(param.shape, generator=generator) * 0.01)
    actor.optimizer.step()
    saved = actor.parameters_snapshot()
    path = os.path.join(root, "global_step_1", "actor")
    if actor.save_checkpoint(path, global_step=1):
        assert actor.finalize_checkpoint(blocking=True) == path
    report = actor.checkpoint_manager.last_save
    other = MegatronEngine(*configs)
    other.load_checkpoint(path)
    loaded = other.parameters_snapshot()
    return {
        "mode": report.mode.value,
        "hf_in_fork": report.hf_weights_in_background,
        "names": sorted(saved),
        "differ": [name for name in saved if not torch.equal(saved[name], loaded[name])],
    }


@pytest.mark.parametrize("async_mode", [None, "background_write", "snapshot"], ids=["sync", "background_write", "snapshot"])
def test_a_te_spec_checkpoint_saves_and_loads_back_bit_exactly(tiny_moe_path, te_host, tmp_path, async_mode):
    """The checkpoint of a TE-spec model (HF weights, optimizer, RNG) at EP2, saved sync, async as a CUDA host
    does (the background write: HF export in the forked processes, from the rank's host copy) or from the
    snapshot (HF export in the forked processes),
    verified and committed, loads back bit for bit."""
    results = te_host.run(
        f"{__name__}:_checkpoint_on_te_spec", 2, ParallelSizes(ep=2), args=(tiny_moe_path, str(tmp_path), async_mode)
    )
    assert {r["mode"] for r in results} == {async_mode or "sync"}
    assert all(r["hf_in_fork"] is (async_mode is not None) for r in results)
    assert any(name.endswith("mlp.experts.linear_fc1.weight3") for name in results[0]["names"])
    assert [r["differ"] for r in results] == [[], []]


def test_a_te_spec_model_saved_as_megatron_shards_loads_back_bit_exactly(tiny_moe_path, te_host, tmp_path):
    """megatron-core's TE attention leaves its ``_extra_state`` out of its sharded state dict: the strict model
    load accepts exactly that absence (it failed with ``Missing key(s) ... core_attention._extra_state``)."""
    results = te_host.run(f"{__name__}:_checkpoint_on_te_spec", 2, ParallelSizes(ep=2), args=(tiny_moe_path, str(tmp_path), None, True))
    assert [r["differ"] for r in results] == [[], []] and results[0]["names"]


def test_the_model_load_stays_strict_for_every_other_key():
    from verl.utils.checkpoint.integrity import CheckpointError
    from verl.utils.checkpoint.megatron_checkpoint_load import _load_chunk_strictly

    class WithExtraState(torch.nn.Linear):
        def get_extra_state(self):
            return torch.zeros(1)

        def set_extra_state(self, state):
            pass

    module = torch.nn.Sequential(WithExtraState(2, 2))
    full = module.state_dict()
    weights_only = {k: v for k, v in full.items() if not k.endswith("_extra_state")}
    _load_chunk_strictly(module, weights_only, set(weights_only), "ckpt")  # left out of the checkpoint by the model
    with pytest.raises(CheckpointError, match=r"ckpt does not fit this model: missing \['0._extra_state'\]"):
        _load_chunk_strictly(module, weights_only, set(full), "ckpt")  # the model checkpoints it: damage
    with pytest.raises(CheckpointError, match=r"missing \['0.bias'\]"):
        _load_chunk_strictly(module, {k: v for k, v in full.items() if k != "0.bias"}, set(full), "ckpt")
    with pytest.raises(CheckpointError, match=r"unexpected \['0.other'\]"):
        _load_chunk_strictly(module, {**full, "0.other": torch.zeros(1)}, set(full), "ckpt")
