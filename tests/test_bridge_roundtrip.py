"""HF -> Megatron -> HF through mbridge is bit-exact in fp32 at several parallel layouts."""

import glob
import os

import pytest
import torch
from safetensors.torch import load_file

from verl.utils.distributed import run_on_ranks
from verl.utils.megatron.parallel import ParallelSizes


def _hf_state(path: str) -> dict:
    state = {}
    for file in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        state.update(load_file(file))
    return state


def _roundtrip(src: str, dst: str) -> int:
    from transformers import AutoConfig

    from verl.models.mcore import make_bridge
    from verl.models.mcore.model import build_megatron_model

    bridge = make_bridge(AutoConfig.from_pretrained(src), dtype=torch.float32)
    model = build_megatron_model(bridge, wrap_with_ddp=False)
    bridge.load_weights(model, src)
    bridge.save_weights(model, dst)
    return sum(p.numel() for chunk in model for p in chunk.parameters())


@pytest.mark.parametrize(
    "tp,pp,ep,etp,world",
    [(1, 1, 1, 1, 1), (2, 2, 2, 2, 8), (2, 1, 2, 1, 4), (2, 4, 2, 2, 16)],
    ids=["1rank", "tp2pp2ep2etp2", "tp2ep2etp1", "seed_tp2pp4ep2etp2"],
)
def test_moe_roundtrip_is_bit_exact(tiny_moe_path, tmp_path, tp, pp, ep, etp, world):
    dst = str(tmp_path / "hf")
    run_on_ranks(_roundtrip, world, ParallelSizes(tp=tp, pp=pp, ep=ep, etp=etp), args=(tiny_moe_path, dst))
    source, exported = _hf_state(tiny_moe_path), _hf_state(dst)
    assert len(source) == 135  # 4 layers x (5 attn + 2 norms + 1 router + 8 experts x 3) + embed, norm, lm_head
    assert set(exported) == set(source)
    for name, tensor in source.items():
        assert torch.equal(exported[name], tensor), name


def test_dense_roundtrip_is_bit_exact(tiny_dense_path, tmp_path):
    dst = str(tmp_path / "hf")
    run_on_ranks(_roundtrip, 4, ParallelSizes(tp=2, pp=2), args=(tiny_dense_path, dst))
    source, exported = _hf_state(tiny_dense_path), _hf_state(dst)
    assert set(exported) == set(source)
    for name, tensor in source.items():
        assert torch.equal(exported[name], tensor), name
