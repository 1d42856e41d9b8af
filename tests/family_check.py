"""Whether Megatron trains the model transformers runs, for one HF model at one parallel layout.

Three checks, run by tests/test_model_families.py (at <= 4 ranks) and scripts/check_model_families.py
(PP4 EP2 TP2 ETP2 and the transformers-5 venv):

- parity: Megatron's next-token log-probs against transformers' in fp32;
- export: the HF folder exported before training holds exactly the source's tensors, bit for bit;
- resume: a step saved by the checkpoint manager (its HF export verified at commit), loaded into a fresh
  actor, trains on to the same loss and parameters, bit for bit, as the run that saved it.
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass

import torch

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


def on_rank(src: str, root: str, resume: bool = True) -> tuple[torch.Tensor, float | None, float | None, list[str]]:
    """One rank's part (under ``run_on_ranks``): Megatron log-probs of ``check_tokens()``, an HF export of
    the untrained model to ``root/export``; with ``resume``, one step trained and saved at
    ``root/global_step_1/actor``, one more step, then a fresh actor resumes from the save and trains that
    step. Returns the log-probs, both runs' losses of the last step and the names of this rank's
    parameters that differ between them (None, None, [] without ``resume``)."""
    from verl.workers.megatron_rank import ActorSettings, MegatronActor

    def actor() -> MegatronActor:
        return MegatronActor(ActorSettings(model_path=src, use_distributed_optimizer=False))

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


def run_family_check(src: str, root: str, world_size: int, sizes, resume: bool = True) -> FamilyCheck:
    """``on_rank`` on ``world_size`` ranks at layout ``sizes`` (a ``ParallelSizes``), and the comparisons.
    ``resume=False``: parity and the export's round trip only (no checkpoint manager)."""
    from verl.utils.distributed import run_on_ranks

    results = run_on_ranks(on_rank, world_size, sizes, args=(src, root, resume))
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
