"""The family flag matrix (``tests.family_check.matrix_cells``; its table in docs/models.md is written by
tests/checks/family_matrix.py): per supported family, every HF config field that mbridge's bridge or transformers'
modelling code reads, toggled one at a time on the tiny model. Each cell trains (parity with transformers,
complete and bit-exact HF export, bit-exact resume) or is refused before start naming the field, and every
refusal is shown to prevent a failure: the same harness with the refusal off fails or crashes.

In the suite: the table against the generated cells and the refusals (no model built), every refused cell
with its refusal off, and the cells of fields only one side reads (where a mapping gap hides; the fields
both read go through mbridge's config mapping) at 1 rank; tied embeddings at PP 2. The script runs every
cell."""

from pathlib import Path

import pytest

from tests.family_check import (
    DOCS,
    matrix_cells,
    refusal_of,
    run_cells,
    run_family_check,
    table_cell_ids,
    table_verdicts,
    table_versions,
)
from verl.models.support import hf_config_problems
from verl.models.tiny import make_tiny_hf_model
from verl.utils.megatron.parallel import ParallelSizes

CELLS = matrix_cells()


def _generated_with() -> str:
    import mbridge
    import transformers

    return f"Generated with transformers {transformers.__version__} and mbridge {mbridge.__version__}."


def test_docs_table_is_the_generated_matrix():
    # Regenerate with `python -m tests.checks.family_matrix --bypass --write-docs` when mbridge or transformers changes.
    text = Path(DOCS).read_text()
    families = {cell.model_type for cell in CELLS}
    assert families == {"llama", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe"}
    for family in families:  # the fields the issue names, generated for every family
        assert {"tie_word_embeddings", "hidden_act"} <= {cell.flag for cell in CELLS if cell.model_type == family}
    if table_versions(text) == _generated_with():
        assert table_cell_ids(text) == [cell.id for cell in CELLS]
    else:  # another transformers (the 4.57 leg) reads other fields; mbridge's are the same
        assert {cell.id for cell in CELLS if cell.readers == ("mbridge",)} <= set(table_cell_ids(text))


def test_each_cell_is_refused_exactly_where_the_table_says_naming_its_field():
    documented = table_verdicts(Path(DOCS).read_text())
    for cell in CELLS:
        problems = hf_config_problems(cell.config())
        if cell.id in documented:
            assert bool(problems) == documented[cell.id].startswith("refused"), (cell.id, problems)
        if problems:
            assert len(problems) == 1 and cell.flag in problems[0] and cell.model_type in problems[0], (cell.id, problems)


def test_every_refused_cell_fails_without_its_refusal(tmp_path):
    refused = [cell for cell in CELLS if hf_config_problems(cell.config())]
    assert len(refused) >= 20
    outcomes = run_cells(refused, str(tmp_path), bypass=True)
    for cell, outcome in zip(refused, outcomes, strict=True):
        assert outcome.verdict == "refused" and cell.flag in outcome.refusal, (cell.id, outcome)
        result = outcome.result
        assert isinstance(result, str) or not result.passed, f"{cell.id}: refused, but the harness passes without the refusal: {result}"


def test_cells_of_fields_one_side_reads_train_on_one_rank(tmp_path):
    one_sided = [cell for cell in CELLS if len(cell.readers) == 1 and not hf_config_problems(cell.config())]
    assert {"tie_word_embeddings", "pad_token_id", "norm_topk_prob"} <= {cell.flag for cell in one_sided}
    outcomes = run_cells(one_sided, str(tmp_path))
    failing = {cell.id: outcome.summary() for cell, outcome in zip(one_sided, outcomes, strict=True) if outcome.verdict != "trains"}
    assert not failing, failing


@pytest.mark.parametrize("kind", ["moe", "dense"], ids=["qwen3_moe-refused", "qwen3-trains"])
def test_tied_embeddings_on_two_pipeline_stages(tmp_path, kind):
    """The last stage's copy of a tied embedding: Qwen3's bridge reads it from the embedding, Qwen3-MoE's
    (like Llama's, Mixtral's and Qwen2-MoE's) from lm_head.weight, which a tied checkpoint lacks."""
    src = make_tiny_hf_model(str(tmp_path / "src"), kind=kind, num_layers=2, tie_word_embeddings=True)
    sizes = ParallelSizes(pp=2)
    refusal = refusal_of(src, sizes, 2)
    if kind == "dense":
        assert refusal is None
        result = run_family_check(src, str(tmp_path / "run"), 2, sizes)
        assert result.passed, result
        return
    assert "tie_word_embeddings=True with pipeline_model_parallel_size=2" in refusal and "pipeline_model_parallel_size=1" in refusal
    assert refusal_of(src, ParallelSizes(), 1) is None  # one stage: the output layer is the embedding itself
    with pytest.raises(Exception, match="KeyError: 'lm_head.weight'"):
        run_family_check(src, str(tmp_path / "run"), 2, sizes, refuse_unsupported=False)


def test_tied_moe_on_two_pipeline_stages_is_refused_by_the_one_second_check(tmp_path):
    """The trainer's pre-start check (before Ray) names the field and the layout key; at PP 1 it passes."""
    import json

    from omegaconf import OmegaConf

    from verl.models.tiny import tiny_hf_config
    from verl.trainer.validation import check_config

    path = tmp_path / "model"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(tiny_hf_config("moe", tie_word_embeddings=True).to_dict()))
    config = OmegaConf.load("verl/trainer/config/ppo_megatron_trainer.yaml")
    config.trainer.default_local_dir = str(tmp_path / "ckpt")
    config.actor_rollout_ref.actor.megatron.pipeline_model_parallel_size = 2
    (problem,) = [p for p in check_config(config, str(path)) if "tie_word_embeddings" in p]
    assert "set actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=1" in problem, problem
    config.actor_rollout_ref.actor.megatron.pipeline_model_parallel_size = 1
    assert not [p for p in check_config(config, str(path)) if "tie_word_embeddings" in p]
