"""Batch-size schedules in the plan: sizes per step, prefix sums, random access, JSON, tokens."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zephon import Node, PlanError, Source
from zephon.plan.batchsizes import BatchSizes, steps_from_tokens

RAMP = ((0, 8), (3, 16), (5, 32))


def test_schedule_sizes_offsets_and_length():
    p = Source(10_000).lanes(4).batch(schedule=RAMP)
    assert [p.size_at(k) for k in range(7)] == [8, 8, 8, 16, 16, 32, 32]
    assert [p.lane_offset(k) for k in range(7)] == [0, 2, 4, 6, 10, 14, 22]
    # 2,500 inputs a lane: 14 before step 5, then 8 a step -> 5 + 310 steps
    assert p.length == 315 and p.num_steps == 315
    assert p.tokens_before(5, seq_len=128) == 14 * 4 * 128


@settings(max_examples=40, deadline=None)
@given(lanes=st.sampled_from([1, 2, 4, 8]), n=st.integers(64, 3000),
       changes=st.lists(st.tuples(st.integers(1, 40), st.integers(1, 6)), max_size=4))
def test_rows_cover_every_position_once_in_order(lanes, n, changes):
    """Random access to every step equals the lanes read in order: each position exactly once."""
    steps = sorted({s for s, _ in changes})
    sched = [(0, lanes)] + [(s, lanes * m) for s, (_, m) in zip(steps, changes)]
    p = Source(n).lanes(lanes).batch(schedule=sched)
    got = [p.lanes.stream_positions(*p.rows(k)) for k in range(p.length)]
    pos = np.concatenate(got) if got else np.zeros(0, np.int64)
    per_lane = n // lanes
    assert len(pos) == len(np.unique(pos))
    assert [len(g) for g in got] == [p.size_at(k) for k in range(p.length)]
    # what is left over is less than the next step
    used = len(pos) // lanes
    assert used <= per_lane < used + p.per_lane_at(p.length)
    # lane-major rows, each lane's outputs consecutive from where the previous step stopped
    for k in range(min(p.length, 50)):
        lane, index = p.rows(k)
        b = p.per_lane_at(k)
        assert np.array_equal(lane, np.repeat(np.arange(lanes), b))
        assert np.array_equal(index, p.lane_offset(k) + np.tile(np.arange(b), lanes))


def test_vectorised_rows_of_many_steps_equal_one_by_one():
    p = Source(5000).shuffle(3).lanes(8).batch(schedule=((0, 8), (2, 24), (7, 64)))
    owned = np.array([2, 3], np.int64)
    steps = np.arange(0, 12)
    lane, index, rows = p.sizes.rows(steps, owned)
    assert rows.tolist() == [2 * p.per_lane_at(int(k)) for k in steps]
    one = [p.rows(int(k), owned) for k in steps]
    assert np.array_equal(lane, np.concatenate([o[0] for o in one]))
    assert np.array_equal(index, np.concatenate([o[1] for o in one]))


def test_json_round_trip_and_fingerprints():
    lanes = Source(1000).shuffle(1).lanes(4)
    p = lanes.batch(schedule=RAMP)
    q = Node.from_json(p.canonical_json())
    assert q == p and q.fingerprint() == p.fingerprint()
    assert p.to_json()["schedule"] == [[3, 16], [5, 32]] and p.size == 8
    # a plan with one size writes no schedule: its fingerprint is the one it always had
    assert "schedule" not in lanes.batch(8).to_json()
    assert lanes.batch(8).fingerprint() != p.fingerprint()
    assert lanes.batch(schedule=((0, 8),)) == lanes.batch(8)
    assert p.fingerprint() != lanes.batch(schedule=((0, 8), (3, 16), (6, 32))).fingerprint()


def test_explain_follows_the_schedule():
    p = Source(1000).lanes(4).batch(schedule=RAMP)
    rows = p.explain(5)
    assert len(rows) == 32 and rows[8]["lane"] == 1
    assert rows[8]["record"] == (p.lane_offset(5) * 4 + 1)  # lane 1's first output of step 5


def test_tokens_schedule_is_converted_to_steps():
    # 4-token rows: 8 rows = 32 tokens a step; 100 tokens are seen before step 4 (128)
    assert steps_from_tokens(((0, 8), (100, 16), (1000, 32)), 4) == [(0, 8), (4, 16), (18, 32)]
    # a threshold already met at a stretch's first step replaces that size; equal sizes merge
    assert steps_from_tokens(((0, 8), (32, 16), (33, 16), (64, 16)), 4) == [(0, 8), (1, 16)]
    p = Source(10_000).lanes(4).batch(schedule=((0, 8), (100, 16), (1000, 32)), by="tokens", seq_len=4)
    assert p == Source(10_000).lanes(4).batch(schedule=((0, 8), (4, 16), (18, 32)))
    for k in (4, 18):  # each size starts at the first step with the threshold reached
        assert p.tokens_before(k, 4) >= {4: 100, 18: 1000}[k] > p.tokens_before(k - 1, 4)


@pytest.mark.parametrize("kwargs, match", [
    ({"schedule": ((0, 8), (3, 10))}, "batch size 10 .from step 3. is not divisible by lanes=4"),
    ({"schedule": ((1, 8),)}, "starts at step 0"),
    ({"schedule": ((0, 8), (5, 16), (5, 32))}, "steps must increase"),
    ({"schedule": ((0, 8), (5,))}, r"\(step, size\) pair"),
    ({"schedule": 8}, "list of"),
    ({"schedule": ((0, 8),), "by": "tokens"}, "needs seq_len"),
    ({"schedule": ((0, 8),), "by": "epochs"}, "'steps' or 'tokens'"),
    ({"size": 16, "schedule": ((0, 8),)}, "disagrees"),
    ({}, "needs a size"),
    ({"schedule": ((0, 8), (10, 16), (5, 32)), "by": "tokens", "seq_len": 4}, "token counts must increase"),
])
def test_bad_schedules_are_refused(kwargs, match):
    with pytest.raises(PlanError, match=match):
        Source(100).lanes(4).batch(**kwargs)


def test_per_lane_of_a_schedule_names_the_step_api():
    p = Source(100).lanes(4).batch(schedule=RAMP)
    with pytest.raises(PlanError, match="per_lane_at"):
        _ = p.per_lane
    assert Source(100).lanes(4).batch(8).per_lane == 2


def test_offsets_are_prefix_sums_without_a_loop_over_steps():
    s = BatchSizes(8, 8, ((1_000, 64), (10**9, 1024)))
    k = np.array([0, 999, 1_000, 10**9, 10**9 + 5])
    assert s.offset(k).tolist() == [0, 999, 999 + 1, 1000 - 1 + 1 + (10**9 - 1000) * 8,
                                    999 + 1 + (10**9 - 1000) * 8 + 5 * 128]
    assert s.steps_within(int(s.offset(10**9 + 5))) == 10**9 + 5
