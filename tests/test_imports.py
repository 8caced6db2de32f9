"""Import contracts: the core runs on numpy alone, and imports point one way (compat -> backends -> core)."""

import ast
import sys
from pathlib import Path

from _helpers import run_group

ROOT = Path(__file__).resolve().parents[1]

BLOCKED = ("jax", "jaxlib", "torch", "grain", "tensorflow_datasets", "tokenizers", "matplotlib",
           "flax", "optax", "orbax", "torchtitan", "megatron", "triton")

SCRIPT = f"""
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in {BLOCKED!r}:
            raise ImportError(name + " is made unimportable by this test")
sys.meta_path.insert(0, Block())
import numpy as np
import zephon
from zephon import Filter, Loader, Source
from zephon.backends import numpy as npb
from zephon.sources.memory import ArraySource
import zephon.cli, zephon.runners, zephon.sources, zephon.fingerprints
import zephon.integrations, zephon.integrations._text   # the trainer integrations' shared core
l = Loader(Source(10).shuffle(1).repeat().lanes(2).batch(4), ArraySource({{"x": np.arange(10)}}),
           [Filter(lambda c: c["x"] % 3 != 0, batched=True, name="not3")])
b = npb.emit(next(l))
assert b["x"].shape == (4,) and l.state()["step"] == 1
print("ok")
"""


def test_core_and_numpy_loader_work_without_jax_torch_grain():
    out = run_group([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def imports_of(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


#: Entry points that sit on top of every layer (the CLI, the pytest-facing test helpers, and the
#: trainer integrations, each imported only by its user). Files, or packages (a trailing "/"),
#: exempt from the one-way rule.
TOP = ("zephon/cli/", "zephon/testing/", "zephon/testing_plugin.py", "zephon/integrations/torchtitan.py",
       "zephon/integrations/megatron.py")


def _on_top(rel: str) -> bool:
    return any(rel.startswith(t) if t.endswith("/") else rel == t for t in TOP)


def test_imports_point_one_way():
    """The core never imports a backend or compat; a backend never imports compat."""
    bad = []
    for folder, forbidden in (("zephon", ("zephon.backends", "zephon.compat", "zephon.integrations", "jax",
                                          "torch", "grain", "torchtitan", "megatron")),
                              ("backends", ("zephon.compat", "zephon.integrations"))):
        for path in (ROOT / folder).rglob("*.py"):
            if _on_top(str(path.relative_to(ROOT))):
                continue
            for name in imports_of(path):
                if any(name == f or name.startswith(f + ".") for f in forbidden):
                    bad.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not bad, bad
