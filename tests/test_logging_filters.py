"""The one vLLM log record ``silence_library_notices`` drops, and the ones it must not."""

from __future__ import annotations

import logging

import pytest

from verl.utils.logging_utils import (
    CHAT_WARMUP_FAILED,
    VLLM_RENDERER_LOGGER,
    SkippedTokenizerWarmupFilter,
    silence_library_notices,
)


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def _logged(message: str, error: Exception | None) -> list[str]:
    silence_library_notices()
    silence_library_notices()  # twice, as a rank may: still one filter
    logger = logging.getLogger(VLLM_RENDERER_LOGGER)
    assert sum(isinstance(f, SkippedTokenizerWarmupFilter) for f in logger.filters) == 1
    collect = _Collect()
    logger.addHandler(collect)
    try:
        if error is None:
            logger.warning(message)
        else:
            try:
                raise error
            except type(error):
                logger.warning(message, exc_info=True)
    finally:
        logger.removeHandler(collect)
    return [r.getMessage() for r in collect.records]


def test_the_warmup_failure_of_an_engine_without_its_tokenizer_is_dropped():
    assert _logged(CHAT_WARMUP_FAILED, ValueError("Tokenizer not available when `skip_tokenizer_init=True`")) == []


@pytest.mark.parametrize(
    "message,error",
    [
        (CHAT_WARMUP_FAILED, ValueError("the chat template has a syntax error")),  # a real template problem
        (CHAT_WARMUP_FAILED, RuntimeError("Tokenizer not available when `skip_tokenizer_init=True`")),
        (CHAT_WARMUP_FAILED, None),
        ("Multimodal warmup failed", ValueError("Tokenizer not available when `skip_tokenizer_init=True`")),
    ],
)
def test_every_other_record_still_prints(message, error):
    assert _logged(message, error) == [message]
