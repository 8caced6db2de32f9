"""Run by `make dist` in a fresh venv holding only the built wheel and the core dependencies."""

import numpy as np

import zephon as z
from zephon.sources.memory import ArraySource

assert z.__file__ and "site-packages" in z.__file__, z.__file__    # the wheel's copy, not the tree's
src = ArraySource({"x": np.arange(64, dtype=np.int64)})
plan = z.Source(64).shuffle(seed=0).lanes(4).batch(8)
whole = [b.data["x"] for _, b in zip(range(8), z.Loader(plan, src))]
ranks = [[b.data["x"] for _, b in zip(range(8), z.Loader(plan, src, rank=r, world=2))] for r in (0, 1)]
assert sorted(np.concatenate(whole).tolist()) == list(range(64)), "one epoch must hold every record once"
for step, (a, b) in enumerate(zip(*ranks)):
    assert np.array_equal(np.concatenate([a, b]), whole[step]), f"step {step}: ranks' rows != the global batch"
print(f"wheel smoke test: zephon {z.__version__} from {z.__file__}: numpy loader ok, 64 records once")

import importlib.util  # noqa: E402

# the C module (setup.py builds it into the wheel; it opens a libjpeg-turbo only when used)
MODULE = "zephon.media.libjpeg_binding"
assert importlib.util.find_spec(MODULE) is not None, f"the wheel lacks {MODULE}"
print("wheel smoke test: zephon.media.libjpeg_binding is in the wheel")
