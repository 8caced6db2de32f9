"""Image lane operators: decode (fused with crop, resize and flip), augment decoded images, normalise.

`DecodeImage` is the hot path. With a geometry (`RandomResizedCrop(224)`, `CenterCrop`,
`Resize(size=...)`) it reads the image's size from its header, draws the box and the flip from
the record's own generator, decodes a JPEG at the largest 1/2, 1/4, 1/8 reduction that keeps the
box at least the output size (with libjpeg-turbo only the box's region of it: `decode_region`),
and writes the cropped, resized, flipped pixels straight into its slot of a preallocated
`[n, H, W, C]` uint8 array. Decoded full-size images never accumulate: at most one per worker is
alive at a time, so decoded-media memory is bounded by the configuration (window rows x H x W x C
per window in flight, plus one image of at most `max_pixels`).

Errors: a corrupt, truncated or unsupported image raises `DecodeError` naming the source, record,
epoch and field. With `on_error="skip"` the record is dropped instead: the operator becomes a
filter (count-changing; the lane engine takes over from the random-access path) and, being a pure
function of the record's bytes, drops the same records at every D, runner and resume.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from zephon.errors import DecodeError, PlanError
from zephon.media.augment import (
    Draws,
    Geometry,
    crop_resize,
    normalize,
    reduction_for,
    resize_into,
    scaled_box,
)
from zephon.media.decode import (
    AUTO,
    Decoder,
    as_decoder,
    decode_image,
    decode_region,
    decoded_size,
    image_format,
    resolved,
)
from zephon.ops.base import Transform, record_seeds
from zephon.plan import Refs
from zephon.sources.base import Columns

log = logging.getLogger(__name__)

#: Images larger than this many pixels (from the header) are refused before decoding.
MAX_PIXELS = 1 << 26


def _check_common(on_error: str, flip: float, max_pixels: int | None) -> None:
    if on_error not in ("raise", "skip"):
        raise PlanError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
    if not 0.0 <= float(flip) <= 1.0:
        raise PlanError(f"flip is a probability in [0, 1], got {flip!r}")
    if max_pixels is not None and max_pixels < 1:
        raise PlanError(f"max_pixels must be positive or None, got {max_pixels!r}")


def _where(refs: Refs, i: int, fld: str) -> str:
    return (f"record {int(refs.record[i])} of source {int(refs.source[i])} (epoch "
            f"{int(refs.epoch[i])}), field {fld!r}")


def _bytes_of(v: Any) -> bytes:
    if isinstance(v, (bytes, bytearray)):
        return bytes(v)
    if isinstance(v, np.ndarray) and v.dtype == np.uint8:
        return v.tobytes()
    if isinstance(v, memoryview):
        return v.tobytes()
    if isinstance(v, dict) and "bytes" in v:   # a Hugging Face Image struct read as a record
        return _bytes_of(v["bytes"])
    raise DecodeError(f"expected encoded image bytes, got {type(v).__name__}")


def _out_columns(cols: Columns, src: str, dst: str, values: np.ndarray, keep: np.ndarray | None) -> Columns:
    out = dict(cols)
    if dst != src:
        out[src] = cols[src]
    else:
        out.pop(src)
    out[dst] = values
    if keep is not None:
        out = {k: v[keep] if k != dst else v for k, v in out.items()}
    return out


@dataclass(frozen=True)
class DecodeImage(Transform):
    """Decodes the encoded image in `field` (JPEG, PNG, WebP bytes) into uint8 HWC pixels.

    geometry: None (the full image; a ragged object column) or a `Resize`, `CenterCrop`,
        `RandomResizedCrop` fused into the decode (fixed-size geometries give `[n, H, W, C]`).
    flip: probability of a horizontal flip, drawn from the record's generator.
    out: the output field (default: replace `field`).
    mode: 'RGB' (C = 3) or 'L' (C = 1).
    decoder: a `Decoder` or a library name; the resolved libraries and versions are part of the
        identity, so a checkpoint from another decoder is refused.
    reduce: decode only what the box needs: a JPEG at a 1/2, 1/4, 1/8 DCT reduction when the box
        is that much larger than the output, and, with libjpeg-turbo (the default JPEG
        decoder), only the box's region of it (False: the whole image at full size — the same
        random choices, slower, slightly other pixels).
    on_error: 'raise' (DecodeError naming the record and field) or 'skip' (drop the record).
    max_pixels: larger images (by header) are an error (or skipped), bounding decoded memory.
    """

    field: str = "image"
    geometry: Geometry | None = None
    flip: float = 0.0
    out: str | None = None
    mode: str = "RGB"
    decoder: Decoder | str = AUTO
    reduce: bool = True
    on_error: str = "raise"
    max_pixels: int | None = MAX_PIXELS
    name: str = "DecodeImage"
    version: int = 1

    def __post_init__(self) -> None:
        _check_common(self.on_error, self.flip, self.max_pixels)
        if self.mode not in ("RGB", "L"):
            raise PlanError(f"DecodeImage mode must be 'RGB' or 'L', got {self.mode!r}")
        object.__setattr__(self, "decoder", as_decoder(self.decoder))

    @property
    def one_to_one(self) -> bool:  # type: ignore[override]
        return self.on_error != "skip"

    @property
    def read_ahead_rows(self) -> int:
        """Rows a loader reads ahead by default with this operator: about 16 MB of output pixels
        (64 to 1,024 rows), not the thousands of rows a text pipeline reads — a decoded image costs
        a millisecond and its pixels take memory (see docs/images.md, Memory)."""
        if self.geometry is not None and self.geometry.fixed is not None:
            h, w = self.geometry.fixed
            return max(64, min(1024, (16 << 20) // (h * w * (3 if self.mode == "RGB" else 1))))
        return 256

    def config(self) -> dict[str, Any]:
        dec = as_decoder(self.decoder)
        return {"field": self.field, "out": self.out or self.field,
                "geometry": None if self.geometry is None else self.geometry.config(),
                "flip": float(self.flip), "mode": self.mode, "decoder": dec.identity(),
                "reduce": self.reduce, "on_error": self.on_error, "max_pixels": self.max_pixels}

    def apply(self, cols: Columns, refs: Refs, seed: int) -> tuple[Columns, np.ndarray | None]:
        if self.field not in cols:
            raise PlanError(f"DecodeImage: no field {self.field!r} in the records (fields: "
                            f"{sorted(cols)}); pass field=... naming the encoded image bytes")
        data = cols[self.field]
        n = len(refs)
        dec = resolved(as_decoder(self.decoder))
        geo = self.geometry
        fixed = geo.fixed if geo is not None else None
        c = 3 if self.mode == "RGB" else 1
        values = np.empty((n, *fixed, c), np.uint8) if fixed else np.empty(n, object)
        random = self.flip > 0 or (geo is not None and geo.random)
        seeds = record_seeds(seed, refs) if random else None
        keep = np.ones(n, bool)
        for i in range(n):
            try:
                rng = Draws(int(seeds[i])) if seeds is not None else None
                got = self._one(_bytes_of(data[i]), rng, dec, values[i] if fixed else None)
                if not fixed:
                    values[i] = got
            except DecodeError as e:
                if self.on_error == "skip":
                    keep[i] = False
                    log.debug("DecodeImage skipped %s: %s", _where(refs, i, self.field), e)
                    continue
                raise DecodeError(f"DecodeImage: {_where(refs, i, self.field)}: {e}. Fix or remove "
                                  "the record, or pass on_error='skip' to drop undecodable images "
                                  "(the same ones at every D).") from e
        if keep.all():
            return _out_columns(cols, self.field, self.out or self.field, values, None), \
                (None if self.on_error == "raise" else keep)
        return _out_columns(cols, self.field, self.out or self.field, values[keep], keep), keep

    def _one(self, data: bytes, rng: Any, dec: Decoder, dst: np.ndarray | None) -> np.ndarray:
        fmt = image_format(data)
        if fmt is None:
            return decode_image(data, decoder=dec, mode=self.mode)   # raises: unsupported
        geo = self.geometry
        h, w = decoded_size(data, fmt=fmt)
        if self.max_pixels is not None and h * w > self.max_pixels:
            raise DecodeError(f"image of {h}x{w} = {h * w} pixels exceeds max_pixels={self.max_pixels}")
        if geo is None:
            a = decode_image(data, decoder=dec, mode=self.mode)
            return np.ascontiguousarray(a[:, ::-1]) if self.flip > 0 and rng is not None \
                and rng.random() < self.flip else a
        box, size = geo.plan(rng, h, w)
        flip = self.flip > 0 and rng.random() < self.flip
        if not (self.reduce and fmt == "jpeg"):
            a = decode_image(data, decoder=dec, mode=self.mode)
            return crop_resize(a, box, size, 1, dec.resize, dst, flip)
        factor = reduction_for(box, size)
        region = scaled_box(box, factor, -(-h // factor), -(-w // factor))
        crop = decode_region(data, region, scale=factor, decoder=dec, mode=self.mode)
        return resize_into(crop, size, dec.resize, dst, flip)


@dataclass(frozen=True)
class AugmentImage(Transform):
    """Crop / resize / flip already decoded images (`[n, H, W, C]` or a ragged object column) —
    for pixels that did not come from `DecodeImage` (a `Map` made them). Prefer `DecodeImage`'s
    fused geometry for encoded images: it skips decoding pixels the crop throws away."""

    field: str = "image"
    geometry: Geometry | None = None
    flip: float = 0.0
    out: str | None = None
    resize: str = "auto"
    name: str = "AugmentImage"
    version: int = 1

    def __post_init__(self) -> None:
        _check_common("raise", self.flip, None)

    def config(self) -> dict[str, Any]:
        return {"field": self.field, "out": self.out or self.field,
                "geometry": None if self.geometry is None else self.geometry.config(),
                "flip": float(self.flip), "resize": as_decoder({"resize": self.resize}).identity()["resize"]}

    def apply(self, cols: Columns, refs: Refs, seed: int) -> tuple[Columns, None]:
        images = cols[self.field]
        n = len(refs)
        lib = resolved(Decoder(resize=self.resize)).resize
        geo = self.geometry
        fixed = geo.fixed if geo is not None else None
        seeds = record_seeds(seed, refs) if (self.flip > 0 or (geo is not None and geo.random)) else None
        values: np.ndarray | None = None
        objs = np.empty(n, object)
        for i in range(n):
            a = np.asarray(images[i])
            if a.ndim == 2:
                a = a[:, :, None]
            rng = Draws(int(seeds[i])) if seeds is not None else None
            h, w = a.shape[:2]
            box, size = geo.plan(rng, h, w) if geo is not None else ((0, 0, h, w), (h, w))
            flip = self.flip > 0 and rng is not None and rng.random() < self.flip
            if fixed:
                if values is None:
                    values = np.empty((n, *fixed, a.shape[2]), np.uint8)
                crop_resize(a, box, size, 1, lib, values[i], flip)
            else:
                objs[i] = crop_resize(a, box, size, 1, lib, None, flip)
        out = values if values is not None else objs
        return _out_columns(cols, self.field, self.out or self.field, out, None), None


@dataclass(frozen=True)
class NormalizeImage(Transform):
    """(pixels / 255 - mean) / std per channel, as float32 (vectorised over the batch)."""

    field: str = "image"
    mean: Sequence[float] = (0.485, 0.456, 0.406)
    std: Sequence[float] = (0.229, 0.224, 0.225)
    out: str | None = None
    name: str = "NormalizeImage"
    version: int = 1

    def config(self) -> dict[str, Any]:
        return {"field": self.field, "out": self.out or self.field, "mean": [float(m) for m in self.mean],
                "std": [float(s) for s in self.std]}

    def apply(self, cols: Columns, refs: Refs, seed: int) -> tuple[Columns, None]:
        images = cols[self.field]
        if images.dtype == object:
            vals = np.empty(len(images), object)
            for i, a in enumerate(images):
                vals[i] = normalize(np.asarray(a), self.mean, self.std)
        else:
            vals = normalize(images, self.mean, self.std)
        return _out_columns(cols, self.field, self.out or self.field, vals, None), None
