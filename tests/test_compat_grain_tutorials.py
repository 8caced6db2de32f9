"""Grain's own tutorials as the compatibility bar (issue 27): `python -m tests.grain_tutorials`.

Every offline-runnable cell of Grain's docs (tests/grain_tutorial_cells.py) runs with real Grain
and, ported the README's way, with Zephon; what each prints must be identical."""

from __future__ import annotations

import warnings

from grain_tutorials import CELLS, STATUSES, run_all, tally


def test_grain_tutorial_cells_give_grains_output() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        results = run_all()
    total = {s: sum(c[s] for c in tally(results).values()) for s in STATUSES}
    runnable = sum(total[s] for s in STATUSES[:4])
    assert len(results) == sum(len(c) for c in CELLS.values())
    assert runnable >= 54, total                       # the cells the bar counts
    assert total["broken"] == 0, [(r.page, r.cell, repr(r.zephon.error)) for r in results
                                  if r.status == "broken"]
    assert total["identical"] >= runnable - 4, [(r.page, r.cell, r.status) for r in results
                                                if r.status not in ("identical", "grain fails")]
