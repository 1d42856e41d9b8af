"""Rollout with transformers' ``generate`` on the rank, weights synced in memory from the Megatron actor.

The HF model is built once from the HF config; before each rollout every rank takes part in
``gather_hf_weights`` (verl.models.mcore.parallel_hf_save), which brings each whole HF tensor to the
generating rank, and that rank copies them into its model in place, so no file is written and the
rollout always samples from the weights the actor has now.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import torch

from verl.utils.internals import transformers as transformers_internals


@dataclasses.dataclass
class RolloutSettings:
    response_length: int
    temperature: float = 1.0
    top_p: float = 1.0
    do_sample: bool = True


class InMemoryHFRollout:
    """transformers' ``generate`` on an HF model whose weights the actor writes in memory.

    Not upstream's ``HFRollout`` (built from ``(module, config)``, ``generate_sequences(DataProto)``): named
    apart so an upstream caller fails on the import instead of getting a different API under the same name.
    """

    def __init__(
        self, hf_config, settings: RolloutSettings, eos_token_id: int, pad_token_id: int, device: str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        """``dtype``: the rollout model's (the trainer passes the actor's, ``actor.megatron.dtype``)."""
        from transformers import AutoModelForCausalLM

        self.settings = settings
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        self.module = AutoModelForCausalLM.from_config(hf_config, dtype=dtype).to(device).eval()
        # Keyed by the names the actor exports (the HF files'): on transformers 5 a fused expert parameter is
        # reached through per-expert views of it.
        self._parameters = transformers_internals.parameters_as_saved(self.module)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy ``(hf_name, tensor)`` pairs into the model; every parameter must arrive exactly once."""
        seen: set[str] = set()
        with torch.no_grad():
            for name, tensor in weights:
                target = self._parameters.get(name)
                if target is None:
                    raise KeyError(f"the actor exported {name!r}, which the rollout model {type(self.module).__name__} does not have")
                if target.shape != tensor.shape:
                    raise ValueError(f"{name}: exported shape {tuple(tensor.shape)}, rollout model expects {tuple(target.shape)}")
                target.copy_(tensor)
                seen.add(name)
        missing = sorted(set(self._parameters) - seen)
        if missing:
            raise KeyError(f"the actor's export lacks {len(missing)} rollout parameter(s), e.g. {missing[:3]}")
        return len(seen)

    @torch.no_grad()
    def generate_sequences(self, input_ids: torch.Tensor, seed: int, attention_mask: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """Sample one response per row of ``input_ids`` (``[rows, prompt_len]``, left-padded where ``attention_mask``,
        transformers' ``[rows, prompt_len]`` mask, is 0: padding is neither attended to nor counted in positions;
        None: no padding).

        Returns ``responses`` (padded after EOS to ``response_length``), ``response_mask`` (1 up to and
        including the first EOS) and ``rollout_log_probs``: log-probabilities of the sampled tokens under
        ``softmax(logits / temperature)`` of the raw logits (before top-p), what the actor recomputes.
        """
        s = self.settings
        device = next(self.module.parameters()).device
        prompts = input_ids.to(device)
        with torch.random.fork_rng(devices=[] if device.type == "cpu" else [device]):
            torch.manual_seed(seed)
            out = self.module.generate(
                prompts,
                attention_mask=torch.ones_like(prompts) if attention_mask is None else attention_mask.to(device),
                do_sample=s.do_sample,
                temperature=s.temperature if s.do_sample else None,
                top_p=s.top_p if s.do_sample else None,
                top_k=0 if s.do_sample else None,
                max_new_tokens=s.response_length,
                min_new_tokens=0,
                eos_token_id=self.eos_token_id,
                pad_token_id=self.pad_token_id,
                output_logits=True,
                remove_invalid_values=True,  # NaN/Inf logits (a diverged model) are returned for the trainer to name, not sampled from
                return_dict_in_generate=True,
            )
        responses = out.sequences[:, prompts.shape[1] :]
        logits = torch.stack(out.logits, dim=1).float()  # [rows, generated, vocab], raw
        log_probs = torch.log_softmax(logits / s.temperature, dim=-1).gather(-1, responses.unsqueeze(-1)).squeeze(-1)
        mask = response_mask(responses, self.eos_token_id)
        pad = s.response_length - responses.shape[1]  # every row stopped early
        if pad:
            responses = torch.nn.functional.pad(responses, (0, pad), value=self.pad_token_id)
            log_probs = torch.nn.functional.pad(log_probs, (0, pad))
            mask = torch.nn.functional.pad(mask, (0, pad))
        responses = responses.masked_fill(mask == 0, self.pad_token_id)
        return {"responses": responses.cpu(), "response_mask": mask.cpu(), "rollout_log_probs": (log_probs * mask).cpu()}


def response_mask(responses: torch.Tensor, eos_token_id: int) -> torch.Tensor:
    """1 for every token up to and including the first EOS of each row, 0 after it."""
    is_eos = (responses == eos_token_id).int()
    after_eos = (is_eos.cumsum(dim=1) - is_eos) > 0
    return (~after_eos).to(torch.int64)
