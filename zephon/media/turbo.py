"""TurboJPEG 3 through ctypes: JPEG decode of one region at a reduced DCT scale.

Why. A random-resized crop keeps a box of the image; libjpeg-turbo's partial decompression
(`tj3SetCroppingRegion` + `tj3SetScalingFactor` + `tj3Decompress8`) runs the IDCT, chroma
upsampling and colour conversion only for the box's columns and rows and stops after its last
row (the rows above it are still entropy-decoded: Huffman data cannot be skipped). On the demo's
~2.8 MP JPEGs cropped to 224 this is ~3x less work than decoding the whole image at full size,
where a reduced DCT scale alone (simplejpeg, OpenCV) gives ~2.3x (docs/images.md, measured).

Where the library comes from. None of the usual Python JPEG packages exposes a cropping region:
simplejpeg, OpenCV and imagecodecs link libjpeg-turbo statically and export none of its symbols;
Pillow's bundled libjpeg exports only the libjpeg API, whose error handler must `longjmp` (not
possible from ctypes); PyTurboJPEG is a ctypes wrapper that ships no library. The `turbojpeg`
wheel (PyPI `turbojpeg` 0.0.2, github.com/Dobatymo/turbojpeg-python, pybind11 bindings of its own
that expose no cropping either) bundles `turbojpeg.libs/libturbojpeg-*.so.0.3.0`, a shared
libturbojpeg with the TurboJPEG 3 API. Zephon loads that file (found through the
distribution's file list, never by importing the module) and calls the C API directly: every
call returns a status and `tj3GetErrorStr` gives the reason, so corrupt bytes come back as an
error, never a crash or a longjmp. The library reports itself as "libjpeg-turbo version 2.1.92
(build 20230806)", a pre-release of the 3.0 series: `library_version()` reads that string and it
is part of the decoder's identity. It is an optional fast path: without the wheel (or on a
platform it has no wheel for) `available()` is False and the decoder falls back to simplejpeg.

Exactness. TurboJPEG widens the region's left edge down to an iMCU boundary, and at the region's
edges chroma upsampling sees no neighbour. So the region asked for is the box widened by one
(scaled) iMCU on each side (clipped to the image), and the exact box is cut out afterwards: the
pixels equal those of decoding the whole image at that scale and slicing (tests/test_media_turbo.py
checks it on every demo subsampling). A handle is not thread-safe: one per thread and process.
"""

from __future__ import annotations

import ctypes
import logging
import os
import re
import threading
from functools import cache
from importlib import metadata
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

#: The distribution whose wheel bundles libturbojpeg (TurboJPEG 3 API).
DIST = "turbojpeg"

_INIT_DECOMPRESS = 1
# enum TJPARAM (turbojpeg.h, TurboJPEG 3): the header values read back after tj3DecompressHeader
_P_SUBSAMP, _P_WIDTH, _P_HEIGHT, _P_COLORSPACE = 4, 5, 6, 8
_PF_RGB = 0
_CS_CMYK, _CS_YCCK = 3, 4
#: iMCU width in pixels by TJSAMP (444, 422, 420, GRAY, 440, 411, 441): the crop's x granularity.
_MCU_WIDTH = (8, 16, 16, 8, 8, 32, 8)


class TurboError(ValueError):
    """A TurboJPEG call failed (corrupt or truncated data, an unsupported JPEG): its message."""


class TurboCMYK(TurboError):
    """A CMYK or YCCK JPEG: libjpeg-turbo cannot give RGB (Pillow can)."""


class _Scaling(ctypes.Structure):
    _fields_ = [("num", ctypes.c_int), ("denom", ctypes.c_int)]


class _Region(ctypes.Structure):
    _fields_ = [("x", ctypes.c_int), ("y", ctypes.c_int), ("w", ctypes.c_int), ("h", ctypes.c_int)]


def _library_path() -> Path | None:
    try:
        files = metadata.files(DIST) or []
        dist = metadata.distribution(DIST)
    except metadata.PackageNotFoundError:
        return None
    for f in files:
        if re.search(r"(^|/)libturbojpeg[^/]*\.(so[.\d]*|dylib|dll)$", str(f)):
            p = Path(str(dist.locate_file(f)))
            if p.exists():
                return p
    return None


@cache
def _lib() -> ctypes.CDLL | None:
    path = _library_path()
    if path is None:
        return None
    try:
        lib = ctypes.CDLL(str(path))
        lib.tj3Init.restype = ctypes.c_void_p
        lib.tj3Init.argtypes = [ctypes.c_int]
        lib.tj3Get.argtypes = [ctypes.c_void_p, ctypes.c_int]
        lib.tj3DecompressHeader.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t]
        lib.tj3SetScalingFactor.argtypes = [ctypes.c_void_p, _Scaling]
        lib.tj3SetCroppingRegion.argtypes = [ctypes.c_void_p, _Region]
        lib.tj3Decompress8.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_void_p,
                                       ctypes.c_int, ctypes.c_int]
        lib.tj3GetErrorStr.restype = ctypes.c_char_p
        lib.tj3GetErrorStr.argtypes = [ctypes.c_void_p]
        lib.tj3Destroy.argtypes = [ctypes.c_void_p]
    except (OSError, AttributeError) as e:   # not loadable here, or no TurboJPEG 3 API in it
        log.debug("libturbojpeg at %s not usable: %s", path, e)
        return None
    return lib


def available() -> bool:
    """Whether the bundled libturbojpeg (TurboJPEG 3 API) loads on this machine."""
    return _lib() is not None


@cache
def library_version() -> str:
    """'0.0.2 (libjpeg-turbo 2.1.92)': the wheel's version and the libjpeg-turbo it bundles."""
    path = _library_path()
    inner = "unknown"
    if path is not None:
        m = re.search(rb"libjpeg-turbo version ([0-9][0-9.]*)", path.read_bytes())
        if m:
            inner = m.group(1).decode()
    return f"{metadata.version(DIST)} (libjpeg-turbo {inner})"


class _Handle:
    """One decompressor handle, destroyed with its thread's local storage."""

    __slots__ = ("lib", "pid", "ptr")

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib, self.pid = lib, os.getpid()
        self.ptr: int = lib.tj3Init(_INIT_DECOMPRESS) or 0
        if not self.ptr:
            raise TurboError("tj3Init failed")

    def __del__(self) -> None:
        if self.ptr and self.pid == os.getpid():
            self.lib.tj3Destroy(self.ptr)
            self.ptr = 0


class _Handles(threading.local):
    handle: _Handle | None = None


_HANDLES = _Handles()


def _handle() -> tuple[ctypes.CDLL, int]:
    lib = _lib()
    if lib is None:
        raise TurboError("libturbojpeg is not installed: pip install turbojpeg")
    hd = _HANDLES.handle
    if hd is None or hd.pid != os.getpid():   # a forked child makes its own
        if hd is not None:
            hd.ptr = 0                        # the parent's: not ours to destroy
        hd = _HANDLES.handle = _Handle(lib)
    return lib, hd.ptr


def _error(lib: ctypes.CDLL, h: int) -> TurboError:
    """The handle's error as an exception; the handle is destroyed (after an error in corrupt
    data its decompressor state is not reliably reset: the next image could fail too)."""
    msg = lib.tj3GetErrorStr(h)
    err = TurboError(msg.decode(errors="replace") if msg else "TurboJPEG error")
    _HANDLES.handle = None   # destroys it
    return err


def header(data: bytes) -> tuple[int, int, int, int]:
    """(height, width, subsampling, colorspace) from the JPEG header (TJSAMP / TJCS codes)."""
    lib, h = _handle()
    if lib.tj3DecompressHeader(h, data, len(data)) != 0:
        raise _error(lib, h)
    return lib.tj3Get(h, _P_HEIGHT), lib.tj3Get(h, _P_WIDTH), lib.tj3Get(h, _P_SUBSAMP), lib.tj3Get(h, _P_COLORSPACE)


def decode(data: bytes, scale: int = 1, box: tuple[int, int, int, int] | None = None) -> np.ndarray:
    """RGB pixels [H, W, 3] of the JPEG decoded at 1/`scale` (1, 2, 4, 8); with `box` = (y0, x0,
    y1, x1) in the scaled image, only that box — the same pixels as the whole scaled image sliced
    `[y0:y1, x0:x1]`. Raises `TurboError` for corrupt or truncated data (warnings included),
    `TurboCMYK` for a CMYK / YCCK JPEG."""
    lib, h = _handle()
    height, width, subsamp, colorspace = header(data)   # also primes the handle for the calls below
    if colorspace in (_CS_CMYK, _CS_YCCK):
        raise TurboCMYK("a CMYK / YCCK JPEG: libjpeg-turbo cannot decode it to RGB")
    if lib.tj3SetScalingFactor(h, _Scaling(1, scale)) != 0:
        raise _error(lib, h)
    sh, sw = -(-height // scale), -(-width // scale)
    if box is None:
        y0, x0, y1, x1 = 0, 0, sh, sw
    else:
        y0, x0, y1, x1 = box
        if not (0 <= y0 < y1 <= sh and 0 <= x0 < x1 <= sw):
            raise ValueError(f"box {box} is not inside the {sh}x{sw} image decoded at 1/{scale}")
    whole = (y0, x0, y1, x1) == (0, 0, sh, sw)
    rx0, rx1 = 0, sw
    if not whole and 0 <= subsamp < len(_MCU_WIDTH):
        mw = max(1, -(-_MCU_WIDTH[subsamp] // scale))          # TJSCALED(iMCU width, 1/scale)
        rx0 = (max(0, x0 - 1) // mw) * mw                       # one pixel of context, aligned down
        rx1 = min(sw, x1 + mw)                                  # chroma context on the right
        region = _Region(rx0, y0, rx1 - rx0, y1 - y0)
    else:   # the whole image, or a subsampling TurboJPEG cannot crop: all columns of the rows
        region = _Region(0, y0, 0, y1 - y0) if not whole else _Region(0, 0, 0, 0)
    if lib.tj3SetCroppingRegion(h, region) == 0:
        y0r, rows = (0, sh) if whole else (y0, y1 - y0)
    else:   # a region TurboJPEG refuses: the whole image, sliced below
        rx0, rx1, y0r, rows = 0, sw, 0, sh
        if lib.tj3SetCroppingRegion(h, _Region(0, 0, 0, 0)) != 0:
            raise _error(lib, h)
    out = np.empty((rows, rx1 - rx0, 3), np.uint8)
    if lib.tj3Decompress8(h, data, len(data), out.ctypes.data, out.strides[0], _PF_RGB) != 0:
        raise _error(lib, h)
    if whole:
        return out
    return out[y0 - y0r:y1 - y0r, x0 - rx0:x1 - rx0]
