"""Image sizes from their headers, without decoding a pixel: what planning reads.

Vision-language packing decides which images go into which row from their sizes alone (each
image's patch count follows from its height and width), so the plan is fixed before any pixel
is decoded, and a restored carry re-reads only bytes. Decoders are far too slow for that (a JPEG
decode costs ~1 ms; a header parse ~1 µs), and the libraries' own "open" calls build objects
per image. This module parses the three formats' headers directly:

- **JPEG**: the markers after SOI are walked by their lengths (APPn segments such as EXIF or ICC
  profiles, DQT, DHT, COM... are skipped whole) up to the first SOFn frame header, which holds
  the height and width. Baseline, extended, progressive and lossless frames all count.
- **PNG**: the IHDR chunk, which the format requires first.
- **WebP**: the first chunk of the RIFF container: `VP8 ` (lossy: the key frame's 14-bit sizes),
  `VP8L` (lossless: 14-bit sizes minus one) or `VP8X` (extended: alpha, animation; 24-bit canvas
  sizes minus one).

The sizes are the stored ones (EXIF orientation is not applied, as the decoders here do not
apply it either). Bytes that are not one of these formats, or a header cut short, raise an
`ImageHeaderError` naming the record (and, when the caller gives them, its source and epoch).
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from zephon.errors import DecodeError

__all__ = ["ImageHeaderError", "image_format", "image_size", "image_sizes"]

_U16 = struct.Struct(">H")
_PNG = b"\x89PNG\r\n\x1a\n"
#: SOFn markers: C0-C3, C5-C7, C9-CB, CD-CF (C4 is DHT, C8 reserved, CC is DAC)
_SOF = frozenset({0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF})
#: markers without a length: TEM, RST0-7 (SOI and EOI are handled apart)
_STANDALONE = frozenset({0x01, *range(0xD0, 0xD8)})


class ImageHeaderError(DecodeError):
    """Bytes whose header is not a JPEG, PNG or WebP image header, or is cut short."""


def image_format(data: bytes | bytearray | memoryview) -> str | None:
    """'jpeg', 'png' or 'webp' from the magic bytes; None for anything else."""
    head = bytes(data[:12])
    if head[:3] == b"\xff\xd8\xff":
        return "jpeg"
    if head[:8] == _PNG:
        return "png"
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "webp"
    return None


def _jpeg(b: bytes) -> tuple[int, int]:
    n = len(b)
    i = 2
    while True:
        # a marker: one or more 0xFF fill bytes, then the code
        if i >= n:
            break
        if b[i] != 0xFF:
            raise ValueError(f"no JPEG marker at byte {i} (before a frame header): corrupt or cut short")
        while i < n and b[i] == 0xFF:
            i += 1
        if i >= n:
            break
        code = b[i]
        i += 1
        if code in _STANDALONE:
            continue
        if code in (0xD9, 0xDA):  # EOI or the scan itself: no frame header came first
            raise ValueError(f"the JPEG reaches {'its end' if code == 0xD9 else 'its scan data'} "
                             "without a frame (SOF) header")
        if i + 2 > n:
            break
        length = (b[i] << 8) | b[i + 1]
        if code in _SOF:
            if i + 7 > n:
                break
            h = (b[i + 3] << 8) | b[i + 4]
            w = (b[i + 5] << 8) | b[i + 6]
            if h == 0 or w == 0:  # height 0 means "defined by a DNL marker": not in use
                raise ValueError(f"the JPEG frame header gives size {h}x{w}")
            return h, w
        if length < 2:
            raise ValueError(f"a JPEG segment (marker 0x{code:02X}) has length {length}")
        i += length
    raise ValueError(f"the JPEG is cut short ({n} bytes) before its frame (SOF) header")


def _png(b: bytes) -> tuple[int, int]:
    if len(b) < 24:
        raise ValueError(f"the PNG is cut short ({len(b)} bytes) before its IHDR chunk ends")
    if b[12:16] != b"IHDR":
        raise ValueError(f"the PNG's first chunk is {b[12:16]!r}, not IHDR")
    w, h = struct.unpack_from(">II", b, 16)
    if h == 0 or w == 0:
        raise ValueError(f"the PNG's IHDR gives size {h}x{w}")
    return h, w


def _webp(b: bytes) -> tuple[int, int]:
    if len(b) < 30:
        raise ValueError(f"the WebP is cut short ({len(b)} bytes) before its first chunk's header")
    kind = b[12:16]
    if kind == b"VP8 ":
        if b[23:26] != b"\x9d\x01\x2a":
            raise ValueError("the WebP's VP8 chunk has no key-frame start code")
        w = ((b[27] << 8) | b[26]) & 0x3FFF
        h = ((b[29] << 8) | b[28]) & 0x3FFF
    elif kind == b"VP8L":
        if b[20] != 0x2F:
            raise ValueError("the WebP's VP8L chunk does not start with its signature 0x2F")
        bits = b[21] | (b[22] << 8) | (b[23] << 16) | (b[24] << 24)
        w = (bits & 0x3FFF) + 1
        h = ((bits >> 14) & 0x3FFF) + 1
    elif kind == b"VP8X":
        w = (b[24] | (b[25] << 8) | (b[26] << 16)) + 1
        h = (b[27] | (b[28] << 8) | (b[29] << 16)) + 1
    else:
        raise ValueError(f"the WebP's first chunk is {kind!r}, not VP8, VP8L or VP8X")
    if h == 0 or w == 0:
        raise ValueError(f"the WebP header gives size {h}x{w}")
    return h, w


def _size(b: bytes) -> tuple[int, int]:
    # the magic bytes, checked inline (this runs once per image of a plan)
    if b[:3] == b"\xff\xd8\xff":
        return _jpeg(b)
    if b[:8] == _PNG:
        return _png(b)
    if b[:4] == b"RIFF" and b[8:12] == b"WEBP":
        return _webp(b)
    raise ValueError(f"not a JPEG, PNG or WebP image (first bytes {b[:8]!r})")


def _as_bytes(data: Any) -> bytes:
    if isinstance(data, bytes):
        return data
    if isinstance(data, (bytearray, memoryview)):
        return bytes(data)
    if isinstance(data, np.ndarray) and data.dtype == np.uint8:
        return data.tobytes()
    if isinstance(data, np.bytes_):
        return bytes(data)
    raise TypeError(f"image bytes must be bytes, bytearray, memoryview or a uint8 array, got "
                    f"{type(data).__name__}")


def image_size(data: bytes | bytearray | memoryview | np.ndarray, *, what: str = "the image") -> tuple[int, int]:
    """(height, width) of a JPEG, PNG or WebP image from its header, without decoding it.

    `what` names the image in the error (e.g. "record 12 of source 0"). Raises `ImageHeaderError`
    for bytes that are not one of the three formats, or whose header is corrupt or cut short."""
    try:
        return _size(_as_bytes(data))
    except (ValueError, TypeError, IndexError, struct.error) as e:
        raise ImageHeaderError(f"{what}: cannot read the image size from its header: {e}. Fix or "
                               "remove the record (only JPEG, PNG and WebP are read).") from None


def image_sizes(images: Sequence[Any], *, names: Callable[[int], str] | None = None) -> np.ndarray:
    """(height, width) of many images, as an int64 array of shape (n, 2).

    `names(i)` names image i in an error (default: "image i of n")."""
    out = np.empty((len(images), 2), np.int64)
    size = _size
    try:
        for i, data in enumerate(images):
            out[i] = size(data if type(data) is bytes else _as_bytes(data))
    except (ValueError, TypeError, IndexError, struct.error):
        what = names(i) if names is not None else f"image {i} of {len(images)}"
        image_size(images[i], what=what)  # raises with the reason
        raise  # pragma: no cover - the same bytes parse the second time: cannot happen
    return out
