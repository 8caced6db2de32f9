"""A weight schedule (curriculum) in a token mix: part of the plan, followed in every lane.

The weights change at given steps; from each such step every lane balances realised tokens under
the new weights. What must hold: each lane follows each stretch's weights within the stated bound
(one document), the data does not depend on D, and a resume on either side of a change equals
the uninterrupted run; a changed schedule is refused at restore, naming it.
"""

import numpy as np
import pytest
from _corpus import corpora_fixture, objects

from zephon import Loader, Mix, Node, PlanError, Source, StateError
from zephon.demo.textdata import EOS_ID
from zephon.fingerprints import run_fingerprints
from zephon.ops.pack import Pack
from zephon.ops.tokenize import Tokenize
from zephon.sources.memory import ArraySource

corpora = corpora_fixture(prose=120, code=80, train=(60, 40), vocab_size=600)

SCHEDULE = ((12, (0.1, 0.9)), (24, (0.5, 0.5)))
LONGEST = 128  # Tokenize(max_tokens=...): no document piece is longer, so one document is the bound


def plan(schedule=SCHEDULE, weights=(0.9, 0.1), lanes=4, batch=8):
    return Mix([Source(120, id=0).shuffle(1).repeat(), Source(80, id=1).shuffle(2).repeat()],
               weights, by="tokens", schedule=schedule).lanes(lanes).batch(batch)


def pipeline(corpora):
    """(sources, transforms, per-source pipelines) of the mixed, packed LM pipeline."""
    prose, code, tok = corpora
    return ([ArraySource({"text": objects(prose)}), ArraySource({"body": objects(code)})], [Pack(64)],
            {0: [Tokenize(tok, eos=EOS_ID, max_tokens=LONGEST)],
             1: [Tokenize(tok, field="body", eos=EOS_ID, max_tokens=LONGEST)]})


def loader(corpora, p=None, **kw):
    sources, transforms, per_source = pipeline(corpora)
    return Loader(p or plan(), sources, transforms, per_source=per_source, **kw)


def weights_at(step):
    w = (0.9, 0.1)
    for start, ws in SCHEDULE:
        if step >= start:
            w = ws
    return np.array(w)


def test_every_lane_follows_each_stretch_of_the_schedule(corpora):
    l = loader(corpora)
    shares = {}
    for step in range(36):
        b = next(l)
        w = weights_at(step)
        for lane, v in l.state()["lanes"].items():
            mix = np.array(v["mix"], float)  # tokens of each source since the last change
            assert np.all(np.abs(mix - w * mix.sum()) <= LONGEST), (step, lane, mix)
        for j, row in enumerate(b.segments):
            c = shares.setdefault((step // 12, int(b.lanes[j // b.rows_per_lane])), np.zeros(2))
            for s, _, _, a, z in row:
                c[s] += z - a
    for (stretch, lane), c in shares.items():  # 12 steps, 2 rows of 64 a lane: ~1.5k tokens
        want = weights_at(12 * stretch)[1]
        # a packed row can still hold documents chosen just before a change (the carry)
        assert abs(c[1] / c.sum() - want) <= 2 * LONGEST / c.sum() + 0.05, (stretch, lane, c)


def test_same_data_at_every_degree_and_across_a_resume_at_the_change(corpora):
    def fp(world):
        ls = [loader(corpora, rank=r, world=world) for r in range(world)]
        return run_fingerprints(ls, 30)

    ref = fp(1)
    assert fp(2) == ref and fp(4) == ref
    whole = loader(corpora)
    expected = [next(whole).data["tokens"] for _ in range(30)]
    for stop in (11, 12, 13, 24):
        first = loader(corpora)
        for _ in range(stop):
            next(first)
        for world in (1, 2):  # resumed at another degree too
            parts = [loader(corpora, rank=r, world=world) for r in range(world)]
            for p in parts:
                p.restore(first.state())
            for step in range(stop, 30):
                got = np.concatenate([next(p).data["tokens"] for p in parts])
                assert np.array_equal(got, expected[step]), (stop, world, step)


def test_a_changed_schedule_is_refused_at_restore(corpora):
    l = loader(corpora)
    next(l)
    other = plan(schedule=((12, (0.2, 0.8)), (24, (0.5, 0.5))))
    with pytest.raises(StateError, match=r"schedule"):
        loader(corpora, other).restore(l.state())
    with pytest.raises(StateError, match=r"schedule"):
        loader(corpora, plan(schedule=())).restore(l.state())


@pytest.mark.parametrize("kwargs, message", [
    ({"schedule": ((10, (0.5, 0.5)),), "by": "samples"}, r"needs Mix\(\.\.\., by='tokens'\)"),
    ({"schedule": ((0, (0.5, 0.5)),)}, r"integer >= 1"),
    ({"schedule": ((5, (0.5, 0.5)), (5, (0.2, 0.8)))}, r"must increase, got 5 after 5"),
    ({"schedule": ((5, (0.5, 0.3, 0.2)),)}, r"2 children but 3 weights \(Mix weights from step 5\)"),
    ({"schedule": ((5, (-1, 2)),)}, r"Mix weights from step 5 must be finite, non-negative"),
    ({"schedule": ((5, (float("nan"), 1)),)}, r"Mix weights from step 5 must be finite"),
    ({"schedule": ((5,),)}, r"a \(step, weights\) pair"),
    ({"schedule": 5}, r"a list of \(step, weights\) pairs"),
    ({"schedule": ((True, (0.5, 0.5)),)}, r"integer >= 1"),
])
def test_invalid_schedules_are_refused_naming_the_problem(kwargs, message):
    kids = [Source(10, id=0).repeat(), Source(10, id=1).repeat()]
    by = kwargs.pop("by", "tokens")
    with pytest.raises(PlanError, match=message):
        Mix(kids, [0.5, 0.5], by=by, **kwargs)


def test_the_schedule_is_in_the_plan_json_and_plans_without_one_are_unchanged():
    p = plan()
    again = Node.from_json(p.canonical_json())
    assert again.canonical_json() == p.canonical_json()
    assert again.lanes.child.schedule == SCHEDULE
    assert "schedule" not in plan(schedule=()).lanes.child.to_json()
    assert Node.mix(p.lanes.child.children, (0.9, 0.1), "tokens", schedule=SCHEDULE) == p.lanes.child


def test_torch_dataloader_workers_follow_the_schedule_and_resume(corpora):
    """DataLoader workers split the lanes; each worker's lanes must change weights at the same
    step as the core loader's, also when resumed from a state_dict taken past the change."""
    tb = pytest.importorskip("zephon.backends.torch")
    sources, transforms, per_source = pipeline(corpora)

    def dataset():
        return tb.ZephonIterableDataset(plan(), sources, transforms, per_source=per_source)

    core = loader(corpora)
    want = [next(core).data["tokens"] for _ in range(20)]
    dl = tb.ZephonDataLoader(dataset(), num_workers=2, timeout=60)
    got = [b["tokens"].numpy() for _, b in zip(range(14), dl)]
    for step, g in enumerate(got):
        assert np.array_equal(g, want[step]), step
    resumed = tb.ZephonDataLoader(dataset(), num_workers=2, timeout=60)
    resumed.load_state_dict(dl.state_dict())
    for step, b in zip(range(14, 20), resumed):
        assert np.array_equal(b["tokens"].numpy(), want[step]), step
