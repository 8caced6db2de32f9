"""Grain's iterator API on Zephon: get_state/set_state, another data-parallel degree, Orbax.

Every equality is checked against Grain itself, never against numbers written down by hand."""

from __future__ import annotations

import importlib.util
import json

import grain
import numpy as np
import pytest
from _grain import Jitter, quiet_remainder_warning, same  # noqa: F401 - an autouse fixture

import zephon.compat.grain as zg


def not_mod3(x):
    return x % 3 != 0


def as_record(x):
    return {"x": x}


def plus_one(x):
    return x + 1


def test_get_state_set_state_round_trip_batched_and_unbatched() -> None:
    src = grain.sources.RangeDataSource(0, 97, 1)
    z = zg.Dataset.source(src).shuffle(seed=5).repeat().filter(not_mod3)  # state needs named functions
    z = z.map(as_record).batch(4)
    it = iter(z)
    for _ in range(5):
        next(it)
    state = json.loads(json.dumps(it.get_state()))
    want = [next(it) for _ in range(6)]
    again = iter(z)
    again.set_state(state)
    for a, b in zip(want, [next(again) for _ in range(6)]):
        same(a, b)

    zu = zg.Dataset.source(src).shuffle(seed=5).repeat().lanes(4)
    gu = grain.MapDataset.source(src).shuffle(seed=5).repeat()
    it = iter(zu)
    head = [next(it) for _ in range(7)]  # mid-step: lanes=4 means 4 elements per step
    state = json.loads(json.dumps(it.get_state()))
    tail = [next(it) for _ in range(9)]
    resumed = iter(zu)
    resumed.set_state(state)
    assert [next(resumed) for _ in range(9)] == tail and head + tail == [gu[i] for i in range(16)]


def test_state_saved_at_one_degree_resumes_at_another() -> None:
    src = grain.sources.RangeDataSource(0, 200, 1)
    z = zg.Dataset.source(src).shuffle(seed=5).repeat().map(plus_one).lanes(4).batch(8)
    it = iter(z)
    for _ in range(3):
        next(it)
    state = it.get_state()
    whole = [next(it) for _ in range(2)]
    halves = []
    for r in range(2):
        part = iter(z.shard(r, 2))
        part.set_state(state)
        halves.append([next(part) for _ in range(2)])
    for k in range(2):
        assert np.array_equal(np.concatenate([halves[0][k], halves[1][k]]), whole[k])


@pytest.mark.skipif(importlib.util.find_spec("orbax") is None,
                    reason="orbax-checkpoint is not installed (pip install zephon-loader[orbax])")
def test_orbax_checkpoint_through_grains_handler(tmp_path) -> None:
    import orbax.checkpoint as ocp

    src = grain.sources.RangeDataSource(0, 50, 1)
    z = zg.Dataset.source(src).seed(1).shuffle().repeat().random_map(Jitter()).batch(4)
    it = iter(z)
    for _ in range(3):
        next(it)
    with ocp.CheckpointManager(tmp_path / "ckpt", item_names=("data",)) as mngr:
        mngr.save(3, args=ocp.args.Composite(data=grain.checkpoint.CheckpointSave(it)))
        mngr.wait_until_finished()
        want = [next(it) for _ in range(4)]
        fresh = iter(z)
        mngr.restore(3, args=ocp.args.Composite(data=grain.checkpoint.CheckpointRestore(fresh)))
    for a, b in zip(want, [next(fresh) for _ in range(4)]):
        same(a, b)
    saved = json.loads((tmp_path / "ckpt" / "3" / "data" / "process_0-of-1.json").read_text())
    assert saved["step"] == 3 and saved["plan_fingerprint"] == z.plan.fingerprint()  # the one state document
