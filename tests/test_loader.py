"""Loader: elastic determinism over D and mappings, resume, lane state, refusals, atomic state."""

import json
import os

import numpy as np
import pytest

from zephon import (
    Filter,
    Loader,
    Map,
    Node,
    PlanError,
    RandomMap,
    Source,
    StateError,
    load_state,
    merge_states,
    save_state,
)
from zephon.backends import numpy as npb
from zephon.fingerprints import explain_mismatch, first_mismatch, lane_digests, run_fingerprints, step_fingerprint
from zephon.sources.memory import ArraySource

N = 503  # prime: lanes never divide it evenly


@pytest.fixture
def src():
    x = np.arange(N * 4, dtype=np.int32).reshape(N, 4)
    return ArraySource({"x": x, "id": np.arange(N, dtype=np.int64), "f": np.linspace(0, 1, N, dtype=np.float32)})


def plan(mapping="contiguous", lanes=8, batch=32, seed=3):
    return Source(N).shuffle(seed).repeat().lanes(lanes, mapping).batch(batch)


def global_batches(p, src, steps, world=1, transforms=(), **kw):
    """Reassembles global batches from all ranks' local rows, placing rows by lane."""
    loaders = [Loader(p, src, transforms, rank=r, world=world, **kw) for r in range(world)]
    out = []
    for _ in range(steps):
        parts = [next(l) for l in loaders]
        rows = {}
        for b in parts:
            for i, lane in enumerate(b.lanes):
                rows[int(lane)] = {k: v[b.lane_slice(i)] for k, v in b.data.items()}
        out.append({k: np.concatenate([rows[l][k] for l in sorted(rows)]) for k in rows[0]})
    return out


@pytest.mark.parametrize("mapping", ["contiguous", "interleaved"])
def test_global_batches_identical_for_every_degree(src, mapping):
    p = plan(mapping)
    ref = global_batches(p, src, 12)
    for D in (2, 4, 8):
        got = global_batches(p, src, 12, world=D)
        for a, b in zip(ref, got):
            assert all(np.array_equal(a[k], b[k]) for k in a)
    # the reference global batch is exactly the plan's records, lane-major
    assert np.array_equal(ref[5]["id"], p.refs(5).record)


def test_contiguous_rank_rows_are_a_block_of_the_global_batch(src):
    p = plan()
    full = Loader(p, src).batch(7).data["x"]
    for D in (2, 4):
        for r in range(D):
            b = Loader(p, src, rank=r, world=D).batch(7)
            assert b.contiguous and b.row_offset == r * 32 // D
            assert np.array_equal(b.data["x"], full[r * 32 // D:(r + 1) * 32 // D])
            assert npb.global_shapes(b) == {"x": (32, 4), "id": (32,), "f": (32,)}


def test_fingerprints_independent_of_degree_and_mapping(src):
    fps = {}
    for mapping in ("contiguous", "interleaved"):
        p = plan(mapping)
        for D in (1, 2, 4, 8):
            fps[mapping, D] = run_fingerprints([Loader(p, src, rank=r, world=D) for r in range(D)], 10)
    assert len({tuple(v) for k, v in fps.items() if k[0] == "contiguous"}) == 1
    assert len({tuple(v) for k, v in fps.items() if k[0] == "interleaved"}) == 1


def test_resume_equals_uninterrupted(src, tmp_path):
    p = plan()
    full = [b.data["x"] for _, b in zip(range(20), Loader(p, src))]
    a = Loader(p, src)
    for _ in range(9):
        next(a)
    save_state(tmp_path / "s.json", a.state())
    b = Loader(p, src)
    b.restore(load_state(tmp_path / "s.json"))
    rest = [next(b).data["x"] for _ in range(11)]
    assert all(np.array_equal(x, y) for x, y in zip(full[9:], rest))


def test_finite_plan_stops_after_full_batches(src):
    p = Source(N).shuffle(1).lanes(4).batch(8)  # one epoch: 503 // 4 = 125 per lane, 2 per batch
    batches = list(Loader(p, src))
    assert len(batches) == p.num_steps == 62
    ids = np.concatenate([b.data["id"] for b in batches])
    assert len(np.unique(ids)) == len(ids) == 496


def test_random_map_is_a_function_of_the_record_not_the_rank(src):
    def jitter(r, rng):
        return {**r, "noise": rng.integers(0, 2**31, size=3)}
    p = plan()
    ref = global_batches(p, src, 5, transforms=[RandomMap(jitter)], seed=11)
    got = global_batches(p, src, 5, world=4, transforms=[RandomMap(jitter)], seed=11)
    assert all(np.array_equal(a["noise"], b["noise"]) for a, b in zip(ref, got))
    other = global_batches(p, src, 1, transforms=[RandomMap(jitter)], seed=12)
    assert not np.array_equal(ref[0]["noise"], other[0]["noise"])
    # the same record in another epoch gets fresh randomness
    p1 = Source(N).repeat().lanes(1).batch(N)
    l = Loader(p1, src, [RandomMap(jitter)], seed=11)
    e0, e1 = next(l).data["noise"], next(l).data["noise"]
    assert not np.array_equal(e0, e1)


def test_two_random_maps_draw_independently(src):
    def draw(name):
        return RandomMap(lambda r, rng: {**r, name: rng.integers(0, 2**31, size=4)})
    got = next(Loader(plan(), src, [draw("a"), draw("b")], seed=5)).data
    assert not np.array_equal(got["a"], got["b"])


def test_batched_map(src):
    p = plan()
    got = next(Loader(p, src, [Map(lambda c: {**c, "x2": c["x"] * 2}, batched=True)])).data
    assert np.array_equal(got["x2"], got["x"] * 2)


def test_filter_lanes_carry_state_and_stay_elastic(src):
    keep = Filter(lambda r: r["id"] % 3 != 0, name="id_mod3")
    p = plan()
    ref = global_batches(p, src, 12, transforms=[keep])
    for a in ref:
        assert (a["id"] % 3 != 0).all()
    for D in (2, 8):
        got = global_batches(p, src, 12, world=D, transforms=[keep])
        assert all(np.array_equal(a["id"], b["id"]) for a, b in zip(ref, got))
    # every lane's outputs are that lane's inputs, filtered, in order
    lane0 = np.concatenate([g["id"][:4] for g in ref])
    stream = p.lanes.resolve(np.arange(0, 8 * 100, 8)).record
    assert np.array_equal(lane0, stream[stream % 3 != 0][:48])


def test_filter_state_saved_at_D2_restores_at_D8(src):
    keep = Filter(lambda r: r["id"] % 5 < 2, name="id_mod5")
    p = plan()
    ref = global_batches(p, src, 14, transforms=[keep])
    ranks = [Loader(p, src, [keep], rank=r, world=2) for r in range(2)]
    for _ in range(6):
        for l in ranks:
            next(l)
    merged = json.loads(json.dumps(merge_states([l.state() for l in ranks])))
    new = [Loader(p, src, [keep], rank=r, world=8) for r in range(8)]
    for l in new:
        l.restore(merged)
    for k in range(6, 14):
        ids = np.concatenate([next(l).data["id"] for l in new])
        assert np.array_equal(ids, ref[k]["id"])
    with pytest.raises(StateError, match="lacks lanes"):
        Loader(p, src, [keep], rank=1, world=2).restore(ranks[0].state())


def test_filter_that_drops_everything_ends_a_finite_plan(src):
    p = Source(N).lanes(2).batch(4)
    assert list(Loader(p, src, [Filter(lambda r: False)])) == []


def test_state_from_another_plan_is_refused_naming_the_difference(src):
    a = Loader(plan(seed=3), src)
    next(a)
    with pytest.raises(StateError, match=r"another plan.*seed: 3 != 4"):
        Loader(plan(seed=4), src).restore(a.state())
    with pytest.raises(StateError, match="seed"):
        Loader(plan(seed=3), src, seed=9).restore(a.state())
    with pytest.raises(StateError, match="not a Zephon loader state"):
        a.restore({"step": 3})


def test_bad_loader_inputs(src):
    with pytest.raises(PlanError, match="not divisible by the data-parallel degree 3"):
        Loader(plan(), src, rank=0, world=3)
    with pytest.raises(PlanError, match="declares 600 records"):
        Loader(Source(600).lanes(2).batch(2), src)
    with pytest.raises(PlanError, match="Source id 1"):
        Loader(Node.mix([Source(N, id=0), Source(N, id=1)]).lanes(2).batch(2), src)
    with pytest.raises(PlanError, match="non-negative"):
        Loader(plan(), src).seek(-2)


def test_mix_of_sources_reads_each_with_one_call(src):
    calls = []

    class Counting(ArraySource):
        def read(self, idx):
            calls.append(len(idx))
            return super().read(idx)

    a = Counting({"x": np.zeros((50, 2), np.int32)})
    b = Counting({"x": np.ones((30, 2), np.int32)})
    p = Node.mix([Source(50, id=0).shuffle(1).repeat(), Source(30, id=1).shuffle(2).repeat()],
                 [3, 1]).lanes(4).batch(16)
    got = next(Loader(p, [a, b])).data["x"]
    assert sorted(calls) == [4, 12] and got.sum() == 4 * 2


def test_save_state_is_atomic_and_load_state_refuses_garbage(tmp_path, src):
    path = tmp_path / "state.json"
    l = Loader(plan(), src)
    next(l)
    save_state(path, l.state())
    assert [p for p in os.listdir(tmp_path) if p != "state.json"] == []
    path.write_text('{"zephon_state": 1, "ste')
    with pytest.raises(StateError, match="not valid JSON"):
        load_state(path)
    with pytest.raises(StateError, match="no loader state"):
        load_state(tmp_path / "missing.json")


def test_mismatch_report_names_step_lane_field(src):
    p = plan()
    a = Loader(p, src)
    b = Loader(p, src, [Map(lambda c: {**c, "x": np.where(np.arange(len(c["x"]))[:, None] == 9, 0, c["x"])},
                            batched=True)])
    fa = [step_fingerprint(lane_digests(next(a))) for _ in range(2)]
    fb = [step_fingerprint(lane_digests(next(b))) for _ in range(2)]
    assert first_mismatch(fa, fb) == 0
    m = explain_mismatch(0, a.batch(0), b.batch(0))
    assert (m.step, m.lane, m.field) == (0, 2, "x")  # row 9 sits in lane 2 (4 rows per lane)


@pytest.mark.parametrize("read_ahead", [1, 64, 10_000])
def test_strided_iteration_equals_random_access(src, read_ahead):
    p = Source(N).shuffle(2).lanes(4).batch(8)  # finite: 62 steps
    l = Loader(p, src, read_ahead=read_ahead)
    for start, stride in [(0, 1), (1, 3), (5, 7), (61, 2)]:
        got = list(l.strided(start, stride))
        assert [b.step for b in got] == list(range(start, p.num_steps, stride))
        assert all(np.array_equal(b.data["x"], l.batch(b.step).data["x"]) for b in got)
    assert l.step == 0 and list(l.strided(62, 2)) == []
    inf = Loader(plan(), src, read_ahead=read_ahead)
    it = inf.strided(3, 4)
    assert all(np.array_equal(next(it).data["id"], inf.batch(3 + 4 * k).data["id"]) for k in range(20))


def test_filter_pass_that_keeps_nothing_is_skipped():
    # records 0..7 fail the filter: the first pass of every lane keeps nothing
    src = ArraySource({"id": np.arange(64, dtype=np.int64)})
    keep = Filter(lambda c: c["id"] >= 8, batched=True, name="id_ge_8")
    b = next(Loader(Source(64).lanes(2).batch(4), src, [keep]))
    assert b.data["id"].tolist() == [8, 10, 9, 11]


# --- LocalBatch.micro_batches: the core numpy batch cuts its rows like every emitter -----------

def test_local_batch_micro_batches_concatenate_to_the_batch(src):
    """Micro-batches are equal consecutive blocks of the rows (views), refs cut with them, and the
    rows they explain are the batch's rows in order."""
    p = plan()
    b = Loader(p, src, rank=1, world=2).batch(3)  # lanes 4..7, 16 rows
    for n in (1, 2, 4, 8, 16):
        micro = b.micro_batches(n)
        assert len(micro) == n and all(m.rows == 16 // n and m.micro == (i, n) for i, m in enumerate(micro))
        for k in b.data:
            assert np.array_equal(np.concatenate([m.data[k] for m in micro]), b.data[k])
        assert np.shares_memory(micro[-1].data["x"], b.data["x"])
        assert [r for m in micro for r in m.explain()] == b.explain()
        assert np.array_equal(np.concatenate([m.refs.record for m in micro]), b.refs.record)
        assert all(m.global_shape("x") == (32 // n, 4) for m in micro)
        # lane_slice of a micro-batch: the part of each owned lane it holds, which together is the lane
        for i in range(len(b.lanes)):
            got = np.concatenate([m.data["id"][m.lane_slice(i)] for m in micro])
            assert np.array_equal(got, b.data["id"][b.lane_slice(i)])
    # micro-batches of a micro-batch are micro-batches of the batch
    assert [m.micro for m in b.micro_batches(2)[1].micro_batches(2)] == [(2, 4), (3, 4)]
    assert np.array_equal(b.micro_batches(2)[1].micro_batches(2)[0].data["id"], b.micro_batches(4)[2].data["id"])


def test_local_batch_micro_batches_split_packed_segments():
    from zephon.ops.pack import Pack

    docs = ArraySource({"tokens": np.array([np.arange(1 + i % 7, dtype=np.int32) for i in range(64)], dtype=object)})
    b = next(Loader(Source(64).shuffle(1).repeat().lanes(4).batch(8), docs, [Pack(8, "concat")]))
    micro = b.micro_batches(4)
    assert [s for m in micro for s in m.segments] == b.segments
    assert [r for m in micro for r in m.explain()] == b.explain()
    assert np.array_equal(np.concatenate([m.data["tokens"] for m in micro]), b.data["tokens"])


def test_local_batch_micro_count_that_does_not_divide_is_refused_like_the_backends(src):
    from zephon.exec.loader import check_micro_count

    b = Loader(plan(), src).batch(0)
    with pytest.raises(PlanError,
                       match=r"micro_batches\(3\) cannot split the 32 rows .* use n in \[1, 2, 4, 8, 16, 32\]"):
        b.micro_batches(3)
    for bad in (0, -2, 1.5, True, "2"):
        with pytest.raises(PlanError, match="positive integer"):
            b.micro_batches(bad)
    # the same message as the numpy emitter's
    with pytest.raises(PlanError) as core:
        check_micro_count(3, 32)
    with pytest.raises(PlanError) as emitted:
        npb.emit(b).micro_batches(3)
    assert str(core.value) == str(emitted.value)


# --- hand-edited states: lanes the plan does not have --------------------------------------------

@pytest.mark.parametrize("key", ["99", "8", "-1", "x", "1.0"])
def test_a_state_naming_a_lane_the_plan_does_not_have_is_refused(src, key):
    l = Loader(plan(), src)
    next(l)
    state = json.loads(json.dumps(l.state()))
    state["lanes"][key] = dict(state["lanes"]["0"])
    with pytest.raises(StateError, match=r"'lanes' names lane\(s\) .* it has 8 lanes, 0\.\.7"):
        Loader(plan(), src).restore(state)
    with pytest.raises(StateError, match="it has 8 lanes"):
        Loader(plan(), src, rank=1, world=2).seek_position(state)


def test_a_state_whose_lanes_is_not_an_object_is_refused(src):
    l = Loader(plan(), src)
    next(l)
    state = l.state()
    state["lanes"] = [state["lanes"][str(i)] for i in range(8)]
    with pytest.raises(StateError, match="'lanes' is list"):
        Loader(plan(), src).restore(state)
