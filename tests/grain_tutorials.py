"""Grain's own tutorials as Zephon's compatibility bar: `python -m tests.grain_tutorials`.

Every page of `tests/grain_tutorial_cells.py` runs twice, cell by cell in one namespace like a
notebook: once as written, with real Grain, and once ported the way the README tells a Grain user
(`port`: `grain.MapDataset` -> `zg.Dataset`, `grain.IterDataset` -> `zg.IterDataset`,
`grain.experimental.X` -> `zg.experimental.X`, `grain.DataLoader` -> `zg.DataLoader`; nothing
else). What a cell prints (stdout, plus the repr of a last bare expression as a notebook shows it)
is compared exactly, memory addresses masked. A cell is

- identical: the same output;
- different: runs, prints something else;
- unsupported: Zephon raised one of its own errors (`ZephonError`: names the feature and the fix);
- broken: any other exception (a crash from inside the library, or a hang past the time limit).

Cells that fail on real Grain are not counted ("grain fails"). Network-only inputs are replaced
by the local stand-ins below, identically for both runs.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import io
import os
import pprint
import random
import re
import shutil
import signal
import sys
import tempfile
import types
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

try:
    from tests.grain_tutorial_cells import CELLS, SKIPPED_CELLS, SKIPPED_PAGES
except ImportError:  # imported by pytest from tests/ itself
    from grain_tutorial_cells import CELLS, SKIPPED_CELLS, SKIPPED_PAGES  # type: ignore[no-redef]

CELL_TIMEOUT_S = 120

_PORT = [
    (re.compile(r"\bgrain\.MapDataset\b"), "zg.Dataset"),
    (re.compile(r"\bgrain\.IterDataset\b"), "zg.IterDataset"),
    (re.compile(r"\bgrain\.experimental\."), "zg.experimental."),
    (re.compile(r"\bgrain\.DataLoader\b"), "zg.DataLoader"),
]


def port(code: str) -> str:
    """The README's port of Grain code to Zephon: four renames and the zg import."""
    for pattern, repl in _PORT:
        code = pattern.sub(repl, code)
    return "import zephon.compat.grain as zg\n" + code if "zg." in code else code


def _shell_free(code: str) -> str:
    """Notebook shell lines: `!rm -rf p` becomes `shutil.rmtree`, other `!`/`%` lines go."""
    lines = []
    for line in code.split("\n"):
        s = line.strip()
        m = re.fullmatch(r"!rm -rf (\S+)", s)
        if m:
            lines.append(f"{line[:len(line) - len(line.lstrip())]}__import__('shutil').rmtree("
                         f"{m.group(1)!r}, ignore_errors=True)")
        elif not s.startswith(("!", "%")):
            lines.append(line)
    return "\n".join(lines)


# --- local stand-ins for what needs the network ------------------------------------------------

class LocalImages:
    """Stands in for `tfds.data_source(name, split)` (an ArrayRecord-backed random-access source):
    the same record structure ({"image": uint8 HxWxC, "label": int64}), fixed pseudo-random data."""

    def __init__(self, name: str, n: int, shape: tuple[int, ...], seed: int, file_names: bool = False):
        rng = np.random.default_rng(seed)
        self.name = name
        self._images = rng.integers(0, 256, (n, *shape), dtype=np.uint8)
        self._labels = rng.integers(0, 10, n).astype(np.int64)
        self._file_names = file_names

    def __len__(self) -> int:
        return len(self._labels)

    def __getitem__(self, i: int) -> dict[str, Any]:
        r = {"image": self._images[i].copy(), "label": self._labels[i]}
        if self._file_names:
            r["file_name"] = f"n0{int(i):07d}.JPEG".encode()
        return r

    def __repr__(self) -> str:
        return f"LocalImages(name={self.name!r}, len={len(self)})"


_TFDS = {"mnist": (1000, (28, 28, 1), 1), "pneumonia_mnist": (300, (28, 28, 1), 2)}


def _fake_tfds() -> types.ModuleType:
    m = types.ModuleType("tensorflow_datasets")

    def data_source(name: str, split: str = "train", **_: Any) -> LocalImages:
        n, shape, seed = _TFDS[name]
        return LocalImages(name, n, shape, seed)

    m.data_source = data_source  # type: ignore[attr-defined]
    fmt = types.SimpleNamespace(ARRAY_RECORD="array_record")
    m.core = types.SimpleNamespace(  # type: ignore[attr-defined]
        DatasetInfo=types.SimpleNamespace(file_format=None),
        file_adapters=types.SimpleNamespace(FileFormat=fmt))
    return m


def _fake_cv2() -> types.ModuleType:
    m = types.ModuleType("cv2")
    m.INTER_LINEAR = 1  # type: ignore[attr-defined]

    def resize(image: np.ndarray, dsize: tuple[int, int], interpolation: int = 1) -> np.ndarray:
        w, h = dsize   # nearest neighbour: a stand-in, identical for both runs
        rows = np.arange(h) * image.shape[0] // h
        cols = np.arange(w) * image.shape[1] // w
        return image[rows][:, cols]

    m.resize = resize  # type: ignore[attr-defined]
    return m


def _fake_torchvision() -> dict[str, types.ModuleType]:
    import torch
    from PIL import Image

    class FashionMNIST:
        def __init__(self, root: str, train: bool = True, download: bool = False,
                     transform: Any = None, target_transform: Any = None) -> None:
            rng = np.random.default_rng(3)
            self.data = torch.from_numpy(rng.integers(0, 256, (400, 28, 28), dtype=np.uint8))
            self.targets = rng.integers(0, 10, 400).tolist()
            self.transform, self.target_transform = transform, target_transform

        def __len__(self) -> int:
            return len(self.targets)

        def __getitem__(self, i: int) -> tuple[Any, Any]:
            img, target = Image.fromarray(self.data[i].numpy(), mode="L"), self.targets[i]
            if self.transform is not None:
                img = self.transform(img)
            if self.target_transform is not None:
                target = self.target_transform(target)
            return img, target

        def __repr__(self) -> str:
            return f"Dataset FashionMNIST (local stand-in)\n    Number of datapoints: {len(self)}"

    class ToTensor:
        def __call__(self, pic: Any) -> Any:
            return torch.from_numpy(np.asarray(pic, dtype=np.float32)[None] / 255.0)

    class Lambda:
        def __init__(self, fn: Any) -> None:
            self.fn = fn

        def __call__(self, x: Any) -> Any:
            return self.fn(x)

    tv = types.ModuleType("torchvision")
    ds = types.ModuleType("torchvision.datasets")
    tr = types.ModuleType("torchvision.transforms")
    ds.FashionMNIST = FashionMNIST  # type: ignore[attr-defined]
    tr.ToTensor, tr.Lambda = ToTensor, Lambda  # type: ignore[attr-defined]
    tv.datasets, tv.transforms = ds, tr  # type: ignore[attr-defined]
    return {"torchvision": tv, "torchvision.datasets": ds, "torchvision.transforms": tr}


_REVIEWS = ["Great app, works offline and syncs fast", "Crashes every time I open settings",
            "Decent but the ads are too loud", "Love the new dark theme", "Battery drain after update",
            "Five stars, simple and clean", "Cannot log in since yesterday", "Useful widgets and tips",
            "Too many permissions for a notes app", "Best calendar I have used"]


class LocalRows:
    """Stands in for a Hugging Face `datasets.Dataset` split: random access to fresh dicts
    (mutating one never changes the next read, as with HF), the demo's column names."""

    def __init__(self, split: str, n: int, offset: int) -> None:
        self.split = split
        self._rows = [{"package_name": f"com.example.app{(i + offset) % 4}", "review": _REVIEWS[(i + offset) % 10],
                       "date": f"{['January', 'March', 'July', 'October'][i % 4]} {1 + 3 * i % 28:02d} 2017",
                       "star": 1 + (7 * (i + offset)) % 5, "version_id": 1000 + i + offset}
                      for i in range(n)]

    def __len__(self) -> int:
        return len(self._rows)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return dict(self._rows[i])

    def __repr__(self) -> str:
        return f"Dataset({{features: {list(self._rows[0])}, num_rows: {len(self)}}})"


def _fake_hf() -> dict[str, types.ModuleType]:
    ds = types.ModuleType("datasets")

    def load_dataset(name: str, **_: Any) -> dict[str, LocalRows]:
        return {"train": LocalRows("train", 10, 0), "test": LocalRows("test", 3, 10)}

    class AutoTokenizer:
        """A deterministic word-level stand-in for a Hub tokenizer (same call shape)."""

        @classmethod
        def from_pretrained(cls, name: str) -> AutoTokenizer:
            return cls()

        def __call__(self, text: str) -> dict[str, list[int]]:
            ids = [101] + [sum(map(ord, w)) % 30000 for w in text.lower().split()] + [102]
            return {"input_ids": ids, "token_type_ids": [0] * len(ids), "attention_mask": [1] * len(ids)}

        def __repr__(self) -> str:
            return "AutoTokenizer(local stand-in)"

    ds.load_dataset = load_dataset  # type: ignore[attr-defined]
    tf = types.ModuleType("transformers")
    tf.AutoTokenizer = AutoTokenizer  # type: ignore[attr-defined]
    return {"datasets": ds, "transformers": tf}


def _fake_bagz() -> dict[str, types.ModuleType]:
    """bagz's `Writer`/`Reader` over a local length-prefixed file (str records stored as UTF-8);
    `apache_beam` and `bagz.beam` import but are empty (their cells fail on both sides)."""
    import struct

    class Writer:
        def __init__(self, path: Any) -> None:
            self._f = open(path, "wb")  # noqa: SIM115 - closed by __exit__

        def write(self, rec: str | bytes) -> None:
            b = rec.encode() if isinstance(rec, str) else rec
            self._f.write(struct.pack("<I", len(b)) + b)

        def __enter__(self) -> Writer:
            return self

        def __exit__(self, *exc: Any) -> None:
            self._f.close()

    class Reader:
        def __init__(self, path: Any) -> None:
            data = open(path, "rb").read()  # noqa: SIM115
            self._recs, pos = [], 0
            while pos < len(data):
                (n,) = struct.unpack_from("<I", data, pos)
                self._recs.append(data[pos + 4:pos + 4 + n])
                pos += 4 + n

        def __len__(self) -> int:
            return len(self._recs)

        def __getitem__(self, i: Any) -> Any:
            return self._recs[i]

        def __iter__(self) -> Iterator[bytes]:
            return iter(self._recs)

    bz, beam_pkg, bagzio = (types.ModuleType(n) for n in ("bagz", "bagz.beam", "bagz.beam.bagzio"))
    bz.Writer, bz.Reader, bz.beam = Writer, Reader, beam_pkg  # type: ignore[attr-defined]
    beam_pkg.bagzio = bagzio  # type: ignore[attr-defined]
    return {"bagz": bz, "bagz.beam": beam_pkg, "bagz.beam.bagzio": bagzio,
            "apache_beam": types.ModuleType("apache_beam")}


def _stand_ins(page: str) -> dict[str, types.ModuleType]:
    mods: dict[str, types.ModuleType] = {"tensorflow_datasets": _fake_tfds()}
    if page == "data_loader":
        mods["cv2"] = _fake_cv2()
    if page == "pytorch":
        mods.update(_fake_torchvision())
    if page == "huggingface":
        mods.update(_fake_hf())
    if page == "bagz":
        mods.update(_fake_bagz())
    return mods


_PRELUDE = {
    # The page iterates `source` without defining it (a tfds image dataset with file names).
    "data_loader": "source = _L('images', 40, (32, 32, 3), 4, file_names=True)\n",
    "transformations": "import grain\nimport numpy as np\n",
}


@contextlib.contextmanager
def _page_env(page: str) -> Iterator[str]:
    saved_mods = {k: sys.modules.get(k) for k in _stand_ins(page)}
    cwd = os.getcwd()
    tmp = tempfile.mkdtemp(prefix=f"grain-tutorial-{page}-")
    sys.modules.update(_stand_ins(page))
    os.environ.setdefault("MPLBACKEND", "Agg")
    from absl import flags  # a notebook kernel has parsed them; Grain's workers read them
    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()
    os.chdir(tmp)
    try:
        yield tmp
    finally:
        os.chdir(cwd)
        shutil.rmtree(tmp, ignore_errors=True)
        for k, v in saved_mods.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v
        shutil.rmtree("/tmp/orbax", ignore_errors=True)
        _reset_grain_config()


def _reset_grain_config() -> None:
    import grain
    with contextlib.suppress(Exception):
        grain.config.update("py_debug_mode", False)
    with contextlib.suppress(Exception):
        grain.config.update("py_dataset_visualization_output_dir", None)


# --- running cells --------------------------------------------------------------------------------

@dataclass(frozen=True)
class CellRun:
    output: str
    error: BaseException | None


class _Timeout(Exception):
    pass


def _on_alarm(signum: int, frame: Any) -> None:
    raise _Timeout(f"cell ran longer than {CELL_TIMEOUT_S} s")


_ADDR = re.compile(r"0x[0-9a-fA-F]+|psm_[0-9a-f]{8}")  # addresses, Grain's random shm names


def run_cell(code: str, ns: dict[str, Any]) -> CellRun:
    """Runs one cell like a notebook: statements, then the repr of a last bare expression."""
    out = io.StringIO()
    old = signal.signal(signal.SIGALRM, _on_alarm)
    signal.alarm(CELL_TIMEOUT_S)
    try:
        with contextlib.redirect_stdout(out):
            tree = ast.parse(code)
            last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
            exec(compile(tree, "<cell>", "exec"), ns)
            if last is not None:
                value = eval(compile(ast.Expression(last.value), "<cell>", "eval"), ns)
                if value is not None:
                    print(pprint.pformat(value))
        error = None
    except BaseException as e:
        if isinstance(e, KeyboardInterrupt):
            raise
        error = e
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    return CellRun(_ADDR.sub("0x?", out.getvalue()), error)


def run_page(page: str, zephon: bool) -> list[CellRun]:
    runs = []
    with _page_env(page):
        ns: dict[str, Any] = {"__name__": "__main__"}
        np.random.seed(0)  # cells drawing from the global generators see the same draws
        random.seed(0)     # in both runs
        if page in _PRELUDE:
            exec(_PRELUDE[page], {**ns, "_L": LocalImages}, ns)
        for _cid, code in CELLS[page]:
            code = _shell_free(code)
            runs.append(run_cell(port(code) if zephon else code, ns))
    return runs


def classify(grain_run: CellRun, zephon_run: CellRun) -> str:
    from zephon.errors import ZephonError
    if grain_run.error is not None:
        return "grain fails"
    if zephon_run.error is not None:
        return "unsupported" if isinstance(zephon_run.error, ZephonError) else "broken"
    return "identical" if zephon_run.output == grain_run.output else "different"


@dataclass(frozen=True)
class CellResult:
    page: str
    cell: str
    status: str
    grain: CellRun
    zephon: CellRun


def run_all(pages: list[str] | None = None) -> list[CellResult]:
    results = []
    for page in pages or list(CELLS):
        g, z = run_page(page, zephon=False), run_page(page, zephon=True)
        for (cid, _code), gr, zr in zip(CELLS[page], g, z):
            results.append(CellResult(page, cid, classify(gr, zr), gr, zr))
    return results


STATUSES = ("identical", "different", "unsupported", "broken", "grain fails")


def tally(results: list[CellResult]) -> dict[str, Counter[str]]:
    t: dict[str, Counter[str]] = {}
    for r in results:
        t.setdefault(r.page, Counter())[r.status] += 1
    return t


def report(results: list[CellResult], verbose: bool = False) -> str:
    t = tally(results)
    lines = [f"{'page':<20}" + "".join(f"{s:>13}" for s in STATUSES)]
    total: Counter[str] = Counter()
    for page, c in t.items():
        total.update(c)
        lines.append(f"{page:<20}" + "".join(f"{c[s]:>13}" for s in STATUSES))
    lines.append(f"{'total':<20}" + "".join(f"{total[s]:>13}" for s in STATUSES))
    runnable = sum(total[s] for s in STATUSES[:4])
    lines.append(f"{total['identical']} of {runnable} cells that run offline on real Grain give "
                 "Grain's output exactly.")
    for r in results:
        if r.status != "identical" and (verbose or r.status != "grain fails"):
            err = r.zephon.error if r.status != "grain fails" else r.grain.error
            lines.append(f"  {r.page}/{r.cell}: {r.status}"
                         + (f": {type(err).__name__}: {str(err)[:300]}" if err is not None else ""))
            if verbose and r.status == "different":
                lines.append("    grain : " + r.grain.output[:600].replace("\n", "\n            "))
                lines.append("    zephon: " + r.zephon.output[:600].replace("\n", "\n            "))
    skipped = [f"  skipped {p}/{c}: {why}" for (p, c), why in SKIPPED_CELLS.items()]
    skipped += [f"  skipped page {p}: {why}" for p, why in SKIPPED_PAGES.items()]
    return "\n".join(lines + skipped)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("pages", nargs="*", help=f"pages (default all): {', '.join(CELLS)}")
    ap.add_argument("-v", "--verbose", action="store_true", help="show differing outputs")
    args = ap.parse_args(argv)
    print(report(run_all(args.pages or None), verbose=args.verbose))
    return 0


if __name__ == "__main__":
    sys.exit(main())
