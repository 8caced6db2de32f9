"""Fixed-size image batches through every emitter: numpy, JAX (sharded over the batch axes),
torch (pinned when asked), and the Grain-compatible API (PIL-style `map`/`random_map` functions
and Zephon's DecodeImage) — the same pixels everywhere."""

from __future__ import annotations

import io

import numpy as np
import pytest

import zephon as z
from zephon.media import DecodeImage, NormalizeImage, RandomResizedCrop
from zephon.sources.memory import ArraySource

PIL = pytest.importorskip("PIL.Image")
N, B, S = 48, 16, 24


def jpegs() -> np.ndarray:
    out = []
    for i in range(N):
        y, x = np.mgrid[0:40 + i, 60 - i // 2:120]
        a = np.stack([(x * 3 + i) % 256, (y * 7) % 256, (x * y) % 256], -1).astype(np.uint8)
        b = io.BytesIO()
        PIL.fromarray(a).save(b, "JPEG", quality=90)
        out.append(b.getvalue())
    return np.array(out, dtype=object)


SRC = ArraySource({"jpg": jpegs(), "label": np.arange(N)})
PLAN = z.Source(N).shuffle(3).repeat().lanes(8).batch(B)
OPS = [DecodeImage("jpg", RandomResizedCrop(S), flip=0.5, out="image")]


def reference(steps: int = 3) -> list[np.ndarray]:
    loader = z.Loader(PLAN, SRC, OPS, seed=5, read_ahead=B)
    return [next(loader).data["image"] for _ in range(steps)]


def test_numpy_batches_are_fixed_size_uint8_and_normalise() -> None:
    ref = reference()
    assert ref[0].shape == (B, S, S, 3) and ref[0].dtype == np.uint8
    loader = z.Loader(PLAN, SRC, [*OPS, NormalizeImage("image", out="x")], seed=5, read_ahead=B)
    x = next(loader).data["x"]
    assert x.dtype == np.float32 and x.shape == (B, S, S, 3)
    np.testing.assert_allclose(x[..., 0], (ref[0][..., 0] / 255 - 0.485) / 0.229, rtol=1e-5, atol=1e-5)


def test_jax_arrays_are_sharded_over_the_batch_axes() -> None:
    jax = pytest.importorskip("jax")
    from jax.sharding import Mesh

    from zephon.backends.jax import JaxLoader

    ref = reference()
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "fsdp"))
    with JaxLoader(PLAN, SRC, OPS, seed=5, mesh=mesh, batch_axes=("data", "fsdp"), read_ahead=B,
                   exclude=("jpg",)) as loader:
        for k in range(3):
            img = next(loader)["image"]
            assert isinstance(img, jax.Array) and img.shape == (B, S, S, 3)
            assert len(img.sharding.device_set) == 8
            assert img.addressable_shards[0].data.shape == (B // 8, S, S, 3)
            np.testing.assert_array_equal(np.asarray(img), ref[k])


def test_torch_tensors_pinned_and_equal() -> None:
    torch = pytest.importorskip("torch")
    from zephon.backends.torch import TorchLoader

    ref = reference()
    pin = torch.cuda.is_available()   # pinning needs an accelerator runtime; CPU builds refuse it
    with TorchLoader(PLAN, SRC, OPS, seed=5, read_ahead=B, pin_memory=pin) as loader:
        for k in range(3):
            img = next(loader)["image"]
            assert isinstance(img, torch.Tensor) and img.dtype == torch.uint8 and tuple(img.shape) == (B, S, S, 3)
            assert img.is_pinned() == pin
            np.testing.assert_array_equal(img.numpy(), ref[k])


def _pil_crop_flip(record, rng):
    """A PIL-style Grain random_map: decode with Pillow, crop a random box, maybe flip."""
    im = PIL.open(io.BytesIO(record["jpg"])).convert("RGB")
    w, h = im.size
    x, y = int(rng.integers(0, w - 16)), int(rng.integers(0, h - 16))
    im = im.crop((x, y, x + 16, y + 16))
    if rng.random() < 0.5:
        im = im.transpose(PIL.Transpose.FLIP_LEFT_RIGHT)
    return {"image": np.asarray(im), "label": record["label"]}


def test_grain_compatible_api_runs_pil_functions_and_decode_image() -> None:
    pytest.importorskip("grain")
    import zephon.compat.grain as zg

    records = [{"jpg": bytes(j), "label": int(i)} for i, j in enumerate(SRC.read(np.arange(N))["jpg"])]
    ds = zg.Dataset.source(records).seed(4).shuffle().repeat().random_map(_pil_crop_flip).batch(8)
    a = [next(iter(ds))["image"] for _ in range(2)]
    assert a[0].shape == (8, 16, 16, 3) and a[0].dtype == np.uint8
    np.testing.assert_array_equal(a[0], a[1])            # data-derived: the same again
    ranks = [zg.grain_batch_columns(next(iter(ds.shard(r, 2))))["image"] for r in range(2)]
    np.testing.assert_array_equal(np.concatenate(ranks), a[0])
    # Zephon's own operator inside the Grain-shaped API
    dz = zg.Dataset.source(records).seed(4).shuffle().repeat().map(
        DecodeImage("jpg", RandomResizedCrop(12), flip=0.5)).batch(8)
    got = next(iter(dz))
    assert np.asarray(got["jpg"]).shape == (8, 12, 12, 3)
