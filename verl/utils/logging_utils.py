"""Quiet the notices megatron-core, mbridge and torch print on every rank of a CPU-only or TE-less host."""

from __future__ import annotations

import logging
import warnings

# Each of these says something true but useless here, once per rank: TransformerEngine / apex are
# absent (local implementations are used), a CUDA-only tuning hint, a deprecated cuda-graph default,
# and torch collectives megatron-core 0.16 still calls by their deprecated names.
KNOWN_NOTICES = (
    r".*(Apex|Transformer Engine|TransformerEngine).*(not installed|Falling back).*",
    r".*full scope is deprecated.*",
    r".*CUDA_DEVICE_MAX_CONNECTIONS.*",
    r".*`torch\.distributed\.(reduce_scatter_tensor|all_gather_into_tensor)` is deprecated.*",
)


# vLLM renders a chat once at start to warm up its chat template, through the engine's tokenizer. The rollout starts
# its engine with skip_tokenizer_init=True (token ids in and out; the dataset applies the chat template with the
# trainer's tokenizer), so that warm-up can only fail, and vLLM logs the failure with a traceback on every engine.
# Nothing the rollout calls renders a chat, so the record says nothing about the run. Any other warm-up failure
# (another exception, or another message) still prints.
VLLM_RENDERER_LOGGER = "vllm.renderers.base"
CHAT_WARMUP_FAILED = "Chat template warmup failed"
NO_TOKENIZER = "skip_tokenizer_init=True"


class SkippedTokenizerWarmupFilter(logging.Filter):
    """Drops vLLM's chat-template warm-up failure when its cause is the engine's skipped tokenizer, nothing else."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        harmless = isinstance(error, ValueError) and NO_TOKENIZER in str(error)
        return not (harmless and record.getMessage() == CHAT_WARMUP_FAILED)


def silence_library_notices() -> None:
    """Filter the notices above (once per process; calling it again adds nothing)."""
    for message in KNOWN_NOTICES:
        warnings.filterwarnings("ignore", message=message)
    renderer = logging.getLogger(VLLM_RENDERER_LOGGER)
    if not any(isinstance(f, SkippedTokenizerWarmupFilter) for f in renderer.filters):
        renderer.addFilter(SkippedTokenizerWarmupFilter())
