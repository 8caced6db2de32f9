"""Large JPEGs cropped to 224: CPU milliseconds per image by decoder and decode strategy, one process.

Why: the large-image target of issue 36 (>= 3x the same pipeline with a full-size decode) is a
question of how much of a JPEG a crop has to decode. This measures each way of doing the same
work — the boxes `RandomResizedCrop(224)` draws, crop, resize to 224 (OpenCV: area when shrinking
>= 2x, else bilinear), flip — on the demo's large JPEGs, in `time.process_time` (CPU of this
process: other load on the machine disturbs it little), best of `--rounds`:

  full          the whole image decoded at full size, then cropped (the baseline)
  reduced       the whole image decoded at the crop's 1/2, 1/4, 1/8 DCT reduction
  region        only the crop's box at that reduction (zephon.media.libjpeg)
  region + RST  the same on the JPEGs rewritten with restart markers (add_restart_markers: lossless)

Writes benchmarks/results/image_decoders.json.

    python benchmarks/image_decoders.py            # ~1 minute
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from images import SIZE, _box  # noqa: E402


def _reduction(ch: int, cw: int) -> int:
    f = 1
    while f < 8 and ch / (2 * f) >= SIZE and cw / (2 * f) >= SIZE:
        f *= 2
    return f


def _resize_flip(crop: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    import cv2
    shrink = min(crop.shape[0], crop.shape[1]) / SIZE
    out = cv2.resize(crop, (SIZE, SIZE), interpolation=cv2.INTER_AREA if shrink >= 2 else cv2.INTER_LINEAR)
    return cv2.flip(out, 1) if rng.random() < 0.5 else out


def _scaled(box: tuple[int, int, int, int], f: int, h: int, w: int) -> tuple[int, int, int, int]:
    from zephon.media.augment import scaled_box
    return scaled_box(box, f, -(-h // f), -(-w // f))


def strategies() -> dict[str, Callable[[bytes, np.random.Generator], Any]]:
    import simplejpeg
    from PIL import Image

    from zephon.media import libjpeg

    def plan(data: bytes, rng: np.random.Generator) -> tuple[tuple[int, int, int, int], int, int, int]:
        h, w = simplejpeg.decode_jpeg_header(data)[:2]
        box = _box(rng, h, w)
        return box, _reduction(box[2], box[3]), h, w

    def simplejpeg_full(data: bytes, rng: np.random.Generator) -> Any:
        (y, x, ch, cw), _, _, _ = plan(data, rng)
        return _resize_flip(simplejpeg.decode_jpeg(data)[y:y + ch, x:x + cw], rng)

    def simplejpeg_reduced(data: bytes, rng: np.random.Generator) -> Any:
        box, f, h, w = plan(data, rng)
        a = simplejpeg.decode_jpeg(data, min_height=-(-h // f), min_width=-(-w // f))
        y0, x0, y1, x1 = _scaled(box, f, h, w)
        return _resize_flip(a[y0:y1, x0:x1], rng)

    def pillow_reduced(data: bytes, rng: np.random.Generator) -> Any:
        box, f, h, w = plan(data, rng)
        im = Image.open(__import__("io").BytesIO(data))
        im.draft("RGB", (math.ceil(w / f), math.ceil(h / f)))
        y0, x0, y1, x1 = _scaled(box, f, h, w)
        return _resize_flip(np.asarray(im.convert("RGB"))[y0:y1, x0:x1], rng)

    def libjpeg_full(data: bytes, rng: np.random.Generator) -> Any:
        (y, x, ch, cw), _, _, _ = plan(data, rng)
        return _resize_flip(libjpeg.decode(data)[y:y + ch, x:x + cw], rng)

    def libjpeg_reduced(data: bytes, rng: np.random.Generator) -> Any:
        box, f, h, w = plan(data, rng)
        y0, x0, y1, x1 = _scaled(box, f, h, w)
        return _resize_flip(libjpeg.decode(data, f)[y0:y1, x0:x1], rng)

    def libjpeg_region(data: bytes, rng: np.random.Generator) -> Any:
        box, f, h, w = plan(data, rng)
        return _resize_flip(libjpeg.decode(data, f, _scaled(box, f, h, w)), rng)

    return {"Pillow 'draft' reduced": pillow_reduced, "simplejpeg full": simplejpeg_full,
            "simplejpeg reduced": simplejpeg_reduced, "libjpeg-turbo full": libjpeg_full,
            "libjpeg-turbo reduced": libjpeg_reduced, "libjpeg-turbo region": libjpeg_region}


def run(args: argparse.Namespace) -> dict[str, Any]:
    import cv2
    import simplejpeg

    from zephon.demo.images import demo_images
    from zephon.media import libjpeg

    cv2.setNumThreads(1)
    plain = demo_images(args.large, large=True).jpegs()[: args.images]
    marked = [libjpeg.add_restart_markers(j) for j in plain]
    sets = {"plain": plain, "restart markers": marked}
    ms: dict[str, dict[str, float]] = {s: {} for s in sets}
    for _ in range(args.rounds):
        for s, jpegs in sets.items():
            for name, fn in strategies().items():
                rng = np.random.default_rng(0)
                t0 = time.process_time()
                for j in jpegs:
                    fn(j, rng)
                v = 1000 * (time.process_time() - t0) / len(jpegs)
                ms[s][name] = min(ms[s].get(name, math.inf), v)
    for s in ms:
        for name, v in ms[s].items():
            print(f"{s:16s} {name:26s} {v:6.2f} CPU ms/image")
    dims = [simplejpeg.decode_jpeg_header(j)[:2] for j in plain]
    out = {"cpu_ms_per_image": ms, "images": len(plain), "rounds": args.rounds,
           "mean_pixels": float(np.mean([h * w for h, w in dims])),
           "mean_kb": {s: float(np.mean([len(j) for j in v]) / 1024) for s, v in sets.items()},
           "libjpeg_turbo": libjpeg.library_version(), "simplejpeg": simplejpeg.__version__,
           "opencv": cv2.__version__}
    for s in ms:
        key = "full_over_region_" + s.replace(" ", "_")
        out[key] = ms[s]["libjpeg-turbo full"] / ms[s]["libjpeg-turbo region"]
        print(f"{s}: full / region = {out[key]:.2f}x")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--large", type=int, default=512, help="the demo's large set to build (or reuse)")
    ap.add_argument("--images", type=int, default=256, help="how many of them to time")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=HERE / "results")
    args = ap.parse_args(argv)
    result = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "image_decoders.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
