"""Forward and forward+backward of Megatron GPT chunks through megatron's pipeline schedule."""

from __future__ import annotations

from functools import partial

import torch
from megatron.core import parallel_state as mpu
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tensor_parallel import (
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    vocab_parallel_cross_entropy,
)


def _position_ids(tokens: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Positions as transformers counts them: real tokens from 0, left padding not counted (pads get 1).

    Megatron's rotary embedding reads positions 0..seq-1 whatever is passed here; RoPE is relative, so once the
    pads are masked the real tokens see the same distances either way. These ids matter to absolute embeddings.
    """
    if attention_mask is None:
        return torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0).expand_as(tokens)
    positions = attention_mask.long().cumsum(dim=1) - 1
    return positions.masked_fill(attention_mask == 0, 1)


def _attention_mask(tokens: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Megatron's mask (True: must NOT be attended to): causal, and no query looks at a padding key.

    ``attention_mask`` is transformers' ``[batch, seq]`` (1: real token, 0: padding); None: nothing is padding.
    """
    seq = tokens.shape[1]
    mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool, device=tokens.device), diagonal=1).view(1, 1, seq, seq)
    if attention_mask is None:
        return mask
    return mask | (attention_mask == 0).view(tokens.shape[0], 1, 1, seq)


def _inputs(microbatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(input_ids, position_ids, attention_mask)`` of a microbatch: a token tensor, or a dict with ``input_ids``
    and an optional ``attention_mask``."""
    tokens = _tokens(microbatch)
    padding = microbatch.get("attention_mask") if isinstance(microbatch, dict) else None
    return tokens, _position_ids(tokens, padding), _attention_mask(tokens, padding)


def interleaved_microbatch_multiple() -> int:
    """What the number of microbatches of one schedule run must be a multiple of: the pipeline size under the
    interleaved schedule (megatron runs microbatches in groups of PP per model chunk), else 1."""
    if (mpu.get_virtual_pipeline_model_parallel_world_size() or 1) > 1:
        return mpu.get_pipeline_model_parallel_world_size()
    return 1


def _run_schedule(model: list, microbatches: list[torch.Tensor], forward_only: bool, step_fn, seq_length: int) -> list:
    multiple = interleaved_microbatch_multiple()
    if len(microbatches) % multiple:
        raise ValueError(
            f"{len(microbatches)} microbatches cannot run through the interleaved pipeline schedule, which needs a "
            f"multiple of pipeline_model_parallel_size={multiple}; choose micro batch sizes that give a multiple of {multiple}"
        )
    forward_backward = get_forward_backward_func()
    return forward_backward(
        forward_step_func=step_fn,
        data_iterator=[iter(microbatches) for _ in model] if len(model) > 1 else iter(microbatches),
        model=model,
        num_microbatches=len(microbatches),
        seq_length=seq_length,
        micro_batch_size=_tokens(microbatches[0]).shape[0],
        forward_only=forward_only,
    )


def _tokens(microbatch) -> torch.Tensor:
    return microbatch["input_ids"] if isinstance(microbatch, dict) else microbatch


def model_device(model: list) -> torch.device:
    """Where the model's weights are: the device every input of a forward must be on."""
    return next(model[0].parameters()).device


def to_device(microbatch, device: torch.device):
    """A microbatch (a tensor or a dict of tensors) on ``device``; the caller's batches stay on the host, as
    the trainer hands them, so a CUDA rank moves each one just before its forward."""
    if isinstance(microbatch, dict):
        return {key: value.to(device) for key, value in microbatch.items()}
    return microbatch.to(device)


def broadcast_from_last_stage(value: torch.Tensor | None) -> torch.Tensor:
    """Every pipeline rank gets the tensor that only the last stage computed."""
    group = mpu.get_pipeline_model_parallel_group()
    last = mpu.get_pipeline_model_parallel_last_rank()
    holder = [(value.shape, value.dtype, value.device.type) if value is not None else None]
    torch.distributed.broadcast_object_list(holder, src=last, group=group)
    if value is None:
        shape, dtype, device = holder[0]
        value = torch.empty(shape, dtype=dtype, device=device)
    torch.distributed.broadcast(value, src=last, group=group)
    return value


def _forward_only(model: list, microbatches: list[torch.Tensor], capture) -> torch.Tensor:
    """Forward of every microbatch; ``capture(output, microbatch)`` on the last stage, concatenated, on every rank.

    Under the interleaved schedule the microbatches are topped up to a multiple of the pipeline size with
    repeats of the last one, whose outputs are dropped: a forward changes nothing, so any batch runs."""
    captured = []
    device = model_device(model)
    count = len(microbatches)
    microbatches = microbatches + [microbatches[-1]] * (-count % interleaved_microbatch_multiple())

    def step(data_iterator, chunk):
        batch = to_device(next(data_iterator), device)
        output = chunk(*_inputs(batch))

        def keep(output_tensor):
            captured.append(capture(output_tensor, batch))
            return output_tensor.sum() * 0.0, {}

        return output, keep

    for chunk in model:
        chunk.eval()
    with torch.no_grad():
        _run_schedule(model, microbatches, forward_only=True, step_fn=step, seq_length=_tokens(microbatches[0]).shape[1])
    return broadcast_from_last_stage(torch.cat(captured[:count]) if captured else None).to(_tokens(microbatches[0]).device)


def forward_logits(model: list, tokens: torch.Tensor) -> torch.Tensor:
    """Full-vocabulary logits [batch, seq, vocab] for ``tokens``, on every rank."""
    return _forward_only(model, [tokens], lambda output, _: gather_from_tensor_model_parallel_region(output).float())


def token_log_probs(vocab_parallel_logits: torch.Tensor, input_ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``[batch, seq - 1]`` log-probabilities of ``input_ids[:, 1:]`` under ``softmax(logits / temperature)``.

    Works on the tensor-parallel vocabulary shards (``[batch, seq, vocab / TP]``) without gathering them;
    differentiable, so the policy loss uses it too.
    """
    scaled = vocab_parallel_logits[:, :-1].float() / temperature
    labels = input_ids[:, 1:]
    # megatron's cross entropy wants [seq, batch, ...] and gives -log p.
    negative = vocab_parallel_cross_entropy(scaled.transpose(0, 1).contiguous(), labels.transpose(0, 1).contiguous())
    return -negative.transpose(0, 1)


def token_entropy(vocab_parallel_logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``[batch, seq - 1]`` entropy of ``softmax(logits / temperature)`` at the positions ``token_log_probs`` scores.

    Works on the tensor-parallel vocabulary shards: the two sums over the vocabulary are all-reduced with
    megatron's reduce (identity backward: each rank's gradient reaches its own shard), so it is differentiable
    and the entropy bonus uses it too. The max subtracted for stability is a constant for autograd.
    """
    scaled = vocab_parallel_logits[:, :-1].float() / temperature
    shift = scaled.detach().max(dim=-1, keepdim=True).values
    if mpu.get_tensor_model_parallel_world_size() > 1:
        torch.distributed.all_reduce(shift, op=torch.distributed.ReduceOp.MAX, group=mpu.get_tensor_model_parallel_group())
    shifted = scaled - shift
    exp = shifted.exp()
    total = reduce_from_tensor_model_parallel_region(exp.sum(dim=-1))
    weighted = reduce_from_tensor_model_parallel_region((exp * shifted).sum(dim=-1))
    # H = -sum p log p with p = exp / total and log p = shifted - log(total)
    return total.log() - weighted / total


def _microbatches(input_ids: torch.Tensor, micro_batch_size: int, attention_mask: torch.Tensor | None) -> list[dict]:
    microbatches = [{"input_ids": ids} for ids in input_ids.split(micro_batch_size)]
    if attention_mask is not None:
        for microbatch, mask in zip(microbatches, attention_mask.split(micro_batch_size), strict=True):
            microbatch["attention_mask"] = mask
    return microbatches


def compute_log_probs(
    model: list, input_ids: torch.Tensor, response_length: int, temperature: float, micro_batch_size: int,
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[batch, response_length]`` log-probabilities of the last ``response_length`` tokens of each row, on every rank.

    ``attention_mask`` (``[batch, seq]``, 0 on left padding) keeps padding out of attention and positions, as
    transformers does for the rollout; None: every token is real.
    """
    return _forward_only(
        model,
        _microbatches(input_ids, micro_batch_size, attention_mask),
        lambda output, batch: token_log_probs(output, batch["input_ids"], temperature)[:, -response_length:],
    )


def compute_log_probs_and_entropy(
    model: list, input_ids: torch.Tensor, response_length: int, temperature: float, micro_batch_size: int,
    attention_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``compute_log_probs`` and, from the same forward, the entropy at each of those positions, on every rank."""

    def capture(output: torch.Tensor, batch: dict) -> torch.Tensor:
        log_probs = token_log_probs(output, batch["input_ids"], temperature)[:, -response_length:]
        return torch.cat([log_probs, token_entropy(output, temperature)[:, -response_length:]], dim=1)

    both = _forward_only(model, _microbatches(input_ids, micro_batch_size, attention_mask), capture)
    return both[:, :response_length], both[:, response_length:]


def forward_backward(model: list, microbatches: list[dict], loss_fn) -> list[dict]:
    """Forward and backward of every microbatch (dicts holding at least ``input_ids``; an ``attention_mask``
    marks left padding) through the pipeline.

    ``loss_fn(microbatch, vocab_parallel_logits) -> (loss, stats)`` runs on the last stage; megatron
    divides each loss by the number of microbatches before backward. Returns the stats of every
    microbatch on the last stage (empty elsewhere), on the model's device. Gradients are left in the DDP buffers.
    """
    device = model_device(model)

    def step(data_iterator, chunk):
        batch = to_device(next(data_iterator), device)
        output = chunk(*_inputs(batch))
        return output, partial(loss_fn, batch)

    for chunk in model:
        chunk.train()
        chunk.zero_grad_buffer()
    first = microbatches[0]["input_ids"]
    return _run_schedule(model, microbatches, forward_only=False, step_fn=step, seq_length=first.shape[1])


def _next_token_loss(labels: torch.Tensor, output_tensor: torch.Tensor):
    loss = output_tensor.float().mean()
    return loss, {"loss": loss.detach()}


def train_step(model: list, optimizer, scheduler, microbatches: list[torch.Tensor]) -> dict:
    """One optimizer step of next-token cross-entropy over the microbatches; returns loss and grad norm."""

    device = model_device(model)

    def step(data_iterator, chunk):
        batch = to_device(next(data_iterator), device)
        inputs, labels = batch[:, :-1].contiguous(), batch[:, 1:].contiguous()
        output = chunk(*_inputs(inputs), labels=labels)
        return output, partial(_next_token_loss, labels)

    for chunk in model:
        chunk.train()
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    losses = _run_schedule(model, microbatches, forward_only=False, step_fn=step, seq_length=microbatches[0].shape[1] - 1)
    update_ok, grad_norm, _ = optimizer.step()
    if update_ok:
        scheduler.step(increment=1)
    mean_loss = torch.stack([item["loss"] for item in losses]).mean() if losses else None
    return {"loss": broadcast_from_last_stage(mean_loss).item(), "grad_norm": float(grad_norm or 0.0), "update_ok": bool(update_ok)}
