"""`zephon.Pipeline` + `Where` + `How`: the one value every entry point takes, its identity, and
the old call form's one deprecated version."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import zephon as z
from zephon.sources import ArraySource


def _pipe(seed: int = 0, ops: tuple = ()) -> z.Pipeline:
    plan = z.Source(96).shuffle(seed=3).repeat().lanes(4).batch(8)
    return z.Pipeline(plan, ArraySource({"x": np.arange(96)}), ops, seed=seed)


def test_new_form_matches_the_old_form_batch_for_batch_and_warns_only_for_the_old():
    pipe = _pipe()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the new form warns about nothing
        new = z.Loader(pipe, where=z.Where(rank=1, world=2), how=z.How(read_ahead=16))
        got = [next(new).data["x"].tolist() for _ in range(5)]
    with pytest.warns(DeprecationWarning, match=r"zephon\.Loader\(zephon\.Pipeline\(plan, sources, ops\), "
                                                 r"where=zephon\.Where\(rank=\.\.\., world=\.\.\.\)"):
        old = z.Loader(pipe.plan, pipe.sources, rank=1, world=2, read_ahead=16)
    assert [next(old).data["x"].tolist() for _ in range(5)] == got
    assert len(got[0]) == 4 and got[0] != got[1]


def test_identity_and_fingerprint_follow_what_changes_the_data_only():
    a, b = _pipe(), _pipe()
    assert a.fingerprint() == b.fingerprint()
    assert a.replace(seed=1).fingerprint() != a.fingerprint()
    negate = z.Map(np.negative, batched=True, name="negate")
    assert _pipe(ops=(negate,)).fingerprint() != a.fingerprint()
    assert _pipe(ops=(z.Map(np.negative, batched=True, name="negate", version=2),)).fingerprint() \
        != _pipe(ops=(negate,)).fingerprint()
    d = a.describe()
    assert d["plan_fingerprint"] == a.plan.fingerprint() and d["seed"] == 0
    assert d["sources"] == {"0": {"type": "ArraySource", "records": 96}}
    # the loader's state records the same identity: a state restores into a loader of an equal pipeline
    l1 = z.Loader(a)
    next(l1)
    l2 = z.Loader(b)
    l2.restore(l1.state())
    assert next(l2).data["x"].tolist() == next(l1).data["x"].tolist()


def test_option_groups_refuse_bad_values_with_the_field_named():
    with pytest.raises(z.PlanError, match=r"rank must be < world"):
        z.Where(rank=2, world=2)
    with pytest.raises(z.PlanError, match=r"world=.*positive"):
        z.Where(world=0)
    with pytest.raises(z.PlanError, match=r"either mesh or rank"):
        z.Where(mesh=object(), rank=0)
    with pytest.raises(z.PlanError, match=r"How\(prefetch"):
        z.How(prefetch=-1)
    with pytest.raises(z.PlanError, match=r"complete plan"):
        z.Pipeline(z.Source(4).lanes(2), ArraySource({"x": np.arange(4)}))
    with pytest.raises(z.PlanError, match=r"takes a zephon.Where"):
        z.Loader(_pipe(), where={"rank": 0})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"\[.rank.\]: rank goes in zephon\.Where"):
        z.Loader(_pipe(), rank=0)


def test_where_accepts_numpy_integers_and_lanes():
    w = z.Where(rank=np.int64(0), world=np.int32(2), lanes=np.array([0]))
    assert (w.rank, w.world, w.lanes) == (0, 2, (0,))
    loader = z.Loader(_pipe(), where=w)
    assert loader.owned.tolist() == [0]
