"""An all-gather among threads: D simulated ranks in one process, for tests of finite plans.

A finite plan whose pipeline changes the number of records ends where every rank's lanes say
(`zephon.exec.end`); ranks agree through an all-gather of the runtime in use. `ThreadGather`
is that all-gather for ranks run as threads of one process, so a test can run D loaders the way
D processes would — each counting only its own lanes — without a distributed runtime.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

from zephon.errors import PlanError


class ThreadGather:
    """`for_rank(r)` is rank r's all-gather; all `world` ranks must call it (from threads)."""

    def __init__(self, world: int, timeout: float = 120.0) -> None:
        self.world = world
        self.timeout = timeout
        self.calls = 0
        self._slots: list[list[int]] = [[] for _ in range(world)]
        self._barrier = threading.Barrier(world)
        self._lock = threading.Lock()

    def for_rank(self, rank: int) -> Callable[[list[int]], Sequence[Sequence[int]]]:
        def all_gather(values: list[int]) -> Sequence[Sequence[int]]:
            with self._lock:
                self.calls += 1
            self._slots[rank] = list(values)
            try:
                self._barrier.wait(self.timeout)  # every rank has written its values
                out = [list(s) for s in self._slots]
                self._barrier.wait(self.timeout)  # every rank has read them
            except threading.BrokenBarrierError:
                raise PlanError(f"rank {rank}'s all-gather timed out after {self.timeout} s: not "
                                f"every one of the {self.world} ranks called it.") from None
            return out

        return all_gather


__all__ = ["ThreadGather"]
