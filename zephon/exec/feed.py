"""The lane feed: which inputs of which lanes the next window of a branch reads.

Why its own rule: in a token mix (or behind a filter, or packing documents of varied length)
the lanes of one branch consume their inputs at different rates, and the gap between the
fastest and the slowest lane is a random walk: it grows like the square root of the steps taken.
If every window read the same inputs of every lane, a window would stay pending until the
slowest lane used it while the fastest lane made the engine fetch new ones, so the rows kept
would grow with that gap, without bound (the 10-minute soak showed the consumer's heap growing
by ~1 MB a minute, with pending windows 10 -> 34 over 170,000 steps).

So on the general path each lane has its own frontier per branch, and a window reads only the
lanes whose buffered rows (unused rows of pending windows, plus inputs in flight) are below one
window's worth (or within one window of the least supplied lane, when the runner reads ahead), or
which the engine is waiting for. Per lane, what is buffered stays bounded by
a few windows, however far the lanes drift. Which window holds which input changes speed only:
every lane still receives its inputs in order, each once, so the data emitted cannot change.

Terms (docs/glossary.md): feed, window.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from zephon.exec.windows import LaneItem, Window


class LaneFeed:
    """Per branch and lane: the next input not yet asked for, the inputs in flight, the lanes
    whose end a window has already asked past (they get no more windows), and the lanes the
    engine waits for."""

    def __init__(self, starts: Sequence[np.ndarray], limits: Sequence[np.ndarray | None],
                 first: int, size: int) -> None:
        self.limits = tuple(limits)
        self.first, self.size = max(1, min(first, size)), size
        n = len(starts[0]) if starts else 0
        self.front = [np.array(s, np.int64) for s in starts]
        self.fed = [np.zeros(n, np.int64) for _ in starts]  # windows that read each lane (ramp)
        self.inflight = [np.zeros(n, np.int64) for _ in starts]
        self.done = [np.zeros(n, bool) for _ in starts]
        self.asked = [np.zeros(n, bool) for _ in starts]
        self._counts: dict[tuple[int, int], np.ndarray] = {}

    def ask(self, branch: int, k: int) -> None:
        """The engine waits for rows of lane k: the next window of `branch` reads it."""
        self.asked[branch][k] = True

    def item(self, branch: int, w: int, buffered: np.ndarray) -> LaneItem:
        """Window w of `branch`, given each lane's unused rows in pending windows."""
        live = ~self.done[branch]
        ahead = buffered + self.inflight[branch]
        # below one window's worth; when the runner reads further ahead than that, every lane
        # within a window of the least supplied one (so windows stay broad, reads large)
        low = max(self.size, int(ahead[live].min()) + self.size) if live.any() else 0
        need = live & ((ahead < low) | self.asked[branch])
        ramp = self.first << np.minimum(self.fed[branch], 40)  # the first windows of a lane are short
        want = np.where(need, np.minimum(ramp, self.size), 0).astype(np.int64)
        lo = self.front[branch].copy()
        limit = self.limits[branch]
        got = want if limit is None else np.clip(limit - lo, 0, want)
        self.done[branch] |= got < want  # this window tells the engine the lane ended
        self.front[branch] += got
        self.fed[branch] += need
        self.inflight[branch] += got
        self.asked[branch][need] = False
        self._counts[(branch, w)] = got
        return branch, w, lo, want

    def received(self, win: Window) -> None:
        got = self._counts.pop((win.branch, win.number), None)
        if got is not None:
            self.inflight[win.branch] -= got
