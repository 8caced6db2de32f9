"""Image decoding: JPEG, PNG and WebP bytes to uint8 HWC arrays, optionally at a reduced size.

Why these libraries. Measured on this project's 2-core machine (~500-px JPEGs re-encoded from
`skimage.data` photographs, one core): decode alone 1.66k images/s with Pillow, 2.19k with
simplejpeg, 2.08k with OpenCV; decode + random-resized crop 224 + flip 0.86k with Pillow
(`resize(box=...)`), 1.70k with OpenCV decode + OpenCV resize, 1.82k with simplejpeg + OpenCV
resize. So JPEG goes through simplejpeg (libjpeg-turbo), PNG and WebP through OpenCV, and every
resize through OpenCV; each falls back to Pillow when its library is not installed. JPEG goes
first through libjpeg-turbo's own libjpeg API (`zephon.media.libjpeg`: Pillow's bundled
libjpeg-turbo through a small C module; the same IDCT and upsampling as simplejpeg, the same
pixels): it can decode only a crop's region (`decode_region`), which makes a random-resized crop
of a large image ~3x cheaper than a full decode (~3.9x with restart markers), where a DCT
reduction alone gives ~2.3x (one process, benchmarks/image_decoders.py). The numbers and the
method are in docs/images.md.

Why the decoder is part of an identity: two decoders (or two versions of one) may give different
pixels for the same bytes (IDCT and chroma upsampling differ), so `decoder_identity()` names the
libraries and versions that produce the pixels, and a checkpoint taken under one is refused under
another.

Reduced-size decode: a JPEG stores 8x8 DCT blocks, so libjpeg-turbo can decode directly at 1/2,
1/4 or 1/8 of the size for a fraction of the work. `decode_image(min_size=(h, w))` picks the
smallest power-of-two reduction whose output is still at least `h` x `w` (Pillow's `draft` does
the same). Only powers of two are used, by every backend, so the geometry does not depend on
which library is installed.
"""

from __future__ import annotations

import io
import math
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from importlib import metadata
from typing import Any

import numpy as np

from zephon.errors import DecodeError, PlanError

#: The formats `decode_image` accepts, by their magic bytes.
FORMATS = ("jpeg", "png", "webp")
#: JPEG decoders, fastest first ('auto' takes the first installed): libjpeg-turbo's region decode
#: (`zephon.media.libjpeg`, a C module over Pillow's libjpeg-turbo), simplejpeg, OpenCV, Pillow.
JPEG_LIBRARIES = ("libjpeg-turbo", "simplejpeg", "opencv", "pillow")
#: Power-of-two DCT reductions a JPEG can be decoded at (1 = full size).
SCALES = (8, 4, 2, 1)


class ImageDecodeError(DecodeError):
    """Bytes that are not a decodable JPEG, PNG or WebP image (corrupt, truncated, other format)."""


def image_format(data: bytes | memoryview | np.ndarray) -> str | None:
    """'jpeg', 'png', 'webp' from the first bytes, or None for anything else."""
    head = data[:12].tobytes() if isinstance(data, np.ndarray) else bytes(data[:12])
    if head[:3] == b"\xff\xd8\xff":
        return "jpeg"
    if head[:8] == b"\x89PNG\r\n\x1a\n":
        return "png"
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "webp"
    return None


# --- which libraries ----------------------------------------------------------------------------
def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


@cache
def _libraries() -> dict[str, str]:
    """Installed decoding libraries -> version (importable ones only)."""
    out: dict[str, str] = {}
    for mod, dist in (("simplejpeg", "simplejpeg"), ("cv2", "opencv-python-headless"),
                      ("PIL", "pillow")):
        try:
            m = __import__(mod)
        except ImportError:
            continue
        v = getattr(m, "__version__", None) or _version(dist) or "unknown"
        out[{"cv2": "opencv", "PIL": "pillow"}.get(mod, mod)] = str(v)
    from zephon.media import libjpeg
    if libjpeg.available():
        out["libjpeg-turbo"] = libjpeg.library_version()
    if "opencv" in out:
        import cv2
        cv2.setNumThreads(1)   # the runner gives the parallelism; OpenCV's pool would oversubscribe
    return out


@dataclass(frozen=True)
class Decoder:
    """Which library decodes each format and which one resizes ('auto' = fastest installed).

    `resolve()` turns 'auto' into library names; `identity()` adds their versions."""

    jpeg: str = "auto"
    png: str = "auto"
    webp: str = "auto"
    resize: str = "auto"

    def resolve(self) -> Decoder:
        libs = _libraries()
        if "pillow" not in libs and "opencv" not in libs:
            raise PlanError("decoding images needs Pillow or OpenCV: pip install 'zephon-loader[media]'")
        prefer = {"jpeg": JPEG_LIBRARIES, "png": ("opencv", "pillow"),
                  "webp": ("opencv", "pillow"), "resize": ("opencv", "pillow")}
        chosen: dict[str, str] = {}
        for role, order in prefer.items():
            want = getattr(self, role)
            if want == "auto":
                chosen[role] = next(lib for lib in order if lib in libs)
            elif want not in order:
                raise PlanError(f"decoder {role}={want!r} is not one of {list(order)}")
            elif want not in libs:
                raise PlanError(f"decoder {role}={want!r} is not installed: pip install "
                                f"{ {'opencv': 'opencv-python-headless'}.get(want, want)}")
            else:
                chosen[role] = want
        return Decoder(**chosen)

    def identity(self) -> dict[str, str]:
        """{'jpeg': 'libjpeg-turbo 3.2.0', ...}: the libraries and versions that make the pixels."""
        r = self.resolve()
        libs = _libraries()
        return {role: f"{lib} {libs[lib]}" for role, lib in
                (("jpeg", r.jpeg), ("png", r.png), ("webp", r.webp), ("resize", r.resize))}


AUTO = Decoder()


@cache
def resolved(decoder: Decoder) -> Decoder:
    """`decoder.resolve()`, once per decoder (the hot path calls it per image)."""
    return decoder.resolve()


def decoder_identity(decoder: Decoder | Mapping[str, str] | None = None) -> dict[str, str]:
    """The libraries and versions `decode_image` uses under `decoder` (default: auto)."""
    return as_decoder(decoder).identity()


def as_decoder(decoder: Decoder | Mapping[str, str] | str | None) -> Decoder:
    if decoder is None:
        return AUTO
    if isinstance(decoder, Decoder):
        return decoder
    if isinstance(decoder, str):   # one library for everything it can do
        return Decoder(**{role: decoder if decoder in ok else "auto" for role, ok in
                          (("jpeg", JPEG_LIBRARIES), ("png", ("opencv", "pillow")),
                           ("webp", ("opencv", "pillow")), ("resize", ("opencv", "pillow")))})
    return Decoder(**dict(decoder))


# --- sizes --------------------------------------------------------------------------------------
def reduction(size: tuple[int, int], min_size: tuple[int, int] | None) -> int:
    """The largest power-of-two factor f (1, 2, 4, 8) with ceil(h/f) >= min_h and ceil(w/f) >= min_w."""
    if min_size is None:
        return 1
    h, w = size
    mh, mw = min_size
    for f in SCALES:
        if math.ceil(h / f) >= mh and math.ceil(w / f) >= mw:
            return f
    return 1


def _pil_open(data: bytes) -> Any:
    from PIL import Image
    return Image.open(io.BytesIO(data))


def decoded_size(data: bytes, *, fmt: str | None = None) -> tuple[int, int]:
    """(height, width) of an image from its header through the decoding library (no pixels).

    For planning over many images use `zephon.media.headers.image_size`, which parses headers
    without any library; this one is what the decode path itself uses."""
    fmt = fmt or image_format(data)
    try:
        if fmt == "jpeg" and "simplejpeg" in _libraries():
            import simplejpeg
            h, w, _, _ = simplejpeg.decode_jpeg_header(data)
            return int(h), int(w)
        if fmt == "jpeg" and "libjpeg-turbo" in _libraries():
            from zephon.media import libjpeg
            h, w, _, _ = libjpeg.header(data)
            return h, w
        if "pillow" in _libraries():
            w, h = _pil_open(data).size
            return int(h), int(w)
        a = _decode_full(data, fmt or "", "opencv")
        return int(a.shape[0]), int(a.shape[1])
    except ImageDecodeError:
        raise
    except Exception as e:
        raise ImageDecodeError(f"cannot read the size of a {fmt or 'unknown-format'} image: {e}") from e


# --- decoding -----------------------------------------------------------------------------------
def _decode_full(data: bytes, fmt: str, lib: str, scale: int = 1, rgb: bool = True) -> np.ndarray:
    if lib == "libjpeg-turbo":
        from zephon.media import libjpeg
        try:
            return libjpeg.decode(data, scale, rgb=rgb)
        except libjpeg.LibjpegCMYK:   # libjpeg-turbo cannot give RGB; Pillow can
            return _decode_full(data, fmt, "pillow", scale)
    if lib == "simplejpeg":
        import simplejpeg
        if scale > 1:
            h, w, cs, _ = simplejpeg.decode_jpeg_header(data)
        else:
            h, w, cs, _ = 0, 0, "", ""
        try:
            if scale > 1:
                return np.asarray(simplejpeg.decode_jpeg(
                    data, colorspace="RGB", min_height=math.ceil(h / scale), min_width=math.ceil(w / scale)))
            return np.asarray(simplejpeg.decode_jpeg(data, colorspace="RGB"))
        except ValueError:
            # CMYK / YCCK JPEGs: libjpeg-turbo cannot convert them to RGB; Pillow can
            if cs in ("CMYK", "YCCK") or simplejpeg.decode_jpeg_header(data)[2] in ("CMYK", "YCCK"):
                return _decode_full(data, fmt, "pillow", scale)
            raise
    if lib == "opencv":
        import cv2
        buf = np.frombuffer(data, np.uint8)
        if fmt == "jpeg" and scale > 1:
            flag = {2: cv2.IMREAD_REDUCED_COLOR_2, 4: cv2.IMREAD_REDUCED_COLOR_4,
                    8: cv2.IMREAD_REDUCED_COLOR_8}[scale]
            a = cv2.imdecode(buf, flag)
            rgb = False
        else:
            rgb = hasattr(cv2, "IMREAD_COLOR_RGB")
            a = cv2.imdecode(buf, cv2.IMREAD_COLOR_RGB if rgb else cv2.IMREAD_COLOR)
        if a is None:
            raise ValueError("OpenCV could not decode the bytes")
        return a if rgb else np.ascontiguousarray(a[:, :, ::-1])
    im = _pil_open(data)
    if scale > 1 and fmt == "jpeg":
        w, h = im.size
        im.draft("RGB", (math.ceil(w / scale), math.ceil(h / scale)))
    return np.asarray(im.convert("RGB"))


def decode_image(data: bytes | memoryview | np.ndarray, *, min_size: tuple[int, int] | None = None,
                 decoder: Decoder | Mapping[str, str] | str | None = None, mode: str = "RGB",
                 scale: int | None = None) -> np.ndarray:
    """Decodes JPEG, PNG or WebP bytes to a uint8 array [H, W, 3] (mode 'RGB') or [H, W, 1] ('L').

    `min_size=(h, w)`: a JPEG is decoded at the smallest 1/2, 1/4 or 1/8 reduction that is still at
    least h x w (other formats at full size) — for an output that will be resized smaller anyway.
    `decoder`: a `Decoder`, a library name ('simplejpeg', 'opencv', 'pillow') or None (fastest
    installed). `scale` (1, 2, 4, 8) gives the JPEG reduction directly instead of `min_size`.
    Raises `ImageDecodeError` (a `DecodeError`) for corrupt or unsupported bytes.
    """
    if isinstance(data, (np.ndarray, memoryview)):
        data = data.tobytes()
    if not isinstance(data, (bytes, bytearray)):
        raise ImageDecodeError(f"decode_image takes bytes, got {type(data).__name__}")
    if mode not in ("RGB", "L"):
        raise PlanError(f"decode_image mode must be 'RGB' or 'L', got {mode!r}")
    fmt = image_format(data)
    if fmt is None:
        head = bytes(data[:8])
        raise ImageDecodeError(f"unsupported image format (first bytes {head!r}, {len(data)} bytes): "
                               "decode_image reads JPEG, PNG and WebP")
    dec = resolved(as_decoder(decoder))
    lib = getattr(dec, fmt)
    if scale is not None and scale not in SCALES:
        raise PlanError(f"decode_image scale must be one of {sorted(SCALES)}, got {scale!r}")
    try:
        if fmt != "jpeg":
            scale = 1
        elif scale is None:
            scale = 1 if min_size is None else reduction(decoded_size(bytes(data), fmt=fmt), min_size)
        a = _decode_full(bytes(data), fmt, lib, scale, mode == "RGB")
    except ImageDecodeError:
        raise
    except Exception as e:
        raise ImageDecodeError(f"corrupt or truncated {fmt} image ({len(data)} bytes, decoder "
                               f"{lib}): {e}") from e
    return _as_mode(a, mode)


def _as_mode(a: np.ndarray, mode: str) -> np.ndarray:
    if a.ndim == 2:
        a = a[:, :, None]
    if mode == "L":
        if a.shape[2] == 3:   # ITU-R 601-2 luma, Pillow's convert('L') in integers
            a = ((a[..., 0].astype(np.uint32) * 19595 + a[..., 1].astype(np.uint32) * 38470
                  + a[..., 2].astype(np.uint32) * 7471 + 0x8000) >> 16).astype(np.uint8)[:, :, None]
        return a
    if a.shape[2] == 1:
        a = np.repeat(a, 3, axis=2)
    return a


def decode_region(data: bytes, box: tuple[int, int, int, int], *, scale: int = 1,
                  decoder: Decoder | Mapping[str, str] | str | None = None, mode: str = "RGB") -> np.ndarray:
    """`decode_image(data, scale=scale, ...)[y0:y1, x0:x1]` for `box` = (y0, x0, y1, x1) in the
    image decoded at 1/scale — computed by decoding only the box where the JPEG decoder can.

    With libjpeg-turbo (`Decoder(jpeg='libjpeg-turbo')`, the default when its C module is built)
    only the box's columns are transformed and decoding stops after the box's last row (with
    restart markers, only the box's rectangle is decoded at all): the same pixels for a fraction
    of the work (`zephon.media.libjpeg`). Other decoders decode the whole image and slice.
    Bytes below the box are not decoded, so a JPEG that does not end with its end-of-image marker
    (truncated, or followed by padding) is decoded whole instead: a truncated file raises
    `ImageDecodeError` whichever box is asked for."""
    fmt = image_format(data)
    dec = resolved(as_decoder(decoder))
    y0, x0, y1, x1 = box
    if fmt == "jpeg" and dec.jpeg == "libjpeg-turbo" and data[-2:] == b"\xff\xd9":
        from zephon.media import libjpeg
        try:
            return _as_mode(libjpeg.decode(data, scale, box, rgb=mode == "RGB"), mode)
        except libjpeg.LibjpegCMYK:   # decoded whole below, where _decode_full hands it to Pillow
            pass
        except libjpeg.LibjpegError as e:   # (a box outside the image stays the caller's ValueError)
            raise ImageDecodeError(f"corrupt or truncated jpeg image ({len(data)} bytes, decoder "
                                   f"libjpeg-turbo): {e}") from e
    return decode_image(data, decoder=dec, mode=mode, scale=scale if fmt == "jpeg" else None)[y0:y1, x0:x1]
