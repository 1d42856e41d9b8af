"""get_megatron_module_device and model/optimizer offload with real Megatron DDP, with and without the
distributed optimizer (use_distributed_optimizer=False leaves every DDP buffer with param_data None).

Each rank function builds a tiny Qwen3-MoE through the bridge (fp32, random init), trains, offloads,
reloads and reports what it saw; the test asserts on the reports of every rank.
"""

import os

import pytest
import torch

from verl.utils import megatron_utils
from verl.utils.device import get_device_name
from verl.utils.distributed import run_on_ranks
from verl.utils.internals.torch import storage_id
from verl.utils.megatron.parallel import ParallelSizes

# ---------------------------------------------------------------------------------------------
# helpers that run on the ranks
# ---------------------------------------------------------------------------------------------


def _build(use_distributed_optimizer: bool = False, wrap_with_ddp: bool = True, dtype=torch.float32) -> list:
    from verl.models.mcore import make_bridge
    from verl.models.mcore.model import build_megatron_model
    from verl.models.tiny import tiny_hf_config

    bridge = make_bridge(tiny_hf_config("moe"), dtype=dtype)
    return build_megatron_model(
        bridge, use_distributed_optimizer=use_distributed_optimizer, wrap_with_ddp=wrap_with_ddp
    )


def _microbatches() -> list[torch.Tensor]:
    data = torch.randint(4, 90, (4, 17), generator=torch.Generator().manual_seed(1))
    return [data[:2], data[2:]]


def _buffers(model: list) -> list:
    return [b for chunk in model for b in list(chunk.buffers) + list(chunk.expert_parallel_buffers)]


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().contiguous().view(-1).view(torch.uint8).clone()


def _param_bits(model: list) -> dict:
    return {f"{i}.{name}": _bits(p) for i, chunk in enumerate(model) for name, p in chunk.named_parameters()}


def _grad_bits(model: list) -> dict:
    return {f"{i}.{name}": _bits(p.main_grad) for i, chunk in enumerate(model) for name, p in chunk.named_parameters()}


def _opt_bits(optimizer) -> dict:
    bits = {}
    for o, opt in enumerate(optimizer.chained_optimizers):
        for attr in ("shard_fp32_from_float16_groups", "fp32_from_float16_groups"):
            for g, group in enumerate(getattr(opt, attr, None) or []):
                for i, tensor in enumerate(group):
                    bits[f"{o}.{attr}.{g}.{i}"] = _bits(tensor)
        for s, state in enumerate(opt.optimizer.state.values()):
            for key, value in state.items():
                if torch.is_tensor(value):
                    bits[f"{o}.state.{s}.{key}"] = _bits(value)
    return bits


def _mismatches(before: dict, after: dict) -> list[str]:
    assert before.keys() == after.keys()
    return [name for name in before if not torch.equal(before[name], after[name])]


def _opt_tensors(optimizer) -> list[torch.Tensor]:
    tensors = []
    for opt in optimizer.chained_optimizers:
        for state in opt.optimizer.state.values():
            tensors += [v for v in state.values() if torch.is_tensor(v)]
    return tensors


def _main_params(optimizer) -> list[torch.Tensor]:
    return [
        t
        for opt in optimizer.chained_optimizers
        for attr in ("shard_fp32_from_float16_groups", "fp32_from_float16_groups")
        for group in getattr(opt, attr, None) or []
        for t in group
    ]


def _optimizer_offloaded_as_upstream(optimizer, working: list[torch.Tensor], bits: dict) -> dict:
    """After offload_megatron_optimizer: every state tensor and main parameter is a CPU tensor holding its
    values (upstream's observable result; on a CPU host the device reads "cpu" either way, so the values and
    the storages are what tells), and the working tensors it stood in for hold no bytes."""
    states, mains = _opt_tensors(optimizer), _main_params(optimizer)
    return {
        "on_cpu": all(t.device.type == "cpu" for t in states + mains),
        "values_held": _mismatches(bits, _opt_bits(optimizer)) == [],
        "stand_ins_have_storage": all(t.untyped_storage().nbytes() > 0 for t in states + mains if t.numel()),
        "not_the_working_tensors": all(s is not w for s, w in zip(states, working, strict=True)),
        "working_freed": _all_freed(working) and not any(r.resident for r in _storages([], optimizer)),
    }


def _residence(model: list) -> tuple[str, bool]:
    return megatron_utils.get_megatron_module_device(model), megatron_utils.is_megatron_module_offloaded(model)


def _all_freed(tensors) -> bool:
    return all(t.untyped_storage().nbytes() == 0 for t in tensors)


def _storages(model: list, optimizer=None) -> list:
    return megatron_utils.describe_megatron_storages(model, optimizer)


def _offload_roundtrip(use_distributed_optimizer: bool) -> dict:
    """Train a model and its twin identically; offload and reload one of them twice; train both on."""
    from verl.models.mcore.forward import train_step
    from verl.utils.megatron.optimizer import get_megatron_optimizer_and_scheduler

    report: dict = {}
    model, twin = _build(use_distributed_optimizer), _build(use_distributed_optimizer)
    with torch.no_grad():
        for (_, p), (_, q) in zip(model[0].named_parameters(), twin[0].named_parameters(), strict=True):
            q.copy_(p)
    optimizer, scheduler = get_megatron_optimizer_and_scheduler(
        model, use_distributed_optimizer=use_distributed_optimizer
    )
    twin_optimizer, twin_scheduler = get_megatron_optimizer_and_scheduler(
        twin, use_distributed_optimizer=use_distributed_optimizer
    )
    buffers = _buffers(model)
    report["dense_buffers"] = sum(len(chunk.buffers) for chunk in model)
    report["expert_buffers"] = sum(len(chunk.expert_parallel_buffers) for chunk in model)
    report["param_data_is_none"] = [b.param_data is None for b in buffers]
    report["fresh"] = _residence(model)

    first = [
        train_step(m, o, s, _microbatches())
        for m, o, s in ((model, optimizer, scheduler), (twin, twin_optimizer, twin_scheduler))
    ]
    report["twin_step1_equal"] = first[0] == first[1]

    params, grads, states = _param_bits(model), _grad_bits(model), _opt_bits(optimizer)
    report["grads_nonzero"] = any(g.any().item() for g in grads.values())
    report["on_device"] = _residence(model)

    working_states = _opt_tensors(optimizer)
    megatron_utils.offload_megatron_model_to_cpu(model)
    megatron_utils.offload_megatron_optimizer(optimizer)
    report["offloaded"] = _residence(model)
    all_params = [p for chunk in model for p in chunk.parameters()]
    report["freed"] = {
        "params": _all_freed(all_params),
        "main_grads": _all_freed(p.main_grad for p in all_params),
        "grad_data": _all_freed(b.grad_data for b in buffers),
    }
    report["optimizer_offloaded"] = _optimizer_offloaded_as_upstream(optimizer, working_states, states)
    def host_ptrs_now() -> list:
        return [(r.name, r.host_copy_addresses) for r in _storages(model, optimizer)]

    host_ptrs = host_ptrs_now()

    # A second offload is a no-op; reloading twice likewise.
    megatron_utils.offload_megatron_model_to_cpu(model)
    megatron_utils.offload_megatron_optimizer(optimizer)
    report["offloaded_twice"] = _residence(model)
    megatron_utils.load_megatron_model_to_gpu(model)
    megatron_utils.load_megatron_optimizer(optimizer)
    megatron_utils.load_megatron_model_to_gpu(model)
    megatron_utils.load_megatron_optimizer(optimizer)
    report["reloaded"] = _residence(model)
    report["same_state_objects"] = all(a is b for a, b in zip(_opt_tensors(optimizer), working_states, strict=True))
    report["param_mismatches"] = _mismatches(params, _param_bits(model))
    report["grad_mismatches"] = _mismatches(grads, _grad_bits(model))
    report["state_mismatches"] = _mismatches(states, _opt_bits(optimizer))

    # The second cycle reuses the host copies of the first: no second host copy is ever allocated.
    megatron_utils.offload_megatron_model_to_cpu(model)
    megatron_utils.offload_megatron_optimizer(optimizer)
    report["host_copies_reused"] = host_ptrs_now() == host_ptrs
    megatron_utils.load_megatron_model_to_gpu(model)
    megatron_utils.load_megatron_optimizer(optimizer)
    report["second_cycle_mismatches"] = _mismatches(params, _param_bits(model)) + _mismatches(
        states, _opt_bits(optimizer)
    )

    # param.main_grad still views the DDP grad buffer: zeroing the buffer zeroes every main_grad.
    for chunk in model:
        chunk.zero_grad_buffer()
    report["main_grad_views_live"] = not any(p.main_grad.any().item() for p in all_params)

    # Training continues exactly as in the twin that was never offloaded.
    second = [
        train_step(m, o, s, _microbatches())
        for m, o, s in ((model, optimizer, scheduler), (twin, twin_optimizer, twin_scheduler))
    ]
    report["twin_step2_equal"] = second[0] == second[1]
    report["twin_param_mismatches"] = _mismatches(_param_bits(twin), _param_bits(model))
    report["twin_state_mismatches"] = _mismatches(_opt_bits(twin_optimizer), _opt_bits(optimizer))
    report["losses"] = (first[0]["loss"], second[0]["loss"])

    report.update(_chunks_without_ddp_buffers(use_distributed_optimizer))
    return report


def _chunks_without_ddp_buffers(use_distributed_optimizer: bool) -> dict:
    """Detection and offload for chunks without DDP, DDP without buffers, no parameters, no chunks."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    report: dict = {}
    plain = _build(wrap_with_ddp=False)  # e.g. a reference model
    with torch.no_grad():
        for chunk in plain:
            for p in chunk.parameters():
                p.grad = torch.randn_like(p)  # a non-DDP grad with its own storage
    params = _param_bits(plain)
    plain_grads = {n: _bits(p.grad) for n, p in plain[0].named_parameters()}
    report["plain_on_device"] = _residence(plain)
    megatron_utils.offload_megatron_model_to_cpu(plain)
    report["plain_offloaded"] = _residence(plain)
    report["plain_freed"] = _all_freed(p for chunk in plain for p in chunk.parameters())
    megatron_utils.load_megatron_model_to_gpu(plain)
    report["plain_reloaded"] = _residence(plain)
    report["plain_mismatches"] = _mismatches(params, _param_bits(plain)) + _mismatches(
        plain_grads, {n: _bits(p.grad) for n, p in plain[0].named_parameters()}
    )

    # All parameters frozen: Megatron DDP allocates no buffers at all.
    for chunk in plain:
        chunk.requires_grad_(False)
        for p in chunk.parameters():
            p.grad = None
    frozen = [
        DistributedDataParallel(
            config=chunk.config,
            ddp_config=DistributedDataParallelConfig(use_distributed_optimizer=use_distributed_optimizer),
            module=chunk,
        )
        for chunk in plain
    ]
    report["frozen_buffers"] = [len(chunk.buffers) + len(chunk.expert_parallel_buffers) for chunk in frozen]
    report["frozen_on_device"] = _residence(frozen)
    megatron_utils.offload_megatron_model_to_cpu(frozen)
    report["frozen_offloaded"] = _residence(frozen)
    megatron_utils.load_megatron_model_to_gpu(frozen, load_frozen_params=False)
    report["frozen_kept_offloaded"] = _residence(frozen)
    megatron_utils.load_megatron_model_to_gpu(frozen)
    report["frozen_reloaded"] = _residence(frozen)
    report["frozen_mismatches"] = _mismatches(params, _param_bits([c.module for c in frozen]))

    report["no_parameters"] = _residence([torch.nn.Module()])
    megatron_utils.offload_megatron_model_to_cpu([torch.nn.Module()])
    report["empty_list"] = _residence([])
    megatron_utils.offload_megatron_model_to_cpu([])
    megatron_utils.load_megatron_model_to_gpu([])
    megatron_utils.offload_megatron_optimizer(None)
    megatron_utils.load_megatron_optimizer(None)
    return report


def _bf16_main_params_roundtrip(use_distributed_optimizer: bool) -> dict:
    """bf16 weights with fp32 main copies owned by the optimizer (Float16OptimizerWithFloat16Params,
    or the distributed optimizer's shard_fp32_from_float16_groups)."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from verl.models.mcore.forward import train_step

    model = _build(use_distributed_optimizer, dtype=torch.bfloat16)
    config = OptimizerConfig(
        optimizer="adam",
        lr=1e-3,
        clip_grad=1.0,
        bf16=True,
        params_dtype=torch.bfloat16,
        use_distributed_optimizer=use_distributed_optimizer,
    )
    optimizer = get_megatron_optimizer(config, model)
    train_step(model, optimizer, _ConstantLR(), _microbatches())
    params, grads, states = _param_bits(model), _grad_bits(model), _opt_bits(optimizer)
    main_params, working_states = _main_params(optimizer), _opt_tensors(optimizer)
    main_storages = [storage_id(p) for p in main_params]
    megatron_utils.offload_megatron_model_to_cpu(model)
    megatron_utils.offload_megatron_optimizer(optimizer)
    report = {
        "optimizer": type(optimizer.chained_optimizers[0]).__name__,
        "main_params": len(main_params),
        "offloaded_as_upstream": _optimizer_offloaded_as_upstream(optimizer, working_states, states),
        "offloaded": _residence(model),
    }
    megatron_utils.load_megatron_model_to_gpu(model)
    megatron_utils.load_megatron_optimizer(optimizer)
    report["reloaded"] = _residence(model)
    # The main parameters are the same objects on their own storages again, the states the same tensors.
    report["same_objects"] = [storage_id(p) for p in _main_params(optimizer)] == main_storages and all(
        a is b for a, b in zip(_opt_tensors(optimizer), working_states, strict=True)
    )
    report["mismatches"] = (
        _mismatches(params, _param_bits(model))
        + _mismatches(grads, _grad_bits(model))
        + _mismatches(states, _opt_bits(optimizer))
    )
    report["next_step"] = train_step(model, optimizer, _ConstantLR(), _microbatches())
    return report


class _ConstantLR:
    def step(self, increment: int) -> None:
        pass


def _pp4_ep2_tp2_etp2_scenario() -> dict:
    """PP4 EP2 TP2 ETP2 on 16 ranks with use_distributed_optimizer=False: fix 1's case at a 16-rank MoE layout."""
    model = _build(use_distributed_optimizer=False)
    params = _param_bits(model)
    report = {"param_data_is_none": [b.param_data is None for b in _buffers(model)], "on_device": _residence(model)}
    megatron_utils.offload_megatron_model_to_cpu(model)
    report["offloaded"] = _residence(model)
    megatron_utils.load_megatron_model_to_gpu(model)
    report["reloaded"] = _residence(model)
    report["mismatches"] = _mismatches(params, _param_bits(model))
    return report


def _regression_do_false() -> dict:
    model = _build(use_distributed_optimizer=False)
    params = _param_bits(model)
    report = {"param_data_is_none": [b.param_data is None for b in _buffers(model)], "device": _residence(model)}
    for buffer in _buffers(model):
        buffer.grad_data.fill_(1.0)  # grads our host copy will hold
    megatron_utils.offload_megatron_model_to_cpu(model)
    report["offloaded"] = _residence(model)
    report["params_freed"] = _all_freed(p for chunk in model for p in chunk.parameters())
    megatron_utils.load_megatron_model_to_gpu(model)
    report["reloaded"] = _residence(model)
    report["mismatches"] = _mismatches(params, _param_bits(model))

    # Grad buffers freed by Megatron's own DDP.offload_grad_buffers (contents dropped) come back zeroed.
    model[0].offload_grad_buffers()
    report["megatron_freed_grads"] = _all_freed(b.grad_data for b in _buffers(model))
    megatron_utils.load_megatron_model_to_gpu(model)
    report["megatron_grads_back_zero"] = all(
        b.grad_data.untyped_storage().nbytes() > 0 and not b.grad_data.any().item() for b in _buffers(model)
    )

    # A parameter whose dtype changed since its host copy was made is refused, not copied a second time.
    name, param = next(model[0].named_parameters())

    def host_copy() -> tuple:
        return next(r.host_copy_addresses for r in _storages(model) if r.name == name)

    kept = host_copy()
    param.data = param.data.double()
    try:
        megatron_utils.offload_megatron_model_to_cpu(model)
        report["changed_layout"] = "no error"
    except RuntimeError as error:
        report["changed_layout"] = str(error)
    report["host_copy_kept"] = bool(kept) and host_copy() == kept
    report["changed_param_resident"] = param.untyped_storage().nbytes() > 0
    return report


# ---------------------------------------------------------------------------------------------
# tests
# ---------------------------------------------------------------------------------------------

LAYOUTS = {
    "1rank": (1, ParallelSizes()),
    "tp2pp2": (4, ParallelSizes(tp=2, pp=2)),
    "tp2pp2ep2etp2": (8, ParallelSizes(tp=2, pp=2, ep=2, etp=2)),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("use_distributed_optimizer", [False, True], ids=["DO=False", "DO=True"])
def test_offload_reload_is_bit_exact_and_training_continues(layout, use_distributed_optimizer):
    world, sizes = LAYOUTS[layout]
    reports = run_on_ranks(_offload_roundtrip, world, sizes, args=(use_distributed_optimizer,))
    device = get_device_name()
    for rank, report in enumerate(reports):
        where = f"rank {rank}"
        # The layout under test: no flat param buffer exactly when the distributed optimizer is off.
        assert report["param_data_is_none"] and all(
            v is not use_distributed_optimizer for v in report["param_data_is_none"]
        )
        if sizes.ep > 1:
            assert report["expert_buffers"] > 0, where
        assert report["twin_step1_equal"], where
        assert report["grads_nonzero"], where
        # Device detection in every state.
        assert report["fresh"] == report["on_device"] == (device, False), where
        assert report["offloaded"] == report["offloaded_twice"] == ("cpu", True), where
        assert report["reloaded"] == (device, False), where
        assert report["freed"] == {"params": True, "main_grads": True, "grad_data": True}
        assert all(report["optimizer_offloaded"].values()), (where, report["optimizer_offloaded"])
        assert report["same_state_objects"], where
        # Bit for bit, twice, with the host copies of the first cycle reused.
        assert report["param_mismatches"] == [], where
        assert report["grad_mismatches"] == [], where
        assert report["state_mismatches"] == [], where
        assert report["second_cycle_mismatches"] == [], where
        assert report["host_copies_reused"], where
        assert report["main_grad_views_live"], where
        # Training after the reload is exactly the twin's that never left the device.
        assert report["twin_step2_equal"], where
        assert report["twin_param_mismatches"] == [] and report["twin_state_mismatches"] == [], where
        assert all(map(torch.isfinite, map(torch.tensor, report["losses"]))), where
        # Chunks without DDP buffers, without parameters, and no chunks at all.
        assert report["plain_on_device"] == report["plain_reloaded"] == (device, False), where
        assert report["plain_offloaded"] == ("cpu", True) and report["plain_freed"], where
        assert report["plain_mismatches"] == [], where
        assert report["frozen_buffers"] == [0], where
        assert report["frozen_on_device"] == report["frozen_reloaded"] == (device, False), where
        assert report["frozen_offloaded"] == report["frozen_kept_offloaded"] == ("cpu", True), where
        assert report["frozen_mismatches"] == [], where
        assert report["no_parameters"] == ("cpu", False), where
        assert report["empty_list"] == ("cpu", False), where


@pytest.mark.parametrize("use_distributed_optimizer", [False, True], ids=["DO=False", "DO=True"])
def test_bf16_fp32_main_params_offload_bit_exact(use_distributed_optimizer):
    report = run_on_ranks(_bf16_main_params_roundtrip, 1, ParallelSizes(), args=(use_distributed_optimizer,))[0]
    expected = "DistributedOptimizer" if use_distributed_optimizer else "Float16OptimizerWithFloat16Params"
    assert report["optimizer"] == expected
    assert report["main_params"] > 0 and all(report["offloaded_as_upstream"].values()), report["offloaded_as_upstream"]
    assert report["same_objects"]
    assert report["offloaded"] == ("cpu", True)
    assert report["reloaded"] == (get_device_name(), False)
    assert report["mismatches"] == []
    assert report["next_step"]["update_ok"]


def test_pp4_ep2_tp2_etp2_without_distributed_optimizer():
    reports = run_on_ranks(_pp4_ep2_tp2_etp2_scenario, 16, ParallelSizes(tp=2, pp=4, ep=2, etp=2), timeout_s=600)
    for rank, report in enumerate(reports):
        assert report["param_data_is_none"] and all(report["param_data_is_none"]), rank
        assert report["on_device"] == report["reloaded"] == (get_device_name(), False), rank
        assert report["offloaded"] == ("cpu", True), rank
        assert report["mismatches"] == [], rank


def test_regression_param_data_none_does_not_crash():
    """use_distributed_optimizer=False leaves ``param_data is None`` on every DDP buffer, the condition under
    which upstream's unguarded ``param_data.storage()`` raised (verl #5782). The test asserts that condition
    itself, then that the helpers see each state: the device query's answer is "cpu" on a CPU host either
    way, so what tells the states apart is the offload flag, the freed parameter storage and the values back."""
    report = run_on_ranks(_regression_do_false, 1, ParallelSizes())[0]
    assert report["param_data_is_none"] and all(report["param_data_is_none"])
    assert report["device"] == report["reloaded"] == (get_device_name(), False)
    assert report["offloaded"] == ("cpu", True) and report["params_freed"]
    assert report["mismatches"] == []
    assert report["megatron_freed_grads"] and report["megatron_grads_back_zero"]
    assert "layout" in report["changed_layout"] and "torch.float64" in report["changed_layout"]
    assert report["host_copy_kept"] and report["changed_param_resident"]


def _module_with(tensor: torch.Tensor) -> torch.nn.Module:
    """A chunk without DDP (as a reference model is) whose one parameter shares ``tensor``'s storage."""
    module = torch.nn.Module()
    module.weight = torch.nn.Parameter(tensor, requires_grad=False)
    return module


@pytest.mark.parametrize("numel", [1, 1000, 1024, 3 * 1024 + 7, 300_001])
def test_split_host_copies_are_exact(numel, monkeypatch):
    """Pinned host copies are split into power-of-two pieces (the pinned allocator rounds sizes up to
    a power of two); exercised here on the CPU by forcing the split."""
    buffer = torch.randn(numel + 3, dtype=torch.float32)
    view = buffer[3:]
    module = _module_with(view)
    expected = _bits(buffer)
    nbytes = buffer.untyped_storage().nbytes()
    sizes = megatron_utils.host_copy_piece_sizes(nbytes, split=True)
    assert sum(sizes) == nbytes
    assert all(size & (size - 1) == 0 for size in sizes[:-1]) and len(set(sizes)) == len(sizes)
    monkeypatch.setattr(megatron_utils, "SPLIT_HOST_COPIES", True)
    megatron_utils.offload_megatron_model_to_cpu([module])
    assert buffer.untyped_storage().nbytes() == 0  # (never let pytest print a released tensor: it segfaults)
    (entry,) = megatron_utils.describe_megatron_storages([module])
    assert not entry.resident and entry.nbytes == nbytes and list(entry.host_copy_sizes) == sizes
    megatron_utils.load_megatron_model_to_gpu([module])
    assert torch.equal(_bits(buffer), expected)
    assert module.weight.data_ptr() == buffer.data_ptr() + 3 * buffer.element_size()


def test_host_copy_with_changed_shape_is_refused():
    module = _module_with(torch.randn(64))
    megatron_utils.offload_megatron_model_to_cpu([module])
    megatron_utils.load_megatron_model_to_gpu([module])
    module.weight.data = torch.randn(32)
    with pytest.raises(RuntimeError, match="layout"):
        megatron_utils.offload_megatron_model_to_cpu([module])
    assert module.weight.untyped_storage().nbytes() == 32 * 4


def test_reload_of_storage_freed_elsewhere_is_refused():
    module = _module_with(torch.randn(8))
    module.weight.untyped_storage().resize_(0)
    with pytest.raises(RuntimeError, match="no host copy"):
        megatron_utils.load_megatron_model_to_gpu([module])


def test_checkpoint_paths_follow_upstream_layout(tmp_path):
    root = str(tmp_path / "global_step_3" / "actor")
    expected = {
        megatron_utils.get_model_checkpoint_path: "model",
        megatron_utils.get_optimizer_checkpoint_path: "optimizer",
        megatron_utils.get_extra_checkpoint_path: "extra",
        megatron_utils.get_model_dist_checkpoint_path: "model/dist_ckpt",
        megatron_utils.get_optimizer_dist_checkpoint_path: "optimizer/dist_ckpt",
        megatron_utils.get_extra_dist_checkpoint_path: "extra/dist_ckpt",
        megatron_utils.get_hf_model_checkpoint_path: "model/huggingface",
    }
    for helper, relative in expected.items():
        path = helper(root)
        assert path == f"{root}/{relative}" and os.path.isdir(path), helper.__name__
    assert megatron_utils.get_transformer_config_checkpoint_path(root) == f"{root}/transformer_config.json"
    assert megatron_utils.get_checkpoint_contents_manifest_path(root) == f"{root}/ckpt_contents.json"
    assert megatron_utils.get_legacy_dist_checkpoint_path(root) == f"{root}/dist_ckpt"
    assert megatron_utils.get_legacy_hf_model_checkpoint_path(root) == f"{root}/huggingface"
    assert not os.path.exists(f"{root}/dist_ckpt") and not os.path.exists(f"{root}/huggingface")
    with pytest.raises(RuntimeError, match="get_model_dist_checkpoint_path"):
        megatron_utils.get_dist_checkpoint_path(root)
