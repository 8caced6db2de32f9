"""The lane engine: count-changing pipelines stay elastic, parallel and resumable.

Pipelines here filter, expand (flat map), draw random numbers and accumulate (a custom
operator with a carry); their fingerprints must not depend on the data-parallel degree, the
runner, the worker count, the read-ahead window or where a run was stopped and resumed.
"""

import time

import numpy as np
import pytest

from zephon import (
    Accumulator,
    AccumulatorStep,
    Filter,
    FlatMap,
    Loader,
    Map,
    PlanError,
    RandomMap,
    Source,
    StateError,
    merge_states,
)
from zephon.fingerprints import run_fingerprints
from zephon.runners import processes, threads
from zephon.sources.memory import ArraySource

N = 701


def make_source():
    return ArraySource({"id": np.arange(N, dtype=np.int64),
                        "x": (np.arange(N * 3, dtype=np.int32) % 97).reshape(N, 3)})


# Module-level functions: picklable for processes(), with stable names for checkpoints.
def keep_most(cols):
    return (cols["id"] * 7919) % 5 != 0


def jitter(r, rng):
    return {**r, "noise": np.float32(rng.normal())}


def split_some(r):
    k = int(r["id"]) % 3  # 0, 1 or 2 outputs per record
    return [{"id": r["id"], "x": r["x"] + j, "noise": r["noise"]} for j in range(k)]


class SumPairs(Accumulator):
    """Emits the sum of every two consecutive rows of a lane: the carry holds an odd one out."""

    def step(self, carry, held, new, demand):
        h = len(held["id"]) if held else 0
        ids = np.concatenate([held["id"], new["id"]]) if h else new["id"]
        n = min(len(ids) // 2, demand)
        out = {"pair": ids[0:2 * n:2] + ids[1:2 * n:2]}
        if n == demand:  # done: whatever follows stays unconsumed
            return AccumulatorStep(out, consumed=2 * n - h)
        hold = [2 * n] if len(ids) > 2 * n else []  # an odd one out waits for its partner
        return AccumulatorStep(out, consumed=len(new["id"]), hold=hold)


def pipeline(kind):
    base = [Filter(keep_most, batched=True), RandomMap(jitter)]
    if kind == "filter":
        return base
    if kind == "flat":
        return base + [FlatMap(split_some)]
    if kind == "acc":
        return base + [FlatMap(split_some), SumPairs()]
    raise ValueError(kind)


def plan(lanes=8, batch=16):
    return Source(N).shuffle(5).repeat().lanes(lanes).batch(batch)


def fps(kind, world=1, runner=None, steps=12, read_ahead=None, **kw):
    loaders = [Loader(plan(), make_source(), pipeline(kind), seed=3, rank=r, world=world,
                      runner=runner, read_ahead=read_ahead, **kw) for r in range(world)]
    try:
        return run_fingerprints(loaders, steps)
    finally:
        for l in loaders:
            l.close()


@pytest.mark.parametrize("kind", ["filter", "flat", "acc"])
def test_fingerprints_identical_over_degree_and_window(kind):
    ref = fps(kind)
    for D in (2, 4, 8):
        assert fps(kind, world=D) == ref, f"D={D}"
    assert fps(kind, read_ahead=40) == ref  # tiny windows: many window boundaries inside steps


@pytest.mark.parametrize("kind", ["filter", "acc"])
def test_fingerprints_identical_over_runners(kind):
    ref = fps(kind, steps=10)
    assert fps(kind, runner=threads(2), steps=10) == ref
    assert fps(kind, runner=processes(2), steps=10) == ref
    assert fps(kind, world=2, runner=threads(2), steps=10) == ref


def test_filter_output_is_the_lane_stream_filtered():
    """Lane l's rows are lane l's inputs that pass the filter, in order (no reordering)."""
    p = plan()
    l = Loader(p, make_source(), [Filter(keep_most, batched=True)])
    rows = [next(l) for _ in range(6)]
    lane3 = np.concatenate([b.data["id"][b.lane_slice(3)] for b in rows])
    inputs = p.lanes.resolve_lanes(np.full(100, 3), np.arange(100)).record
    expected = inputs[(inputs * 7919) % 5 != 0][:len(lane3)]
    assert np.array_equal(lane3, expected)
    assert rows[0].refs is not None and np.array_equal(rows[0].refs.record, rows[0].data["id"])


@pytest.mark.parametrize("kind", ["filter", "flat", "acc"])
@pytest.mark.parametrize("stop", [1, 5, 9])
def test_resume_at_any_step_and_across_degree(kind, stop):
    ref = fps(kind, steps=12)
    # stop at D=2 after `stop` steps, merge, resume at D=4 and D=1
    loaders = [Loader(plan(), make_source(), pipeline(kind), seed=3, rank=r, world=2) for r in range(2)]
    head = run_fingerprints(loaders, stop)
    state = merge_states([l.state() for l in loaders])
    for D in (4, 1):
        resumed = [Loader(plan(), make_source(), pipeline(kind), seed=3, rank=r, world=D) for r in range(D)]
        for l in resumed:
            l.restore(state)
        assert head + run_fingerprints(resumed, 12 - stop) == ref


def test_flat_map_resumes_inside_one_records_outputs():
    l = Loader(plan(lanes=1, batch=3), make_source(), [FlatMap(split_some_plain)])
    seen = [next(l) for _ in range(4)]
    state = l.state()
    assert state["lanes"]["0"]["skip"][0] >= 0
    r = Loader(plan(lanes=1, batch=3), make_source(), [FlatMap(split_some_plain)])
    r.restore(state)
    again = Loader(plan(lanes=1, batch=3), make_source(), [FlatMap(split_some_plain)])
    full = [next(again) for _ in range(8)]
    assert [b.data["x"].tolist() for b in seen] + [next(r).data["x"].tolist() for _ in range(4)] == \
        [b.data["x"].tolist() for b in full]


def split_some_plain(r):
    return [{"x": np.int64(r["id"]) * 10 + j} for j in range(int(r["id"]) % 4)]


def test_changed_operator_config_or_version_is_refused():
    l = Loader(plan(), make_source(), [Filter(keep_most, batched=True, params={"mod": 5})])
    next(l)
    state = l.state()
    other = Loader(plan(), make_source(), [Filter(keep_most, batched=True, params={"mod": 7})])
    with pytest.raises(StateError, match=r"operator 0 \(Filter\(keep_most\)\): config mod 5 != 7"):
        other.restore(state)
    newer = Loader(plan(), make_source(), [Filter(keep_most, batched=True, params={"mod": 5}, version=2)])
    with pytest.raises(StateError, match="version 1 != 2"):
        newer.restore(state)
    renamed = Loader(plan(), make_source(), [Filter(jitter_free, batched=True, params={"mod": 5})])
    with pytest.raises(StateError, match="name 'Filter\\(keep_most\\)' != 'Filter\\(jitter_free\\)'"):
        renamed.restore(state)


def jitter_free(cols):
    return cols["id"] >= 0


def test_lambda_works_but_its_state_is_refused_with_how_to_name_it():
    l = Loader(plan(), make_source(), [Filter(lambda c: c["id"] % 2 == 0, batched=True)])
    assert len(next(l).data["id"]) == 16  # quick experiments stay quick
    with pytest.raises(StateError, match=r"no stable identity.*name='my_op', version=1"):
        l.state()
    named = Loader(plan(), make_source(), [Filter(lambda c: c["id"] % 2 == 0, batched=True, name="even")])
    next(named)
    assert named.state()["pipeline"][0]["name"] == "even"


def test_random_access_refused_with_a_reason_and_allowed_for_one_to_one():
    l = Loader(plan(), make_source(), [Filter(keep_most, batched=True)])
    with pytest.raises(PlanError, match="random access.*Filter\\(keep_most\\)"):
        l.batch(3)
    with pytest.raises(PlanError, match="random access"):
        list(l.strided(0, 2))
    with pytest.raises(StateError, match="restore a state"):
        Loader(plan(), make_source(), [Filter(keep_most, batched=True)], start_step=4)
    one = Loader(plan(), make_source(), [Map(noop, batched=True)])
    assert one.random_access and one.batch(3).step == 3


def noop(cols):
    return cols


def test_a_custom_operator_returning_wrong_counts_gets_a_clear_error():
    bad = Map(drop_one, batched=True)
    with pytest.raises(PlanError, match="must say which input each output came from"):
        next(Loader(plan(), make_source(), [bad]))


def drop_one(cols):
    return {k: v[1:] for k, v in cols.items()}


def test_resume_cost_does_not_grow_with_the_step():
    """Restoring a state at step 10^5 costs what restoring at step 10 costs: O(lanes × carry)."""
    p = Source(10**9).shuffle(1).repeat().lanes(8).batch(16)
    src = ArraySource({"id": np.arange(10**9 // 10**9 * 1000, dtype=np.int64)})

    def cost(step):
        l = Loader(Source(1000).shuffle(1).repeat().lanes(8).batch(16), src,
                   [Filter(keep_most, batched=True), SumPairs()])
        next(l)
        state = l.state()
        state["step"] = step
        for v in state["lanes"].values():  # a lane far into the stream: position step * 2.5 rows
            v["cursor"] = [step * 5 // 2 + v["cursor"][0]]
            v["held"] = []
        best = []
        for _ in range(3):
            r = Loader(Source(1000).shuffle(1).repeat().lanes(8).batch(16), src,
                       [Filter(keep_most, batched=True), SumPairs()])
            t0 = time.perf_counter()
            r.restore(state)
            next(r)
            best.append(time.perf_counter() - t0)
        return min(best)

    assert p.lanes.count == 8
    small, big = cost(10), cost(10**5)
    assert big < max(5 * small, 0.05), (small, big)


def test_hand_edited_lane_states_are_refused_naming_the_field():
    l = Loader(plan(), make_source(), [Filter(keep_most, batched=True)])
    next(l)
    good = l.state()
    for bad, msg in [({"cursor": [-1]}, "invalid 'cursor'"), ({"cursor": ["x"]}, "invalid 'cursor'"),
                     ("nonsense", "expected an object"), ({"cursor": [0], "held": [[5, 0, 0]]}, "held")]:
        s = {**good, "lanes": {**good["lanes"], "0": bad}}
        with pytest.raises(StateError, match=msg):
            Loader(plan(), make_source(), [Filter(keep_most, batched=True)]).restore(s)


def test_a_lane_whose_filter_never_passes_raises_instead_of_hanging():
    src = ArraySource({"x": np.arange(10)})
    l = Loader(Source(10).repeat().lanes(2).batch(4), src, [Filter(even_x, batched=True)])
    with pytest.raises(PlanError, match="lane 1 read .* inputs .* without one record passing Filter"):
        next(l)


def even_x(cols):
    return cols["x"] % 2 == 0


def test_user_mistakes_get_errors_that_name_them():
    src = make_source()
    for kw, msg in [({"rank": "a"}, r"Loader\(rank=...\) must be a non-negative integer"),
                    ({"seed": None}, r"Loader\(seed=...\)"), ({"read_ahead": "x"}, "read_ahead"),
                    ({"per_source": {"a": []}}, "per_source is keyed by Source id")]:
        with pytest.raises(PlanError, match=msg):
            Loader(plan(), src, **kw)
    with pytest.raises(PlanError, match="sources are keyed by Source id"):
        Loader(plan(), {"x": src})
    with pytest.raises(PlanError, match="returned ndarray; a batched operator returns a dict"):
        next(Loader(plan(), src, [Map(as_array, batched=True)]))
    with pytest.raises(PlanError, match="must return a list of records, got int"):
        next(Loader(plan(), src, [FlatMap(not_a_list)]))
    from zephon import Node
    with pytest.raises(PlanError, match="unknown field"):
        Node.from_json({"type": "Source", "size": 3, "bogus": 1})
    with pytest.raises(PlanError, match="not valid"):
        Node.from_json("{nope")


def as_array(cols):
    return cols["id"]


def not_a_list(r):
    return 3
