"""Images, head to head: decode + random-resized crop 224 + flip + batch 256 on two cores.

Issue 36's targets, measured in one run on the same images:

  limit     the work itself: a 2-process `multiprocessing.Pool` whose workers decode, crop,
            resize and flip the in-memory JPEGs in a plain loop with the same libraries and the
            same decode rule as Zephon (`fast_work`: libjpeg-turbo's region decode at a reduced
            DCT scale through `zephon.media.libjpeg`, else simplejpeg's reduced DCT; OpenCV
            resize), returning only a checksum —
            no loader, no batch assembly, no transfer: the ceiling for two cores.
  zephon    `Loader(Source(n).shuffle(0).repeat().lanes(8).batch(256), WebDatasetSource(tar
            shards), [DecodeImage("jpg", RandomResizedCrop(224), flip=0.5)], runner=processes(2))`
            -> numpy [256, 224, 224, 3] uint8 batches in the consumer. Target >= 90 % of limit.
  grain     `MapDataset.source(ArrayRecordDataSource(jpeg records)).shuffle(0).repeat()
            .random_map(decode+crop+flip).batch(256).to_iter_dataset().mp_prefetch(2 workers)`,
            its decode in two variants: Pillow (Grain's tutorials) and the same `fast_work` as the
            limit (libjpeg-turbo or simplejpeg + OpenCV: the strongest Grain one can write).
  torch     `DataLoader(Dataset over JPEG files on disk, batch_size=256, shuffle, num_workers=2)`,
            Pillow decode + RandomResizedCrop + flip as torchvision does for PIL images
            (torchvision itself does not load with the CPU torch pinned here).
  wds       `webdataset.WebDataset(tar shards).shuffle(1000).decode("pil").to_tuple("jpg")
            .map_tuple(crop+flip).batched(256)` under `WebLoader(num_workers=2)`, as its docs write it.
  Target: zephon >= 1.2x the best of grain, torch, wds.

Large images (>= 2 MP, the demo's large set), the same pipeline with `reduce=True` (JPEG decoded
at 1/2, 1/4, 1/8 when the crop is that much larger than 224, and only the crop's region of it)
against `reduce=False` (the whole image decoded at full size by the same library): target >= 3x.
Twice: on the JPEGs as they are ("large"), and on the same JPEGs with restart markers every
~64 px (`zephon.media.restart_webdataset`, lossless: the same pixels), where the region decode
entropy-decodes only the crop's rectangle ("large+RST"); both pipelines read the same shards.
The JSON names the decoders (`zephon_decoder`, `limit_jpeg_decoder`) and gives the ratio both as
rates and as CPU ms per image of the process tree. Peak RSS of the consumer and of the largest
worker is reported for the Zephon runs, with the configuration that bounds it.

Every case runs `--rounds` times, interleaved, best window kept (load from other work only slows
a case down); the 1-minute load average before each window is recorded. Writes
benchmarks/results/images.json and images.png. Run it under `flock /tmp/zephon-bench.lock`.

    python benchmarks/images.py            # ~4 minutes on 2 cores (builds the demo images once)
    python benchmarks/images.py --quick
"""

from __future__ import annotations

import argparse
import io
import json
import math
import multiprocessing as mp
import os
import platform
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

BATCH = 256
SIZE = 224
SCALE = (0.08, 1.0)
RATIO = (3 / 4, 4 / 3)


# --- the work, written plainly (the limit and the Grain "fast" peer) ----------------------------
def _box(rng: np.random.Generator, h: int, w: int) -> tuple[int, int, int, int]:
    area = h * w
    for _ in range(10):
        t = area * rng.uniform(*SCALE)
        a = math.exp(rng.uniform(math.log(RATIO[0]), math.log(RATIO[1])))
        cw, ch = round(math.sqrt(t * a)), round(math.sqrt(t / a))
        if 0 < cw <= w and 0 < ch <= h:
            return int(rng.integers(0, h - ch + 1)), int(rng.integers(0, w - cw + 1)), ch, cw
    s = min(h, w)
    return (h - s) // 2, (w - s) // 2, s, s


def _libjpeg() -> Any:
    """`zephon.media.libjpeg` (libjpeg-turbo's region decode) when its C module loads."""
    from zephon.media import libjpeg
    return libjpeg if libjpeg.available() else None


def jpeg_decoder() -> str:
    """The JPEG library `fast_work` (and Zephon's auto decoder) uses here."""
    return "libjpeg-turbo" if _libjpeg() is not None else "simplejpeg"


def fast_work(data: bytes, rng: np.random.Generator, reduce: bool = True) -> np.ndarray:
    """Zephon's decode rule written plainly: the crop box from the header; with `reduce`, the
    JPEG decoded at the largest 1/2, 1/4, 1/8 DCT scale keeping the box >= 224 and (libjpeg-turbo)
    only the box's region of it; without, the whole image at full size by the same library.
    Then OpenCV resize (area when shrinking >= 2x, else bilinear) + flip."""
    import cv2
    import simplejpeg

    tj = _libjpeg()
    h, w = tj.header(data)[:2] if tj is not None else simplejpeg.decode_jpeg_header(data)[:2]
    y, x, ch, cw = _box(rng, h, w)
    f = 1
    while reduce and f < 8 and ch / (2 * f) >= SIZE and cw / (2 * f) >= SIZE:
        f *= 2
    y0, x0 = min(-(-h // f) - 1, round(y / f)), min(-(-w // f) - 1, round(x / f))
    y1 = max(y0 + 1, min(-(-h // f), round((y + ch) / f)))
    x1 = max(x0 + 1, min(-(-w // f), round((x + cw) / f)))
    if not reduce:
        full = tj.decode(data) if tj is not None else simplejpeg.decode_jpeg(data)
        crop = full[y:y + ch, x:x + cw]
    elif tj is not None:
        crop = tj.decode(data, f, (y0, x0, y1, x1))
    elif f > 1:
        crop = simplejpeg.decode_jpeg(data, min_height=-(-h // f), min_width=-(-w // f))[y0:y1, x0:x1]
    else:
        crop = simplejpeg.decode_jpeg(data)[y:y + ch, x:x + cw]
    shrink = min(crop.shape[0], crop.shape[1]) / SIZE   # antialias a >= 2x shrink, as Zephon does
    out = cv2.resize(crop, (SIZE, SIZE), interpolation=cv2.INTER_AREA if shrink >= 2 else cv2.INTER_LINEAR)
    return cv2.flip(out, 1) if rng.random() < 0.5 else out


def pil_work(data: bytes, rng: np.random.Generator) -> np.ndarray:
    """Pillow decode + crop-and-resize in one `resize(box=...)` + flip (torchvision's PIL path)."""
    from PIL import Image

    im = Image.open(io.BytesIO(data)).convert("RGB")
    w, h = im.size
    y, x, ch, cw = _box(rng, h, w)
    im = im.resize((SIZE, SIZE), Image.Resampling.BILINEAR, box=(x, y, x + cw, y + ch))
    if rng.random() < 0.5:
        im = im.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    return np.asarray(im)


# --- limit: a 2-process pool doing exactly the work --------------------------------------------
_JPEGS: list[bytes] = []


def _limit_chunk(args: tuple[int, int, str]) -> int:
    import cv2
    cv2.setNumThreads(1)
    start, n, how = args
    rng = np.random.default_rng(start)
    batch = np.empty((n, SIZE, SIZE, 3), np.uint8)   # the work ends in a batch, as a loader's does
    for i in range(start, start + n):
        data = _JPEGS[i % len(_JPEGS)]
        batch[i - start] = pil_work(data, rng) if how == "pillow" else fast_work(data, rng, how == "reduce")
    return n


def limit_stream(jpegs: list[bytes], reduce: bool = True, pillow: bool = False) -> Iterator[int]:
    """The work in a plain loop on a 2-process pool: simplejpeg + OpenCV (reduced DCT or not), or
    Pillow's full decode + `resize(box=...)` (what torchvision does with PIL images)."""
    global _JPEGS
    _JPEGS = jpegs
    how = "pillow" if pillow else "reduce" if reduce else "full"
    with mp.get_context("fork").Pool(2) as pool:
        yield from pool.imap(_limit_chunk, ((k * BATCH, BATCH, how) for k in range(10 ** 9)), chunksize=1)


# --- zephon --------------------------------------------------------------------------------------
def zephon_stream(shards: list[str], reduce: bool = True, depth: int | None = None) -> Iterator[int]:
    import zephon as z
    from zephon.media.augment import RandomResizedCrop
    from zephon.media.ops import DecodeImage
    from zephon.runners import processes
    from zephon.sources.webdataset import WebDatasetSource

    src = WebDatasetSource(shards, ["jpg", "cls"])
    ops = [DecodeImage("jpg", RandomResizedCrop(SIZE, SCALE, RATIO), flip=0.5, reduce=reduce)]
    loader = z.Loader(z.Pipeline(z.Source(len(src)).shuffle(0).repeat().lanes(8).batch(BATCH), src, ops),
                      how=z.How(runner=processes(2, depth=depth), telemetry=False))
    try:
        for b in loader:
            assert b.data["jpg"].shape == (BATCH, SIZE, SIZE, 3)
            yield BATCH
    finally:
        loader.close()


# --- grain ---------------------------------------------------------------------------------------
class _GrainFast:
    def random_map(self, element: bytes, rng: np.random.Generator) -> np.ndarray:
        return fast_work(element, rng)


class _GrainPil:
    def random_map(self, element: bytes, rng: np.random.Generator) -> np.ndarray:
        return pil_work(element, rng)


def grain_stream(ar_paths: list[str], variant: str) -> Iterator[int]:
    from absl import flags
    flags.FLAGS.mark_as_parsed()
    import grain
    import grain.python as gp

    cls = _GrainFast if variant == "fast" else _GrainPil
    src = gp.ArrayRecordDataSource(ar_paths)
    fn = cls()
    ds = (grain.MapDataset.source(src).shuffle(seed=0).repeat()
          .random_map(fn.random_map, seed=0).batch(BATCH))
    it = ds.to_iter_dataset(grain.ReadOptions(num_threads=0)).mp_prefetch(
        grain.MultiprocessingOptions(num_workers=2))
    for b in it:
        assert b.shape == (BATCH, SIZE, SIZE, 3)
        yield BATCH


# --- torch ---------------------------------------------------------------------------------------
class _TorchFiles:
    """A map-style Dataset over JPEG files, decoded and cropped with Pillow (torchvision's way)."""

    def __init__(self, paths: list[str]) -> None:
        self.paths = paths

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> Any:
        import torch
        with open(self.paths[i], "rb") as f:
            data = f.read()
        rng = np.random.default_rng()   # torchvision draws from the worker's global RNG
        return torch.from_numpy(np.array(pil_work(data, rng)))   # writable, as pil_to_tensor copies


def torch_stream(files: list[str]) -> Iterator[int]:
    import torch
    from torch.utils.data import DataLoader

    torch.set_num_threads(1)
    while True:
        dl = DataLoader(_TorchFiles(files), batch_size=BATCH, shuffle=True, num_workers=2,
                        drop_last=True, persistent_workers=False, prefetch_factor=2)
        for b in dl:
            assert tuple(b.shape) == (BATCH, SIZE, SIZE, 3)
            yield BATCH


# --- webdataset ----------------------------------------------------------------------------------
def _wds_map(im: Any) -> np.ndarray:
    from PIL import Image
    w, h = im.size
    rng = np.random.default_rng()
    y, x, ch, cw = _box(rng, h, w)
    im = im.resize((SIZE, SIZE), Image.Resampling.BILINEAR, box=(x, y, x + cw, y + ch))
    if rng.random() < 0.5:
        im = im.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    return np.asarray(im)


def wds_stream(shards: list[str]) -> Iterator[int]:
    import webdataset as wds

    ds = (wds.WebDataset(shards, shardshuffle=False, empty_check=False).repeat().shuffle(1000)
          .decode("pil").to_tuple("jpg").map_tuple(_wds_map).batched(BATCH, partial=False))
    loader = wds.WebLoader(ds, batch_size=None, num_workers=2)
    for b in loader:
        assert b[0].shape == (BATCH, SIZE, SIZE, 3)
        yield BATCH


# --- measuring -----------------------------------------------------------------------------------
def _tree_cpu() -> dict[int, float]:
    """CPU seconds (user + system) of this process and every descendant, by pid (Linux /proc)."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[int, float] = {}
    for pid in [os.getpid(), *_descendants(os.getpid())]:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            out[pid] = (int(fields[11]) + int(fields[12])) / tick
        except (OSError, IndexError, ValueError):
            continue
    return out


def measure(stream: Iterable[int], warmup: int, seconds: float) -> dict[str, float]:
    """Images per second over a window after `warmup` batches, and the CPU seconds per image the
    process tree (consumer + workers) spent in it: a second view of the work that other load on
    the machine disturbs less than the rate (a worker started and ended inside the window, as
    torch's per-epoch workers are, is missed: its row's CPU figure is a lower bound)."""
    it = iter(stream)
    t_start = time.perf_counter()
    for _ in range(warmup):
        next(it)
    first = time.perf_counter() - t_start
    cpu0 = _tree_cpu()
    t0 = time.perf_counter()
    n = 0
    while time.perf_counter() - t0 < seconds:
        n += next(it)
    dt = time.perf_counter() - t0
    cpu1 = _tree_cpu()
    cpu = sum(v - cpu0.get(pid, 0.0) for pid, v in cpu1.items())
    close = getattr(it, "close", None)
    if close is not None:
        close()
    return {"images_per_s": n / dt, "images": n, "seconds": dt, "warmup_s": first,
            "cpu_ms_per_image": 1000 * cpu / max(n, 1)}


def prepare(count: int, large_count: int, root: Path) -> dict[str, Any]:
    from zephon.demo.images import demo_images
    from zephon.sources import write_array_record

    imgs = demo_images(20_000)           # the demo set; the benchmark reads its first shards
    shards = list(imgs.shards[: -(-count // 1000)])
    from zephon.sources.webdataset import WebDatasetSource
    src = WebDatasetSource(shards, ["jpg"], decode=False)
    jpegs = list(src.read(np.arange(len(src)))["jpg"])
    large = demo_images(large_count, large=True)
    large_jpegs = large.jpegs()
    from zephon.media import restart_webdataset
    (root / "rst").mkdir(exist_ok=True)
    rst_shards = [str(root / "rst" / Path(s).name) for s in large.shards]
    for s, d in zip(large.shards, rst_shards):
        restart_webdataset(s, d)
    rst_jpegs = list(WebDatasetSource(rst_shards, ["jpg"], decode=False).read(np.arange(len(large_jpegs)))["jpg"])
    ar = root / "grain"
    ar.mkdir(exist_ok=True)
    ar_paths = []
    for k in range(4):
        p = ar / f"jpegs-{k:05d}-of-00004"
        write_array_record(p, jpegs[k::4] if False else jpegs[k * len(jpegs) // 4:(k + 1) * len(jpegs) // 4])
        ar_paths.append(str(p))
    files = root / "files"
    files.mkdir(exist_ok=True)
    paths = []
    for i, j in enumerate(jpegs):
        p = files / f"{i:08d}.jpg"
        p.write_bytes(j)
        paths.append(str(p))
    sizes = np.array([len(j) for j in jpegs])
    return {"shards": shards, "jpegs": jpegs, "ar": ar_paths, "files": paths, "large_shards": list(large.shards),
            "large_jpegs": large_jpegs, "rst_shards": rst_shards, "rst_jpegs": rst_jpegs,
            "mean_kb": float(sizes.mean() / 1024)}


def _hwm_mb(pid: int | str) -> float:
    """Peak resident set (VmHWM) of a process, in MB (reset by exec, unlike ru_maxrss)."""
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) / 1024


def _descendants(root: int) -> list[int]:
    parent: dict[int, int] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    parent[int(d)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
    out, todo = [], [root]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        out += kids
        todo += kids
    return out


def memory_probe(shards: list[str], reduce: bool, batches: int) -> dict[str, float]:
    """Peak RSS (VmHWM) of a fresh process running the Zephon pipeline for `batches` batches, and
    of its largest worker (every descendant process: the runner's workers and fork server)."""
    import subprocess
    code = (f"import sys, os, json; sys.path.insert(0, {str(HERE)!r}); import images as B; "
            f"it = B.zephon_stream({shards!r}, reduce={reduce!r}); "
            f"[next(it) for _ in range({batches})]; "
            "kids = [B._hwm_mb(p) for p in B._descendants(os.getpid())]; it.close(); "
            "print(json.dumps({'consumer_mb': B._hwm_mb('self'), 'largest_worker_mb': max(kids, default=0.0), "
            "'processes': 1 + len(kids)}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def memory(data: dict[str, Any]) -> dict[str, Any]:
    return {"imagenet-size, processes(2), depth 4 (default), 20 batches": memory_probe(data["shards"], True, 20),
            "large (>= 2 MP), processes(2), depth 4, 8 batches": memory_probe(data["large_shards"], True, 8),
            "batch_mb": BATCH * SIZE * SIZE * 3 / 2**20,
            "bound": "depth (4) x max(16 MB, one batch) of pixels in flight + the batch in use + one "
                     "decoded image per worker (<= max_pixels x 3 bytes)"}


def run(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="zephon-bench-images-") as tmp:
        data = prepare(args.images, args.large, Path(tmp))
        import cv2
        cv2.setNumThreads(1)
        import simplejpeg
        from PIL import Image

        from zephon.media.decode import decoder_identity
        dims = [simplejpeg.decode_jpeg_header(j)[:2] for j in data["jpegs"][:2000]]
        ldims = [simplejpeg.decode_jpeg_header(j)[:2] for j in data["large_jpegs"]]
        cases: dict[str, Any] = {
            "limit": lambda: limit_stream(data["jpegs"]),
            "zephon": lambda: zephon_stream(data["shards"]),
            f"grain ({jpeg_decoder()}+OpenCV)": lambda: grain_stream(data["ar"], "fast"),
            "grain (Pillow)": lambda: grain_stream(data["ar"], "pil"),
            "torch DataLoader (Pillow)": lambda: torch_stream(data["files"]),
            "webdataset (Pillow)": lambda: wds_stream(data["shards"]),
            "large: zephon reduced DCT": lambda: zephon_stream(data["large_shards"], reduce=True),
            "large: zephon full decode": lambda: zephon_stream(data["large_shards"], reduce=False),
            "large: limit reduced DCT": lambda: limit_stream(data["large_jpegs"], True),
            "large: limit full decode": lambda: limit_stream(data["large_jpegs"], False),
            "large: Pillow full decode + resize(box) loop": lambda: limit_stream(data["large_jpegs"], pillow=True),
            "large+RST: zephon reduced DCT": lambda: zephon_stream(data["rst_shards"], reduce=True),
            "large+RST: zephon full decode": lambda: zephon_stream(data["rst_shards"], reduce=False),
            "large+RST: limit reduced DCT": lambda: limit_stream(data["rst_jpegs"], True),
            "large+RST: limit full decode": lambda: limit_stream(data["rst_jpegs"], False),
        }
        if args.only:
            cases = {k: v for k, v in cases.items() if any(o in k for o in args.only)}
        windows: dict[str, list[dict[str, Any]]] = {k: [] for k in cases}
        for rnd in range(args.rounds):
            for name, make in cases.items():
                load = os.getloadavg()[0]
                m = {**measure(make(), args.warmup, args.seconds), "load_1min_before": load}
                windows[name].append(m)
                print(f"round {rnd}: {name:30s} {m['images_per_s']:8,.0f} img/s  {m['cpu_ms_per_image']:6.2f} "
                      f"CPU ms/img  (load {load:.1f})", flush=True)
        rss = memory(data)
    rows = {k: max(v, key=lambda m: m["images_per_s"]) | {"windows": [m["images_per_s"] for m in v]}
            for k, v in windows.items()}
    rate = {k: r["images_per_s"] for k, r in rows.items()}
    out: dict[str, Any] = {"rows": rows, "batch": BATCH, "size": SIZE, "images": len(data["jpegs"]),
                           "mean_jpeg_kb": data["mean_kb"],
                           "mean_pixels": float(np.mean([h * w for h, w in dims])),
                           "large_images": len(data["large_jpegs"]),
                           "large_mean_pixels": float(np.mean([h * w for h, w in ldims])),
                           "peak_rss": rss, "pillow": Image.__version__, "simplejpeg": simplejpeg.__version__,
                           "zephon_decoder": decoder_identity(), "limit_jpeg_decoder": jpeg_decoder(),
                           "opencv": cv2.__version__,
                           "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                                       "loadavg_end": os.getloadavg()},
                           "timing": {"warmup_batches": args.warmup, "seconds": args.seconds, "rounds": args.rounds}}
    if "zephon" in rate and "limit" in rate:
        out["zephon_over_limit"] = rate["zephon"] / rate["limit"]
        out["target_over_limit"] = 0.9
    peers = [k for k in rate if k.startswith(("grain", "torch", "webdataset"))]
    if "zephon" in rate and peers:
        best = max(peers, key=lambda k: rate[k])
        out["best_peer"] = best
        out["zephon_over_best_peer"] = rate["zephon"] / rate[best]
        out["target_over_best_peer"] = 1.2
    cpu = {k: min(m["cpu_ms_per_image"] for m in windows[k]) for k in windows}   # least disturbed
    for tag, key in (("large", "large"), ("large+RST", "large_rst")):
        a, b = f"{tag}: zephon reduced DCT", f"{tag}: zephon full decode"
        if a in rate and b in rate:
            out[f"{key}_reduced_over_full"] = rate[a] / rate[b]
            out[f"{key}_full_over_reduced_cpu_per_image"] = cpu[b] / cpu[a]
            out["target_large"] = 3.0
    if "large: zephon reduced DCT" in rate:
        out["large_rst_mean_kb_over_plain"] = (np.mean([len(j) for j in data["rst_jpegs"]])
                                               / np.mean([len(j) for j in data["large_jpegs"]]))
        if "large: Pillow full decode + resize(box) loop" in rate:   # context, not the target's metric
            out["large_reduced_over_pillow_full_loop"] = (rate["large: zephon reduced DCT"]
                                                          / rate["large: Pillow full decode + resize(box) loop"])
    return out


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["rows"])
    vals = [result["rows"][k]["images_per_s"] for k in names]
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(names) + 1.5))
    colors = ["tab:blue" if "zephon" in k else "tab:gray" if "limit" in k else "tab:orange" for k in names]
    ax.barh(names[::-1], vals[::-1], color=colors[::-1])
    for i, v in enumerate(vals[::-1]):
        ax.text(v, i, f" {v:,.0f}", va="center", fontsize=8)
    ax.set_xlabel("images / s (decode + random-resized crop 224 + flip, batch 256, 2 cores)")
    ax.set_title("Images: Zephon vs the work's limit and peers (best of rounds)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", type=int, default=4000)
    ap.add_argument("--large", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=6.0)
    ap.add_argument("--only", nargs="*")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", type=Path, default=HERE / "results")
    ap.add_argument("--memory-only", action="store_true", help="re-measure peak RSS into the existing JSON")
    args = ap.parse_args(argv)
    if args.memory_only:
        path = args.out / "images.json"
        result = json.loads(path.read_text())
        with tempfile.TemporaryDirectory(prefix="zephon-bench-images-") as tmp:
            result["peak_rss"] = memory(prepare(args.images, args.large, Path(tmp)))
        path.write_text(json.dumps(result, indent=1, default=float))
        print(json.dumps(result["peak_rss"], indent=1))
        return 0
    if args.quick:
        args.rounds, args.seconds = 1, 3.0
    result = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "images.json").write_text(json.dumps(result, indent=1, default=float))
    plot(result, args.out / "images.png")
    for k in ("zephon_over_limit", "zephon_over_best_peer", "large_reduced_over_full",
              "large_full_over_reduced_cpu_per_image", "large_rst_reduced_over_full",
              "large_rst_full_over_reduced_cpu_per_image", "large_reduced_over_pillow_full_loop"):
        if k in result:
            print(f"{k}: {result[k]:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
