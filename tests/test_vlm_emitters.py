"""VLM-packed batches through every emitter: numpy (reference), JAX (global arrays sharded over the
batch axes: a device holds its rows' patches), torch (zero-copy, pinned dynamic form) — and the
VLM pipeline in the verify matrix (degrees, runners, emitters, stop/resume across them)."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from zephon import Loader
from zephon import testing as zt
from zephon.backends.numpy import emit
from zephon.cli.pipelines import demo_vlm
from zephon.media.vlm_batch import packed_patches

VLM = "zephon.cli.pipelines:demo_vlm"


@pytest.fixture(scope="module")
def reference():
    p = demo_vlm()
    loader = Loader(p.plan, p.sources, p.transforms)
    return p, [emit(next(loader)) for _ in range(3)]


def test_jax_global_arrays_shard_patches_with_their_rows(reference):
    jax = pytest.importorskip("jax")
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    from zephon.backends.jax import JaxLoader

    p, ref = reference
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "fsdp"))
    with JaxLoader(p.plan, p.sources, p.transforms, mesh=mesh, batch_axes=("data", "fsdp"), prefetch=0) as loader:
        got = [next(loader) for _ in range(3)]
    rows = p.plan.size // 8
    for arrays, want in zip(got, ref):
        assert set(arrays) == set(want)
        for name, w in want.items():
            a = arrays[name]
            assert a.sharding.spec == P(("data", "fsdp")) and a.shape == w.shape, name
            np.testing.assert_array_equal(np.asarray(a), w, err_msg=name)
        # each device holds a block of rows: their tokens and exactly their patches
        tok = {s.device: s for s in arrays["tokens"].addressable_shards}
        for s in arrays["pixel_values"].addressable_shards:
            block = s.index[0]
            assert s.data.shape == (rows,) + w_shape(want, "pixel_values")
            np.testing.assert_array_equal(np.asarray(s.data), want["pixel_values"][block])
            assert tok[s.device].index[0] == block
            np.testing.assert_array_equal(np.asarray(tok[s.device].data), want["tokens"][block])


def w_shape(batch, name):
    return batch[name].shape[1:]


def test_torch_tensors_and_pinned_dynamic_form(reference, caplog):
    torch = pytest.importorskip("torch")
    from zephon.backends import torch as tb
    from zephon.backends.torch.batch import can_pin
    from zephon.backends.torch.vlm import packed_patches as torch_packed

    p, ref = reference
    with tb.TorchLoader(p.plan, p.sources, p.transforms, world=2, rank=1) as loader:
        got = [next(loader) for _ in range(3)]
    half = p.plan.size // 2
    for batch, want in zip(got, ref):
        for name, w in want.items():
            t = batch[name]
            assert isinstance(t, torch.Tensor), name
            np.testing.assert_array_equal(t.numpy(), w[half:], err_msg=name)
        with caplog.at_level(logging.WARNING):
            dyn = torch_packed(batch, pin_memory=True)
        ref_dyn = packed_patches({k: v[half:] for k, v in want.items()})
        assert set(dyn) == set(ref_dyn)
        for k, v in ref_dyn.items():
            assert isinstance(dyn[k], torch.Tensor)
            np.testing.assert_array_equal(dyn[k].numpy(), v, err_msg=k)
            assert dyn[k].is_pinned() == can_pin()
        if not can_pin():
            assert "not pinned" in caplog.text


def test_verify_matrix_small():
    """Processes, JAX and torch, and resumes across emitters: the fast part of the matrix."""
    report = zt.verify(VLM, ["numpy D=2 runner=processes:2", "jax mesh=8", "torch D=4",
                             "torch D=1 workers=2", "numpy D=2 @2 -> jax mesh=2x4",
                             "jax mesh=8 @2 -> torch D=2 micro=2"], steps=4)
    assert report.ok, report.summary()


@pytest.mark.slow
def test_verify_matrix_long():
    """The whole default matrix on the VLM pipeline (make verify also runs it through the CLI)."""
    configs = zt.matrix(steps=12, backends=("numpy", "jax", "torch"))
    report = zt.verify(VLM, configs, steps=12)
    assert report.ok, report.summary()
