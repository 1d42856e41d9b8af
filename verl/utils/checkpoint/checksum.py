"""The content checksum a step's manifest records for each file (CRC-32, ``crc32:<8 hex>``), computed in one place.

Two ways to take it: ``file_checksum`` reads a file for it (the save, and a check of a few small files), and
``checksum_of`` hashes bytes a reader already holds, so a load checksums a file from the very bytes it loads
(one read, not two). Torch-free: the layer above ``errors`` and ``layout``, below every check.
"""

from __future__ import annotations

import mmap
import os

from verl.utils.checkpoint import check_audit

try:  # zlib-ng's CRC-32 is zlib's function (the same values), computed with carry-less multiplies: several times faster
    from zlib_ng.zlib_ng import crc32
except ImportError:  # where zlib-ng is not installed: the standard library's, same checksums, slower
    from zlib import crc32

CHUNK = 8 << 20  # crc32 releases the GIL per call: chunks let other threads run between them
# The files of a step that hold its bulk (dist-checkpoint shards, safetensors weights): a load checksums them
# from the bytes it reads; every other file is a few KiB of metadata, checked before anything loads.
BULK_SUFFIXES = (".distcp", ".safetensors")


class RunningChecksum:
    """The manifest's checksum of a file taken piece by piece, in the file's order, as a reader goes through it."""

    def __init__(self) -> None:
        self._crc = 0

    def update(self, data: bytes | bytearray | memoryview) -> None:
        with memoryview(data) as view:
            for offset in range(0, len(view), CHUNK):
                self._crc = crc32(view[offset : offset + CHUNK], self._crc)

    def result(self, path: str) -> str:
        """The checksum of every piece so far, as the whole content of the file at ``path`` (noted for ``check_audit``)."""
        check_audit.note(check_audit.CHECKSUM, os.path.abspath(path))
        return f"crc32:{self._crc:08x}"


def checksum_of(data: bytes | bytearray | memoryview, path: str) -> str:
    """The manifest's checksum of ``data``, the whole content of the file at ``path`` (noted for ``check_audit``)."""
    running = RunningChecksum()
    running.update(data)
    return running.result(path)


def file_checksum(path: str) -> str:
    """The manifest's checksum of the file at ``path`` (a byte flip anywhere changes it; docs/perf.md has its
    cost). Read through a memory map: no copy of the bytes, which costs about as much as the CRC itself."""
    with open(path, "rb") as handle:
        if os.fstat(handle.fileno()).st_size == 0:  # an empty file cannot be mapped
            return checksum_of(b"", path)
        with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            return checksum_of(mapped, path)


def is_bulk(relative: str) -> bool:
    """Whether a step's file (path relative to the step) is one whose bytes a load checksums as it reads them."""
    return relative.endswith(BULK_SUFFIXES)
