"""Whether Megatron trains the model transformers runs, for one HF model at one parallel layout.

Three checks, run by tests/test_model_families.py (at <= 4 ranks) and tests/checks/check_model_families.py
(PP4 EP2 TP2 ETP2 and the transformers-5 venv):

- parity: Megatron's next-token log-probs against transformers' in fp32;
- export: the HF folder exported before training holds exactly the source's tensors, bit for bit;
- resume: a step saved by the checkpoint manager (its HF export verified at commit), loaded into a fresh
  actor, trains on to the same loss and parameters, bit for bit, as the run that saved it.
"""

from __future__ import annotations

import copy
import glob
import os
from dataclasses import dataclass
from typing import Any

import torch

from tests.main_leg import TRAINING_STEPS, actor_configs

FP32_LOG_PROB_TOLERANCE = 1e-5


def check_tokens() -> torch.Tensor:
    """The fixed prompt batch the parity check runs: 2 sequences of 16 token ids."""
    return torch.randint(4, 200, (2, 16), generator=torch.Generator().manual_seed(0))


def _batches(seed: int) -> list[torch.Tensor]:
    data = torch.randint(4, 200, (4, 17), generator=torch.Generator().manual_seed(seed))
    return [data[:2], data[2:]]


def next_token_log_probs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log p(token t+1 | tokens <= t), [batch, seq - 1]."""
    return torch.log_softmax(logits[:, :-1].float(), dim=-1).gather(-1, tokens[:, 1:].unsqueeze(-1)).squeeze(-1)


def hf_state(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors files in an HF folder."""
    from safetensors.torch import load_file

    state = {}
    for file in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        state.update(load_file(file))
    return state


def transformers_log_probs(hf_path: str, tokens: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_path, dtype=torch.float32).eval()
    with torch.no_grad():
        return next_token_log_probs(model(tokens).logits, tokens)


def on_rank(
    src: str, root: str, resume: bool = True, refuse_unsupported: bool = True
) -> tuple[torch.Tensor, float | None, float | None, list[str]]:
    """One rank's part (under ``run_on_ranks``): Megatron log-probs of ``check_tokens()``, an HF export of
    the untrained model to ``root/export``; with ``resume``, one step trained and saved at
    ``root/global_step_1/actor``, one more step, then a fresh actor resumes from the save and trains that
    step. Returns the log-probs, both runs' losses of the last step and the names of this rank's
    parameters that differ between them (None, None, [] without ``resume``). ``refuse_unsupported=False``
    builds the model even where ``verl.models.support`` refuses its config."""
    from verl.workers.engine.megatron.transformer_impl import MegatronEngine

    def actor() -> MegatronEngine:
        configs = actor_configs(src, "megatron.use_distributed_optimizer=False", total_training_steps=TRAINING_STEPS)
        return MegatronEngine(*configs, refuse_unsupported=refuse_unsupported)

    first = actor()
    log_probs = next_token_log_probs(first.logits(check_tokens()), check_tokens())
    first.export_hf(os.path.join(root, "export"))
    if not resume:
        return log_probs, None, None, []
    step = os.path.join(root, "global_step_1", "actor")
    first.train_step(_batches(0))
    first.save_checkpoint(step, global_step=1)
    continued = first.train_step(_batches(1))["loss"]
    expected = first.parameters_snapshot()
    del first
    resumed = actor()
    resumed.load_checkpoint(step)
    resumed_loss = resumed.train_step(_batches(1))["loss"]
    actual = resumed.parameters_snapshot()
    return log_probs, continued, resumed_loss, [name for name in expected if not torch.equal(expected[name], actual[name])]


@dataclass
class FamilyCheck:
    log_prob_gap: float  # max |Megatron - transformers| over ranks and tokens
    export_missing: list[str]  # source tensors the untrained export lacks
    export_extra: list[str]  # export tensors the source lacks
    export_changed: list[str]  # tensors whose bits differ
    step_export_complete: bool | None  # the saved step's HF folder names exactly the source's tensors
    resume_loss_gap: float | None  # max |continued - resumed| last-step loss over ranks
    resume_differing: list[str]  # parameters (rank:name) that differ after the resumed step

    @property
    def passed(self) -> bool:
        """Parity and an exact export, and, where resume was checked, a complete step that resumes exactly."""
        resumed = self.resume_loss_gap is None or (self.step_export_complete and self.resume_loss_gap == 0.0 and not self.resume_differing)
        exact = not (self.export_missing or self.export_extra or self.export_changed)
        return self.log_prob_gap <= FP32_LOG_PROB_TOLERANCE and exact and resumed


def on_rank_each(cases: list[tuple[str, str]], resume: bool, refuse_unsupported: bool) -> list[tuple | str]:
    """``on_rank`` for each (src, root) in one process (a cell costs its model, not a process start); a
    case that raises gives ``"<ExceptionType>: <message>"`` instead of stopping the others."""
    results: list[tuple | str] = []
    for src, root in cases:
        try:
            results.append(on_rank(src, root, resume, refuse_unsupported))
        except Exception as exc:  # noqa: BLE001 - the matrix records what each cell raises
            results.append(f"{type(exc).__name__}: {exc}")
    return results


def _compare(src: str, root: str, results: list[tuple], resume: bool) -> FamilyCheck:
    reference = transformers_log_probs(src, check_tokens())
    source, exported = hf_state(src), hf_state(os.path.join(root, "export"))
    step_export = hf_state(os.path.join(root, "global_step_1", "actor", "model", "huggingface")) if resume else None
    return FamilyCheck(
        log_prob_gap=max((log_probs - reference).abs().max().item() for log_probs, *_ in results),
        export_missing=sorted(set(source) - set(exported)),
        export_extra=sorted(set(exported) - set(source)),
        export_changed=sorted(n for n in set(source) & set(exported) if not torch.equal(source[n], exported[n])),
        step_export_complete=set(step_export) == set(source) if resume else None,
        resume_loss_gap=max(abs(continued - resumed) for _, continued, resumed, _ in results) if resume else None,
        resume_differing=[f"{rank}:{name}" for rank, (*_, differing) in enumerate(results) for name in differing],
    )


def run_family_check(src: str, root: str, world_size: int, sizes, resume: bool = True, refuse_unsupported: bool = True) -> FamilyCheck:
    """``on_rank`` on ``world_size`` ranks at layout ``sizes`` (a ``ParallelSizes``), and the comparisons.
    ``resume=False``: parity and the export's round trip only (no checkpoint manager)."""
    from verl.utils.distributed import run_on_ranks

    results = run_on_ranks(on_rank, world_size, sizes, args=(src, root, resume, refuse_unsupported))
    return _compare(src, root, results, resume)


def run_family_checks(
    cases: list[tuple[str, str]], world_size: int, sizes, resume: bool = True, refuse_unsupported: bool = True, timeout_s: float = 900.0
) -> list[FamilyCheck | str]:
    """``run_family_check`` for each (src, root); a case that raised on any rank (or whose comparison raised)
    gives ``"<ExceptionType>: <message>"``. On 1 rank all cases share one start of the rank; on more, each case
    starts its own ranks, so that a rank that raises stops the others (instead of leaving them in a collective)."""
    from verl.utils.distributed import run_on_ranks

    if world_size > 1:
        checks: list[FamilyCheck | str] = []
        for src, root in cases:
            try:
                checks.append(run_family_check(src, root, world_size, sizes, resume, refuse_unsupported))
            except Exception as exc:  # noqa: BLE001 - recorded per case
                checks.append(f"{type(exc).__name__}: {exc}")
        return checks
    per_rank = run_on_ranks(on_rank_each, world_size, sizes, args=(cases, resume, refuse_unsupported), timeout_s=timeout_s)
    checks = []
    for index, (src, root) in enumerate(cases):
        results = [rank_results[index] for rank_results in per_rank]
        error = next((r for r in results if isinstance(r, str)), None)
        if error is None:
            try:
                checks.append(_compare(src, root, results, resume))
            except Exception as exc:  # noqa: BLE001 - recorded per case, as on the ranks
                error = f"{type(exc).__name__}: {exc}"
        if error is not None:
            checks.append(error)
    return checks


# ---- The family flag matrix (tests/test_family_flag_matrix.py, tests/checks/family_matrix.py) -------------------
#
# Generated, not listed: for each supported family, every HF config field that mbridge's bridge for it or
# transformers' modelling code reads (found in their installed sources), each toggled away from the tiny
# model's value. A cell either trains (this harness passes) or is refused before start by
# verl.models.support.hf_config_problems naming the field.

# The generic toggle (bool flipped, number doubled, ...) where it would not make a valid or a different model.
TOGGLES: dict[str, Any] = {
    "hidden_act": "gelu",
    "head_dim": 64,  # != the tiny model's 32 and != hidden_size / num_attention_heads (16, the unset default)
    "sliding_window": 8,  # shorter than the 16-token check, so a window would change the logits
    "mlp_only_layers": [0],
    "rope_parameters": {"rope_type": "linear", "factor": 2.0},
    "rope_scaling": {"rope_type": "linear", "factor": 2.0},
    "layer_types": ["sliding_attention", "full_attention"],
    "max_window_layers": 1,
    "pad_token_id": 3,
    "decoder_sparse_step": 2,
    "num_key_value_heads": 1,
}
# Fields set with a toggled one so that the toggle takes effect (a sliding window only exists with
# use_sliding_window, and only matters when shorter than the check's 16 tokens).
COMPANIONS: dict[str, dict[str, Any]] = {
    "use_sliding_window": {"sliding_window": 8},
    "max_window_layers": {"use_sliding_window": True, "sliding_window": 8},
    "layer_types": {"use_sliding_window": True, "sliding_window": 8},
}
# Fields read but not toggled, and why toggling cannot change the model that is trained or exported.
NOT_TOGGLED = {
    "output_router_logits": "only adds the router logits to transformers' outputs",
    "initializer_range": "only initialises weights, which are loaded from the checkpoint",
    "use_cache": "only keeps the KV cache during generation",
    "num_hidden_layers": "the layer count every cell already varies with its layout (tests/test_model_families.py)",
}
TINY_LAYERS = 2


def _fields_in(source: str, owner: str = r"(?:hf_)?config") -> set[str]:
    """Names read as ``config.X`` / ``hf_config.X`` (or ``<owner>.X``) / ``getattr(..config, "X"`` / ``"X" in ..config``."""
    import re

    names = set(re.findall(rf"\b{owner}\.([A-Za-z]\w*)", source))
    names |= set(re.findall(r"getattr\(\s*(?:self\.)?(?:hf_|text_)?config,\s*[\"'](\w+)[\"']", source))
    names |= set(re.findall(r"[\"'](\w+)[\"']\s+in\s+(?:self\.)?hf_config\b", source))
    return names


def flags_read(model_type: str) -> dict[str, list[str]]:
    """Config field -> who reads it (``mbridge``, ``transformers``) for one family, from the installed sources:
    mbridge's bridge class and its bases (and their ``_CONFIG_MAPPING``), transformers' modelling module and
    its config's ``__post_init__`` (which derives fields such as ``layer_types`` from others)."""
    import importlib
    import inspect

    from verl.models.tiny import tiny_hf_config
    from verl.utils.internals.mbridge import bridge_class

    readers: dict[str, set[str]] = {}
    for cls in bridge_class(model_type).__mro__:
        if cls.__module__.startswith("mbridge"):
            found = _fields_in(inspect.getsource(inspect.getmodule(cls)))
            for value in vars(cls).get("_CONFIG_MAPPING", {}).values():
                found.add(value[0] if isinstance(value, tuple) else value)
            for name in found:
                readers.setdefault(name, set()).add("mbridge")
    package = f"transformers.models.{model_type}"
    config_cls = type(tiny_hf_config(kind_of(model_type)))
    found = _fields_in(inspect.getsource(importlib.import_module(f"{package}.modeling_{model_type}")))
    if "__post_init__" in vars(config_cls):
        found |= _fields_in(inspect.getsource(config_cls.__post_init__), owner="self")
    for name in found:
        readers.setdefault(name, set()).add("transformers")
    config = tiny_hf_config(kind_of(model_type), num_layers=TINY_LAYERS)
    known = set(config.to_dict()) | set(config.attribute_map)  # attribute_map: aliases such as num_experts
    fields = {name for name in readers if not name.startswith("_") and name in known and not callable(getattr(config, name))}
    return {name: sorted(readers[name]) for name in sorted(fields)}


def toggled(flag: str, value: Any) -> Any:
    """The cell's value of ``flag``: ``TOGGLES``, else the tiny model's value flipped (bool) or doubled (number)."""
    if flag in TOGGLES:
        return copy.deepcopy(TOGGLES[flag])
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value * 2 if value else type(value)(1 if isinstance(value, int) else 0.1)
    raise ValueError(f"no toggle for {flag}={value!r}: add one to tests.family_check.TOGGLES")


def kind_of(model_type: str) -> str:
    """The tiny model kind (``verl.models.tiny.KINDS``) of an HF ``model_type``."""
    from verl.models.tiny import KINDS, tiny_hf_config

    return next(kind for kind in KINDS if tiny_hf_config(kind, num_layers=1).model_type == model_type)


@dataclass(frozen=True)
class Cell:
    model_type: str
    flag: str
    value: Any
    readers: tuple[str, ...]

    @property
    def overrides(self) -> dict[str, Any]:
        """The HF config fields this cell sets: the flag and its ``COMPANIONS`` (copies: transformers fills in
        a ``rope_parameters`` dict it is given)."""
        return copy.deepcopy({**COMPANIONS.get(self.flag, {}), self.flag: self.value})

    @property
    def id(self) -> str:
        """``model_type:flag=value``, the companions (if any) after it in brackets."""
        with_ = ", ".join(f"{k}={v!r}" for k, v in COMPANIONS.get(self.flag, {}).items())
        return f"{self.model_type}:{self.flag}={self.value!r}" + (f" (with {with_})" if with_ else "")

    @property
    def kind(self) -> str:
        return kind_of(self.model_type)

    def config(self):
        """The tiny HF config of this cell (transformers' class, the flag set)."""
        from verl.models.tiny import tiny_hf_config

        return tiny_hf_config(self.kind, num_layers=TINY_LAYERS, **self.overrides)


def matrix_cells() -> list[Cell]:
    """Every (family, flag) cell, in a stable order."""
    from verl.models.support import SUPPORTED_MODEL_TYPES
    from verl.models.tiny import tiny_hf_config

    cells = []
    for model_type in SUPPORTED_MODEL_TYPES:
        base = tiny_hf_config(kind_of(model_type), num_layers=TINY_LAYERS)
        for flag, readers in flags_read(model_type).items():
            if flag not in NOT_TOGGLED:
                cells.append(Cell(model_type, flag, toggled(flag, getattr(base, flag)), tuple(readers)))
    return cells


def _exception_line(message: str) -> str:
    """The raised exception's own line out of a rank failure's tracebacks (or the message's first line)."""
    import re

    lines = [line.strip() for line in message.splitlines()]
    raised = [line for line in lines[1:] if re.match(r"[\w.]*(Error|Exception)\b", line) and "gloo" not in line]
    return raised[0] if raised else lines[0]


@dataclass
class Outcome:
    """A cell's result: ``trains`` (the harness passed), ``refused`` (before start, ``refusal`` naming the
    flag; ``result`` what the harness gave with the refusal off, when run) or ``FAILS``."""

    verdict: str
    refusal: str | None = None
    result: FamilyCheck | str | None = None

    def summary(self) -> str:
        """What the harness measured, in a few words (no paths)."""
        result = self.result
        if result is None:
            return "not run"
        if isinstance(result, str):
            return _exception_line(result)[:160]
        parts = [f"log-prob gap {result.log_prob_gap:.1e}"]
        if result.export_missing or result.export_extra or result.export_changed:
            parts.append(f"export: {len(result.export_missing)} missing, {len(result.export_extra)} extra, {len(result.export_changed)} changed")
        if result.resume_loss_gap is not None and not (result.step_export_complete and result.resume_loss_gap == 0.0 and not result.resume_differing):
            parts.append(f"resume: loss gap {result.resume_loss_gap:.1e}, {len(result.resume_differing)} parameters differ")
        return ", ".join(parts)

    def as_json(self) -> dict[str, Any]:
        result = self.result
        return {
            "verdict": self.verdict,
            "refusal": self.refusal,
            "passed": result.passed if isinstance(result, FamilyCheck) else None,
            "log_prob_gap": result.log_prob_gap if isinstance(result, FamilyCheck) else None,
            "summary": self.summary(),
        }


def refusal_of(src: str, sizes, world_size: int) -> str | None:
    """The pre-start check's problems for a saved model at a layout, joined; None if it passes."""
    from verl.models.mcore import UnsupportedHFConfigError, validate_model_build
    from verl.utils.megatron.parallel import ParallelConfigError

    try:
        validate_model_build(src, sizes, world_size)
    except (UnsupportedHFConfigError, ParallelConfigError) as exc:
        return " / ".join(exc.problems)
    return None


def run_cells(cells: list[Cell], root: str, world_size: int = 1, sizes=None, bypass: bool = False) -> list[Outcome]:
    """Every cell at one layout: refused ones recorded (and with ``bypass`` run with the refusal off),
    the others through the harness; two starts of the ranks in all."""
    from verl.models.tiny import make_tiny_hf_model
    from verl.utils.megatron.parallel import ParallelSizes

    sizes = sizes or ParallelSizes()
    # One start of the ranks per (refusal on, tied embeddings): mbridge 0.15.1's Qwen2 bridge writes the tied
    # mapping into its class, so an untied Qwen2/Qwen3 built after a tied one in a process would export no
    # lm_head.weight (the trainer builds one model per process).
    outcomes: list[Outcome] = []
    cases: dict[tuple[bool, bool], list] = {}
    for index, cell in enumerate(cells):
        src = os.path.join(root, str(index), "src")
        try:
            make_tiny_hf_model(src, kind=cell.kind, num_layers=TINY_LAYERS, **cell.overrides)
        except Exception as exc:  # noqa: BLE001 - a toggle transformers rejects is a bad cell, shown as such
            outcomes.append(Outcome("FAILS", result=f"transformers cannot build it: {type(exc).__name__}: {exc}"))
            continue
        refusal = refusal_of(src, sizes, world_size)
        outcomes.append(Outcome("refused" if refusal else "trains", refusal=refusal))
        if not refusal or bypass:
            key = (not refusal, bool(cell.overrides.get("tie_word_embeddings")))
            cases.setdefault(key, []).append((index, (src, os.path.join(root, str(index), "run"))))
    for (refuse, _), batch in cases.items():
        if batch:
            results = run_family_checks([case for _, case in batch], world_size, sizes, refuse_unsupported=refuse)
            for (index, (_, run_root)), result in zip(batch, results, strict=True):
                if isinstance(result, str):
                    result = result.replace(os.path.dirname(run_root), "{cell}")
                outcomes[index].result = result
                if refuse and not (isinstance(result, FamilyCheck) and result.passed):
                    outcomes[index].verdict = "FAILS"
    return outcomes


def table_rows(cells: list[Cell], outcomes: list[Outcome]) -> list[str]:
    """The docs table's rows, one per cell."""
    rows = []
    for cell, outcome in zip(cells, outcomes, strict=True):
        verdict = outcome.verdict if outcome.verdict != "refused" else f"refused (`{cell.flag}`)"
        measured = outcome.summary() if outcome.verdict != "refused" else f"without the refusal: {outcome.summary()}"
        rows.append(f"| `{cell.id}` | {', '.join(cell.readers)} | {verdict} | {measured} |")
    return rows


TABLE_BEGIN, TABLE_END = "<!-- family-matrix:begin -->", "<!-- family-matrix:end -->"
DOCS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "models.md")


def write_table(rows: list[str]) -> None:
    """Replace the table between the markers in docs/models.md."""
    with open(DOCS) as handle:
        text = handle.read()
    head, rest = text.split(TABLE_BEGIN, 1)
    tail = rest.split(TABLE_END, 1)[1]
    import mbridge
    import transformers

    table = [
        f"Generated with transformers {transformers.__version__} and mbridge {mbridge.__version__}.",
        "","| cell (family: field=toggled value) | read by | outcome | measured (1 rank) |", "|---|---|---|---|", *rows]
    with open(DOCS, "w") as handle:
        handle.write(head + TABLE_BEGIN + "\n" + "\n".join(table) + "\n" + TABLE_END + tail)


def table_cell_ids(text: str) -> list[str]:
    """The cell ids of the docs table (its first column)."""
    return list(table_verdicts(text))


def table_verdicts(text: str) -> dict[str, str]:
    """The docs table's cell id -> outcome column."""
    body = text.split(TABLE_BEGIN, 1)[1].split(TABLE_END, 1)[0]
    rows = [line for line in body.strip().splitlines() if line.startswith("| `")]
    return {row.split("|")[1].strip().strip("`"): row.split("|")[3].strip() for row in rows}


def table_versions(text: str) -> str:
    """The 'Generated with ...' line of the docs table."""
    return text.split(TABLE_BEGIN, 1)[1].strip().splitlines()[0]
