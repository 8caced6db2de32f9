"""Byte ranges -> as few requests as help, and back.

A request costs a round trip (tens of ms on a cloud store) and a slot of the store's request
rate; a gap fetched with its neighbours costs only its bytes. So neighbouring ranges are merged
across gaps, smallest gaps first, while the bytes of the merged gaps stay within `overfetch` x the
bytes asked for (fetched <= (1 + overfetch) x asked, whatever the spacing of the ranges); never
across a gap longer than `gap` bytes and never into a request longer than `max_request` (a few
large requests in flight beat one huge one).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def plan_requests(ranges: Sequence[tuple[int, int]], gap: int, max_request: int,
                  overfetch: float = 0.0) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(requests as [start, end), and for each range its (request index, offset in request)).

    Overlapping and touching ranges always share a request; gaps up to `gap` bytes are merged,
    smallest first, while their total stays within `overfetch` x the bytes of the ranges.
    """
    if not ranges:
        return [], []
    arr = np.asarray(ranges, dtype=np.int64).reshape(-1, 2)
    order = np.argsort(arr[:, 0], kind="stable")
    starts, ends = arr[order, 0], arr[order, 0] + arr[order, 1]
    reach = np.maximum.accumulate(ends)  # the end of everything before, for overlapping ranges
    gaps = starts[1:] - reach[:-1]  # <= 0: overlapping or touching
    merge = gaps <= 0
    free = np.flatnonzero(~merge & (gaps <= gap))
    if len(free) and overfetch > 0:
        budget = overfetch * float(arr[:, 1].sum())
        by_size = free[np.argsort(gaps[free], kind="stable")]
        take = np.cumsum(gaps[by_size]) <= budget
        merge[by_size[take]] = True
    requests: list[tuple[int, int]] = []
    where: list[tuple[int, int]] = [(0, 0)] * len(order)
    cur_start = cur_end = -1
    for k, (i, s, e) in enumerate(zip(order.tolist(), starts.tolist(), ends.tolist())):
        if k and merge[k - 1] and max(e, cur_end) - cur_start <= max_request:
            cur_end = max(cur_end, e)
            requests[-1] = (cur_start, cur_end)
        else:
            cur_start, cur_end = s, e
            requests.append((s, e))
        where[i] = (len(requests) - 1, s - cur_start)
    return requests, where
