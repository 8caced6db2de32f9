"""Image decoding: formats, reduced-size decode, corrupt bytes, decoder identity."""

from __future__ import annotations

import importlib.util
import io

import numpy as np
import pytest

from zephon.errors import DecodeError
from zephon.media import libjpeg
from zephon.media.decode import Decoder, ImageDecodeError, decode_image, decoder_identity, image_format

PIL = pytest.importorskip("PIL.Image")


def encode(a: np.ndarray, fmt: str, **kw) -> bytes:
    b = io.BytesIO()
    PIL.fromarray(a).save(b, fmt, **kw)
    return b.getvalue()


def smooth(h: int, w: int) -> np.ndarray:
    y, x = np.mgrid[0:h, 0:w]
    return np.stack([x * 255 // max(w - 1, 1), y * 255 // max(h - 1, 1), (x + y) % 256], -1).astype(np.uint8)


LIBS = [lib for lib, mod in (("simplejpeg", "simplejpeg"), ("opencv", "cv2"), ("pillow", "PIL"))
        if importlib.util.find_spec(mod)]
if libjpeg.available():   # the region decode through libjpeg-turbo (zephon.media.libjpeg)
    LIBS.insert(0, "libjpeg-turbo")


@pytest.mark.parametrize("fmt", ["JPEG", "PNG", "WEBP"])
@pytest.mark.parametrize("lib", LIBS)
def test_formats_decode_to_uint8_hwc(fmt: str, lib: str) -> None:
    a = smooth(60, 80)
    data = encode(a, fmt, **({"quality": 95} if fmt != "PNG" else {}))
    assert image_format(data) == fmt.lower()
    x = decode_image(data, decoder=lib)
    assert x.dtype == np.uint8 and x.shape == (60, 80, 3)
    err = np.abs(x.astype(int) - a).mean()
    assert err == 0 if fmt == "PNG" else err < 6, err
    g = decode_image(data, decoder=lib, mode="L")
    assert g.shape == (60, 80, 1)


def test_grayscale_and_alpha_become_rgb() -> None:
    gray = smooth(20, 30)[:, :, 0]
    assert decode_image(encode(gray, "JPEG")).shape == (20, 30, 3)
    rgba = np.dstack([smooth(20, 30), np.full((20, 30), 128, np.uint8)])
    assert decode_image(encode(rgba, "PNG")).shape == (20, 30, 3)


@pytest.mark.parametrize("lib", LIBS)
def test_reduced_size_decode_is_the_smallest_power_of_two_at_least_min_size(lib: str) -> None:
    data = encode(smooth(400, 600), "JPEG", quality=90)
    assert decode_image(data, decoder=lib, min_size=(100, 150)).shape == (100, 150, 3)   # 1/4
    assert decode_image(data, decoder=lib, min_size=(101, 150)).shape == (200, 300, 3)   # 1/2
    assert decode_image(data, decoder=lib, min_size=(10, 10)).shape == (50, 75, 3)       # 1/8
    assert decode_image(data, decoder=lib, min_size=(500, 10)).shape == (400, 600, 3)    # none
    png = encode(smooth(400, 600), "PNG")
    assert decode_image(png, decoder=lib, min_size=(10, 10)).shape == (400, 600, 3)


@pytest.mark.parametrize("lib", LIBS)
def test_corrupt_and_unsupported_bytes_raise_decode_error(lib: str) -> None:
    data = encode(smooth(64, 64), "JPEG")
    with pytest.raises(ImageDecodeError, match="unsupported image format"):
        decode_image(b"GIF89a......", decoder=lib)
    with pytest.raises(DecodeError, match="corrupt or truncated jpeg"):
        decode_image(data[:150], decoder=lib)
    png = encode(smooth(64, 64), "PNG")
    with pytest.raises(DecodeError, match="corrupt or truncated png"):
        decode_image(png[:40] + b"\0" * 40, decoder=lib)


def test_decoder_identity_names_libraries_and_versions() -> None:
    ident = decoder_identity()
    assert set(ident) == {"jpeg", "png", "webp", "resize"}
    assert all(" " in v for v in ident.values())   # "library version"
    pil = decoder_identity(Decoder("pillow", "pillow", "pillow", "pillow"))
    assert pil["jpeg"].startswith("pillow ") and pil["resize"].startswith("pillow ")
    with pytest.raises(ValueError, match="not one of"):
        Decoder(jpeg="libjpeg").resolve()


def test_decode_operator_identity_names_decoder_and_version_and_refuses_another() -> None:
    import zephon as z
    from zephon.errors import StateError
    from zephon.media import DecodeImage, RandomResizedCrop
    from zephon.sources.memory import ArraySource

    data = np.array([encode(smooth(30 + i, 40), "JPEG") for i in range(8)], dtype=object)
    src = ArraySource({"jpg": data})
    plan = z.Source(8).repeat().lanes(2).batch(4)
    auto = DecodeImage("jpg", RandomResizedCrop(8), flip=0.5)
    cfg = auto.identity()["config"]["decoder"]
    assert cfg == decoder_identity() and all(" " in v for v in cfg.values())   # "library version"
    a = z.Loader(plan, src, [auto], seed=2)
    next(a)
    state = a.state()
    if decoder_identity()["jpeg"].startswith("pillow"):
        pytest.skip("only Pillow is installed: no other decoder to refuse")
    other = z.Loader(plan, src, [DecodeImage("jpg", RandomResizedCrop(8), flip=0.5, decoder="pillow")], seed=2)
    with pytest.raises(StateError, match=r"DecodeImage.*decoder\.jpeg"):
        other.restore(state)
    same = z.Loader(plan, src, [DecodeImage("jpg", RandomResizedCrop(8), flip=0.5)], seed=2)
    same.restore(state)
    np.testing.assert_array_equal(next(same).data["jpg"], next(a).data["jpg"])


def test_random_choices_are_keyed_on_the_record_not_the_batch() -> None:
    from zephon.media import DecodeImage, RandomResizedCrop
    from zephon.plan import Refs

    data = np.array([encode(smooth(50, 70), "JPEG")] * 6, dtype=object)
    op = DecodeImage("jpg", RandomResizedCrop(10, scale=(0.1, 0.5)), flip=0.5)
    refs = Refs(np.zeros(6, np.int64), np.arange(6), np.zeros(6, np.int64))
    whole = op.apply({"jpg": data}, refs, 11)[0]["jpg"]
    parts = [op.apply({"jpg": data[i:i + 1]}, refs.take(np.array([i])), 11)[0]["jpg"][0] for i in (4, 0, 2)]
    for got, i in zip(parts, (4, 0, 2)):
        np.testing.assert_array_equal(got, whole[i])
    assert len({whole[i].tobytes() for i in range(6)}) > 1          # the same image, other crops
    epoch1 = op.apply({"jpg": data}, Refs(refs.source, refs.record, np.ones(6, np.int64)), 11)[0]["jpg"]
    assert not np.array_equal(epoch1, whole)                        # a new epoch, new choices


def test_decode_operator_bounds_the_loaders_default_read_ahead() -> None:
    import zephon as z
    from zephon.media import DecodeImage, RandomResizedCrop, Resize
    from zephon.sources.memory import ArraySource

    src = ArraySource({"jpg": np.array([encode(smooth(30, 40), "JPEG")] * 8, dtype=object)})
    plan = z.Source(8).repeat().lanes(2).batch(4)
    crop = DecodeImage("jpg", RandomResizedCrop(224), on_error="skip")
    assert z.Loader(plan, src, [crop]).read_ahead == (16 << 20) // (224 * 224 * 3)   # 111 rows, ~16 MB
    assert z.Loader(plan, src, [DecodeImage("jpg", RandomResizedCrop(8))]).read_ahead == 1024
    assert z.Loader(plan, src, [DecodeImage("jpg", Resize(shorter=64))]).read_ahead == 256
    assert z.Loader(plan, src, [crop], read_ahead=4096).read_ahead == 4096      # explicit wins
    assert z.Loader(plan, src, []).read_ahead == 16384                          # text default
