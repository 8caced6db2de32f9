"""TurboJPEG's region decode (zephon.media.turbo, the default JPEG decoder when the `turbojpeg`
wheel is installed): the crop gives exactly the pixels of decoding the whole image at that scale
and cutting the box, on the demo's kinds of JPEGs (large and ImageNet-size, 4:4:4 / 4:2:2 /
4:2:0 / grayscale, qualities 70-95); corrupt and truncated bytes give the clear error naming the
record whichever box is drawn; without the library Zephon falls back to simplejpeg."""

from __future__ import annotations

import io

import numpy as np
import pytest

from zephon.errors import DecodeError
from zephon.media import turbo
from zephon.media.decode import decode_image, decode_region, decoder_identity

pytestmark = pytest.mark.skipif(not turbo.available(), reason="the turbojpeg wheel is not installed")


@pytest.fixture(scope="module")
def demo_jpegs() -> list[bytes]:
    """Demo JPEGs made the way `zephon.demo.images` makes them (the same photographs, sizes,
    qualities and subsamplings): 4 large (>= 2 MP) and 12 ImageNet-size, plus a grayscale one."""
    from PIL import Image

    from zephon.demo.images import _one, photographs

    photos = photographs()
    out = [_one(np.random.default_rng([0, i, 1]), photos, True)[0] for i in range(4)]
    out += [_one(np.random.default_rng([0, i, 0]), photos, False)[0] for i in range(12)]
    gray = io.BytesIO()
    Image.open(io.BytesIO(out[-1])).convert("L").save(gray, "JPEG", quality=85)
    out.append(gray.getvalue())
    subs = {turbo.header(d)[2] for d in out}
    assert {0, 1, 2, 3} <= subs, subs     # TJSAMP 4:4:4, 4:2:2, 4:2:0 and grayscale all covered
    return out


def _boxes(rng: np.random.Generator, sh: int, sw: int, mcu: int) -> list[tuple[int, int, int, int]]:
    edges = [(0, 0, sh, sw), (0, 0, 1, 1), (sh - 1, sw - 1, sh, sw), (0, mcu, sh, min(sw, 2 * mcu + 1)),
             (sh // 2, sw - 3, sh, sw), (1, 1, sh - 1, sw - 1)]
    rand = []
    for _ in range(12):
        h, w = int(rng.integers(1, sh + 1)), int(rng.integers(1, sw + 1))
        y, x = int(rng.integers(0, sh - h + 1)), int(rng.integers(0, sw - w + 1))
        rand.append((y, x, y + h, x + w))
    return [b for b in edges if b[0] < b[2] and b[1] < b[3]] + rand


def test_region_decode_equals_the_whole_image_sliced(demo_jpegs) -> None:
    rng = np.random.default_rng(0)
    checked = 0
    for data in demo_jpegs:
        _, _, sub, _ = turbo.header(data)
        for scale in (1, 2, 4, 8):
            whole = turbo.decode(data, scale)
            sh, sw = whole.shape[:2]
            mcu = max(1, -(-(8, 16, 16, 8)[sub] // scale))
            for y0, x0, y1, x1 in _boxes(rng, sh, sw, mcu):
                got = turbo.decode(data, scale, (y0, x0, y1, x1))
                np.testing.assert_array_equal(got, whole[y0:y1, x0:x1],
                                              err_msg=f"sub {sub} 1/{scale} {(y0, x0, y1, x1)}")
                checked += 1
    assert checked > 1000


def test_turbojpeg_is_libjpeg_turbo_and_matches_simplejpeg(demo_jpegs) -> None:
    """The same libjpeg-turbo IDCT and upsampling: the pixels match simplejpeg's at every scale."""
    simplejpeg = pytest.importorskip("simplejpeg")
    for data in demo_jpegs[:6]:
        h, w = turbo.header(data)[:2]
        for scale in (1, 2, 4):
            ref = simplejpeg.decode_jpeg(data, colorspace="RGB", min_height=-(-h // scale), min_width=-(-w // scale))
            np.testing.assert_array_equal(turbo.decode(data, scale), ref)


def test_decode_image_op_crop_path_equals_the_scaled_decode_path(demo_jpegs) -> None:
    """DecodeImage with the region decode gives the pixels the whole-image-at-scale path gives."""
    from zephon.media import DecodeImage, RandomResizedCrop
    from zephon.media.augment import Draws, crop_resize, reduction_for
    from zephon.ops.base import record_seeds
    from zephon.plan import Refs

    data = np.array(demo_jpegs[:8], dtype=object)
    refs = Refs(np.zeros(8, np.int64), np.arange(8), np.zeros(8, np.int64))
    for mode in ("RGB", "L"):
        op = DecodeImage("jpg", RandomResizedCrop(64), flip=0.5, decoder="turbojpeg", mode=mode)
        got = op.apply({"jpg": data}, refs, 5)[0]["jpg"]
        seeds = record_seeds(5, refs)
        for i, d in enumerate(demo_jpegs[:8]):
            rng = Draws(int(seeds[i]))
            h, w = turbo.header(d)[:2]
            box, size = op.geometry.plan(rng, h, w)
            flip = rng.random() < 0.5
            f = reduction_for(box, size)
            want = crop_resize(decode_image(d, decoder="turbojpeg", scale=f, mode=mode), box, size, f, "opencv",
                               None, flip)
            np.testing.assert_array_equal(got[i], want)


def test_corrupt_and_truncated_jpegs_name_the_record(demo_jpegs) -> None:
    from zephon.media import DecodeImage, RandomResizedCrop
    from zephon.plan import Refs

    good = demo_jpegs[0]
    bad = {1: good[: len(good) // 3],                   # truncated in the middle
           2: good[:-200],                             # truncated below any crop: no end marker
           3: good[:400] + b"\x00" * 300}             # header, then zeros
    for i, data in bad.items():
        with pytest.raises(DecodeError, match="corrupt or truncated jpeg"):
            decode_region(data, (0, 0, 8, 8), scale=8, decoder="turbojpeg")
        cols = {"jpg": np.array([good, data, good], dtype=object)}
        refs = Refs(np.zeros(3, np.int64), np.array([10, 10 + i, 12]), np.zeros(3, np.int64))
        for seed in range(3):   # whichever box is drawn
            op = DecodeImage("jpg", RandomResizedCrop(32), flip=0.5, decoder="turbojpeg")
            with pytest.raises(DecodeError, match=rf"record {10 + i} of source 0 .*field 'jpg'.*on_error='skip'"):
                op.apply(cols, refs, seed)
            skip = DecodeImage("jpg", RandomResizedCrop(32), decoder="turbojpeg", on_error="skip")
            out, keep = skip.apply(cols, refs, seed)
            assert keep.tolist() == [True, False, True] and out["jpg"].shape == (2, 32, 32, 3)


def test_cmyk_jpegs_go_through_pillow() -> None:
    from PIL import Image

    rgb = np.random.default_rng(1).integers(0, 256, (40, 56, 3), dtype=np.uint8)
    b = io.BytesIO()
    Image.fromarray(rgb).convert("CMYK").save(b, "JPEG", quality=95)
    data = b.getvalue()
    with pytest.raises(turbo.TurboCMYK):
        turbo.decode(data)
    whole = decode_image(data, decoder="turbojpeg")
    np.testing.assert_array_equal(whole, decode_image(data, decoder="pillow"))
    np.testing.assert_array_equal(decode_region(data, (3, 5, 20, 30), decoder="turbojpeg"), whole[3:20, 5:30])


def test_auto_decoder_is_turbojpeg_and_falls_back_without_it(monkeypatch) -> None:
    from zephon.media import decode as D

    assert decoder_identity()["jpeg"].startswith("turbojpeg ")
    assert "libjpeg-turbo" in decoder_identity()["jpeg"]     # the bundled library's own version
    monkeypatch.setattr(turbo, "available", lambda: False)
    D._libraries.cache_clear()
    D.resolved.cache_clear()
    try:
        assert not decoder_identity()["jpeg"].startswith("turbojpeg")
        from PIL import Image
        b = io.BytesIO()
        Image.new("RGB", (300, 200), (200, 30, 10)).save(b, "JPEG")
        from zephon.media import DecodeImage, RandomResizedCrop
        from zephon.plan import Refs
        op = DecodeImage("jpg", RandomResizedCrop(32))
        out = op.apply({"jpg": np.array([b.getvalue()], dtype=object)},
                       Refs(np.zeros(1, np.int64), np.zeros(1, np.int64), np.zeros(1, np.int64)), 0)[0]["jpg"]
        assert out.shape == (1, 32, 32, 3) and abs(int(out[0, 0, 0, 0]) - 200) < 8
        with pytest.raises(ValueError, match="not installed"):
            D.Decoder(jpeg="turbojpeg").resolve()
    finally:
        monkeypatch.undo()
        D._libraries.cache_clear()
        D.resolved.cache_clear()
