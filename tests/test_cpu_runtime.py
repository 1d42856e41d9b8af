"""Each CUDA-only call of megatron-core / mbridge that the CPU runtime answers, proven on a real rank.

The runtime patches torch process-wide, so every check runs inside a spawned rank, never in pytest itself.
"""

import torch

from verl.utils.distributed import run_on_ranks
from verl.utils.megatron.parallel import ParallelSizes


def _device_answers() -> dict:
    from verl.utils.megatron import cpu_runtime

    layer = torch.nn.Linear(2, 2)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        stream.wait_stream(torch.cuda.current_stream())
    event = stream.record_event()
    event.synchronize()
    torch.cuda.synchronize()
    return {
        "enabled_twice": cpu_runtime.enable() and cpu_runtime.enable(),
        "current_device": torch.empty(1, device=torch.cuda.current_device()).device.type,
        "literal": torch.tensor([1.0], device="cuda").device.type,
        "zeros_index": torch.zeros(2, device=0).device.type,
        "module_cuda_is_self": layer.cuda(torch.cuda.current_device()) is layer,
        "tensor_to_cuda": torch.ones(1).to("cuda").device.type,
        "tensor_type": torch.ones(1).type(),
        "explicit_type_cast": torch.ones(1).type(torch.float64).dtype == torch.float64,
    }


def test_device_stream_and_type_answers():
    answers = run_on_ranks(_device_answers, 1)[0]
    assert answers == {
        "enabled_twice": True,
        "current_device": "cpu",
        "literal": "cpu",
        "zeros_index": "cpu",
        "module_cuda_is_self": True,
        "tensor_to_cuda": "cpu",
        "tensor_type": "torch.cuda.FloatTensor",
        "explicit_type_cast": True,
    }


def _rng_tracker() -> dict:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    tracker = get_cuda_rng_tracker()
    torch.manual_seed(7)
    before = torch.get_rng_state()
    with tracker.fork():
        inside_first = torch.rand(3)
    with tracker.fork():
        inside_second = torch.rand(3)
    after = torch.get_rng_state()
    return {
        "names": sorted(tracker.get_states()),
        "default_restored": torch.equal(before, after),
        "tracker_advances": not torch.equal(inside_first, inside_second),
    }


def test_rng_tracker_forks_and_restores_the_cpu_generator():
    result = run_on_ranks(_rng_tracker, 1, ParallelSizes())[0]
    assert "model-parallel-rng" in result["names"]
    assert result["default_restored"] and result["tracker_advances"]


def _clip() -> tuple[float, float]:
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32, get_grad_norm_fp32

    param = torch.nn.Parameter(torch.zeros(4))
    param.grad = torch.tensor([3.0, 4.0, 0.0, 0.0])
    total = get_grad_norm_fp32([param.grad])
    clip_grad_by_total_norm_fp32([param], max_norm=1.0, total_norm=total)
    return total, param.grad.norm().item()


def test_grad_clipping_really_clips():
    total, after = run_on_ranks(_clip, 1, ParallelSizes())[0]
    assert abs(total - 5.0) < 1e-6
    assert abs(after - 1.0) < 1e-5


def _uneven_gather() -> list[float]:
    from megatron.core import parallel_state

    from verl.utils.internals import megatron_core

    group = parallel_state.get_tensor_model_parallel_group()
    rank = group.rank()
    mine = torch.full((rank + 1, 2), float(rank))
    gather, reduce_scatter = megatron_core.first_dim_collectives()
    gathered = gather(mine, group, output_split_sizes=[1, 2])
    scattered = reduce_scatter(torch.ones(3, 2), group, input_split_sizes=[1, 2])
    return gathered[:, 0].tolist() + [scattered.shape[0], scattered.sum().item()]


def test_uneven_gather_and_reduce_scatter_on_gloo():
    results = run_on_ranks(_uneven_gather, 2, ParallelSizes(tp=2))
    assert results[0] == [0.0, 1.0, 1.0, 1, 4.0]
    assert results[1] == [0.0, 1.0, 1.0, 2, 8.0]


def _scatter_views() -> dict:
    import torch.distributed as dist

    rank = dist.get_rank()
    full = torch.arange(32.0).reshape(4, 8)
    received = {}
    # A column chunk (what a row-parallel TP split sends) and a transposed view: both non-contiguous.
    for name, chunks in (("column_chunk", list(full.chunk(2, dim=1))), ("transposed", [c.t() for c in full.chunk(2, dim=0)])):
        assert not chunks[0].is_contiguous()
        out = torch.empty_like(chunks[rank].contiguous())
        dist.scatter(out, chunks if rank == 0 else None, src=0)
        received[name] = (out, chunks[rank].clone())
    # A non-contiguous output (a column of a bigger buffer) receives the right elements too.
    buffer = torch.zeros(4, 4)
    dist.scatter(buffer[:, :2], list(full[:, :4].chunk(2, dim=1)) if rank == 0 else None, src=0)
    received["strided_output"] = (buffer[:, :2].clone(), full[:, :4].chunk(2, dim=1)[rank].clone())
    received["untouched"] = (buffer[:, 2:].clone(), torch.zeros(4, 2))
    return received


def test_gloo_scatter_of_non_contiguous_views_sends_the_right_elements():
    # torch 2.13's gloo scatter without the runtime: rank 0 gets [0..7] for the column chunk [0,1,2,3,8,...].
    for rank, received in enumerate(run_on_ranks(_scatter_views, 2)):
        for name, (got, expected) in received.items():
            assert torch.equal(got, expected), (rank, name, got.flatten().tolist())


def _moe_dispatch_helpers() -> tuple:
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    splits = token_dispatcher.maybe_move_tensor_to_cpu(torch.tensor([2, 3]), as_numpy=True)
    return type(splits).__name__, moe_utils.te_general_gemm is None


def test_moe_dispatcher_split_sizes_and_missing_te_gemm():
    assert run_on_ranks(_moe_dispatch_helpers, 1)[0] == ("ndarray", True)


def _device_context_and_hf_load(src: str) -> dict:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        placed = {
            "tensor": torch.tensor([1.0]).device.type,
            "zeros": torch.zeros(2).device.type,
            "ones": torch.ones(2).device.type,
            "full": torch.full((2,), 3.0).device.type,
            "arange": torch.arange(3).device.type,
        }
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(_tokens()).logits
    return {"placed": placed, "inv_freq": model.model.rotary_emb.inv_freq.clone(), "logits": logits}


def _tokens() -> torch.Tensor:
    return torch.randint(4, 90, (2, 16), generator=torch.Generator().manual_seed(0))


def test_device_contexts_still_place_tensors_and_transformers_loads_rope(tiny_moe_path):
    # transformers 5 finds its meta-device load context through `torch.tensor([]).device`; a runtime whose
    # factories escaped the context made from_pretrained leave RoPE's inv_freq uninitialised (logits off by ~0.4).
    from transformers import AutoModelForCausalLM

    answers = run_on_ranks(_device_context_and_hf_load, 1, args=(tiny_moe_path,))[0]
    reference = AutoModelForCausalLM.from_pretrained(tiny_moe_path, dtype=torch.float32).eval()
    with torch.no_grad():
        reference_logits = reference(_tokens()).logits
    assert answers["placed"] == dict.fromkeys(("tensor", "zeros", "ones", "full", "arange"), "meta")
    assert torch.equal(answers["inv_freq"], reference.model.rotary_emb.inv_freq)
    assert (answers["logits"] - reference_logits).abs().max().item() <= 1e-5  # rank and pytest differ in threads


def test_runtime_is_off_in_this_process():
    from verl.utils.megatron import cpu_runtime

    # pytest itself never enabled it: only ranks do, and only on hosts without an accelerator.
    assert not cpu_runtime.is_enabled()
