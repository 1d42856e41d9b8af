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


def _position_ids(tokens: torch.Tensor) -> torch.Tensor:
    return torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0).expand_as(tokens)


def _causal_mask(tokens: torch.Tensor) -> torch.Tensor:
    seq = tokens.shape[1]
    # Megatron convention: True marks positions that must NOT be attended to.
    return torch.triu(torch.ones(seq, seq, dtype=torch.bool, device=tokens.device), diagonal=1).view(1, 1, seq, seq)


def _run_schedule(model: list, microbatches: list[torch.Tensor], forward_only: bool, step_fn, seq_length: int) -> list:
    forward_backward = get_forward_backward_func()
    return forward_backward(
        forward_step_func=step_fn,
        data_iterator=[iter(microbatches) for _ in model] if len(model) > 1 else iter(microbatches),
        model=model,
        num_microbatches=len(microbatches),
        seq_length=seq_length,
        micro_batch_size=_rows(microbatches[0]),
        forward_only=forward_only,
    )


def _rows(microbatch) -> int:
    return (microbatch["input_ids"] if isinstance(microbatch, dict) else microbatch).shape[0]


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
    """Forward of every microbatch; ``capture(output, microbatch)`` on the last stage, concatenated, on every rank."""
    captured = []

    def step(data_iterator, chunk):
        batch = next(data_iterator)
        output = chunk(batch, _position_ids(batch), _causal_mask(batch))

        def keep(output_tensor):
            captured.append(capture(output_tensor, batch))
            return output_tensor.sum() * 0.0, {}

        return output, keep

    for chunk in model:
        chunk.eval()
    with torch.no_grad():
        _run_schedule(model, microbatches, forward_only=True, step_fn=step, seq_length=microbatches[0].shape[1])
    return broadcast_from_last_stage(torch.cat(captured) if captured else None)


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


def compute_log_probs(model: list, input_ids: torch.Tensor, response_length: int, temperature: float, micro_batch_size: int) -> torch.Tensor:
    """``[batch, response_length]`` log-probabilities of the last ``response_length`` tokens of each row, on every rank."""
    return _forward_only(
        model,
        list(input_ids.split(micro_batch_size)),
        lambda output, batch: token_log_probs(output, batch, temperature)[:, -response_length:],
    )


def compute_log_probs_and_entropy(
    model: list, input_ids: torch.Tensor, response_length: int, temperature: float, micro_batch_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``compute_log_probs`` and, from the same forward, the entropy at each of those positions, on every rank."""

    def capture(output: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
        log_probs = token_log_probs(output, batch, temperature)[:, -response_length:]
        return torch.cat([log_probs, token_entropy(output, temperature)[:, -response_length:]], dim=1)

    both = _forward_only(model, list(input_ids.split(micro_batch_size)), capture)
    return both[:, :response_length], both[:, response_length:]


def forward_backward(model: list, microbatches: list[dict], loss_fn) -> list[dict]:
    """Forward and backward of every microbatch (dicts holding at least ``input_ids``) through the pipeline.

    ``loss_fn(microbatch, vocab_parallel_logits) -> (loss, stats)`` runs on the last stage; megatron
    divides each loss by the number of microbatches before backward. Returns the stats of every
    microbatch on the last stage (empty elsewhere). Gradients are left in the DDP buffers.
    """

    def step(data_iterator, chunk):
        batch = next(data_iterator)
        input_ids = batch["input_ids"]
        output = chunk(input_ids, _position_ids(input_ids), _causal_mask(input_ids))
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

    def step(data_iterator, chunk):
        batch = next(data_iterator)
        inputs, labels = batch[:, :-1].contiguous(), batch[:, 1:].contiguous()
        output = chunk(inputs, _position_ids(inputs), _causal_mask(inputs), labels=labels)
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
