"""Host memory the process no longer uses, handed back to the OS."""

from __future__ import annotations

import ctypes
import functools
import gc


@functools.cache
def _libc_malloc_trim():
    """glibc's ``malloc_trim``, looked up once; None where the C library has none (musl, macOS)."""
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None


def malloc_trim() -> None:
    """Give the free pages of the C heap back to the OS; no-op where the C library has no ``malloc_trim``.

    glibc keeps freed small and mid-sized blocks in its arenas, so after a phase that allocates and frees
    a lot (loading HF weights, offloading many small tensors) the resident size stays high although the
    memory is free.
    """
    trim = _libc_malloc_trim()
    if trim is not None:
        trim(0)


def release_free_heap() -> None:
    """Collect garbage first, so that what it frees is trimmed too, then ``malloc_trim``."""
    gc.collect()
    malloc_trim()


def freeze_long_lived_objects() -> None:
    """Once a worker has built everything it keeps (models, optimizer, rollout, reference): collect, then move
    every object alive now out of the garbage collector's view (``gc.freeze``). Each later ``gc.collect`` (the
    offload helpers run one per call, as upstream's do) then scans only what was made since, not the ~500k
    objects of torch, megatron and transformers: a reference model's reload + offload went 0.9 s -> 0.2 s
    (docs/offload.md). Frozen objects are still freed by reference counting; only cycles among them are not."""
    gc.collect()
    gc.freeze()
