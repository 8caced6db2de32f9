"""Batch-size ramps and resumes at another global batch size, on the Loader.

Every record (every token, when packed) exactly once across a ramp and across a resume with a
changed B, at D = 1, 2, 4, 8; the same batches and fingerprints at every D; a changed B refused
without the opt-in; micro-batch counts checked against every size up front.
"""

import itertools
import json

import numpy as np
import pytest

from zephon import Filter, Loader, PlanError, Source, StateError, merge_states
from zephon.fingerprints import run_fingerprints
from zephon.ops.pack import Pack
from zephon.sources.memory import ArraySource

N = 997  # prime: lanes never divide it
RAMP = ((0, 8), (3, 16), (6, 32))


def ids_source():
    return ArraySource({"id": np.arange(N, dtype=np.int64)})


def doc_source():
    """Document i has 1 + i % 23 tokens, token t of it is 100 * i + t: each token names itself."""
    docs = np.empty(N, object)
    for i in range(N):
        docs[i] = np.arange(1 + i % 23, dtype=np.int32) + 100 * i
    return ArraySource({"tokens": docs})


def keep(cols):
    return cols["id"] % 3 != 0


KEEP = Filter(keep, name="id_mod3")


def plan(schedule=RAMP, size=None, repeat=False):
    s = Source(N).shuffle(3)
    s = s.repeat() if repeat else s
    return s.lanes(8).batch(size, schedule=None if size else schedule, remainder="drop")


def run(p, src, transforms=(), world=1, steps=None, state=None, allow=False):
    """Global batches (rows of every rank joined in rank order) until the plan ends or `steps`,
    resumed from `state` if given; and the merged state after `steps`."""
    loaders = [Loader(p, src, list(transforms), rank=r, world=world) for r in range(world)]
    for l in loaders:
        if state is not None:
            l.restore(state, allow_batch_change=allow)
    out = []
    for parts in zip(*loaders):
        out.append(parts)
        if steps is not None and len(out) == steps:
            break
    if steps is None:  # ran to the end: ranks may have stopped at different points of it
        return out, None
    return out, json.loads(json.dumps(merge_states([l.state() for l in loaders])))


def joined(batches, field):
    return [np.concatenate([b.data[field] for b in parts]) for parts in batches]


def lane_rows(batches, field="id"):
    """Lane -> its rows of `field` over all batches, in order."""
    out: dict[int, list[np.ndarray]] = {}
    for parts in batches:
        for b in parts:
            for i, lane in enumerate(b.lanes):
                out.setdefault(int(lane), []).append(b.data[field][b.lane_slice(i)])
    return {k: np.concatenate(v) for k, v in out.items()}


def lane_prefix_records(p, per_lane):
    """The records lanes 0..L-1 hold at their first `per_lane` inputs (what exactly-once means)."""
    L = p.lanes.count
    pos = (np.arange(per_lane)[None, :] * L + np.arange(L)[:, None]).ravel()
    return np.sort(p.lanes.resolve(pos).record)


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_one_to_one_ramp_then_resume_at_another_size_exactly_once(world):
    src = ids_source()
    p = plan()
    ref, _ = run(p, src)
    ref_ids = joined(ref, "id")
    assert [len(x) for x in ref_ids[:8]] == [8, 8, 8, 16, 16, 16, 32, 32]
    assert len(ref) == p.num_steps == 34
    ids = np.concatenate(ref_ids)
    assert np.array_equal(np.sort(ids), lane_prefix_records(p, p.lane_offset(34)))
    got, state = run(p, src, world=world, steps=4)
    assert all(np.array_equal(a, b) for a, b in zip(ref_ids, joined(got, "id")))
    # resume at B=64 (a bigger cluster), then, after 3 steps, at B=24 (a smaller one)
    q, r = plan(size=64), plan(size=24)
    more, state2 = run(q, src, world=world, steps=3, state=state, allow=True)
    rest, _ = run(r, src, world=world, state=state2, allow=True)
    sizes = [len(x) for x in joined(more + rest, "id")]
    assert sizes[:4] == [64, 64, 64, 24] and set(sizes[3:]) == {24}
    ids = np.concatenate(joined(got + more + rest, "id"))
    # each lane went on where it stopped: its first inputs, each once, none skipped
    per_lane = len(ids) // 8
    assert len(ids) == len(np.unique(ids))
    assert np.array_equal(np.sort(ids), lane_prefix_records(p, per_lane))
    assert N // 8 - per_lane < 3  # the end left less than one 24-row step in every lane


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_filter_ramp_and_resume_at_another_size_exactly_once(world):
    src = ids_source()
    p = plan()
    ref, _ = run(p, src, [KEEP])
    got, state = run(p, src, [KEEP], world=world, steps=5)
    assert all(np.array_equal(a, b) for a, b in zip(joined(ref, "id"), joined(got, "id")))
    rest, _ = run(plan(size=48), src, [KEEP], world=world, state=state, allow=True)
    assert {len(x) for x in joined(rest, "id")} == {48}
    ids = np.concatenate(joined(got + rest, "id"))
    assert len(ids) == len(np.unique(ids)) and not (ids % 3 == 0).any()
    # every lane: the kept records of its inputs, in order, none skipped, up to the end
    per_lane = lane_rows(got + rest)
    for lane, rows in per_lane.items():
        inputs = p.lanes.resolve_lanes(lane, np.arange(N // 8)).record
        kept = inputs[inputs % 3 != 0]
        assert np.array_equal(rows, kept[:len(rows)])
    assert min(len(kept) - len(rows) for rows in per_lane.values()) < 48 // 8  # the end: no whole step left


def pieces(batches):
    """(record) -> sorted token spans [start, stop) emitted, with the tokens of each checked."""
    out: dict[int, list[tuple[int, int]]] = {}
    for parts in batches:
        for b in parts:
            for j, row in enumerate(b.segments):
                at = 0
                for _, rec, _, a, z in row:
                    assert np.array_equal(b.data["tokens"][j, at:at + z - a], np.arange(a, z) + 100 * rec)
                    out.setdefault(rec, []).append((a, z))
                    at += z - a
    return out


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_packed_tokens_exactly_once_across_ramp_and_resize(world):
    src = doc_source()
    p = plan()
    got, state = run(p, src, [Pack(16)], world=world, steps=7)
    assert [sum(len(b.data["tokens"]) for b in parts) for parts in got] == [8, 8, 8, 16, 16, 16, 32]
    rest, _ = run(plan(size=40), src, [Pack(16)], world=world, state=state, allow=True)
    assert {sum(len(b.data["tokens"]) for b in parts) for parts in rest} == {40}
    spans = pieces(got + rest)
    lengths = {i: 1 + i % 23 for i in range(N)}
    done = 0
    for rec, sp in spans.items():
        sp.sort()
        assert sp[0][0] == 0 and all(x[1] == y[0] for x, y in itertools.pairwise(sp)), (rec, sp)
        assert sp[-1][1] <= lengths[rec]
        done += sp[-1][1] == lengths[rec]
    assert done > 0.9 * N  # all but each lane's last few documents were packed whole


def test_fingerprints_equal_across_degree_for_a_schedule():
    src = ids_source()
    p = plan(repeat=True)
    ref = run_fingerprints([Loader(p, src, [KEEP])], 12)
    for D in (2, 4, 8):
        assert run_fingerprints([Loader(p, src, [KEEP], rank=r, world=D) for r in range(D)], 12) == ref
    assert run_fingerprints([Loader(p, src)], 12) == run_fingerprints(
        [Loader(p, src, rank=r, world=4) for r in range(4)], 12)


def test_a_changed_batch_size_is_refused_without_the_opt_in():
    src = ids_source()
    l = Loader(plan(), src)
    next(l)
    with pytest.raises(StateError, match=r"batch sizes 8 from step 0.* this plan has size 64.*allow_batch_change=True"):
        Loader(plan(size=64), src).restore(l.state())
    # another difference is still another plan, opt-in or not
    other = Source(N).shuffle(4).lanes(8).batch(64)
    with pytest.raises(StateError, match="another plan"):
        Loader(other, src).restore(l.state(), allow_batch_change=True)


def test_a_resumed_state_keeps_its_shift_and_refuses_an_edit():
    src = ids_source()
    _, state = run(plan(), src, steps=4)
    q = plan(size=64)
    a, s2 = run(q, src, steps=2, state=state, allow=True)
    assert s2["lane_shift"] == 5 - q.lane_offset(4)  # lanes were at input 5 at step 4
    b, _ = run(q, src, state=s2)  # same plan now: no opt-in needed
    c, _ = run(q, src, state=state, allow=True)
    assert all(np.array_equal(x, y) for x, y in zip(joined(a + b, "id"), joined(c, "id")))
    with pytest.raises(StateError, match="was edited"):
        Loader(q, src).restore({**s2, "lane_shift": s2["lane_shift"] + 1})


def test_micro_batches_must_divide_every_size_checked_up_front():
    src = ids_source()
    Loader(plan(), src, micro_batches=4)  # 8, 16, 32 all split in 4
    with pytest.raises(PlanError, match=r"micro_batches\(16\).*8-row batches from step 0"):
        Loader(plan(), src, micro_batches=16)
    with pytest.raises(PlanError, match="16-row batches from step 3"):
        Loader(plan(schedule=((0, 32), (3, 16))), src, world=2, micro_batches=16)


def test_a_schedule_by_tokens_switches_at_the_tokens_packed_rows_carry():
    """Packed rows hold `seq_len` tokens each, so the tokens a run has seen before step k are
    `Σ B(j) · seq_len`: the size changes at the first step whose packed tokens reach the threshold."""
    p = Source(N).shuffle(3).lanes(8).batch(schedule=((0, 8), (400, 16), (1000, 32)), by="tokens", seq_len=16)
    got, _ = run(p, doc_source(), [Pack(16)], steps=8)
    seen, sizes = 0, []
    for parts in got:
        tokens = np.concatenate([b.data["tokens"] for b in parts])
        sizes.append(len(tokens))
        assert tokens.shape[1] == 16 and (np.concatenate([b.data["segment_ids"] for b in parts]) > 0).all()
        seen += tokens.size
    # 8 rows x 16 = 128 tokens a step: 400 are reached before step 4 (512); then 256 a step: 1000
    # before step 6 (1024)
    assert sizes == [8, 8, 8, 8, 16, 16, 32, 32] and seen == 4 * 128 + 2 * 256 + 2 * 512
    assert [p.tokens_before(k, 16) for k in (4, 6)] == [512, 1024]
