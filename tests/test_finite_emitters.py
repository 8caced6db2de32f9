"""Finite plans through the emitters: torch-style epochs (every `iter()` is the next pass),
`len()`, padding with `valid` on numpy, JAX and torch, and the same end on every one."""

from __future__ import annotations

import numpy as np
import pytest

import zephon as z
from zephon import testing as zt
from zephon.sources.memory import ArraySource

torch = pytest.importorskip("torch")
from zephon.backends.torch import TorchLoader, ZephonDataLoader, ZephonIterableDataset  # noqa: E402


def keep(row: dict) -> bool:
    return int(row["x"]) % 3 != 0


def finite_filtered(world: int = 1) -> zt.Pipeline:
    """A filtered finite plan padded at its end (module level: process runners import it)."""
    src = ArraySource({"x": np.arange(203, dtype=np.int64)})
    plan = z.Source(203).shuffle(5).lanes(8).batch(16, remainder="pad")
    return zt.Pipeline(plan, [src], [z.Filter(keep, name="keep")])


def test_every_iter_of_a_finite_dataloader_is_the_next_epoch():
    src = ArraySource({"x": np.arange(96, dtype=np.int64)})
    finite = z.Source(96).shuffle(4).lanes(8).batch(16)
    forever = z.Loader(z.Source(96).shuffle(4).repeat().lanes(8).batch(16), src)
    dl = ZephonDataLoader(ZephonIterableDataset(finite, src))
    for epoch in range(3):
        xs = [b["x"].numpy() for b in dl]
        assert len(xs) == 6, f"epoch {epoch} yielded {len(xs)} batches"
        for x in xs:
            assert np.array_equal(x, next(forever).data["x"])
    dl.set_epoch(7)
    it = iter(dl)
    next(it)
    state = dl.state_dict()
    assert state["epoch"] == 7 and state["step"] == 1
    again = ZephonDataLoader(ZephonIterableDataset(finite, src))
    again.load_state_dict(state)
    assert len(again) == 5 and len(list(again)) == 5  # resumes inside epoch 7
    assert len(list(again)) == 6  # then epoch 8


def test_torch_loader_epochs_and_length():
    src = ArraySource({"x": np.arange(100, dtype=np.int64)})
    plan = z.Source(100).shuffle(4).lanes(8).batch(16, remainder="pad")
    tl = TorchLoader(plan, src, rank=1, world=2)
    assert len(tl) == 7
    first = [b["x"].clone() for b in tl]
    second = list(tl)
    assert len(first) == len(second) == 7 and tl.epoch == 1
    assert all(b["valid"].dtype == torch.bool for b in second)
    assert not torch.equal(torch.cat(first), torch.cat([b["x"] for b in second]))  # reshuffled


def test_dataloader_workers_pad_a_filtered_finite_plan_like_one_loader():
    p = finite_filtered()
    ref = [b.data for b in z.Loader(p.plan, p.sources[0], p.transforms)]
    dl = ZephonDataLoader(ZephonIterableDataset(p.plan, p.sources[0], p.transforms, rank=0, world=1),
                          num_workers=2)
    got = list(dl)
    assert len(got) == len(ref) == len(dl)
    for a, b in zip(ref, got):
        assert np.array_equal(a["x"], b["x"].numpy()) and np.array_equal(a["valid"], b["valid"].numpy())


def test_emitters_and_degrees_agree_to_the_padded_end():
    report = zt.assert_emitters_agree(finite_filtered, backends=("jax", "torch"), steps=100)
    p = finite_filtered()
    assert report.steps == len(list(z.Loader(p.plan, p.sources[0], p.transforms))) < 100
    near = [r for r in report.results if "near the end" in r.name]
    assert len(near) == 3 and all(r.ok and r.steps == report.steps for r in near), near


def test_grain_iterator_epochs_follow_repeat():
    pytest.importorskip("grain")
    from zephon.compat.grain.iterator import Iterator

    src = ArraySource({"x": np.arange(96, dtype=np.int64)})
    it = Iterator(z.Loader(z.Source(96).shuffle(4).lanes(8).batch(16), src))
    forever = z.Loader(z.Source(96).shuffle(4).repeat().lanes(8).batch(16), src)
    for epoch in range(3):
        it.set_epoch(epoch)  # iter() of a Grain iterator is itself (Grain's steps rely on it)
        got = [b["x"] for b in it]
        assert len(got) == 6 and all(np.array_equal(g, next(forever).data["x"]) for g in got)
    assert it.get_state()["epoch"] == 2
