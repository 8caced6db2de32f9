"""Per-file start-up work (footers, indexes, line scans) on a few threads, in contiguous chunks.

A source over many small files must touch each file once before it knows its length. With one
task per file a thread pool's own bookkeeping (a future, a lock, a wake-up per file) costs more
than reading a small footer; so the files are cut into a few contiguous chunks, each thread
works through one chunk in order, and the results come back in file order. The readers involved
(ArrayRecord's C++, pyarrow, numpy scans) release the GIL for their I/O, so threads overlap the
waits even on few cores. An error is raised for the first failing file in file order, so the
message does not depend on thread timing.

The work always runs on pool threads, never in the caller's: ArrayRecord readers opened and
closed in the main thread made a child forked later hang in its first parallel read (about one
run in four of tests/test_sources.py's fork test); opened on a pool thread, as before, they do not.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")

#: Threads for start-up work: I/O waits overlap, CPU work is bounded by the cores anyway.
MAX_THREADS = 8
#: Files per thread at least (below, fewer threads: a thread costs more than it saves).
MIN_FILES_PER_THREAD = 32


def map_files(fn: Callable[[str], T], paths: Sequence[str], threads: int | None = None) -> list[T]:
    """`[fn(p) for p in paths]`, computed in contiguous chunks on up to `threads` threads."""
    if threads is None:
        threads = min(MAX_THREADS, 2 * (os.cpu_count() or 1))
    threads = max(1, min(threads, len(paths) // MIN_FILES_PER_THREAD))
    bounds = [len(paths) * k // threads for k in range(threads + 1)]

    def chunk(k: int) -> list[T]:
        return [fn(p) for p in paths[bounds[k]:bounds[k + 1]]]

    out: list[T] = []
    with ThreadPoolExecutor(threads, thread_name_prefix="zephon-open") as pool:
        for part in [pool.submit(chunk, k) for k in range(threads)]:
            out.extend(part.result())  # in chunk order: the first failing file's error wins
    return out
