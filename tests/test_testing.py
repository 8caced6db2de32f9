"""zephon.testing: one-call determinism checks of a user's own pipeline factory.

- a deterministic pipeline passes every check: degrees, runners, emitters (numpy, JAX meshes,
  torch, the Grain-compatible iterator), micro-batches and stop/resume across degrees *and*
  emitters (each state saved through that emitter's own API);
- negative controls — a map reading the global RNG, a filter that depends on the worker thread,
  a pipeline that changes with D — are each reported at exactly the step, lane, row and field a
  brute-force comparison of the two runs' arrays finds first, with `explain` of that row;
- one state document: Loader, JaxLoader, TorchLoader, ZephonDataLoader and the Grain iterator
  write the same JSON document, and each restores it;
- `micro_batches(n)` on every emitter concatenates to the batch;
- hand-edited states are refused naming the field;
- the pytest plugin's fixture and marker.
"""

from __future__ import annotations

import copy
import io
import json
import multiprocessing
import threading

import numpy as np
import pytest

import zephon as z
from zephon import testing as zt
from zephon.checkpoint import STATE_VERSION
from zephon.errors import PlanError, StateError
from zephon.fingerprints import run_fingerprints
from zephon.sources.memory import ArraySource
from zephon.testing import Config, DeterminismError, FactoryError, Pipeline, Segment
from zephon.testing.sessions import runner_from_spec

pytest_plugins = ["pytester"]

N = 1000
STEPS = 12


def source() -> ArraySource:
    return ArraySource({"x": np.arange(N * 4, dtype=np.int32).reshape(N, 4),
                        "id": np.arange(N, dtype=np.int64)})


def plan() -> z.Batching:
    return z.Source(N).shuffle(1).repeat().lanes(8).batch(32)


# --- pipelines under test (module level: the processes runner and other processes import them) ---

def keep_not_7(cols):
    return cols["id"] % 10 != 7


def jitter(record, rng):
    return {**record, "x": record["x"] + rng.integers(0, 100, record["x"].shape).astype(np.int32)}


def good() -> Pipeline:
    """A filter (lanes advance by the data) and a per-record random map."""
    return Pipeline(plan(), source(), [z.Filter(keep_not_7, batched=True, name="keep_not_7"),
                                       z.RandomMap(jitter, name="jitter")], seed=3)


def noisy(cols):
    return {**cols, "noise": np.random.random(len(cols["id"])).astype(np.float32)}


def global_rng() -> Pipeline:
    """Negative control: a map that reads the global RNG."""
    return Pipeline(plan(), source(), [z.Map(noisy, batched=True, name="noisy")])


def keep_in_main_thread(cols):
    worker = (threading.current_thread() is not threading.main_thread()
              or multiprocessing.parent_process() is not None)
    return ~((cols["id"] % 50 == 0) & worker)


def worker_filter() -> Pipeline:
    """Negative control: a filter that drops every 50th record, but only in a worker (a thread
    or a process of a runner)."""
    return Pipeline(plan(), source(), [z.Filter(keep_in_main_thread, batched=True, name="keep")])


DROPPED = 777


def drop_at_scale(world: int = 1) -> Pipeline:
    """Negative control: a pipeline that changes with D (record 777 vanishes beyond one rank)."""
    def keep(cols):
        return (cols["id"] != DROPPED) | (world == 1)
    return Pipeline(plan(), source(), [z.Filter(keep, batched=True, name="keep_unless_scaled")])


# --- brute force: the two runs' full arrays, compared directly ------------------------------------

def rows_by_lane(factory, world: int, steps: int, runner: str = "inline", builds: int = 1):
    """Per step {lane: {field: rows}} of `world` ranks (the factory is called with world=)."""
    b = zt.Builder(factory)
    pipe = b(world, 0)
    loaders = [pipe.loader(rank=r, world=world, runner=runner_from_spec(runner)) for r in range(world)]
    out = []
    for _ in range(steps):
        step = {}
        for l in loaders:
            batch = next(l)
            for i, lane in enumerate(batch.lanes):
                step[int(lane)] = {k: v[batch.lane_slice(i)] for k, v in batch.data.items()}
        out.append(step)
    for l in loaders:
        l.close()
    return out


def brute_first_difference(a, b):
    """(step, lane, global row, field) where two runs' arrays first differ."""
    for s, (x, y) in enumerate(zip(a, b)):
        for lane in sorted(x):
            for name in sorted(x[lane]):
                u, v = x[lane][name], y[lane][name]
                if not np.array_equal(u, v):
                    j = int(np.flatnonzero([not np.array_equal(p, q) for p, q in zip(u, v)])[0])
                    return s, lane, lane * len(u) + j, name
    return None


def where(div) -> tuple:
    return div.step, div.lane, div.row, div.field


def result(report, name):
    return next(r for r in report.results if r.name == name)


# --- a deterministic pipeline passes ------------------------------------------------------------

def test_a_deterministic_pipeline_passes_degrees_runners_and_resumes():
    rep = zt.assert_elastic(good, steps=STEPS)
    assert [r.name for r in rep.results] == ["numpy D=1 (reference)", "numpy D=2", "numpy D=4", "numpy D=8"]
    assert all(r.status == "identical" and r.steps == STEPS for r in rep.results)
    # the fingerprints are the ones zephon.fingerprints.run_fingerprints computes
    assert rep.results[0].fingerprints == run_fingerprints([good().loader()], STEPS)
    assert rep.summary() == "good: 4 configurations, 12 steps, all identical"
    zt.assert_runners_agree(good, runners=("threads:2",), steps=STEPS)
    rep = zt.assert_resumes(good, steps=STEPS)
    assert "numpy D=2 @4 -> numpy D=8" in [r.name for r in rep.results]
    assert all(r.ok for r in rep.results)


def test_emitters_micro_batches_and_resume_across_emitters_agree():
    """Each stop saves the state through that emitter's API (state(), state_dict() via torch.save
    + weights_only load, get_state()), JSON round-trips it and restores it in the next emitter."""
    configs = ["jax mesh=8", "jax mesh=2x4 micro=2", "torch D=2 micro=4", "grain D=2 micro=2",
               "numpy D=2 @3 -> jax mesh=4x2 micro=4 @5 -> torch D=4 @7 -> grain D=8 @9 -> numpy D=1 micro=2"]
    rep = zt.verify(good, configs, STEPS)
    assert rep.ok, rep.table()
    assert [r.status for r in rep.results] == ["identical"] * 6
    doc = rep.to_json()
    assert doc["ok"] and doc["configurations"][-1]["matches"] == [True] * STEPS
    assert len({r.fingerprints[-1] for r in rep.results}) == 1


def test_configurations_a_pipeline_cannot_take_are_not_applicable_with_the_reason():
    rep = zt.verify(good, ["numpy D=3", "jax mesh=8 micro=8", "torch D=16"], 4)
    assert [r.status for r in rep.results[1:]] == ["n/a"] * 3
    assert "lanes=8 is not divisible by D=3" in rep.results[1].note
    assert "micro=8 does not divide the 4 row(s) each device holds" in rep.results[2].note
    assert rep.ok and rep.summary().endswith("all identical (3 not applicable)")


# --- negative controls: reported at the exact step, lane, row and field ----------------------------

def test_global_rng_is_caught_at_step_0_lane_0_row_0():
    rep = zt.verify(global_rng, [Config((Segment(),), note="second run"), "numpy D=2"], 6)
    assert not rep.ok
    for res in rep.results[1:]:
        assert res.status == "differs"
        assert where(res.divergence) == (0, 0, 0, "noise")
        assert res.matches[0] is False
    d = rep.results[1].divergence
    # the row's provenance is the same record: only the noise differs
    assert d.expected == d.got and d.expected.startswith("lane 0, source 0 record ")
    with pytest.raises(DeterminismError) as e:
        zt.assert_elastic(global_rng, degrees=(1, 2), steps=4)
    msg = str(e.value)
    assert "numpy D=2: DIFFERS at step 0, lane 0, row 0, field 'noise'" in msg
    assert "reference row: lane 0, source 0 record" in msg


def test_worker_dependent_filter_is_caught_where_the_first_record_is_dropped():
    rep = zt.verify(worker_filter, ["numpy D=2 runner=threads:2", "numpy D=1 runner=threads:1"], STEPS)
    ref = rows_by_lane(worker_filter, 1, STEPS)
    for res, world, runner in ((rep.results[1], 2, "threads:2"), (rep.results[2], 1, "threads:1")):
        assert res.status == "differs"
        brute = brute_first_difference(ref, rows_by_lane(worker_filter, world, STEPS, runner))
        assert where(res.divergence) == brute
    # ... and the reference's row there is a record the worker dropped (id % 50 == 0; windows
    # the engine computes in the calling thread keep theirs, so it need not be the first such id)
    step, lane, row, _ = where(rep.results[1].divergence)
    rid = int(ref[step][lane]["id"][row - lane * 4])
    assert rid % 50 == 0
    assert f"record {rid} epoch 0" in rep.results[1].divergence.expected
    assert rep.results[1].divergence.got != rep.results[1].divergence.expected


def test_degree_dependent_pipeline_is_caught_where_the_record_goes_missing():
    rep = zt.verify(drop_at_scale, ["numpy D=2", "numpy D=8", "torch D=4"], 30)
    ref = rows_by_lane(drop_at_scale, 1, 30)
    at = next((s, l, l * 4 + j) for s, st in enumerate(ref) for l in sorted(st)
              for j, i in enumerate(st[l]["id"]) if i == DROPPED)
    for res, world in zip(rep.results[1:], (2, 8, 4)):
        assert res.status == "differs"
        assert where(res.divergence)[:3] == at
        assert f"record {DROPPED} epoch 0" in res.divergence.expected
        if world != 4:
            assert where(res.divergence) == brute_first_difference(ref, rows_by_lane(drop_at_scale, world, 30))
        assert res.matches[:at[0]] == [True] * at[0] and res.matches[at[0]] is False
    with pytest.raises(DeterminismError, match=rf"step {at[0]}, lane {at[1]}, row {at[2]}, field 'id'"):
        zt.assert_elastic(drop_at_scale, degrees=(1, 2), steps=30)


def test_a_plan_that_changes_with_the_degree_is_named():
    def lanes_per_rank(world=1):  # the classic: lanes = number of ranks
        return Pipeline(z.Source(N).shuffle(1).repeat().lanes(world).batch(32), source())

    rep = zt.verify(lanes_per_rank, ["numpy D=2"], 3)
    d = rep.results[1].divergence
    assert (d.step, d.lane) == (0, 1)
    assert "another lane count" in d.detail and "plan.child.count: 1 != 2" in d.detail


def test_a_pipeline_built_per_rank_is_caught_when_it_reads_the_rank():
    def seeded_by_rank(rank=0, world=1):  # a common slip: seeding augmentation with the rank
        return Pipeline(plan(), source(), [z.RandomMap(jitter, name="jitter")], seed=rank)

    rep = zt.verify(seeded_by_rank, ["numpy D=2", "torch D=4"], 4)
    assert [where(r.divergence)[:3] for r in rep.results[1:]] == [(0, 4, 16), (0, 2, 8)]
    assert all(r.divergence.field == "x" for r in rep.results[1:])


# --- one state document, every emitter ----------------------------------------------------------

def torch_round_trip(state):
    import torch

    buf = io.BytesIO()
    torch.save({"data": state}, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)["data"]


def plain_json(x) -> bool:
    if isinstance(x, dict):
        return all(isinstance(k, str) and plain_json(v) for k, v in x.items())
    if isinstance(x, list):
        return all(plain_json(v) for v in x)
    if isinstance(x, str):
        return not x.lstrip().startswith(("{", "["))  # no JSON inside strings
    return x is None or isinstance(x, (bool, int, float))


def test_every_emitter_writes_the_same_document_and_restores_it():
    import jax
    from jax.sharding import Mesh

    import zephon.compat.grain as zg
    from zephon.backends.jax import JaxLoader
    from zephon.backends.torch import TorchLoader, ZephonDataLoader, ZephonIterableDataset

    p = good()
    ops, steps = tuple(p.transforms), 5
    mesh = Mesh(np.array(jax.devices()[:8]), ("data",))
    ref = [next(l) for l in [p.loader()] for _ in range(steps + 2)]

    def emitters():
        return {
            "Loader": p.loader(),
            "JaxLoader": JaxLoader(p.plan, p.sources, ops, mesh=mesh, seed=p.seed),
            "TorchLoader": TorchLoader(p.plan, p.sources, ops, seed=p.seed, rank=0, world=1),
            "ZephonDataLoader": ZephonDataLoader(ZephonIterableDataset(p.plan, p.sources, ops, seed=p.seed,
                                                                       rank=0, world=1)),
            "grain Iterator": zg.Iterator(p.loader()),
        }

    def get(name, e):
        return {"Loader": lambda: e.state(), "JaxLoader": lambda: e.get_state(),
                "TorchLoader": lambda: torch_round_trip(e.state_dict()),
                "ZephonDataLoader": lambda: torch_round_trip(e.state_dict()),
                "grain Iterator": lambda: e.get_state()}[name]()

    def put(name, e, doc):
        method = {"Loader": "restore", "JaxLoader": "set_state", "TorchLoader": "load_state_dict",
                  "ZephonDataLoader": "load_state_dict", "grain Iterator": "set_state"}[name]
        getattr(e, method)(copy.deepcopy(doc))

    docs = {}
    for name, e in emitters().items():
        it = iter(e)
        for _ in range(steps):
            next(it)
        docs[name] = json.loads(json.dumps(get(name, e)))
        getattr(e, "close", lambda: None)()
    first = docs["Loader"]
    assert first["zephon_state"] == STATE_VERSION and first["step"] == steps
    assert plain_json(first) and set(first["lanes"]) == {str(i) for i in range(8)}
    for name, doc in docs.items():
        assert doc == first, name  # one document, whoever wrote it
    for name, e in emitters().items():  # ... and everyone restores it
        put(name, e, first)
        got = next(iter(e))
        x = got.data["x"] if isinstance(got, z.LocalBatch) else got["x"]
        assert np.array_equal(np.asarray(x), ref[steps].data["x"]), name
        getattr(e, "close", lambda: None)()


def test_grain_iterator_states_inside_a_step_and_their_edits():
    import zephon.compat.grain as zg

    ds = zg.Dataset.source(list(range(200))).shuffle(seed=2).repeat().lanes(4)  # unbatched: elements
    it = iter(ds)
    head = [next(it) for _ in range(6)]  # inside step 1 (4 elements a step)
    state = json.loads(json.dumps(it.get_state()))
    assert state["zephon_state"] == STATE_VERSION and state["step"] == 1 and state["elements_taken"] == 2
    tail = [next(it) for _ in range(5)]
    again = iter(ds)
    again.set_state(state)
    assert [next(again) for _ in range(5)] == tail and len(head) == 6
    z.Loader(ds.plan, ds.record_sources, ds.transforms).restore(state)  # the document, for every emitter
    for bad in (-1, "2", 99):
        with pytest.raises(StateError, match="elements_taken"):
            iter(ds).set_state({**state, "elements_taken": bad})
    with pytest.raises(StateError, match="inside a step"):
        zg.merge_states([state])


EDITS = {
    "cursor negative": (lambda s: s["lanes"]["0"].__setitem__("cursor", [-1]), "'cursor'"),
    "cursor of another type": (lambda s: s["lanes"]["0"].__setitem__("cursor", ["5"]), "'cursor'"),
    "skip negative": (lambda s: s["lanes"]["0"].__setitem__("skip", [-2]), "'skip'"),
    "held malformed": (lambda s: s["lanes"]["0"].__setitem__("held", [[0, -1, 0]]), "'held'"),
    "lane not an object": (lambda s: s["lanes"].__setitem__("2", [1, 2]), "lane 2"),
    "lane missing": (lambda s: s["lanes"].pop("3"), "lacks lanes [3]"),
    "step negative": (lambda s: s.__setitem__("step", -1), "step -1"),
    "step of another type": (lambda s: s.__setitem__("step", "3"), "step '3'"),
    "format of another type": (lambda s: s.__setitem__("zephon_state", "2"), "'zephon_state'"),
    "format from the future": (lambda s: s.__setitem__("zephon_state", 99), "state format 99"),
    "seed": (lambda s: s.__setitem__("seed", 5), "seed 5"),
    "operator version": (lambda s: s["pipeline"][0].__setitem__("version", 2), "version 2 != 1"),
    "plan": (lambda s: s.__setitem__("plan_fingerprint", "abc"), "another plan"),
}


@pytest.mark.parametrize("edit", sorted(EDITS))
def test_hand_edited_states_are_refused_naming_the_field(edit):
    fn, needle = EDITS[edit]
    l = good().loader()
    for _ in range(3):
        next(l)
    state = json.loads(json.dumps(l.state()))
    fn(state)
    with pytest.raises(StateError, match=needle.replace("[", r"\[").replace("]", r"\]")):
        good().loader().restore(state)


def test_cursor_beyond_a_finite_lane_and_off_the_step_are_refused():
    finite = Pipeline(z.Source(N).shuffle(1).lanes(8).batch(32), source(),
                      [z.Filter(keep_not_7, batched=True, name="keep_not_7")])
    l = finite.loader()
    next(l)
    state = l.state()
    state["lanes"]["0"]["cursor"] = [10 ** 6]
    with pytest.raises(StateError, match=r"lane 0 .* beyond its 125 inputs"):
        finite.loader().restore(state)
    one_to_one = Pipeline(plan(), source())
    l = one_to_one.loader()
    next(l)
    state = l.state()
    state["lanes"]["5"]["cursor"] = [0]
    with pytest.raises(StateError, match="lane 5 of the state is at input 0, but step 1"):
        one_to_one.loader().restore(state)


def test_a_lane_the_plan_does_not_have_is_refused():
    l = good().loader()
    next(l)
    state = l.state()
    state["lanes"]["99"] = {"cursor": [0], "skip": [0]}
    with pytest.raises(StateError, match="99"):
        good().loader().restore(state)


# --- micro-batches on every emitter -------------------------------------------------------------

def test_micro_batches_concatenate_to_the_batch_on_every_emitter():
    import jax
    import torch
    from jax.sharding import Mesh

    from zephon.backends import numpy as znp
    from zephon.backends.jax import JaxBatch, JaxLoader, join_micro_batches
    from zephon.backends.torch import TorchBatch, TorchLoader, ZephonDataLoader, ZephonIterableDataset

    p = good()
    ops = tuple(p.transforms)
    batch = next(p.loader(rank=1, world=2))
    for n in (1, 2, 4, 16):
        micro = znp.micro_batches(batch, n)
        assert len(micro) == n and all(m["x"].shape == (16 // n, 4) for m in micro)
        assert np.array_equal(np.concatenate([m["x"] for m in micro]), batch.data["x"])
        assert np.shares_memory(micro[-1]["x"], batch.data["x"])  # views
    emitted = znp.emit(batch)
    assert np.array_equal(np.concatenate([m["id"] for m in emitted.micro_batches(4)]), batch.data["id"])
    with pytest.raises(PlanError, match=r"micro_batches\(3\) cannot split the 16 rows .* use n in \[1, 2, 4, 8, 16\]"):
        emitted.micro_batches(3)

    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "fsdp"))
    with JaxLoader(p.plan, p.sources, ops, mesh=mesh, batch_axes=("data", "fsdp"), seed=p.seed) as jl:
        b = next(jl)
        assert isinstance(b, JaxBatch)
        micro = b.micro_batches(2)
        for m in micro:
            assert m["x"].shape == (16, 4) and m["x"].sharding == b["x"].sharding
        # micro-batch i holds the i-th half of every device's 4 rows
        x = np.asarray(b["x"])
        assert np.array_equal(np.asarray(micro[1]["x"]), x.reshape(8, 2, 2, 4)[:, 1].reshape(16, 4))
        assert np.array_equal(np.asarray(join_micro_batches(micro)["x"]), x)
        total = jax.jit(lambda d: d["x"].sum())  # a JaxBatch is a pytree
        assert int(total(micro[0])) + int(total(micro[1])) == int(total(b))
        with pytest.raises(PlanError, match=r"use n in \[1, 2, 4\]"):
            b.micro_batches(8)

    t = next(TorchLoader(p.plan, p.sources, ops, seed=p.seed, rank=1, world=2))
    assert isinstance(t, TorchBatch)
    micro = t.micro_batches(4)
    assert torch.equal(torch.cat([m["x"] for m in micro]), t["x"])
    assert np.array_equal(t["x"].numpy(), batch.data["x"])
    dl = ZephonDataLoader(ZephonIterableDataset(p.plan, p.sources, ops, seed=p.seed, rank=1, world=2))
    d = next(iter(dl))
    assert isinstance(d, TorchBatch) and torch.equal(torch.cat([m["id"] for m in d.micro_batches(2)]), d["id"])


# --- configurations, factories --------------------------------------------------------------------

def test_configurations_parse_and_print_the_same():
    for text in ("numpy D=2", "numpy D=2 runner=threads:2", "jax mesh=2x4 micro=2", "torch D=1 workers=2",
                 "jax procs=2 mesh=2x4", "torch procs=2", "numpy D=2 @10 -> jax mesh=8 @20 -> grain D=4"):
        assert Config.parse(text).name == text
    for bad, msg in (("tf D=2", "unknown backend"), ("numpy D=x", "not an integer"),
                     ("numpy D=2 -> torch D=4", "@STEP"), ("numpy @5", "drop its @STEP"),
                     ("numpy fast", "key=value"), ("jax D=2", "drop D="),
                     ("numpy D=2 @9 -> torch D=1 @4 -> grain D=1", "increase"), ("grain procs=2", "jax")):
        with pytest.raises(PlanError, match=msg):
            Config.parse(bad)
    names = [c.name for c in zt.matrix(steps=30)]
    for want in ("numpy D=1 (second run)", "numpy D=8", "jax mesh=4x2", "torch D=4", "grain D=2",
                 "numpy D=2 runner=processes:2", "torch D=1 workers=2", "jax mesh=8 micro=2",
                 "jax procs=2 mesh=2x4", "torch procs=2", "numpy D=2 @10 -> numpy D=8",
                 "jax mesh=8 @15 -> torch D=2 micro=2", "torch D=4 @10 -> grain D=1"):
        assert want in names, want
    assert [c.name for c in zt.matrix(steps=30, backends=("numpy",), degrees=(1, 2), runners=(), micro=(),
                                      procs=0, resume=["7:2->1"], repeat=False)
            ] == ["numpy D=2", "numpy D=2 @7 -> numpy D=1"]


def test_factories_in_every_form_and_their_errors(tmp_path):
    import zephon.compat.grain as zg

    p = plan()
    assert Pipeline.of((p, source())).plan is p
    assert Pipeline.of({"plan": p, "sources": source(), "seed": 4}).seed == 4
    ds = zg.Dataset.source(list(range(100))).shuffle(seed=1).repeat().batch(8).lanes(4)
    assert Pipeline.of(ds).dataset is ds
    zt.assert_elastic(lambda: ds, degrees=(1, 2, 4), steps=4)
    plan_only = Pipeline.of(p)  # a plan alone: its rows' (source, record)
    rows = next(plan_only.loader()).data
    assert np.array_equal(rows["record"], p.refs(0).record)
    with pytest.raises(FactoryError, match="returned int"):
        zt.verify(lambda: 3, [], 2)
    with pytest.raises(FactoryError, match="without .batch"):
        Pipeline.of(zg.Dataset.source(list(range(10))))

    def broken():
        raise KeyError("tokenizer.json")

    with pytest.raises(FactoryError, match=r"the factory .*broken raised KeyError: 'tokenizer.json'"):
        zt.verify(broken, [], 2)
    with pytest.raises(FactoryError, match="cannot import module 'no_such_pkg.data'"):
        zt.load_factory("no_such_pkg.data:pipeline")
    with pytest.raises(FactoryError, match="has no 'nope'; its functions: .*good"):
        zt.load_factory("test_testing:nope")
    with pytest.raises(FactoryError, match="MODULE:FUNCTION"):
        zt.load_factory("just_a_name")
    f = tmp_path / "my_data.py"
    f.write_text("from test_testing import good\n\ndef pipeline():\n    return good()\n")
    assert zt.load_factory(f"{f}:pipeline")().plan == plan()
    assert zt.factory_spec(good) == "test_testing:good"


# --- the pytest plugin ---------------------------------------------------------------------------

def test_pytest_plugin_fixture_and_marker(pytester):
    pytester.makeconftest("")
    pytester.makepyfile(test_user="""
        import numpy as np
        import pytest
        import zephon as z
        from zephon.sources.memory import ArraySource
        from zephon.testing import Pipeline

        def pipeline(world=1):
            src = ArraySource({"id": np.arange(500)})
            keep = lambda c: (c["id"] != 123) | (world < 4)   # changes at D >= 4
            return Pipeline(z.Source(500).shuffle(3).repeat().lanes(4).batch(16), src,
                            [z.Filter(keep, batched=True, name="keep")])

        @pytest.mark.zephon_pipeline(factory=pipeline, steps=6)
        def test_passes_up_to_two(zephon_verify):
            zephon_verify.elastic(degrees=(1, 2))
            zephon_verify.resume(degrees=[(2, 1)])

        @pytest.mark.zephon_pipeline("test_user:pipeline")
        def test_fails_at_four(zephon_verify):
            zephon_verify.elastic(degrees=(1, 4))

        def test_without_marker(zephon_verify):
            zephon_verify(pipeline, steps=3).configs("numpy D=2 @1 -> numpy D=1")
    """)
    res = pytester.runpytest_inprocess("-q", "-p", "no:cacheprovider", "--zephon-steps", "40")
    res.assert_outcomes(passed=2, failed=1)
    res.stdout.fnmatch_lines(["*DeterminismError: not elastic: pipeline: 2 configurations, 40 steps: 1 differs*",
                              "*numpy D=4: DIFFERS at step *, lane *, row *, field 'id'*",
                              "*reference row: lane *, source 0 record 123 epoch 0*"])


# --- slow: processes, two local processes, the whole matrix ----------------------------------------

@pytest.mark.slow
@pytest.mark.multiprocess
def test_processes_and_two_local_processes_agree_and_catch_the_worker_filter():
    rep = zt.verify(good, ["numpy D=2 runner=processes:2", "jax procs=2 mesh=2x4", "torch procs=2",
                           "numpy D=2 @4 -> jax procs=2 mesh=4x2 micro=2 @8 -> torch procs=2 micro=2 @10 -> grain D=1"],
                    STEPS)
    assert rep.ok, rep.table()
    rep = zt.verify(worker_filter, ["numpy D=2 runner=processes:2"], STEPS)
    ref = rows_by_lane(worker_filter, 1, STEPS)
    assert where(rep.results[1].divergence) == brute_first_difference(
        ref, rows_by_lane(worker_filter, 2, STEPS, "processes:2"))
