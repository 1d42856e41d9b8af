"""An RMSNorm for megatron-core's local layer spec that, unlike WrappedTorchNorm, allows sequence parallel."""

from __future__ import annotations

import torch
from megatron.core.transformer import TransformerConfig


class RMSNorm(torch.nn.Module):
    """RMSNorm with the numerics of HF Qwen/Llama (normalise in fp32, scale in the input dtype).

    Under sequence parallel every TP rank sees a different slice of the sequence, so the weight's
    gradient is partial; tagging it ``sequence_parallel`` makes megatron's finalize_model_grads
    all-reduce it across the tensor-parallel group, exactly as it does for TransformerEngine norms.
    """

    def __init__(
        self,
        config: TransformerConfig,
        hidden_size: int,
        eps: float = 1e-6,
        persist_layer_norm: bool = False,
        zero_centered_gamma: bool = False,
        normalization: str = "RMSNorm",
    ) -> None:
        super().__init__()
        if normalization != "RMSNorm" or zero_centered_gamma or config.layernorm_zero_centered_gamma:
            raise ValueError(f"RMSNorm only implements plain RMSNorm, got normalization={normalization!r}")
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        self.weight.sequence_parallel = bool(config.sequence_parallel)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.eps)
        return self.weight * hidden_states.to(input_dtype)
