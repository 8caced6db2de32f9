"""Every training example runs, in reduced size, and shows what its docstring promises.

- examples/lm_torch_ddp.py: DDP on 2 gloo processes with ZephonDataLoader workers and gradient
  accumulation; a single process resumes from the checkpoint and its losses equal the 2-rank
  run's bit for bit.
- examples/lm_jax_flax.py: flax + optax on 8 CPU devices, a (data, fsdp) mesh, Orbax checkpoint;
  resumed under another mesh the batches and losses are identical.
- examples/torch_train.py (the small DDP example with stop/resume on 2 and 1 ranks).
- benchmarks/elastic_training.py --quick (the elastic-training experiment's smoke run; slow:
  `make verify`).

- examples/clip_torch.py: CLIP-style contrastive steps on the demo images; the second half
  resumed on 2 ranks gives the same global batches.

(examples/jax_train.py is run by tests/test_jax_backend.py.)
"""

import json
import os
import re
import sys
from pathlib import Path

import pytest
from _helpers import run_group

ROOT = Path(__file__).resolve().parent.parent


def run(script: str, *args: str, timeout: int = 600) -> str:
    env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    proc = run_group([sys.executable, str(ROOT / script), *args], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=timeout)
    assert proc.returncode == 0, f"{script} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc.stdout


SMALL_DATA = ("--code-every", "30", "--prose-docs", "120")


@pytest.mark.multiprocess
def test_lm_torch_ddp_resumes_on_one_process_bit_for_bit(tmp_path):
    out = run("examples/lm_torch_ddp.py", "--steps", "6", "--workers", "2", "--micro-batches", "2",
              *SMALL_DATA, "--out", str(tmp_path))
    assert "max |loss diff| = 0  (bit for bit)" in out, out
    assert "run A's global batches had [8, 8, 16, 16, 16, 16] rows" in out, out  # the warm-up ran
    assert (tmp_path / "checkpoint.pt").exists()
    assert "B (1 process)" in out and "(identical)" in out.split("held-out loss")[1], out


def test_lm_jax_flax_resumes_under_another_mesh_identically(tmp_path):
    pytest.importorskip("flax")
    pytest.importorskip("optax")
    pytest.importorskip("orbax.checkpoint")
    assert "--xla_force_host_platform_device_count=8" in os.environ.get("XLA_FLAGS", "")  # conftest
    out = run("examples/lm_jax_flax.py", "--steps", "6", "--batch", "16", "--lanes", "8", *SMALL_DATA,
              "--out", str(tmp_path))
    assert "max |loss diff| = 0  (identical)" in out, out
    assert "global batch rows per step {0: 8, 1: 8, 2: 16, 3: 16, 4: 16, 5: 16}" in out, out  # the warm-up
    assert "global batches of B equal to A's: 3 of 3" in out, out
    assert "(identical)" in out.split("held-out loss")[1], out


def test_held_out_loss_is_identical_at_every_degree(tmp_path):
    """The examples' evaluation path (lm_data.eval_pipeline + evaluate) at D = 1, 2, 4, 8: the
    same loss, bit for bit, equal to scoring every held-out document directly (no packing, no
    padding), over exactly the held-out tokens."""
    import argparse
    import math

    import numpy as np
    from tokenizers import Tokenizer

    import zephon as z

    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import lm_data
    finally:
        sys.path.remove(str(ROOT / "examples"))
    ap = argparse.ArgumentParser()
    lm_data.add_data_args(ap, "")
    args = ap.parse_args(["--batch", "8", "--seq-len", "64", "--vocab", "300", "--code-every", "60",
                          "--prose-docs", "30", "--eval-docs", "8"])
    lm_data.write_data(tmp_path, args)
    weights = np.random.default_rng(0).random(args.vocab)  # a fixed "model": a token's loss by id

    def row_loss(row):
        return weights[row["targets"][0]]

    pipe = lm_data.eval_pipeline(tmp_path, args)
    got = {}
    for d in (1, 2, 4, 8):
        batches = [dict(b) for r in range(d) for b in z.Loader(pipe, z.Where(rank=r, world=d))]
        got[d] = lm_data.evaluate(batches, row_loss)
    assert len(set(got.values())) == 1, got
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    direct = []
    for name, field in (("eval_code", "source"), ("eval_prose", "text")):
        docs = [json.loads(l)[field] for l in (tmp_path / f"{name}.jsonl").read_text().splitlines()]
        for ids in (e.ids + [lm_data.EOS_ID] for e in tok.encode_batch(docs)):
            direct += [float(weights[t]) for t in ids[1:]]  # a document's last token predicts nothing
    assert got[1] == (math.fsum(direct) / len(direct), len(direct))


@pytest.mark.multiprocess
def test_torch_train_example(tmp_path):
    out = run("examples/torch_train.py", "--steps", "6", "--out", str(tmp_path))
    assert "equals A bit for bit: True" in out, out
    assert "saw A's global batches at every step: True" in out, out
    assert re.search(r"A: the training loop \(rank 0\) waited for data \d+\.\d% of its time", out), out


@pytest.mark.slow
def test_elastic_training_experiment_quick(tmp_path):
    import json

    out = run("benchmarks/elastic_training.py", "--quick", "--out", str(tmp_path))
    result = json.loads((tmp_path / "elastic_training.json").read_text())
    assert result["spread"]["zephon"] == 0.0, out
    assert result["resume"]["zephon"]["max_abs_eval_diff_vs_uninterrupted_D2"] == 0.0
    assert all(v == result["config"]["steps"] for v in result["global_batches_equal_to_D1"]["zephon"].values())
    assert (tmp_path / "elastic_training.png").stat().st_size > 10_000


def test_clip_torch_trains_and_resumes_on_two_ranks_identically():
    """examples/clip_torch.py: contrastive image-text steps over the demo photographs (their first
    shard, 1,000 JPEGs), then the second half's global batches re-made on 2 ranks from the state."""
    pytest.importorskip("simplejpeg")
    pytest.importorskip("skimage")
    out = run("examples/clip_torch.py", "--steps", "6", "--images", "1000", "--batch", "32")
    assert re.search(r"step   5  loss \d+\.\d+", out), out
    assert "resumed at step 3 on 2 ranks: 3 of 3 global batches identical" in out, out
