"""Byte ranges -> as few requests as help, and back.

Ranges closer than `gap` bytes are fetched by one request (a small gap costs less than a round
trip), but never across a large gap (that would fetch bytes nobody asked for) and never into a
request longer than `max_request` (a few large requests in flight beat one huge one).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def plan_requests(ranges: Sequence[tuple[int, int]], gap: int,
                  max_request: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(requests as [start, end), and for each range its (request index, offset in request))."""
    if not ranges:
        return [], []
    starts = np.fromiter((r[0] for r in ranges), dtype=np.int64, count=len(ranges))
    lengths = np.fromiter((r[1] for r in ranges), dtype=np.int64, count=len(ranges))
    order = np.argsort(starts, kind="stable")
    requests: list[tuple[int, int]] = []
    where: list[tuple[int, int]] = [(0, 0)] * len(ranges)
    cur_start = cur_end = -1
    for i in order.tolist():
        s, e = int(starts[i]), int(starts[i] + lengths[i])
        if requests and s - cur_end <= gap and max(e, cur_end) - cur_start <= max_request:
            cur_end = max(cur_end, e)
            requests[-1] = (cur_start, cur_end)
        else:
            cur_start, cur_end = s, e
            requests.append((s, e))
        where[i] = (len(requests) - 1, s - cur_start)
    return requests, where
