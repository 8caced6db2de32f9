"""The index algebra: bijections, coverage, random access, JSON, explain, and clear errors."""

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zephon import Batching, Lanes, Mix, Node, PlanError, Repeat, Shuffle, Slice, Source
from zephon.plan.permute import permute

SIZES = [1, 2, 3, 5, 7, 8, 13, 31, 127, 255, 256, 257, 1023, 1024, 1025, 4099, 65537]


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("seed", [0, 1, 12345, 2**63 - 1])
def test_permute_is_bijection(n, seed):
    p = permute(np.arange(n), n, seed)
    assert np.array_equal(np.sort(p), np.arange(n))


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 5000), seed=st.integers(0, 2**64 - 1), epoch=st.integers(0, 10**6))
def test_permute_bijection_property(n, seed, epoch):
    p = permute(np.arange(n), n, seed, epoch)
    assert np.array_equal(np.sort(p), np.arange(n))


def test_permute_rekeys_per_epoch_and_seed():
    n = 1000
    a, b, c = (permute(np.arange(n), n, 1, 0), permute(np.arange(n), n, 1, 1), permute(np.arange(n), n, 2, 0))
    assert not np.array_equal(a, b) and not np.array_equal(a, c)
    # and it actually moves things around
    assert np.mean(a == np.arange(n)) < 0.05


def test_permute_is_platform_independent_golden():
    # Pure 64-bit integer math: these values must never change (checkpoints depend on them).
    assert permute(np.arange(10), 10, 2024).tolist() == [6, 5, 2, 0, 8, 3, 1, 7, 9, 4]
    assert permute(np.array([0, 1, 2]), 10**12, 7, 3).tolist() == [75665777750, 645760494490, 279166580208]


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 300), seed=st.integers(0, 2**32), epochs=st.integers(1, 4))
def test_every_record_once_per_epoch(n, seed, epochs):
    node = Source(n).shuffle(seed).repeat(epochs)
    r = node.resolve(np.arange(n * epochs))
    for e in range(epochs):
        sl = slice(e * n, (e + 1) * n)
        assert np.array_equal(np.sort(r.record[sl]), np.arange(n))
        assert (r.epoch[sl] == e).all()


def test_shuffle_order_commutes_with_repeat():
    a = Source(97).shuffle(5).repeat(3).resolve(np.arange(291))
    b = Source(97).repeat(3).shuffle(5).resolve(np.arange(291))
    assert np.array_equal(a.record, b.record) and np.array_equal(a.epoch, b.epoch)
    # different epochs get different orders
    assert not np.array_equal(a.record[:97], a.record[97:194])


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 200), seed=st.integers(0, 1000), lanes=st.sampled_from([1, 2, 4, 8]),
       per=st.integers(1, 4), data=st.data())
def test_random_access_equals_sequential(n, seed, lanes, per, data):
    plan = Source(n).shuffle(seed).repeat().lanes(lanes).batch(lanes * per)
    steps = 6
    seq = [plan.refs(k) for k in range(steps)]
    k = data.draw(st.integers(0, steps - 1))
    assert np.array_equal(plan.refs(k).record, seq[k].record)
    # the stream read lane-major equals the flat stream dealt to lanes
    flat = plan.lanes.resolve(np.arange(steps * lanes * per))
    for k in range(steps):
        lane, idx = plan.rows(k)
        assert np.array_equal(seq[k].record, flat.record[idx * lanes + lane])


def test_huge_plan_is_as_cheap_as_small():
    big = Source(10**12).shuffle(1).repeat().lanes(64).batch(1024)
    small = Source(10**3).shuffle(1).repeat().lanes(64).batch(1024)
    rb, rs = big.refs(10**6), small.refs(10**6)
    assert rb.record.max() < 10**12 and len(np.unique(rb.record)) == 1024
    assert len(rs.record) == 1024


def test_mix_counts_and_random_access():
    a, b = Source(1000, id=0).repeat(), Source(500, id=1).repeat()
    m = Mix((a, b), (0.75, 0.25))
    r = m.resolve(np.arange(4000))
    assert (r.source == 0).sum() == 3000 and (r.source == 1).sum() == 1000
    # spread evenly: every window of four positions holds the exact proportions
    assert all((r.source[i:i + 4] == 1).sum() == 1 for i in range(0, 4000, 4))
    pos = np.array([3999, 7, 0, 1234])
    assert np.array_equal(m.resolve(pos).record, r.record[pos])
    # each child's records are visited in its own order, consecutively
    assert np.array_equal(r.record[r.source == 1][:500], np.arange(500))


def test_mix_of_finite_children_stops_at_first_exhausted():
    m = Node.mix([Source(10, id=0), Source(5, id=1)], [1, 1])
    assert m.length == 11  # child 1 is used up after position 9; child 0's turn at 10 still fits
    r = m.resolve(np.arange(m.length))
    assert sorted(r.record[r.source == 1]) == list(range(5))
    assert r.record[r.source == 0].tolist() == list(range(6))
    with pytest.raises(PlanError, match="past the end"):
        m.resolve([m.length])


def test_slice_take_skip():
    s = Source(100)
    assert s.take(10).length == 10 and s.skip(90).length == 10
    assert Slice(s, 10, 50, 4).resolve(np.arange(10)).record.tolist() == list(range(10, 50, 4))
    assert s.repeat().skip(5).take(200).resolve([199]).record.tolist() == [(199 + 5) % 100]


def test_json_round_trip_and_fingerprint():
    plan = (Node.mix([Source(100, id=0, name="web").shuffle(3).repeat(), Source(50, id=1).repeat()], [2, 1])
            .take(10**6).lanes(8, "interleaved").batch(64))
    text = plan.canonical_json()
    back = Node.from_json(json.loads(text))
    assert back == plan and back.canonical_json() == text and back.fingerprint() == plan.fingerprint()
    assert np.array_equal(back.refs(17).record, plan.refs(17).record)
    other = Source(100, id=0, name="web").shuffle(4).repeat().lanes(8).batch(64)
    assert other.fingerprint() != plan.fingerprint()


def test_explain_rows():
    plan = Source(20).shuffle(1).repeat().lanes(4).batch(8)
    rows = plan.explain(3)
    assert [r["lane"] for r in rows] == [0, 0, 1, 1, 2, 2, 3, 3]
    refs = plan.refs(3)
    assert [r["record"] for r in rows] == refs.record.tolist()
    assert "lane" in plan.explain_text(0)


def test_owned_rows_cover_global_batch_for_both_mappings():
    for mapping in ("contiguous", "interleaved"):
        plan = Source(1000).shuffle(9).repeat().lanes(8, mapping).batch(32)
        full = plan.refs(5).record
        for D in (1, 2, 4, 8):
            owned = [plan.lanes.owned(r, D) for r in range(D)]
            assert sorted(np.concatenate(owned).tolist()) == list(range(8))
            rows = {}
            for lanes in owned:
                lane, _ = plan.rows(5, lanes)
                for l, rec in zip(lane, plan.refs(5, lanes).record):
                    rows.setdefault(int(l), []).append(int(rec))
            assert np.array_equal(np.concatenate([rows[l] for l in range(8)]), full)
            if mapping == "contiguous":
                assert all(np.array_equal(o, np.arange(r * 8 // D, (r + 1) * 8 // D)) for r, o in enumerate(owned))


@pytest.mark.parametrize("make, match", [
    (lambda: Source(100).lanes(8).batch(12), "not divisible by lanes=8"),
    (lambda: Source(0), "empty"),
    (lambda: Node.mix([Source(5), Source(5)], [0, 0]), "sum to a positive"),
    (lambda: Node.mix([Source(5), Source(5)], [1, -1]), "non-negative"),
    (lambda: Node.mix([Source(5), Source(5)], [1]), "one weight per child"),
    (lambda: Source(5).repeat().repeat(), "infinite"),
    (lambda: Node.mix([Source(5).repeat(), Source(5).repeat()]).shuffle(1), "shuffle"),
    (lambda: Source(5).lanes(8), "lanes"),
    (lambda: Source(10).slice(10, 10), "empty"),
    (lambda: Source(10).lanes(2, "striped"), "mapping"),
])
def test_bad_plans_raise_clear_errors(make, match):
    with pytest.raises(PlanError, match=match):
        make()


def test_lanes_not_divisible_by_degree_names_fix():
    lanes = Source(100).lanes(6)
    with pytest.raises(PlanError, match=r"lanes=6 is not divisible by the data-parallel degree 4.*\[1, 2, 3, 6\]"):
        lanes.owned(0, 4)


def test_negative_step_is_refused():
    plan = Source(100).lanes(2).batch(4)
    with pytest.raises(PlanError, match="non-negative"):
        plan.explain(-1)
    with pytest.raises(PlanError, match="past the end"):
        plan.refs(plan.num_steps)


def test_node_kinds_are_explicit_and_collisions_refused():
    from zephon.plan import Node as N

    assert {c.kind for c in (Source, Shuffle, Repeat, Mix, Slice, Lanes, Batching)} == {
        "Source", "Shuffle", "Repeat", "Mix", "Slice", "Lanes", "Batch"}
    with pytest.raises(PlanError, match="kind 'Mix'.*already taken.*kind='package.Mix'"):
        type("Mix", (N,), {"__module__": "someone.else"})
    p = Source(10).repeat().lanes(2).batch(4)
    assert Node.from_json(p.to_json()) == p


def test_refs_extra_columns_ride_through_every_core_node():
    """A node may add extra columns to the references it resolves (Grain's index tags do);
    every core node carries them, and rows from a child without the column get -1."""
    from dataclasses import dataclass

    from zephon.plan import PassThrough, Refs

    @dataclass(frozen=True)
    class Tagged(PassThrough, kind="tests.test_plan.Tagged"):
        child: Node

        def _resolve(self, pos, epoch):
            return self.child._resolve(pos, epoch).with_extra("tag", pos * 100 + epoch)

    a, b = Tagged(Source(5, 0)), Source(7, 1)

    def check(refs, n):
        mine = refs.source == 0
        assert len(refs) == n and ("tag" in refs.extra) == mine.any()
        tag = refs.extra.get("tag", np.full(n, -1))
        assert tag.shape == (n,) and (tag[~mine] == -1).all()
        assert np.array_equal(tag[mine], refs.record[mine] * 100 + refs.epoch[mine])

    mix = Mix((a, b), (1.0, 2.0))
    for node in (a.shuffle(3), a.repeat(3), a.repeat().slice(2, 40, 3), mix, mix.shuffle(1).repeat(),
                 Mix((a.shuffle(4).repeat(), b.repeat()), (2.0, 1.0))):
        n = min(12, node.length or 12)
        check(node.resolve(np.arange(n)), n)
    for plan in (mix.shuffle(1).repeat().lanes(4).batch(8), Mix((a.repeat(), b.repeat()), (1.0, 1.0)).lanes(2).batch(4),
                 a.repeat().lanes(2, "interleaved").batch(4)):
        for step in (0, 3):
            check(plan.refs(step), plan.size)
        lanes = plan.lanes
        for i in range(4):
            check(lanes.resolve_lanes(np.arange(lanes.count), np.full(lanes.count, i)), lanes.count)
    refs = a.resolve(np.arange(5))
    check(refs.take(np.array([4, 1])), 2)
    check(Refs.concat([refs, b.resolve(np.arange(3)), refs.take(slice(1, 3))]), 10)
    assert not b.resolve(np.arange(3)).extra


def test_renamed_names_still_work_with_a_deprecation_warning_naming_the_new_one():
    """Batch -> Batching, Take/Skip -> .take(n)/.skip(n), Step -> AccumulatorStep: one version of
    grace, and the plan JSON kind stays "Batch" so every fingerprint is unchanged."""
    import zephon
    import zephon.ops
    import zephon.plan

    s = Source(100)
    cases = [(zephon, "Batch", "zephon.Batching"), (zephon.plan, "Batch", "zephon.Batching"),
             (zephon, "Take", r"\.take\(n\)"), (zephon.plan, "Skip", r"\.skip\(n\)"),
             (zephon, "Step", "zephon.AccumulatorStep"), (zephon.ops, "Step", "zephon.AccumulatorStep")]
    for module, name, new in cases:
        with pytest.warns(DeprecationWarning, match=f"{module.__name__}.{name} is deprecated.*{new}"):
            getattr(module, name)
    with pytest.warns(DeprecationWarning):
        assert zephon.Batch is Batching and zephon.Step is zephon.AccumulatorStep
    with pytest.warns(DeprecationWarning):
        assert zephon.Take(s, 10) == s.take(10) and zephon.Skip(s, 90) == s.skip(90)
    plan = s.repeat().lanes(2).batch(4)
    assert type(plan) is Batching and plan.to_json()["type"] == "Batch"
    assert Node.from_json(plan.canonical_json()) == plan
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        zephon.Nope  # noqa: B018
