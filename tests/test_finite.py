"""The end of finite plans: every rank ends at the same step, every record (token) exactly once
with `remainder="pad"`, `len()`, `Mix(stop="all")`, epochs and resuming near the end."""

from __future__ import annotations

import itertools
import threading

import numpy as np
import pytest

import zephon as z
from zephon.ops.pack import Pack
from zephon.ops.tokenize import Tokenize
from zephon.sources.memory import ArraySource
from zephon.testing.gather import ThreadGather


def chars(s: str) -> list[int]:
    return [ord(c) for c in s]


def keep(row: dict) -> bool:
    return int(row["x"]) % 3 != 0


def ranks(plan, src, ops, world, **kw):
    """Every rank's batches, each rank run on its own (no all-gather: each counts every lane)."""
    return [list(z.Loader(plan, src, ops(), rank=r, world=world, **kw)) for r in range(world)]


def global_steps(per_rank):
    """The global batches: every rank's rows of each step, in rank (= lane) order."""
    counts = {len(b) for b in per_rank}
    assert len(counts) == 1, f"ranks ended at different steps: {[len(b) for b in per_rank]}"
    return [{k: np.concatenate([b[s].data[k] for b in per_rank]) for k in per_rank[0][s].data}
            for s in range(counts.pop())]


def same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for k in x:
            assert x[k].dtype == y[k].dtype and len(x[k]) == len(y[k]), k
            if x[k].dtype == object:  # ragged rows
                assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(x[k], y[k])), k
            else:
                assert np.array_equal(x[k], y[k]), k


# --- issue 22, failure 1: ranks disagree on the last step --------------------------------------
def test_issue_reproduction_gives_equal_step_counts():
    texts = np.array(["ab" if i % 2 == 0 else "x" * 40 for i in range(8)], dtype=object)
    src, plan = ArraySource({"text": texts}), z.Source(8).lanes(2).batch(2, remainder="drop")
    ops = lambda: [Tokenize(chars, name="chars"), Pack(8, "concat")]
    steps = lambda r, d: sum(1 for _ in z.Loader(plan, src, ops(), rank=r, world=d))
    assert (steps(0, 1), steps(0, 2), steps(1, 2)) == (1, 1, 1)


def _lm(n=64, lanes=8):
    rng = np.random.default_rng(0)
    texts = np.array(["".join(chr(97 + int(c)) for c in rng.integers(0, 26, rng.integers(1, 60)))
                      for _ in range(n)], dtype=object)
    return ArraySource({"text": texts}), texts, lanes


@pytest.mark.parametrize("mode", ["concat", "first_fit", "best_fit"])
@pytest.mark.parametrize("remainder", ["drop", "pad"])
def test_packed_ends_at_the_same_step_at_every_degree(mode, remainder):
    src, texts, lanes = _lm()
    plan = z.Source(len(texts)).shuffle(3).lanes(lanes).batch(16, remainder=remainder)
    ops = lambda: [Tokenize(chars, name="chars"), Pack(16, mode)]
    ref = global_steps(ranks(plan, src, ops, 1))
    for d in (2, 4, 8):
        per_rank = ranks(plan, src, ops, d)
        same(global_steps(per_rank), ref)
        ends = [z.Loader(plan, src, ops(), rank=r, world=d) for r in range(d)]
        for ld in ends:
            for _ in ld:
                pass
        assert z.merge_states([ld.state() for ld in ends])["step"] == len(ref)  # one end: mergeable


# --- failure 2: records never seen ---------------------------------------------------------------
def test_pad_emits_every_record_exactly_once_and_drop_is_todays():
    src = ArraySource({"x": np.arange(100, dtype=np.int64)})
    drop = z.Source(100).shuffle(1).lanes(8).batch(16)
    pad = z.Source(100).shuffle(1).lanes(8).batch(16, remainder="pad")
    assert drop.num_steps == 6 and pad.num_steps == 7
    got = [b.data for b in z.Loader(pad, src)]
    assert len(got) == 7 and all(g["valid"].dtype == bool for g in got)
    seen = np.concatenate([g["x"][g["valid"]] for g in got])
    assert np.array_equal(np.sort(seen), np.arange(100))
    assert sum(int((~g["valid"]).sum()) for g in got) == 7 * 16 - 100
    assert all(np.all(g["x"][~g["valid"]] == 0) for g in got)
    for d in (2, 4, 8):
        same(global_steps(ranks(pad, src, list, d)), got)
    assert len(z.Loader(drop, src)) == 6 and len(list(z.Loader(drop, src))) == 6
    assert "valid" not in next(z.Loader(drop, src)).data
    done = z.Loader(pad, src, rank=1, world=2)
    for _ in done:
        pass
    at_end = z.Loader(pad, src, rank=2, world=4)
    at_end.restore(done.state())  # a state at the end restores (its cursors are past short lanes)
    assert len(at_end) == 0 and list(at_end) == []


@pytest.mark.parametrize("remainder", ["drop", "pad"])
def test_filtered_finite_plan_same_steps_and_batches_at_every_degree(remainder):
    src = ArraySource({"x": np.arange(203, dtype=np.int64)})
    plan = z.Source(203).shuffle(5).lanes(8).batch(16, remainder=remainder)
    ops = lambda: [z.Filter(keep, name="keep")]
    ref = global_steps(ranks(plan, src, ops, 1))
    for d in (2, 4, 8):
        same(global_steps(ranks(plan, src, ops, d)), ref)
    kept = [x for x in range(203) if x % 3]
    if remainder == "pad":
        seen = np.concatenate([g["x"][g["valid"]] for g in ref])
        assert np.array_equal(np.sort(seen), kept)  # every kept record exactly once
        assert not ref[-1]["valid"].all() and ref[-1]["valid"].any()
    else:
        assert all("valid" not in g for g in ref)
        assert len(ref) * 16 <= len(kept) < (len(ref) + 8) * 16


def test_packed_pad_emits_every_token_exactly_once():
    src, texts, lanes = _lm(50)
    plan = z.Source(len(texts)).lanes(lanes).batch(16, remainder="pad")
    for d in (1, 2, 4, 8):
        pieces: dict[int, list[tuple[int, int]]] = {}
        tokens = 0
        for r in range(d):
            for b in z.Loader(plan, src, [Tokenize(chars, name="chars"), Pack(12, "first_fit")],
                              rank=r, world=d):
                assert np.array_equal(b.data["valid"], [bool(s) for s in b.segments])
                assert np.all(b.data["loss_mask"][~b.data["valid"]] == 0)
                assert np.all(b.data["segment_ids"][~b.data["valid"]] == 0)
                tokens += int((b.data["segment_ids"] > 0).sum())
                for row in b.segments:
                    for _, rec, _, a, e in row:
                        pieces.setdefault(rec, []).append((a, e))
        assert tokens == sum(len(t) for t in texts)
        for rec, spans in pieces.items():  # each document's tokens once, no overlap, no gap
            spans.sort()
            assert spans[0][0] == 0 and spans[-1][1] == len(texts[rec])
            assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))
        assert sorted(pieces) == list(range(len(texts)))


# --- len(), all-gather, resume near the end ------------------------------------------------------
def test_len_counts_the_steps_left():
    src = ArraySource({"x": np.arange(203, dtype=np.int64)})
    plan = z.Source(203).lanes(8).batch(16, remainder="pad")
    ld = z.Loader(plan, src, [z.Filter(keep, name="keep")], rank=1, world=2)
    n = len(ld)
    next(ld), next(ld)
    assert len(ld) == n - 2 and len(list(ld)) == n - 2 and len(ld) == 0
    with pytest.raises(TypeError, match="repeats forever"):
        len(z.Loader(z.Source(10).repeat().lanes(2).batch(2), src))


def test_ranks_agree_through_an_all_gather_counting_only_their_lanes():
    src = ArraySource({"x": np.arange(203, dtype=np.int64)})
    plan = z.Source(203).shuffle(2).lanes(8).batch(16, remainder="pad")
    ref = global_steps(ranks(plan, src, lambda: [z.Filter(keep, name="keep")], 1))
    world = 4
    gather = ThreadGather(world)
    out: list = [None] * world

    def run(r: int) -> None:
        ld = z.Loader(plan, src, [z.Filter(keep, name="keep")], rank=r, world=world,
                      all_gather=gather.for_rank(r))
        assert len(ld) == len(ref)
        out[r] = list(ld)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    same(global_steps(out), ref)
    assert gather.calls == world  # one all-gather per rank per epoch


@pytest.mark.parametrize("remainder", ["drop", "pad"])
def test_resume_a_few_steps_before_the_end_at_another_degree(remainder):
    src, texts, lanes = _lm(80)
    plan = z.Source(len(texts)).shuffle(9).lanes(lanes).batch(16, remainder=remainder)
    ops = lambda: [Tokenize(chars, name="chars"), Pack(16, "concat")]
    ref = global_steps(ranks(plan, src, ops, 1))
    stop = len(ref) - 2
    first = [z.Loader(plan, src, ops(), rank=r, world=2) for r in range(2)]
    for ld in first:
        for _ in range(stop):
            next(ld)
    state = z.merge_states([ld.state() for ld in first])
    rest = []
    for r in range(4):
        ld = z.Loader(plan, src, ops(), rank=r, world=4)
        ld.restore(state)
        assert len(ld) == 2
        rest.append(list(ld))
    same(global_steps(rest), ref[stop:])


# --- failure 3: a finite mixture ends at its first exhausted child ---------------------------------
@pytest.mark.parametrize("by", ["samples", "tokens"])
def test_mix_stop_all_reads_every_child_whole(by):
    sizes = (40, 24, 16)
    srcs = [ArraySource({"text": np.array([f"{i}:{j}" + "y" * (j % 5) for j in range(n)], dtype=object)})
            for i, n in enumerate(sizes)]
    kids = [z.Source(n, id=i).shuffle(i) for i, n in enumerate(sizes)]
    plan = z.Node.mix(kids, (0.6, 0.3, 0.1), by=by, stop="all").lanes(4).batch(8, remainder="pad")
    ops = lambda: [Tokenize(chars, name="chars")]
    ref = global_steps(ranks(plan, srcs, ops, 1))
    seen = sorted("".join(map(chr, t)) for g in ref for t, v in zip(g["tokens"], g["valid"]) if v)
    assert seen == sorted(f"{i}:{j}" + "y" * (j % 5) for i, n in enumerate(sizes) for j in range(n))
    same(global_steps(ranks(plan, srcs, ops, 2)), ref)
    first = z.Node.mix(kids, (0.6, 0.3, 0.1), by=by).lanes(4).batch(8, remainder="pad")
    left = sum(int(g["valid"].sum()) for g in global_steps(ranks(first, srcs, ops, 1)))
    assert left < sum(sizes)  # stop="first" still ends with the first exhausted child
    # resumable: stop after 3 steps, restore, continue
    ld = z.Loader(plan, srcs, ops())
    for _ in range(3):
        next(ld)
    again = z.Loader(plan, srcs, ops())
    again.seek_position(ld.position())
    same([b.data for b in again], ref[3:])


# --- failure 4: epoch loops ----------------------------------------------------------------------
def test_epochs_follow_repeats_passes():
    src = ArraySource({"x": np.arange(96, dtype=np.int64)})
    finite = z.Source(96).shuffle(4).lanes(8).batch(16)
    forever = z.Source(96).shuffle(4).repeat().lanes(8).batch(16)
    ld = z.Loader(finite, src)
    rep = z.Loader(forever, src)
    for e in range(3):
        ld.set_epoch(e)
        mine = [b.data["x"] for b in ld]
        theirs = [next(rep).data["x"] for _ in range(6)]
        assert len(mine) == 6 and all(np.array_equal(a, b) for a, b in zip(mine, theirs))
    ld.set_epoch(2)
    next(ld)
    assert ld.state()["epoch"] == 2
    back = z.Loader(finite, src)
    back.restore(ld.state())
    assert back.epoch == 2 and back.step == 1
