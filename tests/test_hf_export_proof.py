"""An HF export found complete at a save is recorded in the step's manifest; a later check of the same export
against the same config compares the files' headers with that record instead of deriving the expected tensors
from a meta model again, and anything the record does not prove is derived and judged as before."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from safetensors.torch import load_file, save_file

from verl.models.tiny import tiny_hf_config
from verl.utils.checkpoint import hf_verify

DROPPED = "model.layers.3.mlp.experts.7.down_proj.weight"


@pytest.fixture
def derivations(monkeypatch) -> list[int]:
    """Every derivation of the expected tensors (``hf_verify.expected_hf_tensors``), counted."""
    derive, calls = hf_verify.expected_hf_tensors, []

    def counted(hf_config):
        calls.append(1)
        return derive(hf_config)

    monkeypatch.setattr(hf_verify, "expected_hf_tensors", counted)
    return calls


def _proof_of(folder: str) -> dict:
    report = hf_verify.verify_hf_checkpoint(folder, tiny_hf_config("moe"))
    assert report.ok and report.proof is not None
    return report.proof


def _without_one_expert_tensor(tiny_moe_path: str, tmp_path) -> str:
    """A copy of the folder whose shard holding ``DROPPED`` lacks it, the index still naming it."""
    folder = str(tmp_path / "export")
    shutil.copytree(tiny_moe_path, folder)
    with open(os.path.join(folder, "model.safetensors.index.json")) as handle:
        shard = os.path.join(folder, json.load(handle)["weight_map"][DROPPED])
    tensors = load_file(shard)
    del tensors[DROPPED]
    save_file(tensors, shard, metadata={"format": "pt"})
    return folder


def test_the_same_export_against_the_same_config_is_proven_without_deriving_it(tiny_moe_path, derivations):
    proof = _proof_of(tiny_moe_path)
    derivations.clear()
    report = hf_verify.verify_hf_checkpoint(tiny_moe_path, tiny_hf_config("moe"), proof=proof)
    assert report.ok and report.expected == proof["tensors"] and report.proof == proof
    assert derivations == []


def test_a_config_read_from_another_folder_is_the_same_config(tiny_moe_path, tmp_path, derivations):
    from transformers import AutoConfig

    elsewhere = shutil.copytree(tiny_moe_path, str(tmp_path / "elsewhere"))
    proof = hf_verify.verify_hf_checkpoint(tiny_moe_path, AutoConfig.from_pretrained(tiny_moe_path)).proof
    derivations.clear()
    assert hf_verify.verify_hf_checkpoint(elsewhere, AutoConfig.from_pretrained(elsewhere), proof=proof).ok
    assert derivations == []


def test_an_export_that_lost_a_tensor_since_its_proof_is_derived_and_refused_naming_it(tiny_moe_path, tmp_path, derivations):
    proof = _proof_of(tiny_moe_path)
    report = hf_verify.verify_hf_checkpoint(_without_one_expert_tensor(tiny_moe_path, tmp_path), tiny_hf_config("moe"), proof=proof)
    assert not report.ok and report.missing == [DROPPED] and report.proof is None
    assert "missing (1): " + DROPPED in report.describe()


def test_a_proof_made_for_another_config_proves_nothing(tiny_moe_path, derivations):
    proof = _proof_of(tiny_moe_path)
    deeper = tiny_hf_config("moe")
    deeper.num_hidden_layers += 1
    derivations.clear()
    report = hf_verify.verify_hf_checkpoint(tiny_moe_path, deeper, proof=proof)
    assert derivations == [1]
    assert not report.ok and any(name.startswith(f"model.layers.{deeper.num_hidden_layers - 1}.") for name in report.missing)


@pytest.mark.parametrize(
    "proof",
    [None, [], "sha", {"config_sha256": 1, "tensors_sha256": None}, {"tensors": 135}, "another-count"],
    ids=["none", "list", "string", "wrong-types", "no-digests", "another-count"],
)
def test_a_malformed_proof_is_ignored_and_the_expectation_derived(tiny_moe_path, derivations, proof):
    if proof == "another-count":  # the digests right, the count not: a record no save wrote
        proof = {**_proof_of(tiny_moe_path), "tensors": 1}
        derivations.clear()
    report = hf_verify.verify_hf_checkpoint(tiny_moe_path, tiny_hf_config("moe"), proof=proof)
    assert report.ok and derivations == [1]
