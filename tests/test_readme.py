"""Every ```python block of README.md and of the docs site's pages (docs/**/*.md) runs as written.

Each block runs alone in a fresh interpreter, in an empty directory (blocks write their own data
under relative paths), with the environment the tests have (8 fake CPU devices for jax, from
conftest). Two conventions, so the README can show a module and a test file as users write them:

- a block whose first line is a comment naming a Python file (`# my_project/data.py`) *is* that
  file: it is written there (in the directory of every later block of the same page) instead of
  being run, so later blocks can import it;
- a block that defines `test_...` functions is a test file: it runs under pytest, which must
  pass it.

A failing block shows its README line and output. A block using the `zephon_verify` fixture is
skipped, saying so, while no pytest plugin of Zephon is registered (it comes with
`zephon.testing`).
"""

import importlib.metadata
import os
import re
import sys
from pathlib import Path

import pytest
from _helpers import run_group

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("**/*.md"))]
FILE_BLOCK = re.compile(r"\A# ([\w/.-]+\.py)\s*\n")


def python_blocks() -> list[tuple[str, int, str]]:
    """(page, line of the opening fence, code) of every ```python block of every page."""
    blocks = []
    for page in PAGES:
        text = page.read_text()
        name = str(page.relative_to(ROOT))
        blocks += [(name, text.count("\n", 0, m.start()) + 1, m.group(1))
                   for m in re.finditer(r"^```python\n(.*?)^```", text, re.S | re.M)]
    return blocks


BLOCKS = python_blocks()
RUNNABLE = [(page, line, code) for page, line, code in BLOCKS if not FILE_BLOCK.match(code)]


def files_before(page: str, line: int) -> dict[str, str]:
    return {m.group(1): code for p, ln, code in BLOCKS
            if p == page and ln < line and (m := FILE_BLOCK.match(code))}


def zephon_pytest_plugin() -> bool:
    return any("zephon" in f"{ep.name} {ep.value}" for ep in importlib.metadata.entry_points(group="pytest11"))


def test_readme_has_python_blocks():
    assert sum(page == "README.md" for page, _, _ in RUNNABLE) >= 2, BLOCKS
    assert len(RUNNABLE) >= 6, BLOCKS


@pytest.mark.parametrize("page,line,code", BLOCKS, ids=[f"{page}:{line}" for page, line, _ in BLOCKS])
def test_readme_block_has_no_placeholder(page, line, code):
    compile(code, f"{page}:{line}", "exec")
    assert not re.search(r"(?<![\"'])\.\.\.(?![\"'])", code), f"{page}:{line} has a `...` placeholder:\n{code}"


@pytest.mark.parametrize("page,line,code", RUNNABLE, ids=[f"{page}:{line}" for page, line, _ in RUNNABLE])
def test_readme_block_runs(page, line, code, tmp_path):
    for name, text in files_before(page, line).items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))
    if re.search(r"^def test_", code, re.M):
        if "zephon_verify" in code and not zephon_pytest_plugin():
            pytest.skip(f"{page}:{line} uses the zephon_verify fixture; no Zephon pytest plugin is registered")
        script = tmp_path / "test_block.py"
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(script)]
    else:
        script = tmp_path / "block.py"
        cmd = [sys.executable, str(script)]
    script.write_text(code)
    proc = run_group(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (f"{page}:{line} failed ({proc.returncode}):\n{code}\n--- stdout\n"
                                  f"{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-3000:]}")
