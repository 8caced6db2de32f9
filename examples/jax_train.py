"""Train a tiny MLP with `jax.jit` on sharded global batches from Zephon, on 8 CPU devices.

It trains the same model twice, with the batch split over a mesh of shape (8,) and over a
(2, 4) mesh's two axes, and prints both loss curves' largest difference: the data are the same
global batches whatever the mesh. Then it stops a run half way, saves the loader state (JSON)
beside the parameters, resumes from disk and shows the resumed losses equal the uninterrupted run.

    python examples/jax_train.py --steps 300
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from zephon import How, Pipeline, RandomMap, Source, Where, load_state, save_state
from zephon.backends.jax import JaxLoader
from zephon.sources.memory import ArraySource

FEATURES, HIDDEN, RECORDS, LANES, BATCH, LR = 16, 32, 20_000, 16, 64, 0.05


def dataset() -> ArraySource:
    """y = sin(x . w) + noise: a small regression task an MLP learns in a few hundred steps."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((RECORDS, FEATURES)).astype(np.float32)
    w = rng.standard_normal(FEATURES).astype(np.float32) / np.sqrt(FEATURES)
    y = (np.sin(2 * x @ w) + 0.05 * rng.standard_normal(RECORDS)).astype(np.float32)
    return ArraySource({"x": x, "y": y[:, None]})


def jitter(record: dict, rng: np.random.Generator) -> dict:
    """Input noise drawn from the record's own generator: the same on every mesh and after resume."""
    return {**record, "x": record["x"] + np.float32(0.01) * rng.standard_normal(FEATURES, dtype=np.float32)}


PLAN = Source(RECORDS).shuffle(seed=42).repeat().lanes(LANES).batch(BATCH)
TRANSFORMS = (RandomMap(jitter),)


def init_params(key: jax.Array) -> dict[str, jax.Array]:
    k1, k2 = jax.random.split(key)
    return {"w1": jax.random.normal(k1, (FEATURES, HIDDEN)) / np.sqrt(FEATURES), "b1": jnp.zeros(HIDDEN),
            "w2": jax.random.normal(k2, (HIDDEN, 1)) / np.sqrt(HIDDEN), "b2": jnp.zeros(1)}


def loss_fn(params: dict[str, jax.Array], batch: dict[str, jax.Array]) -> jax.Array:
    h = jnp.tanh(batch["x"] @ params["w1"] + params["b1"])
    return jnp.mean((h @ params["w2"] + params["b2"] - batch["y"]) ** 2)


@jax.jit
def train_step(params: dict[str, jax.Array], batch: dict[str, jax.Array]) -> tuple[dict[str, jax.Array], jax.Array]:
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    return jax.tree.map(lambda p, g: p - LR * g, params, grads), loss


def make_mesh(shape: tuple[int, ...]) -> tuple[Mesh, str | tuple[str, ...]]:
    names = ("data", "fsdp")[: len(shape)]
    mesh = Mesh(np.array(jax.devices()).reshape(shape), names)
    return mesh, names if len(names) > 1 else names[0]


def train(shape: tuple[int, ...], steps: int, params: dict[str, jax.Array] | None = None,
          state: dict | None = None) -> tuple[list[float], dict[str, jax.Array], dict]:
    """Trains until global step `steps`; returns losses, parameters and the loader state."""
    mesh, axes = make_mesh(shape)
    replicated = NamedSharding(mesh, P())
    params = jax.device_put(params if params is not None else init_params(jax.random.key(0)), replicated)
    losses = []
    with JaxLoader(Pipeline(PLAN, dataset(), TRANSFORMS), Where(mesh=mesh, batch_axes=axes),
                   How(prefetch=2)) as loader:
        if state is not None:
            loader.restore(state)
        while loader.step < steps:
            batch = next(loader)
            params, loss = train_step(params, batch)
            # Read the loss every step, as a logging loop does. Without any sync, hundreds of
            # steps queue up asynchronously and XLA's CPU backend can starve the all-reduce
            # rendezvous of its 8 fake devices (an XLA-CPU limit, not a data-loading one).
            losses.append(float(loss))
        s = loader.stats()  # did the train step wait for data? (telemetry, on by default)
        print(f"mesh {shape}: the train loop waited for data {s.stall_pct:.1f}% of its time after the "
              f"first batch ({s.first_batch_s:.2f}s); {s.rows_per_s:,.0f} rows/s; busiest loader stage: "
              f"{s.bottleneck()}")
        return losses, params, loader.state()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--ckpt-dir", default=None, help="where to write the checkpoint (default: a temp dir)")
    args = ap.parse_args()
    print(f"{jax.device_count()} devices; plan {PLAN.fingerprint()}: batch {BATCH}, {LANES} lanes")

    t0 = time.perf_counter()
    curves = {}
    for shape in [(8,), (2, 4)]:
        curves[shape], _, _ = train(shape, args.steps)
        print(f"mesh {shape}: loss " + "  ".join(f"{i}:{curves[shape][i]:.4f}"
                                                 for i in range(0, args.steps, max(args.steps // 6, 1))) +
              f"  {args.steps - 1}:{curves[shape][-1]:.4f}")
    diff = float(np.max(np.abs(np.subtract(curves[(8,)], curves[(2, 4)]))))
    print(f"max |loss(8,) - loss(2,4)| over {args.steps} steps: {diff:.3g}")

    half = args.steps // 2
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = args.ckpt_dir or tmp
        os.makedirs(ckpt, exist_ok=True)
        _, params, state = train((2, 4), half)
        np.savez(os.path.join(ckpt, "params.npz"), **jax.device_get(params))
        save_state(os.path.join(ckpt, "loader_state.json"), state)
        print(f"saved params.npz + loader_state.json (step {state['step']}) in {ckpt}")
        with np.load(os.path.join(ckpt, "params.npz")) as f:
            restored = {k: jnp.asarray(f[k]) for k in f.files}
        resumed, _, _ = train((8,), args.steps, restored, load_state(os.path.join(ckpt, "loader_state.json")))
    rdiff = float(np.max(np.abs(np.subtract(resumed, curves[(8,)][half:]))))
    print(f"resumed at step {half} on mesh (8,) from a (2,4) checkpoint: max |loss diff| vs "
          f"uninterrupted over steps {half}..{args.steps - 1}: {rdiff:.3g}")
    print(f"total {time.perf_counter() - t0:.1f}s")


if __name__ == "__main__":
    main()
