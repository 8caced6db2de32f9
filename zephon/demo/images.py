"""Demo images: ImageNet-like JPEGs with captions, made from real photographs shipped in packages.

Nothing is downloaded: the photographs are the ones scikit-image (`skimage.data`: astronaut,
chelsea, coffee, rocket, hubble_deep_field, retina, immunohistochemistry, the stereo motorcycle
pair, and grayscale camera, coins, moon, brick, grass, gravel, cell, clock) and scikit-learn
(`load_sample_images`: china, flower) install with them. Each demo image is a random crop of one
of them (35-100 % of its area, aspect 3:4-4:3), resized so its longer side is 400-500 px
(`large=True`: 1600-2000 px, >= 2 MP), maybe flipped and darkened or brightened, and encoded as
JPEG at quality 70-95 with 4:4:4, 4:2:2 or 4:2:0 chroma subsampling — the spread of sizes,
qualities and subsamplings a real data set has, which is what decode speed depends on. Its
caption describes the photograph and the crop; its class is the photograph.

The images are written once as WebDataset tar shards (`<key>.jpg`, `.txt`, `.cls`, `.json`) under
`$ZEPHON_CACHE_DIR/demo/` (default `~/.cache/zephon/demo/`), with a tqdm progress bar, and reused.
"""

from __future__ import annotations

import io
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

VERSION = 1
PER_SHARD = 1000

#: name -> (loader, description used in captions)
PHOTOS: dict[str, tuple[str, str]] = {
    "astronaut": ("skimage", "an astronaut in a spacesuit in front of a flag"),
    "chelsea": ("skimage", "a tabby cat looking to the side"),
    "coffee": ("skimage", "a cup of coffee on a saucer"),
    "rocket": ("skimage", "a rocket on a launch pad"),
    "hubble_deep_field": ("skimage", "galaxies in the deep field of a telescope"),
    "retina": ("skimage", "the retina of a human eye"),
    "immunohistochemistry": ("skimage", "stained tissue under a microscope"),
    "stereo_motorcycle": ("skimage", "a motorcycle in a workshop"),
    "camera": ("skimage", "a black and white photo of a cameraman"),
    "coins": ("skimage", "a black and white photo of old coins"),
    "moon": ("skimage", "the surface of the moon"),
    "brick": ("skimage", "a brick wall"),
    "grass": ("skimage", "a patch of grass"),
    "gravel": ("skimage", "gravel on the ground"),
    "cell": ("skimage", "a cell under a microscope"),
    "clock": ("skimage", "a clock on a wall"),
    "china": ("sklearn", "a Chinese temple among trees"),
    "flower": ("sklearn", "a flower in bloom"),
}


def photographs() -> list[tuple[str, np.ndarray]]:
    """The source photographs as (name, uint8 HxW or HxWx3), in `PHOTOS` order."""
    out: list[tuple[str, np.ndarray]] = []
    sk: Any = None
    for name, (pkg, _) in PHOTOS.items():
        if pkg == "skimage":
            if sk is None:
                try:
                    import skimage.data as sk
                except ImportError as e:
                    raise ImportError("the demo images need scikit-image and scikit-learn: "
                                      "pip install 'zephon-loader[media]'") from e
            a = getattr(sk, name)()
            if isinstance(a, tuple):   # stereo_motorcycle: (left, right, disparity)
                a = a[0]
        else:
            from sklearn.datasets import load_sample_images
            imgs = load_sample_images()
            a = imgs.images[[f.split("/")[-1] for f in imgs.filenames].index(f"{name}.jpg")]
        out.append((name, np.asarray(a, dtype=np.uint8)))
    return out


def _one(rng: np.random.Generator, photos: list[tuple[str, np.ndarray]], large: bool) -> tuple[bytes, str, int, dict]:
    from PIL import Image, ImageEnhance

    cls = int(rng.integers(len(photos)))
    name, a = photos[cls]
    h, w = a.shape[:2]
    area = h * w * rng.uniform(0.35, 1.0)
    ratio = float(np.exp(rng.uniform(np.log(3 / 4), np.log(4 / 3))))
    cw, ch = min(w, round((area * ratio) ** 0.5)), min(h, round((area / ratio) ** 0.5))
    y, x = int(rng.integers(0, h - ch + 1)), int(rng.integers(0, w - cw + 1))
    im = Image.fromarray(a[y:y + ch, x:x + cw])
    longer = int(rng.integers(1600, 2001)) if large else int(rng.integers(400, 501))
    s = longer / max(ch, cw)
    im = im.resize((max(1, round(cw * s)), max(1, round(ch * s))), Image.Resampling.BICUBIC)
    flip = bool(rng.random() < 0.5)
    if flip:
        im = im.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    light = float(rng.choice([0.7, 1.0, 1.0, 1.3]))
    if light != 1.0:
        im = ImageEnhance.Brightness(im).enhance(light)
    quality = int(rng.choice([70, 75, 85, 90, 95]))
    sub = int(rng.choice([0, 1, 2]))        # Pillow: 0 = 4:4:4, 1 = 4:2:2, 2 = 4:2:0
    buf = io.BytesIO()
    im.save(buf, "JPEG", quality=quality, subsampling=sub if im.mode == "RGB" else 0)
    zoom = "a close-up of" if area < 0.6 * h * w else "a photo of"
    light_word = {0.7: ", in dim light", 1.3: ", brightly lit"}.get(light, "")
    caption = f"{zoom} {PHOTOS[name][1]}{light_word}"
    meta = {"photo": name, "width": im.size[0], "height": im.size[1], "quality": quality,
            "subsampling": ["4:4:4", "4:2:2", "4:2:0"][sub] if im.mode == "RGB" else "gray", "flip": flip}
    return buf.getvalue(), caption, cls, meta


@dataclass(frozen=True)
class DemoImages:
    """Where the demo images are: WebDataset shards, `count` samples, `PER_SHARD` per shard."""

    shards: tuple[str, ...]
    count: int
    large: bool

    def jpegs(self) -> list[bytes]:
        """All JPEG bytes in sample order (for benchmarks that need them in memory)."""
        from zephon.sources.webdataset import WebDatasetSource

        src = WebDatasetSource(list(self.shards), ["jpg"], decode=False)
        return list(src.read(np.arange(len(src)))["jpg"])


def demo_dir() -> str:
    root = os.environ.get("ZEPHON_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "zephon")
    return os.path.join(root, "demo")


def demo_images(count: int = 20_000, *, large: bool = False, seed: int = 0, directory: str | None = None,
                progress: bool = True, on_shard: Callable[[str], None] | None = None) -> DemoImages:
    """Builds (once) and returns `count` demo JPEGs with captions as WebDataset shards.

    Sample i is a pure function of (seed, i, large) and the Pillow version, so a set is
    rebuilt only when one of them changes (they name the directory)."""
    from PIL import __version__ as pil_version

    from zephon.sources.webdataset import write_webdataset

    kind = "large" if large else "imagenet"
    root = os.path.join(directory or demo_dir(), f"images-v{VERSION}-{kind}-s{seed}-pil{pil_version}")
    os.makedirs(root, exist_ok=True)
    n_shards = -(-count // PER_SHARD)
    # a shard is named by its sample range, so sets of different counts share their full shards
    shards = [os.path.join(root, f"{kind}-{k * PER_SHARD:08d}-{min(count, (k + 1) * PER_SHARD):08d}.tar")
              for k in range(n_shards)]
    todo = [k for k in range(n_shards) if not os.path.exists(shards[k])]
    photos = photographs() if todo else []
    bar = None
    if todo and progress:
        from tqdm import tqdm
        bar = tqdm(total=sum(min(PER_SHARD, count - k * PER_SHARD) for k in todo),
                   desc=f"demo images ({kind}, once)", unit="img")
    for k in todo:
        samples = []
        for i in range(k * PER_SHARD, min(count, (k + 1) * PER_SHARD)):
            rng = np.random.default_rng([seed, i, int(large)])
            jpg, caption, cls, meta = _one(rng, photos, large)
            samples.append({"__key__": f"{i:08d}", "jpg": jpg, "txt": caption, "cls": cls,
                            "json": json.dumps(meta)})
            if bar is not None:
                bar.update(1)
        tmp = f"{shards[k]}.tmp-{os.getpid()}"
        write_webdataset(tmp, samples)
        os.replace(tmp, shards[k])
        if on_shard is not None:
            on_shard(shards[k])
    if bar is not None:
        bar.close()
    return DemoImages(tuple(shards), count, large)


def tiny_images(directory: str, count: int = 256, *, corrupt: tuple[int, ...] = (), seed: int = 0,
                name: str = "tiny", shards: int = 2) -> list[str]:
    """A small WebDataset set for tests and `zephon verify`: `count` JPEGs of 40-96 px (crops of
    the same photographs, varied sizes and subsamplings) with captions and classes, in `shards`
    shards; the samples in `corrupt` get truncated JPEG bytes (for `on_error='skip'`). Returns
    the shard paths."""
    from zephon.sources.webdataset import write_webdataset

    os.makedirs(directory, exist_ok=True)
    photos = photographs()
    paths = [os.path.join(directory, f"{name}-{k}.tar") for k in range(shards)]
    for k, path in enumerate(paths):
        samples = []
        for i in range(k * count // shards, (k + 1) * count // shards):
            rng = np.random.default_rng([seed, i, 7])
            jpg, caption, cls, meta = _one(rng, photos, False)
            from PIL import Image
            src = Image.open(io.BytesIO(jpg))
            s = int(rng.integers(40, 97)) / max(src.size)
            im = src.resize((max(8, round(src.size[0] * s)), max(8, round(src.size[1] * s))))
            buf = io.BytesIO()
            im.save(buf, "JPEG", quality=meta["quality"])
            data = buf.getvalue()
            if i in corrupt:
                data = data[: len(data) // 3]
            samples.append({"__key__": f"{name}-{i:06d}", "jpg": data, "txt": caption, "cls": cls})
        tmp = f"{path}.tmp-{os.getpid()}"
        write_webdataset(tmp, samples)
        os.replace(tmp, path)
    return paths
