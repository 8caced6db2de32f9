"""Image sizes read from headers (zephon.media.headers) against Pillow's, on generated images."""

from __future__ import annotations

import io

import numpy as np
import pytest

from zephon.media.headers import ImageHeaderError, image_format, image_size, image_sizes

Image = pytest.importorskip("PIL.Image")

SIZES = [(1, 1), (7, 13), (64, 48), (333, 500), (480, 640), (1025, 77)]


def _pixels(h: int, w: int, mode: str = "RGB", seed: int = 0) -> object:
    rng = np.random.default_rng(seed + h * 7 + w)
    c = {"RGB": 3, "RGBA": 4, "L": 1, "LA": 2, "CMYK": 4}[mode]
    a = rng.integers(0, 256, (h, w, c), dtype=np.uint8)
    # a smooth gradient plus noise: compresses like a photo, not like pure noise
    a = (a // 4 + (np.arange(w)[None, :, None] * 3 % 192)).astype(np.uint8)
    return Image.fromarray(a[:, :, 0] if c == 1 else a, mode if mode != "CMYK" else None) \
        if mode != "CMYK" else Image.fromarray(a[:, :, :3]).convert("CMYK")


def _encode(im: object, fmt: str, **kw: object) -> bytes:
    buf = io.BytesIO()
    im.save(buf, fmt, **kw)  # type: ignore[attr-defined]
    return buf.getvalue()


def _exif() -> bytes:
    ex = Image.Exif()
    ex[0x0112] = 6  # orientation: rotated (the stored size is what counts)
    ex[0x010F] = "zephon-test-camera " * 20  # a long EXIF segment to skip
    return ex.tobytes()


def _cases() -> list[tuple[str, bytes]]:
    out = []
    for h, w in SIZES:
        rgb = _pixels(h, w)
        out += [(f"jpeg baseline {h}x{w}", _encode(rgb, "JPEG", quality=85)),
                (f"jpeg progressive {h}x{w}", _encode(rgb, "JPEG", quality=70, progressive=True)),
                (f"jpeg exif+icc {h}x{w}", _encode(rgb, "JPEG", exif=_exif(), icc_profile=b"\0" * 3000)),
                (f"jpeg 4:4:4 restart {h}x{w}", _encode(rgb, "JPEG", subsampling=0, restart_marker_blocks=1)),
                (f"jpeg gray {h}x{w}", _encode(_pixels(h, w, "L"), "JPEG")),
                (f"jpeg cmyk {h}x{w}", _encode(_pixels(h, w, "CMYK"), "JPEG")),
                (f"png rgb {h}x{w}", _encode(rgb, "PNG")),
                (f"png rgba {h}x{w}", _encode(_pixels(h, w, "RGBA"), "PNG")),
                (f"png gray {h}x{w}", _encode(_pixels(h, w, "L"), "PNG")),
                (f"png palette {h}x{w}", _encode(rgb.convert("P"), "PNG")),  # type: ignore[attr-defined]
                (f"webp lossy {h}x{w}", _encode(rgb, "WEBP", quality=80)),
                (f"webp lossless {h}x{w}", _encode(rgb, "WEBP", lossless=True)),
                (f"webp lossy alpha {h}x{w}", _encode(_pixels(h, w, "RGBA"), "WEBP", quality=80)),
                (f"webp lossless alpha {h}x{w}", _encode(_pixels(h, w, "RGBA"), "WEBP", lossless=True)),
                (f"webp exif {h}x{w}", _encode(rgb, "WEBP", exif=_exif()))]
    return out


CASES = _cases()


@pytest.mark.parametrize("name,data", CASES, ids=[c[0] for c in CASES])
def test_size_matches_pillow(name: str, data: bytes) -> None:
    w, h = Image.open(io.BytesIO(data)).size
    assert image_size(data) == (h, w)
    assert image_format(data) == name.split()[0]


def test_webp_chunk_kinds_are_all_exercised() -> None:
    kinds = {d[12:16] for n, d in CASES if n.startswith("webp")}
    assert kinds == {b"VP8 ", b"VP8L", b"VP8X"}
    progressive = [d for n, d in CASES if "progressive" in n]
    assert all(b"\xff\xc2" in d for d in progressive)  # SOF2 frames really are read


def test_batch_form_and_input_types() -> None:
    datas = [d for _, d in CASES]
    want = np.array([image_size(d) for d in datas])
    got = image_sizes(datas)
    assert got.dtype == np.int64 and got.shape == (len(datas), 2)
    np.testing.assert_array_equal(got, want)
    mixed = [datas[0], bytearray(datas[1]), memoryview(datas[2]), np.frombuffer(datas[3], np.uint8)]
    np.testing.assert_array_equal(image_sizes(mixed), want[:4])
    objs = np.empty(2, object)
    objs[:] = [datas[4], datas[5]]
    np.testing.assert_array_equal(image_sizes(objs), want[4:6])
    assert image_sizes([]).shape == (0, 2)


def _corrupt() -> list[tuple[str, bytes, str]]:
    jpeg = _encode(_pixels(40, 30), "JPEG", exif=_exif())
    png = _encode(_pixels(40, 30), "PNG")
    webp = _encode(_pixels(40, 30), "WEBP")
    sof = jpeg.index(b"\xff\xc0")
    return [("empty", b"", "not a JPEG, PNG or WebP"),
            ("gif", b"GIF89a" + b"\0" * 40, "not a JPEG, PNG or WebP"),
            ("text", b"hello world, not an image", "not a JPEG, PNG or WebP"),
            ("jpeg cut in its EXIF", jpeg[:40], "cut short"),
            ("jpeg cut before SOF", jpeg[:sof], "cut short"),
            ("jpeg garbage between segments", jpeg[:20] + b"\x00" * 10 + jpeg[30:], "no JPEG marker"),
            ("jpeg without frame", b"\xff\xd8\xff\xd9", "without a frame"),
            ("png cut", png[:20], "cut short"),
            ("png without IHDR", png[:12] + b"IDAT" + png[16:], "not IHDR"),
            ("webp cut", webp[:16], "cut short"),
            ("webp other chunk", webp[:12] + b"ALPH" + webp[16:], "not VP8"),
            ("webp vp8 without start code", webp[:23] + b"\0\0\0" + webp[26:], "start code")]


@pytest.mark.parametrize("name,data,why", _corrupt(), ids=[c[0] for c in _corrupt()])
def test_corrupt_headers_name_the_record(name: str, data: bytes, why: str) -> None:
    with pytest.raises(ImageHeaderError, match=why) as e:
        image_size(data, what="record 12 of source 3")
    assert "record 12 of source 3" in str(e.value)
    good = _encode(_pixels(8, 8), "PNG")
    with pytest.raises(ImageHeaderError, match="image 2 of 3") as e:
        image_sizes([good, good, data])
    assert why in str(e.value)
    with pytest.raises(ImageHeaderError, match="record 99"):
        image_sizes([data], names=lambda i: f"record {99 + i}")


def test_non_bytes_are_refused() -> None:
    with pytest.raises(ImageHeaderError, match="must be bytes"):
        image_size("a string")  # type: ignore[arg-type]
    with pytest.raises(ImageHeaderError, match="must be bytes"):
        image_sizes([np.zeros(30, np.float32)])
