"""Interleaved pipelines (VPP2 at PP2, 4 ranks) with the model built by Megatron-Bridge on megatron-core 0.18:
two model chunks per rank, every layer's rows in the dist checkpoint, a bit-exact resume, and the HF export's
logits equal transformers'. The same checks as tests/test_vpp.py's mbridge run (tests/vpp_check.py)."""

from tests.vpp_check import logits_gap, missing_layer_rows, num_hidden_layers, train_save_continue_then_resume
from verl.utils.distributed import run_on_ranks
from verl.utils.megatron.parallel import ParallelSizes


def test_vpp2_through_megatron_bridge_saves_every_chunk_and_resumes_bit_exactly(tiny_moe_path, tmp_path):
    root = str(tmp_path)
    results = run_on_ranks(train_save_continue_then_resume, 4, ParallelSizes(pp=2, vpp=2), args=(tiny_moe_path, root, False, False))
    for result in results:
        assert result["chunks"] == 2  # the provider was given the virtual pipeline size
        assert result["continued"] == result["resumed"] and result["differing"] == []
    step = f"{root}/global_step_2/actor"
    assert missing_layer_rows(step, num_hidden_layers(tiny_moe_path)) == {}
    assert logits_gap(f"{step}/model/huggingface", results[0]["logits"]) <= 1e-5
