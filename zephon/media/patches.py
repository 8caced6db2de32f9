"""How an image becomes patches and placeholder tokens: the geometry of vision-language packing.

`Patches` fixes, from an image's header size alone, the size it is resized to and its patch grid
`(t, h, w)` — so a packer can plan rows before any pixel is decoded — and cuts decoded pixels
into patch vectors in the order a vision encoder with a spatial merger expects.

Two ways to size an image:

- **native resolution** (`tile=None`, Qwen2-VL's rule): each side is rounded to a multiple of
  `patch × merge`; if the area exceeds `max_pixels` (or falls below `min_pixels`), both sides are
  scaled by the same factor first (aspect ratio kept as closely as the multiples allow). The grid
  is `(1, H/patch, W/patch)`.
- **fixed tiles** (`tile=T`): the image is resized to `r × c` tiles of `T × T` pixels, `r·c ≤
  max_tiles` chosen to match its aspect ratio best (then the most tiles up to its own area); the
  grid is `(r·c, T/patch, T/patch)`, tiles in row-major order (Megatron-LM's / InternVL's tiling).

Patch order. Within an image (each tile), patches are listed so that the `merge × merge` patches
a spatial merger fuses into one token are consecutive: blocks of `merge × merge` in row-major
block order, row-major inside each block. Each patch vector holds `patch × patch × channels`
values, row-major, channels last. An image of grid `(t, h, w)` has `t·h·w` patches and
`t·h·w / merge²` placeholder tokens — an integer by construction.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from zephon.errors import PlanError, check_positive_int

__all__ = ["Patches"]


@dataclass(frozen=True)
class Patches:
    """Patch size, merge factor and sizing rule (see the module doc).

    Args:
      patch: patch side in pixels (14 for ViT-L/14, Qwen2-VL).
      merge: spatial merge factor: `merge × merge` patches make one placeholder token.
      max_pixels, min_pixels: the pixel budget of one image at native resolution.
      tile: fixed tiles of `tile × tile` pixels instead of native resolution (None: native).
      max_tiles: most tiles per image (tile mode).
      channels: 3 (RGB).
    """

    patch: int = 14
    merge: int = 2
    max_pixels: int = 448 * 448
    min_pixels: int = 56 * 56
    tile: int | None = None
    max_tiles: int = 1
    channels: int = 3

    def __post_init__(self) -> None:
        for k in ("patch", "merge", "max_pixels", "min_pixels", "max_tiles"):
            check_positive_int(getattr(self, k), f"Patches.{k}")
        if self.channels not in (1, 3):
            raise PlanError(f"Patches.channels must be 1 or 3, got {self.channels!r}")
        f = self.factor
        if self.tile is not None:
            check_positive_int(self.tile, "Patches.tile")
            if self.tile % f:
                raise PlanError(f"Patches.tile={self.tile} must be a multiple of patch × merge = {f}")
        elif self.max_pixels < f * f:
            raise PlanError(f"Patches.max_pixels={self.max_pixels} is below one merged patch "
                            f"({f}×{f} = {f * f} pixels); raise it")
        if self.tile is None and self.min_pixels > self.max_pixels:
            raise PlanError(f"Patches.min_pixels={self.min_pixels} exceeds max_pixels={self.max_pixels}")

    @property
    def factor(self) -> int:
        """Pixels per side of one merged token: `patch × merge`."""
        return self.patch * self.merge

    @property
    def dim(self) -> int:
        """Values per patch vector: `patch² × channels`."""
        return self.patch * self.patch * self.channels

    def config(self) -> dict[str, int | None]:
        return {"patch": self.patch, "merge": self.merge, "max_pixels": self.max_pixels,
                "min_pixels": self.min_pixels, "tile": self.tile, "max_tiles": self.max_tiles,
                "channels": self.channels}

    # --- sizes (from headers) ----------------------------------------------------------------
    def resized(self, h: int, w: int) -> tuple[int, int]:
        """The (height, width) an image of stored size (h, w) is resized to."""
        if self.tile is not None:
            r, c = self.tiles(h, w)
            return r * self.tile, c * self.tile
        f = self.factor
        hb, wb = max(f, round(h / f) * f), max(f, round(w / f) * f)
        if hb * wb > self.max_pixels:
            beta = math.sqrt(h * w / self.max_pixels)
            hb, wb = max(f, math.floor(h / beta / f) * f), max(f, math.floor(w / beta / f) * f)
            while hb * wb > self.max_pixels:  # a very long image: its short side is at f already
                if hb >= wb:
                    hb -= f
                else:
                    wb -= f
        elif hb * wb < self.min_pixels:
            beta = math.sqrt(self.min_pixels / (h * w))
            hb, wb = math.ceil(h * beta / f) * f, math.ceil(w * beta / f) * f
            while hb * wb > self.max_pixels:
                if hb >= wb:
                    hb -= f
                else:
                    wb -= f
        return hb, wb

    def tiles(self, h: int, w: int) -> tuple[int, int]:
        """(rows, columns) of tiles for an image of size (h, w) (tile mode)."""
        if self.tile is None:
            raise PlanError("Patches.tiles needs tile mode (Patches(tile=...))")
        best: tuple[float, int, int, int] | None = None
        area = h * w
        for r in range(1, self.max_tiles + 1):
            for c in range(1, self.max_tiles // r + 1):
                err = abs(math.log((r / c) / (h / w)))
                # prefer the aspect ratio; then the tile count closest to the image's own area
                over = abs(r * c * self.tile * self.tile - area)
                key = (round(err, 9), over, r, c)
                if best is None or key < best:
                    best = key
        assert best is not None
        return best[2], best[3]

    def grid(self, h: int, w: int) -> tuple[int, int, int]:
        """(t, gh, gw) patches of an image of stored size (h, w)."""
        if self.tile is not None:
            r, c = self.tiles(h, w)
            g = self.tile // self.patch
            return r * c, g, g
        hb, wb = self.resized(h, w)
        return 1, hb // self.patch, wb // self.patch

    def grids(self, sizes: np.ndarray) -> np.ndarray:
        """Grids (int32, shape (n, 3)) of images of sizes (n, 2) (height, width)."""
        out = np.empty((len(sizes), 3), np.int32)
        for i, (h, w) in enumerate(np.asarray(sizes).tolist()):
            out[i] = self.grid(h, w)
        return out

    def tokens(self, grid: np.ndarray) -> np.ndarray:
        """Placeholder tokens of images of these grids: patches ÷ merge²."""
        g = np.asarray(grid, np.int64).reshape(-1, 3)
        return g.prod(axis=1) // (self.merge * self.merge)

    # --- pixels ------------------------------------------------------------------------------
    def cut(self, pixels: np.ndarray) -> np.ndarray:
        """Patch vectors `[t·h·w, patch² × channels]` of resized pixels `[H, W, C]` (see the
        module doc for the order). `pixels` must already have the size `resized` gives."""
        p, m, c = self.patch, self.merge, self.channels
        if pixels.ndim != 3 or pixels.shape[2] != c:
            raise PlanError(f"Patches.cut takes [H, W, {c}] pixels, got shape {pixels.shape}")
        if self.tile is not None:
            T = self.tile
            r, cc = pixels.shape[0] // T, pixels.shape[1] // T
            # tiles in row-major order, each cut like a native image
            tiles = pixels.reshape(r, T, cc, T, c).transpose(0, 2, 1, 3, 4).reshape(r * cc, T, T, c)
            return np.concatenate([self._cut_one(t, p, m, c) for t in tiles]) if r * cc else \
                np.zeros((0, self.dim), pixels.dtype)
        return self._cut_one(pixels, p, m, c)

    @staticmethod
    def _cut_one(a: np.ndarray, p: int, m: int, c: int) -> np.ndarray:
        H, W = a.shape[:2]
        gh, gw = H // p, W // p
        if gh * p != H or gw * p != W or gh % m or gw % m:
            raise PlanError(f"an image of {H}x{W} pixels is not a whole number of {p * m}-pixel "
                            "merged patches per side")
        x = a.reshape(gh // m, m, p, gw // m, m, p, c)
        # (block row, block col, row in block, col in block, pixel row, pixel col, channel)
        x = x.transpose(0, 3, 1, 4, 2, 5, 6)
        return np.ascontiguousarray(x).reshape(gh * gw, p * p * c)
