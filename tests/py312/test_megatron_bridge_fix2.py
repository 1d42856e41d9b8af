"""Fix 2 (upstream #6821 / #6842) against Megatron-Bridge's own HF weight save, at PP2 EP2 on 4 CPU ranks.

Upstream's case, made tiny: the source checkpoint counts an MTP layer (``mtp_num_hidden_layers: 1``) and keeps
its ``mtp.*`` tensors in the same shard as the last layer's experts and the final norm; the model is built
without the MTP head, and the config the export writes counts none (upstream zeroes it when MTP is off). Each
rank exports the same model four times: in fix 2's order (the checkpoint manager's save of ``hf_model``: rank
0's config, barrier, every rank's weights; the worker's step transaction verifies, here the test), and with the weights first into an empty
folder, into a folder holding the source's config (which counts the MTP layer) and into one holding a config
that counts none.

What the reversed order costs depends on where Megatron-Bridge learns that the model has no MTP head
(docs/checkpoint.md, "Fix 2 under Megatron-Bridge"): before 0.6 only from ``config.json`` in the output
folder, so the weights-first export leaves out the whole last shard unless the folder already holds a config
that counts no MTP layer; from 0.6 on also from the built model, so every order writes every tensor.
"""

import functools
import glob
import json
import os

import torch

from verl.utils.distributed import run_on_ranks
from verl.utils.megatron.parallel import ParallelSizes

SIZES = ParallelSizes(pp=2, ep=2)
FIX2 = "fix2_order"
# reversed order: the folder's config.json before the weights are written (None: no folder yet)
REVERSED = {"weights_first_into_empty_folder": None, "weights_first_over_source_config": 1, "weights_first_over_config_without_mtp": 0}
_MTP_TENSORS = {"mtp.fc.weight": (64, 128), "mtp.norm.weight": (64,)}


def _source_with_mtp_tensors(path: str) -> tuple[str, list[str]]:
    """The tiny Qwen3-MoE, its config counting one MTP layer and its last shard holding ``mtp.*`` tensors
    beside the last layer's; returns the folder and the names of the last shard's non-MTP tensors."""
    from safetensors.torch import load_file, save_file

    from verl.models.tiny import make_tiny_hf_model

    make_tiny_hf_model(path, kind="moe", mtp_num_hidden_layers=1)
    index_file = os.path.join(path, "model.safetensors.index.json")
    index = json.load(open(index_file))
    last = sorted(set(index["weight_map"].values()))[-1]
    shard = load_file(os.path.join(path, last))
    last_layer = sorted(shard)
    generator = torch.Generator().manual_seed(1)
    for name, shape in _MTP_TENSORS.items():
        shard[name] = torch.randn(shape, generator=generator)
        index["weight_map"][name] = last
        index["metadata"]["total_size"] += shard[name].numel() * shard[name].element_size()
    save_file(shard, os.path.join(path, last), metadata={"format": "pt"})
    json.dump(index, open(index_file, "w"), indent=2)
    return path, last_layer


def _export_in_each_order(src: str, out: str, sizes: ParallelSizes) -> tuple[int, int]:
    """Every rank: build the model from ``src`` at ``sizes``, double every weight (so the files can only come
    from the model), export it once per order; returns Megatron-Bridge's (major, minor) version."""
    from transformers import AutoConfig, AutoTokenizer

    from verl.models.mcore.megatron_bridge import MegatronBridgeWeights, megatron_bridge_provider
    from verl.utils.checkpoint.megatron_checkpoint_manager import MegatronCheckpointManager
    from verl.utils.checkpoint.megatron_metadata import write_hf_config
    from verl.workers.config.checkpoint import McoreCheckpointConfig

    auto_bridge, provider = megatron_bridge_provider(src, dtype=torch.float32, sizes=sizes)
    from megatron.bridge.package_info import MAJOR, MINOR  # imported by the provider (where TE is absent too)

    model = provider.provide_distributed_model(wrap_with_ddp=False, use_cpu_initialization=True)
    with torch.no_grad():
        for chunk in model:
            for param in chunk.parameters():
                param.mul_(2)
    hf_config = AutoConfig.from_pretrained(src)
    hf_config.mtp_num_hidden_layers = 0  # the model has no MTP head, and the folder's config says so
    tokenizer = AutoTokenizer.from_pretrained(src)
    weights = MegatronBridgeWeights(auto_bridge)
    rank = torch.distributed.get_rank()

    def config_writer(path: str):
        return functools.partial(write_hf_config, path, tokenizer, hf_config, src)

    manager = MegatronCheckpointManager(
        config={"model": {"path": src}}, checkpoint_config=McoreCheckpointConfig(save_contents=["hf_model"], load_contents=[]),
        model_config=hf_config, transformer_config=provider, role="actor", model=model, arch=hf_config.architectures[0],
        hf_config=hf_config, param_dtype=torch.float32, share_embeddings_and_output_weights=False, processing_class=tokenizer,
        optimizer=None, optimizer_scheduler=None, use_distributed_optimizer=False, bridge=weights,
    )  # fmt: skip
    manager.save_checkpoint(os.path.join(out, FIX2), global_step=1)
    for name, mtp_layers_in_folder in REVERSED.items():
        path = os.path.join(out, name)
        if rank == 0 and mtp_layers_in_folder is not None:
            AutoConfig.from_pretrained(src, mtp_num_hidden_layers=mtp_layers_in_folder).save_pretrained(path)
        torch.distributed.barrier()
        weights.save_weights(model, path)
        torch.distributed.barrier()
        if rank == 0:
            config_writer(path)()
        torch.distributed.barrier()
    return MAJOR, MINOR


def _tensors(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    state = {}
    for file in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        state.update(load_file(file))
    return state


def test_megatron_bridge_export_is_complete_in_fix2_order_and_the_reversed_order_costs_what_the_version_says(tmp_path):
    from transformers import AutoModelForCausalLM

    from verl.utils.checkpoint.hf_verify import verify_hf_checkpoint
    from verl.utils.checkpoint.layout import hf_path

    src, last_shard = _source_with_mtp_tensors(str(tmp_path / "source"))
    out = str(tmp_path / "exports")
    version = run_on_ranks(_export_in_each_order, 4, SIZES, args=(src, out, SIZES), timeout_s=600)[0]
    expected = {name: 2 * tensor for name, tensor in _tensors(src).items() if not name.startswith("mtp.")}

    def check_complete(path: str) -> None:
        report = verify_hf_checkpoint(path)
        assert report.ok, report.describe()
        exported = _tensors(path)
        assert sorted(exported) == sorted(expected)
        assert [name for name in expected if not torch.equal(exported[name], expected[name])] == []
        assert json.load(open(os.path.join(path, "config.json")))["mtp_num_hidden_layers"] == 0

    fix2_folder = hf_path(os.path.join(out, FIX2))  # the manager's step layout: <step>/model/huggingface
    check_complete(fix2_folder)
    loaded = AutoModelForCausalLM.from_pretrained(fix2_folder, dtype=torch.float32).state_dict()
    assert torch.equal(loaded["model.norm.weight"], expected["model.norm.weight"])  # from the last shard

    for name, mtp_layers_in_folder in REVERSED.items():
        path = os.path.join(out, name)
        if version >= (0, 6) or mtp_layers_in_folder == 0:
            check_complete(path)  # 0.6+ knows from the built model; before, a folder config counting no MTP layer
        else:
            report = verify_hf_checkpoint(path)
            assert report.missing == sorted(last_shard), report.describe()  # the whole last shard, nothing else
            assert report.index_problems == [] and report.unexpected == [] and report.wrong_shape == []
