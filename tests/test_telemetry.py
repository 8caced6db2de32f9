"""Telemetry (`stats()` on every emitter): the counts are exact, the times add up, the data never change."""

from __future__ import annotations

import logging
import time

import numpy as np
import pytest

from zephon import Filter, Loader, Map, Source
from zephon.errors import PlanError
from zephon.runners import threads
from zephon.sources import ArraySource
from zephon.telemetry import STAGES, Telemetry

N, WIDTH, B = 600, 8, 24  # a finite plan of 2 epochs: 50 global batches of 24 rows


def source() -> ArraySource:
    ids = np.arange(N, dtype=np.int64)
    return ArraySource({"tokens": (ids[:, None] * 3 + np.arange(WIDTH)).astype(np.int32), "id": ids})


def plan():
    return Source(N).shuffle(5).repeat(2).lanes(4).batch(B, remainder="drop")


def odd(cols):
    return cols["id"] % 2 == 1


def run(loader, between: float = 0.0) -> list[dict[str, np.ndarray]]:
    out = []
    for batch in loader:
        fields = batch.data if hasattr(batch, "data") else batch
        out.append({k: v.numpy() if hasattr(v, "numpy") else np.array(v) for k, v in fields.items()})
        if between:
            time.sleep(between)
    return out


def same(a, b) -> None:
    assert len(a) == len(b) > 0
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for k in x:
            np.testing.assert_array_equal(x[k], y[k])


def check_adds_up(s, steps: int, rows: int, workers: int = 1) -> None:
    assert (s.steps, s.rows, s.tokens) == (steps, rows, rows * WIDTH)
    assert s.first_batch_s + s.wait_s + s.between_s <= s.wall_s + 1e-6
    assert s.wait_s + s.between_s > 0 and 0.0 <= s.stall_pct <= 100.0
    for stage in STAGES:
        assert 0.0 <= s.stages[stage] <= s.wall_s * (workers if stage in ("read", "ops") else 1) + 1e-6
    assert s.stages["read"] > 0
    assert s.rows_per_s == pytest.approx(rows / s.wall_s)


@pytest.mark.parametrize("runner", [None, 2])
def test_loader_one_to_one_counts_exact_times_add_up_data_unchanged(runner):
    off = run(Loader(plan(), source(), runner=runner and threads(runner), telemetry=False))
    loader = Loader(plan(), source(), runner=runner and threads(runner))
    on = run(loader)
    same(on, off)
    s = loader.stats()
    check_adds_up(s, 50, 50 * B, workers=runner or 1)
    assert s.bytes_read == 2 * N * (WIDTH * 4 + 8)  # every record of both epochs read once
    if runner is None:  # one thread: the stages are parts of the time next() took
        assert sum(s.stages.values()) <= s.first_batch_s + s.wait_s + 1e-6
    assert "stall" in s.summary() and s.to_json()["steps"] == 50


@pytest.mark.parametrize("runner", [None, 2])
def test_loader_lane_engine_counts_exact_data_unchanged(runner):
    ops = [Filter(odd, batched=True)]
    off = run(Loader(plan(), source(), ops, runner=runner and threads(runner), telemetry=False))
    loader = Loader(plan(), source(), ops, runner=runner and threads(runner))
    on = run(loader)
    same(on, off)
    s = loader.stats()
    check_adds_up(s, len(on), len(on) * B, workers=runner or 1)
    assert all(set(b["id"] % 2) == {1} for b in on)


def test_stall_is_the_share_of_the_loop_spent_waiting():
    slow = Map(lambda c: (time.sleep(0.01), c)[1], batched=True)  # ~10 ms of row operators a step
    loader = Loader(Source(N).lanes(4).batch(B), source(), [slow], read_ahead=B)
    got = run(loader, between=0.0)
    s = loader.stats()
    assert s.stages["ops"] >= 0.01 * len(got) and s.bottleneck() == "ops"
    assert s.wait_s >= 0.01 * (len(got) - 1) and s.stall_pct > 50
    fast = Loader(Source(N).lanes(4).batch(B), source())
    run(fast, between=0.01)  # the loop's own 10 ms a step: it hardly waits
    f = fast.stats()
    assert f.between_s >= 0.01 * (f.steps - 1) and f.stall_pct < 50


def test_periodic_log_and_progress_bar(caplog, capsys):
    tel = Telemetry(log_every=1e-9, progress=True)
    loader = Loader(plan(), source(), telemetry=tel)
    with caplog.at_level(logging.INFO, logger="zephon.telemetry"):
        run(loader)
    loader.close()
    lines = [r.getMessage() for r in caplog.records if r.name == "zephon.telemetry"]
    assert len(lines) == 49 and lines[-1].startswith("step 50: stall ")  # each step after the first
    err = capsys.readouterr().err
    assert "50/50" in err  # the plan's length is the bar's total (hence its ETA)


def test_telemetry_off_has_no_stats():
    with pytest.raises(PlanError, match="telemetry=False"):
        Loader(plan(), source(), telemetry=False).stats()
    with pytest.raises(ValueError, match="log_every"):
        Telemetry(log_every=0)


def test_jax_loader_stats():
    import jax
    from jax.sharding import Mesh

    from zephon.backends.jax import JaxLoader

    mesh = Mesh(np.array(jax.devices()[:4]), ("data",))
    with JaxLoader(plan(), source(), mesh=mesh, telemetry=False) as loader:
        off = [{k: np.asarray(v) for k, v in b.items()} for b in loader]
    with JaxLoader(plan(), source(), mesh=mesh) as loader:
        on = [{k: np.asarray(v) for k, v in b.items()} for b in loader]
        s = loader.stats()
    same(on, off)
    check_adds_up(s, 50, 50 * B)
    assert s.stages["emit"] > 0


def test_torch_loader_and_dataloader_stats():
    from zephon.backends import torch as tb

    off = run(tb.TorchLoader(plan(), source(), telemetry=False))
    loader = tb.TorchLoader(plan(), source())
    same(run(loader), off)
    check_adds_up(loader.stats(), 50, 50 * B)
    assert loader.stats().stages["emit"] > 0
    # DataLoader workers (processes) send their stage times with their batches
    dl = tb.ZephonDataLoader(tb.ZephonIterableDataset(plan(), source()), num_workers=2, timeout=120)
    same(run(dl), off)
    s = dl.stats()
    check_adds_up(s, 50, 50 * B, workers=2)
    assert s.workers == 2 and s.bytes_read == 2 * N * (WIDTH * 4 + 8)
    # a count-changing pipeline: workers run lane blocks, the loader joins their parts
    ops = [Filter(odd, batched=True)]
    ref = run(Loader(plan(), source(), ops, telemetry=False))
    dl = tb.ZephonDataLoader(tb.ZephonIterableDataset(plan(), source(), ops), num_workers=2, timeout=120)
    got = run(dl)
    same(got, ref[:len(got)])
    check_adds_up(dl.stats(), len(got), len(got) * B, workers=2)


def test_grain_iterator_stats():
    import zephon.compat.grain as zg

    it = zg.Iterator(Loader(plan(), source()))
    got = list(it)
    s = it.stats()
    assert len(got) == 50
    check_adds_up(s, 50, 50 * B)
    assert s.stages["emit"] > 0
