"""libjpeg-turbo's region decode (zephon.media.libjpeg, the default JPEG decoder when its C module
is built): a crop gives exactly the pixels of decoding the whole image at that scale and cutting
the box, on the demo's kinds of JPEGs (large and ImageNet-size, 4:4:4 / 4:2:2 / 4:2:0 /
grayscale, qualities 70-95), with and without restart markers; `add_restart_markers` is lossless;
corrupt and truncated bytes give the clear error naming the record whichever box is drawn;
without the module Zephon falls back to simplejpeg."""

from __future__ import annotations

import io

import numpy as np
import pytest

from zephon.errors import DecodeError
from zephon.media import libjpeg
from zephon.media.decode import decode_image, decode_region, decoder_identity


def test_the_c_module_is_built_wherever_a_compiler_is() -> None:
    """setup.py builds it with `optional=True` (no compiler: simplejpeg decodes instead), so a build
    that broke would only show as the tests below skipping: with a compiler, it must be here."""
    import shutil
    import sysconfig

    if shutil.which((sysconfig.get_config_var("CC") or "cc").split()[0]) is None:
        pytest.skip("no C compiler on this machine: the package installs without its C module")
    assert libjpeg.available(), ("zephon.media.libjpeg_binding is not built or finds no libjpeg-turbo: "
                                 f"library {libjpeg.library_path()}; reinstall with `make venv`")


needs_module = pytest.mark.skipif(not libjpeg.available(), reason="zephon.media.libjpeg_binding is not built")


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
    subs = {Image.open(io.BytesIO(d)).layer[0][1:3] if Image.open(io.BytesIO(d)).mode != "L" else "gray"
            for d in out}
    assert {(1, 1), (2, 1), (2, 2), "gray"} <= subs, subs   # 4:4:4, 4:2:2, 4:2:0 and grayscale all covered
    return out


def _boxes(rng: np.random.Generator, sh: int, sw: int) -> list[tuple[int, int, int, int]]:
    edges = [(0, 0, sh, sw), (0, 0, 1, 1), (sh - 1, sw - 1, sh, sw), (0, 16, sh, min(sw, 33)),
             (sh // 2, sw - 3, sh, sw), (1, 1, sh - 1, sw - 1)]
    rand = []
    for _ in range(10):
        h, w = int(rng.integers(1, sh + 1)), int(rng.integers(1, sw + 1))
        y, x = int(rng.integers(0, sh - h + 1)), int(rng.integers(0, sw - w + 1))
        rand.append((y, x, y + h, x + w))
    return [b for b in edges if b[0] < b[2] and b[1] < b[3]] + rand


@needs_module
@pytest.mark.parametrize("restart_px", [None, 8, 64, 10_000])
def test_region_decode_equals_the_whole_image_sliced(demo_jpegs, restart_px) -> None:
    """Plain JPEGs (rows above skipped), and JPEGs with restart markers every MCU, every ~64 px
    and every row (only the box's rectangle of intervals decoded)."""
    rng = np.random.default_rng(0)
    checked = 0
    for data in demo_jpegs:
        if restart_px is not None:
            data = libjpeg.add_restart_markers(data, restart_px)
        for scale in (1, 2, 4, 8):
            whole = libjpeg.decode(data, scale)
            sh, sw = whole.shape[:2]
            for y0, x0, y1, x1 in _boxes(rng, sh, sw):
                got = libjpeg.decode(data, scale, (y0, x0, y1, x1))
                np.testing.assert_array_equal(got, whole[y0:y1, x0:x1],
                                              err_msg=f"restart {restart_px} 1/{scale} {(y0, x0, y1, x1)}")
                checked += 1
    assert checked > 1000


@needs_module
def test_libjpeg_matches_simplejpeg_and_restart_markers_are_lossless(demo_jpegs) -> None:
    """The same libjpeg-turbo IDCT and upsampling: the pixels match simplejpeg's at every scale,
    before and after `add_restart_markers` (which copies the DCT coefficients)."""
    simplejpeg = pytest.importorskip("simplejpeg")
    for data in demo_jpegs[:6] + demo_jpegs[-1:]:
        marked = libjpeg.add_restart_markers(data)
        assert marked != data and b"\xff\xdd" in marked[:2000]   # a DRI segment in the header
        h, w = libjpeg.header(data)[:2]
        for scale in (1, 2, 4):
            ref = simplejpeg.decode_jpeg(data, colorspace="RGB", min_height=-(-h // scale), min_width=-(-w // scale))
            for d in (data, marked):
                np.testing.assert_array_equal(libjpeg.decode(d, scale), ref)
            np.testing.assert_array_equal(
                simplejpeg.decode_jpeg(marked, colorspace="RGB", min_height=-(-h // scale), min_width=-(-w // scale)),
                ref)


@needs_module
def test_restart_markers_keep_metadata_and_make_progressive_baseline() -> None:
    from PIL import Image

    rgb = np.random.default_rng(2).integers(0, 256, (120, 200, 3), dtype=np.uint8)
    b = io.BytesIO()
    exif = Image.Exif()
    exif[0x0112] = 6   # orientation
    Image.fromarray(rgb).save(b, "JPEG", quality=90, progressive=True, exif=exif, icc_profile=b"\x00icc-bytes")
    data = b.getvalue()
    marked = libjpeg.add_restart_markers(data, 32)
    im = Image.open(io.BytesIO(marked))
    assert not im.info.get("progressive") and im.getexif()[0x0112] == 6 and im.info["icc_profile"] == b"\x00icc-bytes"
    np.testing.assert_array_equal(libjpeg.decode(marked), libjpeg.decode(data))
    np.testing.assert_array_equal(libjpeg.decode(marked, 2, (5, 7, 50, 90)), libjpeg.decode(data, 2)[5:50, 7:90])


@needs_module
def test_decode_image_op_crop_path_equals_the_scaled_decode_path(demo_jpegs) -> None:
    """DecodeImage with the region decode gives the pixels the whole-image-at-scale path gives."""
    from zephon.media import DecodeImage, RandomResizedCrop
    from zephon.media.augment import Draws, crop_resize, reduction_for
    from zephon.ops.base import record_seeds
    from zephon.plan import Refs

    data = np.array(demo_jpegs[:8], dtype=object)
    refs = Refs(np.zeros(8, np.int64), np.arange(8), np.zeros(8, np.int64))
    for mode in ("RGB", "L"):
        op = DecodeImage("jpg", RandomResizedCrop(64), flip=0.5, decoder="libjpeg-turbo", mode=mode)
        got = op.apply({"jpg": data}, refs, 5)[0]["jpg"]
        seeds = record_seeds(5, refs)
        for i, d in enumerate(demo_jpegs[:8]):
            rng = Draws(int(seeds[i]))
            h, w = libjpeg.header(d)[:2]
            box, size = op.geometry.plan(rng, h, w)
            flip = rng.random() < 0.5
            f = reduction_for(box, size)
            want = crop_resize(decode_image(d, decoder="libjpeg-turbo", scale=f, mode=mode), box, size, f,
                               "opencv", None, flip)
            np.testing.assert_array_equal(got[i], want)


@needs_module
def test_corrupt_and_truncated_jpegs_name_the_record(demo_jpegs) -> None:
    from zephon.media import DecodeImage, RandomResizedCrop
    from zephon.plan import Refs

    good = demo_jpegs[0]
    marked = libjpeg.add_restart_markers(good)
    at = marked.index(b"\xff\xd3")                           # the fourth restart marker
    bad = {1: good[: len(good) // 3],                      # truncated in the middle
           2: good[:-200],                                # truncated below any crop: no end marker
           3: good[:400] + b"\x00" * 300,                 # header, then zeros
           4: marked[:at] + b"\xff\xd5" + marked[at + 2:]}   # a misnumbered restart marker
    for i, data in bad.items():
        with pytest.raises(DecodeError, match="corrupt or truncated jpeg"):
            decode_region(data, (0, 0, 8, 8), scale=8, decoder="libjpeg-turbo")
        cols = {"jpg": np.array([good, data, good], dtype=object)}
        refs = Refs(np.zeros(3, np.int64), np.array([10, 10 + i, 12]), np.zeros(3, np.int64))
        for seed in range(3):   # whichever box is drawn
            op = DecodeImage("jpg", RandomResizedCrop(32), flip=0.5, decoder="libjpeg-turbo")
            with pytest.raises(DecodeError, match=rf"record {10 + i} of source 0 .*field 'jpg'.*on_error='skip'"):
                op.apply(cols, refs, seed)
            skip = DecodeImage("jpg", RandomResizedCrop(32), decoder="libjpeg-turbo", on_error="skip")
            out, keep = skip.apply(cols, refs, seed)
            assert keep.tolist() == [True, False, True] and out["jpg"].shape == (2, 32, 32, 3)
    with pytest.raises(libjpeg.LibjpegError):
        libjpeg.add_restart_markers(good[:5000])


@needs_module
def test_cmyk_jpegs_go_through_pillow() -> None:
    from PIL import Image

    rgb = np.random.default_rng(1).integers(0, 256, (40, 56, 3), dtype=np.uint8)
    b = io.BytesIO()
    Image.fromarray(rgb).convert("CMYK").save(b, "JPEG", quality=95)
    data = b.getvalue()
    with pytest.raises(libjpeg.LibjpegCMYK):
        libjpeg.decode(data)
    whole = decode_image(data, decoder="libjpeg-turbo")
    np.testing.assert_array_equal(whole, decode_image(data, decoder="pillow"))
    np.testing.assert_array_equal(decode_region(data, (3, 5, 20, 30), decoder="libjpeg-turbo"), whole[3:20, 5:30])


@needs_module
def test_a_library_of_another_abi_is_refused(tmp_path) -> None:
    """load() checks the library's ABI version and struct size; a non-libjpeg file is an OSError."""
    from zephon.media import libjpeg_binding

    fake = tmp_path / "libjpeg.so.62"
    fake.write_bytes(b"not a shared library")
    import subprocess
    import sys
    code = ("from zephon.media import libjpeg_binding\n"
            f"try:\n    libjpeg_binding.load({str(fake)!r})\nexcept OSError as e:\n    print('refused:', e)\n"
            "try:\n    libjpeg_binding.decode(b'', 8, 0, 0, 0, 0)\n"
            "except RuntimeError as e:\n    print('unloaded:', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "refused: cannot open" in out and "unloaded: zephon.media.libjpeg_binding: load() has not been called" in out
    assert libjpeg_binding is not None


@needs_module
def test_auto_decoder_is_libjpeg_turbo_and_falls_back_without_it(monkeypatch) -> None:
    from zephon.media import decode as D

    assert decoder_identity()["jpeg"] == f"libjpeg-turbo {libjpeg.library_version()}"
    assert libjpeg.library_version()[0].isdigit()
    monkeypatch.setattr(libjpeg, "available", lambda: False)
    D._libraries.cache_clear()
    D.resolved.cache_clear()
    try:
        assert not decoder_identity()["jpeg"].startswith("libjpeg-turbo")
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
            D.Decoder(jpeg="libjpeg-turbo").resolve()
    finally:
        monkeypatch.undo()
        D._libraries.cache_clear()
        D.resolved.cache_clear()


@needs_module
def test_restart_webdataset_and_its_cli_keep_every_member_and_every_pixel(demo_jpegs, tmp_path, capsys) -> None:
    import tarfile

    from zephon.cli import main
    from zephon.media import DecodeImage, RandomResizedCrop
    from zephon.plan import Refs
    from zephon.sources.webdataset import WebDatasetSource, write_webdataset

    samples = [{"__key__": f"{i:04d}", "jpg": d, "txt": f"caption {i}", "cls": i} for i, d in enumerate(demo_jpegs[:5])]
    src = tmp_path / "in" / "shard-0000.tar"
    src.parent.mkdir()
    write_webdataset(str(src), samples)
    assert main(["images", "restart", str(src), "--out", str(tmp_path / "out")]) == 0
    assert "5 JPEGs in 1 shards" in capsys.readouterr().out
    dst = tmp_path / "out" / "shard-0000.tar"
    with tarfile.open(src) as a, tarfile.open(dst) as b:
        assert a.getnames() == b.getnames()
        for m in a.getmembers():
            x, y = a.extractfile(m).read(), b.extractfile(m.name).read()
            assert (x != y and b"\xff\xdd" in y[:2000]) if m.name.endswith(".jpg") else x == y
    op = DecodeImage("jpg", RandomResizedCrop(48), flip=0.5)
    refs = Refs(np.zeros(5, np.int64), np.arange(5), np.zeros(5, np.int64))
    got = [op.apply(WebDatasetSource([str(p)], ["jpg"], decode=False).read(np.arange(5)), refs, 3)[0]["jpg"]
           for p in (src, dst)]
    np.testing.assert_array_equal(got[0], got[1])

    samples[2]["jpg"] = demo_jpegs[2][:3000]   # a truncated member: named, and no half shard left
    write_webdataset(str(src), samples)
    with pytest.raises(libjpeg.LibjpegError, match=r"shard-0000.tar: member 0002.jpg"):
        libjpeg.restart_webdataset(src, tmp_path / "bad.tar")
    assert not (tmp_path / "bad.tar").exists() and not (tmp_path / "bad.tar.tmp").exists()


@needs_module
def test_a_box_outside_the_image_is_the_callers_error_not_a_corrupt_image(demo_jpegs) -> None:
    h = libjpeg.header(demo_jpegs[5])[0]
    with pytest.raises(ValueError, match="is not inside the") as e:
        decode_region(demo_jpegs[5], (0, 0, -(-h // 2) + 1, 8), scale=2, decoder="libjpeg-turbo")
    assert not isinstance(e.value, DecodeError)


@needs_module
def test_damaged_bytes_raise_and_never_crash(demo_jpegs) -> None:
    """The C module parses untrusted bytes (markers, restart intervals, headers): damaged JPEGs,
    with and without restart markers, give an error or pixels of the asked shape, never a crash.
    (Run longer, 6,000 cases of this found none.)"""
    rng = np.random.default_rng(7)
    small = demo_jpegs[4:16]
    marked = [libjpeg.add_restart_markers(d, px) for d, px in zip(small, [8, 32, 64, 10_000] * 3)]
    decoded = failed = 0
    for _ in range(400):
        d = bytearray(marked[rng.integers(len(marked))] if rng.random() < 0.8 else small[rng.integers(len(small))])
        kind = rng.integers(4)
        if kind == 0:      # random bytes anywhere
            for _ in range(rng.integers(1, 20)):
                d[rng.integers(len(d))] = rng.integers(256)
        elif kind == 1:    # truncated
            d = d[: rng.integers(2, len(d))]
        elif kind == 2:    # a stray marker
            p = rng.integers(2, len(d) - 2)
            d[p], d[p + 1] = 0xFF, rng.integers(0xC0, 0x100)
        else:              # the header's fields
            for _ in range(rng.integers(1, 6)):
                d[rng.integers(2, min(len(d), 700))] = rng.integers(256)
        data = bytes(d)
        try:
            h, w = libjpeg.header(data)[:2]
            s = int(rng.choice([1, 2, 4, 8]))
            sh, sw = -(-h // s), -(-w // s)
            y0, x0 = int(rng.integers(0, sh)), int(rng.integers(0, sw))
            y1, x1 = int(rng.integers(y0 + 1, sh + 1)), int(rng.integers(x0 + 1, sw + 1))
            assert libjpeg.decode(data, s, (y0, x0, y1, x1)).shape[:2] == (y1 - y0, x1 - x0)
            decoded += 1
        except ValueError:   # LibjpegError, or a header whose size went to 0
            failed += 1
        try:
            libjpeg.add_restart_markers(data)
        except libjpeg.LibjpegError:
            pass
    assert decoded > 50 and failed > 50, (decoded, failed)
