"""The block shuffle (zephon.plan.blockshuffle): exact once per epoch, random access, "auto"
resolution, stripes that keep a lane to a few blocks of a window, composition with the rest of
the algebra and the lane engine, the same batches at every D / runner / emitter and across a
resume at another D — and the quality report (zephon.plan.quality)."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import zephon as z
from zephon import testing as zt
from zephon.errors import PlanError
from zephon.plan.blockshuffle import BlockShuffle, resolve_blocks
from zephon.plan.quality import effective_batch, p_same_block, shuffle_quality
from zephon.sources.memory import ArraySource


@settings(max_examples=80, deadline=None)
@given(n=st.integers(1, 3000), block=st.integers(1, 64), window=st.integers(1, 40),
       stripes=st.integers(1, 70), seed=st.integers(0, 2**63 - 1), epoch=st.integers(0, 10**6))
def test_every_record_exactly_once_per_epoch(n, block, window, stripes, seed, epoch):
    node = BlockShuffle(z.Source(n), seed, block, window, stripes)
    rec = node.resolve(np.arange(n), epoch).record
    assert np.array_equal(np.sort(rec), np.arange(n))


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 400), block=st.integers(1, 16), window=st.integers(1, 8), epochs=st.integers(1, 4),
       seed=st.integers(0, 1000))
def test_repeated_epochs_each_hold_every_record_with_fresh_orders(n, block, window, epochs, seed):
    a = z.Source(n).block_shuffle(seed, block, window, 1).repeat(epochs).resolve(np.arange(n * epochs))
    b = z.Source(n).repeat(epochs).block_shuffle(seed, block, window, 1).resolve(np.arange(n * epochs))
    assert np.array_equal(a.record, b.record) and np.array_equal(a.epoch, b.epoch)
    for e in range(epochs):
        sl = slice(e * n, (e + 1) * n)
        assert np.array_equal(np.sort(a.record[sl]), np.arange(n)) and (a.epoch[sl] == e).all()
    if epochs > 1 and n >= 64:
        assert not np.array_equal(a.record[:n], a.record[n:2 * n])


def test_windows_hold_whole_blocks_and_stripes_hold_few_of_them():
    n, b, w, g = 4096, 16, 32, 8
    rec = BlockShuffle(z.Source(n), 5, b, w, g).resolve(np.arange(n)).record
    for win in range(n // (b * w)):
        part = rec[win * b * w:(win + 1) * b * w]
        blocks, counts = np.unique(part // b, return_counts=True)
        assert len(blocks) == w and (counts == b).all()  # whole blocks, nothing else
        for s in range(g):  # stripe s: positions s, s+g, ... read w/g blocks (+ none shared here)
            assert len(np.unique(part[s::g] // b)) == w // g
    # random access equals sequential, at any position
    pos = np.random.default_rng(0).integers(0, n, 300)
    assert np.array_equal(BlockShuffle(z.Source(n), 5, b, w, g).resolve(pos).record, rec[pos])
    # within a window, records are shuffled (not left in block order)
    assert np.mean(np.diff(rec[:b * w]) == 1) < 0.2


def test_auto_resolves_window_and_stripes_at_the_root_and_block_from_the_sources():
    plan = z.Source(1000).block_shuffle(3, block=10).repeat().lanes(8).batch(16)
    node = plan.lanes.child.child
    assert (node.window, node.stripes) == (32, 8)  # 2 × B blocks, one stripe per lane
    sched = z.Source(1000).block_shuffle(3, block=10).repeat().lanes(8).batch(schedule=((0, 16), (5, 64)))
    assert sched.lanes.child.child.window == 128  # the largest size of the schedule
    again = z.Node.from_json(json.loads(json.dumps(plan.to_json())))
    assert again == plan and again.fingerprint() == plan.fingerprint()
    assert z.Source(1000).block_shuffle(3, block=10, window=40).repeat().lanes(8).batch(16).fingerprint() \
        != plan.fingerprint()

    auto = z.Source(1000).block_shuffle(3).repeat().lanes(8).batch(16)
    with pytest.raises(PlanError, match="block='auto'"):
        auto.refs(0)

    class Blocky(ArraySource):
        def natural_block(self) -> int:
            return 10

    src = Blocky({"x": np.arange(1000)})
    assert resolve_blocks(auto, {0: src}) == plan
    with z.Loader(auto, src) as loader:  # the loader also settles remainder='auto' (one-to-one: drop)
        assert loader.plan == dataclasses.replace(plan, remainder="drop")
        assert np.array_equal(next(loader).data["x"], plan.refs(0).record)
    with pytest.raises(PlanError, match="natural block"):
        z.Loader(auto, ArraySource({"x": np.arange(1000)}))
    with pytest.raises(PlanError, match="BlockShuffle.block"):
        z.Source(10).block_shuffle(1, block=0)
    with pytest.raises(PlanError, match="no epoch length"):
        z.Mix([z.Source(5).repeat(), z.Source(6, id=1).repeat()], [1, 1]).block_shuffle(1, block=2)


def _block_plan(n: int = 3000, lanes: int = 8, batch: int = 32) -> z.Batching:
    return z.Source(n, name="x").block_shuffle(11, block=8).repeat().lanes(lanes).batch(batch)


def block_pipeline():
    return zt.Pipeline(_block_plan(), ArraySource({"x": np.arange(3000), "y": np.arange(3000) * 2}))


def _keep_odd(cols):
    return cols["x"] % 2 == 1


def block_mix_filter():
    """A mix of two block-shuffled sources through a filter: the lane engine."""
    plan = z.Mix([z.Source(2000, id=0).block_shuffle(1, block=16).repeat(),
                  z.Source(700, id=1).block_shuffle(2, block=4).repeat()], [0.7, 0.3]).lanes(8).batch(32)
    srcs = [ArraySource({"x": np.arange(2000)}), ArraySource({"x": np.arange(700) + 10_000})]
    return zt.Pipeline(plan, srcs, [z.Filter(_keep_odd, batched=True, name="test.keep_odd")])


def block_packed():
    """Block-shuffled variable-length documents packed into rows of 32 tokens."""
    from zephon.ops.pack import Pack

    rng = np.random.default_rng(0)
    docs = np.empty(1500, dtype=object)
    for i in range(len(docs)):
        docs[i] = np.arange(rng.integers(3, 40), dtype=np.int32) + i
    plan = z.Source(1500).block_shuffle(4, block=8).repeat().lanes(4).batch(16)
    return zt.Pipeline(plan, ArraySource({"tokens": docs}), [Pack(32, "concat")])


def test_global_batches_identical_at_every_degree_runner_and_resume():
    zt.assert_elastic(block_pipeline, steps=12)
    zt.assert_runners_agree(block_pipeline, runners=("threads:2",), steps=8)
    zt.assert_resumes(block_pipeline, stops=(5,), degrees=((2, 8), (8, 1)), steps=10)


def block_schedule():
    """A batch-size ramp (16 rows, then 64 from step 5): the window is 2 × 64 blocks."""
    plan = z.Source(3000).block_shuffle(6, block=8).repeat().lanes(8).batch(schedule=((0, 16), (5, 64)))
    return zt.Pipeline(plan, ArraySource({"x": np.arange(3000)}))


def test_composes_with_mix_filter_pack_and_schedules_at_every_degree_and_across_a_resume():
    for factory in (block_mix_filter, block_packed, block_schedule):
        zt.assert_elastic(factory, degrees=(1, 2, 4), steps=8)
        zt.assert_resumes(factory, stops=(4,), degrees=((2, 4),), steps=8)


def test_emitters_agree():
    pytest.importorskip("torch")
    zt.assert_emitters_agree(block_pipeline, backends=("numpy", "torch"), steps=6)


def test_a_mix_of_block_shuffled_sources_keeps_exact_weights_and_once_per_epoch():
    plan = z.Mix([z.Source(400, id=0).block_shuffle(1, block=8, window=4),
                  z.Source(400, id=1).block_shuffle(2, block=8, window=4)], [1, 1]).lanes(4).batch(8)
    refs = [plan.refs(k) for k in range(plan.num_steps)]
    src = np.concatenate([r.source for r in refs])
    rec = np.concatenate([r.record for r in refs])
    for s in (0, 1):
        got = rec[src == s]
        assert len(np.unique(got)) == len(got)  # never twice in an epoch


def test_p_same_is_about_one_over_the_window_and_the_report_discriminates():
    n = 60_000
    q = shuffle_quality(z.Source(n).block_shuffle(1, block=32).repeat().lanes(8).batch(256), rho=0.2)
    assert q.window == 512 and 0.5 / 512 < q.p_same < 1.6 / 512
    assert q.p_same_full < 0.5 / 512
    small = shuffle_quality(z.Source(n).block_shuffle(1, block=32, window=8).repeat().lanes(8).batch(256))
    assert 0.7 / 8 < small.p_same < 1.3 / 8
    assert small.effective_batch < q.effective_batch < q.effective_batch_full + 1e-9
    assert small.neighbours > 10 * small.neighbours_full
    full = shuffle_quality(z.Source(n).shuffle(1).repeat().lanes(8).batch(256), block=32)
    assert full.p_same == pytest.approx(full.p_same_full, rel=0.5)
    assert abs(full.displacement - 1 / 3) < 0.02 and abs(full.inversions - 0.5) < 0.02
    assert "P(same block)" in q.text()
    assert effective_batch(100, 0.0, 0.5) == 100 and effective_batch(100, 1.0, 1.0) == 1
    assert p_same_block(np.array([1, 1, 2, 2])) == pytest.approx(2 / 6)
    with pytest.raises(PlanError, match="block="):
        shuffle_quality(z.Source(n).shuffle(1).repeat().lanes(8).batch(256))


def test_cli_explain_quality(tmp_path, capsys):
    from zephon.cli import main

    path = tmp_path / "plan.json"
    path.write_text(json.dumps(_block_plan(n=20_000, batch=64).to_json()))
    assert main(["explain", str(path), "--quality", "--rho", "0.3"]) == 0
    out = capsys.readouterr().out
    assert "P(same block)" in out and "rho=0.3" in out and "windows of 128 blocks" in out
    assert main(["explain", str(path), "--step", "2"]) == 0
    out = capsys.readouterr().out
    assert "BlockShuffle(seed=11): blocks of 8 records" in out and "windows of 128 blocks" in out


def test_block_cache_is_bounded_and_reports_its_memory():
    from zephon.sources.blocks import BlockCache, natural_block

    fetched: list[list[int]] = []

    def fetch(blocks):
        fetched.append(list(blocks))
        return [(np.array([bytes([k, j]) for j in range(4)], dtype=object), 8) for k in blocks]

    cache = BlockCache(block=4, capacity=3)
    got = cache.gather(np.array([0, 5, 9, 1]), fetch)  # blocks 0, 1, 2
    assert got.tolist() == [b"\x00\x00", b"\x01\x01", b"\x02\x01", b"\x00\x01"]
    assert cache.gather(np.array([2, 3]), fetch).tolist() == [b"\x00\x02", b"\x00\x03"]  # a hit
    assert fetched == [[0, 1, 2]]
    cache.gather(np.array([13, 17]), fetch)  # blocks 3, 4: two evicted (least recently used)
    s = cache.stats()
    assert (s.fetched, s.hits, s.held_blocks, s.held_bytes, s.peak_bytes) == (5, 1, 3, 24, 40)
    cache.gather(np.array([5]), fetch)  # block 1 was evicted: fetched again
    assert fetched[-1] == [1]
    assert natural_block(1 << 30, 1 << 20, unit=1) == 256 and natural_block(100, 10, unit=7) == 26215
