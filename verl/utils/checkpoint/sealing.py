"""Checksums and fsync of a step's files, started as soon as the files are complete and spread over the ranks.

The step transaction needs every file's CRC-32 (the manifest) and every file durable (before the rename). Done by
rank 0 at the end, that is one more pass over the whole step on one rank. A ``Sealer`` instead takes each
rank's share of the files a phase just finished (the dist checkpoints, while the HF export still runs) and
hashes and fsyncs them in background threads (zlib and fsync release the GIL); the step transaction gathers the
shares and hashes only what is left.
"""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor

from verl.utils.checkpoint.integrity import file_checksum
from verl.utils.fs import fsync_path


def share_of(relpaths: list[str], sizes: list[int], rank: int, world_size: int) -> list[str]:
    """This rank's files of ``relpaths``: the largest file first to the rank with the fewest bytes so far. Every
    rank computes the same split from the same listing, so no collective is needed."""
    loads = [0] * world_size
    mine = []
    for size, relpath in sorted(zip(sizes, relpaths, strict=True), reverse=True):
        owner = loads.index(min(loads))
        loads[owner] += size
        if owner == rank:
            mine.append(relpath)
    return mine


def checksum_and_sync(path: str) -> str:
    """The file's CRC-32, then an fsync of it: read from the page cache first, written back while others hash."""
    checksum = file_checksum(path)
    fsync_path(path)
    return checksum


class Sealer:
    """Hashes and fsyncs files of one step in background threads; ``results`` waits for them."""

    def __init__(self, step_path: str, threads: int = 2) -> None:
        self.step_path = step_path
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="checkpoint-seal")
        self._pending: dict[str, Future] = {}

    def seal(self, relpaths: list[str]) -> None:
        for relpath in relpaths:
            self._pending[relpath] = self._pool.submit(checksum_and_sync, os.path.join(self.step_path, relpath))

    def results(self) -> dict[str, str]:
        """Relative path -> checksum of every file given to ``seal`` that could be read; one that could not is
        left out (the step transaction then hashes it itself, and reports it if it is gone)."""
        self._pool.shutdown(wait=True)
        return {relpath: future.result() for relpath, future in self._pending.items() if future.exception() is None}
