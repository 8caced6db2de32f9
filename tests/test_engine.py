"""The engine behind `zephon.Loader`: one validated run holding exactly one core by composition
(random access or the lane engine), with its end and resume as components (issue 40)."""

import ast
from pathlib import Path

import numpy as np
import pytest

import zephon as z
from zephon.exec.cores import LaneCore, RandomAccessCore
from zephon.exec.engine import Engine
from zephon.exec.lockstep import LockstepAssembly
from zephon.exec.perlane import PerLaneAssembly
from zephon.ops.pack import Pack
from zephon.sources.memory import ArraySource

X = ArraySource({"x": np.arange(1000, dtype=np.int64)})
THIRD = z.Filter(lambda c: c["x"] % 3 != 0, name="third", version=1)


def _docs(n):
    from zephon.sources.columns import objects

    rng = np.random.default_rng(0)
    return ArraySource({"tokens": objects([rng.integers(1, 1000, rng.integers(5, 90), dtype=np.int32)
                                           for _ in range(n)])})


def test_one_core_chosen_once():
    ra = z.Loader(z.Pipeline(z.Source(1000).shuffle(1).repeat().lanes(8).batch(16), X))
    assert isinstance(ra.engine.core, RandomAccessCore) and ra.engine.lane_core is None
    assert ra.engine.end is None and ra.engine.lane_engine is None
    lanes = z.Loader(z.Pipeline(z.Source(1000).shuffle(1).lanes(8).batch(16), X, [THIRD]))
    assert isinstance(lanes.engine.core, LaneCore) and lanes.engine.random_core is None
    assert lanes.engine.why() == "third"
    assert lanes.engine.lane_engine is None  # started by the first step
    next(lanes)
    assert isinstance(lanes.engine.lane_engine.assembly, LockstepAssembly)
    lanes.close()
    assert lanes.engine.lane_engine is None
    packed = z.Loader(z.Pipeline(z.Source(300).repeat().lanes(4).batch(8), _docs(300), [Pack(64, "concat")]))
    next(packed)
    assert isinstance(packed.engine.lane_engine.assembly, PerLaneAssembly)
    assert packed.engine.why() == "accumulator Pack"


@pytest.mark.parametrize("ops", [[], [THIRD]])
def test_engine_rows_are_the_loaders(ops):
    """The engine alone gives the rows the loader wraps into batches, step by step."""
    pipe = z.Pipeline(z.Source(1000).shuffle(1).lanes(8).batch(16), X, ops)
    where, how = z.Where(rank=1, world=2), z.How()
    engine = Engine(pipe, where, how)
    loader = z.Loader(pipe, where=where, how=how)
    for batch in loader:
        step, (cols, _, _) = engine.next_rows(lambda s, rows: (s, rows))
        assert step == batch.step and engine.step == loader.step
        np.testing.assert_array_equal(cols["x"], batch.data["x"])
    with pytest.raises(StopIteration):
        engine.next_rows(lambda s, rows: rows)
    assert engine.position() == loader.position()


def test_end_is_a_component_of_the_lane_core():
    pipe = z.Pipeline(z.Source(1000).shuffle(1).lanes(8).batch(16, remainder="drop"), X, [THIRD])
    loader = z.Loader(pipe)
    end = loader.engine.end
    assert end is not None and end.ends == {} and end.finite
    n = len(loader)
    assert end.ends == {0: n} and loader.end_if_known() == n
    assert loader.unemitted is end.unemitted is not None
    assert loader.stats().unemitted == end.unemitted  # handed to telemetry
    assert len(list(loader)) == n and end.done is False  # a known end stops without running past it


def test_a_refused_restore_moves_nothing():
    pipe = z.Pipeline(z.Source(1000).shuffle(1).repeat().lanes(8).batch(16), X, [THIRD])
    loader = z.Loader(pipe)
    for _ in range(3):
        next(loader)
    before = loader.position()
    other = z.Loader(pipe.replace(seed=1))
    with pytest.raises(z.StateError, match="seed"):
        loader.restore(other.state())
    assert loader.position() == before
    parsed = loader.engine.resume.parse(before)
    assert (parsed.step, parsed.epoch, parsed.shift, parsed.everyone) == (3, 0, 0, None)


def test_no_mixins_or_stubs_in_exec():
    """The loader and the lane engine are composed, not spread over mixins: no class in
    zephon/exec has a base class of its own package, and nothing raises NotImplementedError."""
    root = Path(z.__file__).parent / "exec"
    for path in sorted(root.glob("*.py")):
        tree = ast.parse(path.read_text())
        assert "NotImplementedError" not in path.read_text(), path.name
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                bases = [ast.unparse(b) for b in node.bases]
                assert all(b in ("Protocol",) for b in bases), (path.name, node.name, bases)
