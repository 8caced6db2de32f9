"""Geometry of image augmentation: resize, center crop, random-resized crop, flip, normalise.

A geometry spec (`Resize`, `CenterCrop`, `RandomResizedCrop`) answers one question: given an
image of h x w pixels and a generator, which box of the *original* image becomes an output of
which size. Because the box is chosen from the header's size before any pixel is decoded, the
decode operator (`zephon.media.ops.DecodeImage`) can decode a JPEG at 1/2, 1/4 or 1/8 of its size
when the box is that much larger than the output, then crop and resize the small image: the
random choices are the same, only the work is less.

The generator comes from the operator (seeded by loader seed, operator position, source, record,
epoch — `zephon.ops.base.record_seeds`), never from a worker or a call order, so the same record
gets the same crop and flip at every D, runner and emitter.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from zephon.errors import PlanError

Box = tuple[int, int, int, int]   # y, x, height, width in original pixels


def _size2(size: int | Sequence[int], what: str) -> tuple[int, int]:
    hw = (size, size) if isinstance(size, int) else tuple(int(s) for s in size)
    if len(hw) != 2 or min(hw) < 1:
        raise PlanError(f"{what} size must be a positive int or (height, width), got {size!r}")
    return int(hw[0]), int(hw[1])


@dataclass(frozen=True)
class Resize:
    """The whole image resized: to `size` (h, w) exactly, or its shorter side to `shorter`, or to
    at most `max_pixels` pixels (aspect kept; never enlarged by `max_pixels`). Outputs of varying
    size are ragged (object arrays); give `size` for fixed-size batches."""

    size: tuple[int, int] | None = None
    shorter: int | None = None
    max_pixels: int | None = None
    random = False

    def __post_init__(self) -> None:
        if sum(x is not None for x in (self.size, self.shorter, self.max_pixels)) != 1:
            raise PlanError("Resize takes exactly one of size=(h, w), shorter=N or max_pixels=N")
        if self.size is not None:
            object.__setattr__(self, "size", _size2(self.size, "Resize"))

    @property
    def fixed(self) -> tuple[int, int] | None:
        return self.size

    def plan(self, rng: Any, h: int, w: int) -> tuple[Box, tuple[int, int]]:
        if self.size is not None:
            return (0, 0, h, w), self.size
        if self.shorter is not None:
            s = self.shorter / min(h, w)
        else:
            s = min(1.0, math.sqrt(self.max_pixels / (h * w))) if self.max_pixels else 1.0
        return (0, 0, h, w), (max(1, round(h * s)), max(1, round(w * s)))

    def config(self) -> dict[str, Any]:
        return {"op": "resize", "size": list(self.size) if self.size else None,
                "shorter": self.shorter, "max_pixels": self.max_pixels}


@dataclass(frozen=True)
class CenterCrop:
    """The centered box with the output's aspect ratio covering `fraction` of the image (e.g.
    ImageNet evaluation's resize-256-crop-224 is `CenterCrop(224, fraction=224/256)`)."""

    size: int | tuple[int, int]
    fraction: float = 1.0
    random = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "size", _size2(self.size, "CenterCrop"))
        if not 0 < self.fraction <= 1:
            raise PlanError(f"CenterCrop fraction must be in (0, 1], got {self.fraction!r}")

    @property
    def fixed(self) -> tuple[int, int]:
        return self.size  # type: ignore[return-value]

    def plan(self, rng: Any, h: int, w: int) -> tuple[Box, tuple[int, int]]:
        oh, ow = self.fixed
        s = min(h / oh, w / ow) * self.fraction
        ch, cw = max(1, min(h, round(oh * s))), max(1, min(w, round(ow * s)))
        return ((h - ch) // 2, (w - cw) // 2, ch, cw), (oh, ow)

    def config(self) -> dict[str, Any]:
        return {"op": "center_crop", "size": list(self.fixed), "fraction": self.fraction}


@dataclass(frozen=True)
class RandomResizedCrop:
    """A box of random area (`scale` of the image) and aspect ratio (`ratio`, log-uniform), at a
    random place, resized to `size` — torchvision's algorithm (10 tries, then a center crop)."""

    size: int | tuple[int, int]
    scale: tuple[float, float] = (0.08, 1.0)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)
    random = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "size", _size2(self.size, "RandomResizedCrop"))
        if not (0 < self.scale[0] <= self.scale[1] <= 1) or not (0 < self.ratio[0] <= self.ratio[1]):
            raise PlanError(f"RandomResizedCrop needs 0 < scale[0] <= scale[1] <= 1 and 0 < ratio[0] <= "
                            f"ratio[1], got scale={self.scale!r} ratio={self.ratio!r}")
        object.__setattr__(self, "scale", (float(self.scale[0]), float(self.scale[1])))
        object.__setattr__(self, "ratio", (float(self.ratio[0]), float(self.ratio[1])))

    @property
    def fixed(self) -> tuple[int, int]:
        return self.size  # type: ignore[return-value]

    def plan(self, rng: Any, h: int, w: int) -> tuple[Box, tuple[int, int]]:
        area = h * w
        lo, hi = math.log(self.ratio[0]), math.log(self.ratio[1])
        for _ in range(10):
            target = area * rng.uniform(self.scale[0], self.scale[1])
            aspect = math.exp(rng.uniform(lo, hi))
            cw = round(math.sqrt(target * aspect))
            ch = round(math.sqrt(target / aspect))
            if 0 < cw <= w and 0 < ch <= h:
                y = int(rng.integers(0, h - ch + 1))
                x = int(rng.integers(0, w - cw + 1))
                return (y, x, ch, cw), self.fixed
        r = w / h
        if r < self.ratio[0]:
            cw, ch = w, round(w / self.ratio[0])
        elif r > self.ratio[1]:
            ch, cw = h, round(h * self.ratio[1])
        else:
            ch, cw = h, w
        return ((h - ch) // 2, (w - cw) // 2, ch, cw), self.fixed

    def config(self) -> dict[str, Any]:
        return {"op": "random_resized_crop", "size": list(self.fixed), "scale": list(self.scale),
                "ratio": list(self.ratio)}


Geometry = Resize | CenterCrop | RandomResizedCrop


def reduction_for(box: Box, out: tuple[int, int], limit: int = 8) -> int:
    """The largest power-of-two DCT reduction (<= limit) that keeps the box at least `out`."""
    _, _, ch, cw = box
    f = 1
    while f * 2 <= limit and ch / (f * 2) >= out[0] and cw / (f * 2) >= out[1]:
        f *= 2
    return f


def scaled_box(box: Box, factor: int, ah: int, aw: int) -> tuple[int, int, int, int]:
    """(y0, x0, y1, x1) of `box` (original pixels) in an image decoded at 1/factor (ah x aw):
    the corners rounded, at least one pixel kept."""
    y, x, ch, cw = box
    if factor > 1:
        y0, x0 = min(ah - 1, round(y / factor)), min(aw - 1, round(x / factor))
        return y0, x0, max(y0 + 1, min(ah, round((y + ch) / factor))), max(x0 + 1, min(aw, round((x + cw) / factor)))
    return y, x, min(ah, y + ch), min(aw, x + cw)


def crop_resize(a: np.ndarray, box: Box, out: tuple[int, int], factor: int, resize: str,
                dst: np.ndarray | None = None, flip: bool = False) -> np.ndarray:
    """Crops `box` (original pixels; `a` decoded at 1/factor) and resizes it to `out` (h, w);
    flips left-right when `flip`. Writes into `dst` when given (a slot of a preallocated batch)."""
    y0, x0, y1, x1 = scaled_box(box, factor, a.shape[0], a.shape[1])
    return resize_into(a[y0:y1, x0:x1], out, resize, dst, flip)


def resize_into(crop: np.ndarray, out: tuple[int, int], resize: str, dst: np.ndarray | None = None,
                flip: bool = False) -> np.ndarray:
    """Resizes `crop` [h, w, C] to `out` (h, w), flipped left-right when `flip`, into `dst`.

    OpenCV: bilinear when the remaining downscale is under 2x (after a reduced DCT decode it
    always is), area averaging when it is 2x or more — bilinear alone would alias there, which
    is what torchvision's `antialias=True` avoids. Pillow: bilinear with its own antialiasing."""
    oh, ow = out
    c = crop.shape[2]
    if dst is None:
        dst = np.empty((oh, ow, c), np.uint8)
    if crop.shape[0] == oh and crop.shape[1] == ow:
        r = crop
    elif resize == "opencv":
        import cv2
        shrink = min(crop.shape[0] / oh, crop.shape[1] / ow)
        mode = cv2.INTER_AREA if shrink >= 2 else cv2.INTER_LINEAR
        if c == 1:
            r = cv2.resize(crop[:, :, 0], (ow, oh), interpolation=mode)[:, :, None]
        else:   # straight into the batch's slot, flipped there in place (OpenCV's flip allows it)
            cv2.resize(crop, (ow, oh), dst=dst, interpolation=mode)
            if flip:
                cv2.flip(dst, 1, dst=dst)
            return dst
    else:
        from PIL import Image
        im = Image.fromarray(np.ascontiguousarray(crop[:, :, 0] if c == 1 else crop))
        r = np.asarray(im.resize((ow, oh), Image.Resampling.BILINEAR))
        r = r[:, :, None] if r.ndim == 2 else r
    if flip:
        _flip_into(r, dst)
    else:
        dst[...] = r
    return dst


def _flip_into(src: np.ndarray, dst: np.ndarray) -> None:
    """dst = src flipped left-right, in one pass (OpenCV's flip when src is 3-channel)."""
    if src.shape[2] == 3:
        try:
            import cv2
            cv2.flip(src, 1, dst=dst)
            return
        except ImportError:
            pass
    dst[...] = src[:, ::-1]


_M = (1 << 64) - 1


class Draws:
    """A small counter-based random stream (splitmix64) for one record: `uniform`, `integers`,
    `random` — the calls geometry specs make. Seeded by the record's 64-bit seed
    (`zephon.ops.base.record_seeds`), it costs a microsecond to set up where a numpy Generator
    costs a hundred, and gives the same numbers on every platform and numpy version."""

    __slots__ = ("state",)

    def __init__(self, seed: int) -> None:
        self.state = int(seed) & _M

    def _next(self) -> int:
        self.state = (self.state + 0x9E3779B97F4A7C15) & _M
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M
        return z ^ (z >> 31)

    def random(self) -> float:
        """A float in [0, 1) with 53 random bits."""
        return (self._next() >> 11) * (1.0 / (1 << 53))

    def uniform(self, low: float, high: float) -> float:
        return low + (high - low) * self.random()

    def integers(self, low: int, high: int) -> int:
        """An int in [low, high) (multiply-shift: no modulo bias worth naming below 2^32)."""
        return low + (((self._next() >> 32) * (high - low)) >> 32)


def normalize(images: np.ndarray, mean: Sequence[float], std: Sequence[float],
              dtype: Any = np.float32) -> np.ndarray:
    """(images / 255 - mean) / std per channel, vectorised over a [..., C] uint8 batch."""
    m = np.asarray(mean, dtype) * 255
    s = np.asarray(std, dtype) * 255
    return ((images.astype(dtype) - m) / s).astype(dtype, copy=False)
