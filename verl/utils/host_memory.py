"""Host memory the process no longer uses, handed back to the OS."""

from __future__ import annotations

import ctypes
import gc


def release_free_heap() -> None:
    """Return the heap that freed objects left behind to the OS.

    glibc keeps freed small and mid-sized blocks in its arenas, so after a phase that allocates and frees
    a lot (loading HF weights: every tensor is read, converted and copied into the model) the resident
    size stays high although the memory is free. No-op where the C library has no ``malloc_trim``.
    """
    gc.collect()
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass
