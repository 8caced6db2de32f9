"""JPEG decode of one region at a reduced DCT scale, through libjpeg-turbo's libjpeg API.

Why. A random-resized crop keeps a box of the image. libjpeg-turbo can decode just that box: the
IDCT, chroma upsampling and colour conversion run only for the box's columns
(`jpeg_crop_scanline`), the rows above it are entropy-decoded but not transformed
(`jpeg_skip_scanlines`), and decoding stops after its last row. Entropy (Huffman) decoding cannot
skip bytes, so the rows above the box still cost their Huffman decode: on the demo's ~2.8 MP
JPEGs a crop of 224 costs ~3x less than the same crop from a full-size decode. A JPEG with
restart markers lined up with its rows and columns can do better: its intervals are
byte-aligned and restart the DC prediction, so the intervals under the box alone make a valid
JPEG of that rectangle, and nothing outside it is decoded at all (~3.9x). `add_restart_markers`
rewrites a JPEG that way, losslessly (the DCT coefficients are copied, so every decoder gives
the same pixels as before): an optional preparation step for data sets read with large crops.
The numbers are in docs/images.md.

Where the library comes from. The C module `zephon.media.libjpeg_binding` (built with the package)
calls the libjpeg-turbo that Pillow's wheel bundles (`pillow.libs/libjpeg-*.so.62`,
`PIL/.dylibs/libjpeg.62.dylib`), found through Pillow's file list and opened with dlopen, else
the system's `libjpeg.so.62`. It is a release of the libjpeg-turbo project, kept current by
Pillow; its version is read from the library and is part of the decoder's identity. No Python
JPEG package exposes a cropped decode (simplejpeg, OpenCV and imagecodecs link libjpeg-turbo
statically and hide it), and the libjpeg API needs setjmp/longjmp for its errors, so a small
C module binds it. Without a C compiler at install time, or without a 6.2-ABI libjpeg-turbo,
`available()` is False and decoding falls back to simplejpeg.

Exactness. The columns asked of libjpeg-turbo are the box's widened by one pixel on the left and
two iMCUs on the right (chroma upsampling at a region's edge sees no neighbour), and the exact
box is cut from them; a cut rectangle keeps one MCU of margin on every side. The pixels equal
those of decoding the whole image at that scale and slicing (tests/test_media_libjpeg.py).

Errors. Corrupt data and every libjpeg warning (corrupt-data warnings) raise `LibjpegError`
with libjpeg's message; a CMYK/YCCK JPEG raises `LibjpegCMYK` (Pillow decodes those).
"""

from __future__ import annotations

import ctypes.util
import logging
import re
from functools import cache
from importlib import metadata
from pathlib import Path
from types import ModuleType

import numpy as np

log = logging.getLogger(__name__)

#: Restart-interval width `add_restart_markers` aims for, in pixels: narrow enough that a crop's
#: rectangle is not much wider than the crop, wide enough that markers cost little. Measured in
#: one run on the large demo JPEGs, one process, full-size decode over crop decode: 3.40x at
#: 64 px, 3.22x at 128, 3.20x at 256, 2.93x with one interval a row (2.60x without markers).
RESTART_PX = 64


class LibjpegError(ValueError):
    """libjpeg-turbo refused the bytes (corrupt, truncated, unsupported): its message."""


class LibjpegCMYK(LibjpegError):
    """A CMYK or YCCK JPEG: libjpeg-turbo cannot give RGB (Pillow can)."""


def library_path() -> Path | None:
    """The libjpeg-turbo shared library: Pillow's bundled one, else the system's libjpeg.so.62."""
    try:
        dist = metadata.distribution("pillow")
        for f in dist.files or []:
            if re.search(r"(^|/)libjpeg[^/]*\.(so\.62[.\d]*|62[.\d]*dylib)$", str(f)):
                p = Path(str(dist.locate_file(f)))
                if p.exists():
                    return p
    except metadata.PackageNotFoundError:
        pass
    name = ctypes.util.find_library("jpeg")
    return Path(name) if name and ".so.62" in name else None


@cache
def _module() -> ModuleType | None:
    try:
        from zephon.media import libjpeg_binding
    except ImportError as e:   # the C module was not built (no compiler at install time)
        log.debug("zephon.media.libjpeg_binding is not built: %s", e)
        return None
    path = library_path()
    if path is None:
        log.debug("no libjpeg-turbo (6.2 ABI) found beside Pillow or on the system")
        return None
    try:
        libjpeg_binding.load(str(path))
    except OSError as e:
        log.debug("libjpeg at %s not usable: %s", path, e)
        return None
    return libjpeg_binding


def available() -> bool:
    """Whether the C module is built and a libjpeg-turbo (6.2 ABI) loads."""
    return _module() is not None


def _lib() -> ModuleType:
    m = _module()
    if m is None:
        raise LibjpegError("zephon.media.libjpeg_binding is not available: reinstall zephon-loader with a C compiler "
                           "and Pillow installed, or use Decoder(jpeg='simplejpeg')")
    return m


@cache
def library_version() -> str:
    """'3.2.0': the libjpeg-turbo version the library reports (its build string)."""
    path = library_path()
    if path is not None:
        m = re.search(rb"libjpeg-turbo version ([0-9][0-9.]*)", path.read_bytes())
        if m:
            return m.group(1).decode()
    return "unknown"


def header(data: bytes) -> tuple[int, int, int, int]:
    """(height, width, components, jpeg_color_space) from the JPEG header, no pixels."""
    try:
        return _lib().header(data)
    except ValueError as e:
        raise LibjpegError(str(e)) from None


def decode(data: bytes, scale: int = 1, box: tuple[int, int, int, int] | None = None, *,
           rgb: bool = True) -> np.ndarray:
    """Pixels [H, W, 3] of the JPEG decoded at 1/`scale` (1, 2, 4, 8); with `box` = (y0, x0,
    y1, x1) in the scaled image only that box, the same pixels as the whole scaled image sliced
    `[y0:y1, x0:x1]`. `rgb=False`: a grayscale JPEG comes as [H, W, 1] (a colour one as RGB)."""
    lib = _lib()
    if scale not in (1, 2, 4, 8):
        raise ValueError(f"scale must be 1, 2, 4 or 8, got {scale!r}")
    y0, x0, y1, x1 = (0, 0, 0, 0) if box is None else box
    if box is not None and (min(y0, x0) < 0 or y0 >= y1 or x0 >= x1):
        raise ValueError(f"box {box} is empty or negative")
    try:
        buf, rows, xoff, width, c = lib.decode(data, 8 // scale, y0, x0, y1, x1, rgb)
    except IndexError as e:    # the box is not inside the scaled image: the caller's ValueError
        raise ValueError(str(e)) from None
    except LookupError as e:   # (IndexError's parent, so second)
        raise LibjpegCMYK(str(e)) from None
    except ValueError as e:
        raise LibjpegError(str(e)) from None
    a = np.frombuffer(buf, np.uint8).reshape(rows, width, c)
    return a if box is None else a[:, x0 - xoff:x1 - xoff]


def add_restart_markers(data: bytes, every_px: int = RESTART_PX) -> bytes:
    """The same JPEG with restart markers every ~`every_px` pixels along each row, losslessly.

    The DCT coefficients are copied unchanged, so every decoder gives exactly the pixels it gave
    before; Huffman tables are re-optimised (files grow ~9 % at 64 px on the demo's large JPEGs), APPn and COM markers
    (EXIF, ICC) are kept, a progressive JPEG becomes baseline. Decoding a crop of the result
    (`decode` with a box) entropy-decodes only the rectangle of intervals under the crop."""
    try:
        return _lib().restart(data, int(every_px))
    except ValueError as e:
        raise LibjpegError(str(e)) from None


def restart_webdataset(src: str | Path, dst: str | Path, every_px: int = RESTART_PX,
                       exts: tuple[str, ...] = ("jpg", "jpeg")) -> int:
    """Copies the WebDataset tar shard `src` to `dst` with `add_restart_markers` applied to every
    member whose extension is in `exts` (other members, names and order unchanged); returns the
    number of JPEGs rewritten. `dst` is written beside itself and renamed into place, so a failure
    leaves no half shard. A member that is not a JPEG libjpeg-turbo can read raises `LibjpegError`
    naming the shard and member."""
    import io
    import os
    import tarfile

    dst = Path(dst)
    tmp = dst.with_name(dst.name + ".tmp")
    n = 0
    try:
        with tarfile.open(src, "r:*") as tin, tarfile.open(tmp, "w", format=tarfile.USTAR_FORMAT) as tout:
            for m in tin:
                f = tin.extractfile(m) if m.isfile() else None
                data = f.read() if f is not None else None
                if data is not None and m.name.rsplit(".", 1)[-1].lower() in exts:
                    try:
                        data = add_restart_markers(data, every_px)
                    except LibjpegError as e:
                        raise LibjpegError(f"{src}: member {m.name}: {e}") from None
                    n += 1
                info = tarfile.TarInfo(m.name)
                info.size, info.mtime, info.mode = (len(data) if data is not None else 0), m.mtime, m.mode
                info.type = m.type
                tout.addfile(info, io.BytesIO(data) if data is not None else None)
        os.replace(tmp, dst)
    finally:
        tmp.unlink(missing_ok=True)
    return n
