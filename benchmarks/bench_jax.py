"""Loader -> sharded jax.Array on 8 CPU devices, against the numpy backend alone, in one run.

Data: `--records` x 256 int32 tokens, global shuffle, batch `--batch`, 64 lanes, from two sources
in turn: ArrayRecord in 4 shards (reads on the reader's own threads) and in-memory numpy (the
backend's own cost stands out). Measured per source (median of `--rounds` interleaved rounds, so
machine noise hits every row alike):

  numpy            Loader + numpy emitter (the host-side work alone)
  jax sync         JaxLoader(prefetch=0): the same plus make_array_from_process_local_data
                   onto 8 devices, waited for, in the caller's thread
  jax prefetch=2   JaxLoader(prefetch=2) drained by a caller doing nothing else

Prefetch overlap, with two train steps whose result the host waits for every step (as a loop
that logs the loss does, so jax's async dispatch cannot hide the loader by itself):
  jit step      a jit MLP (batch sharded over the 8 devices) calibrated to cost about one batch
                load; on CPU it competes with the loader for the same cores
  device wait   the host sleeps as long as one batch load, as it waits for an accelerator
`hidden` is the share of the hideable time prefetch hid: (sync - prefetch) / (sync - max(load,
step)); 1.0 is perfect overlap.

    python benchmarks/bench_jax.py            # writes benchmarks/results/jax.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from zephon import How, Loader, Pipeline, Source, Where
from zephon.backends.jax import JaxLoader
from zephon.backends.numpy import emit
from zephon.sources.array_record import ArrayRecordSource, write_sharded_array_record
from zephon.sources.base import RecordSource
from zephon.sources.memory import ArraySource
from zephon.sources.spec import FixedFields

SEQ, LANES, WIDTH = 256, 64, 256
RESULTS = Path(__file__).resolve().parent / "results" / "jax.json"


def write_data(directory: str, tokens: np.ndarray) -> ArrayRecordSource:
    spec = FixedFields({"tokens": ("int32", (SEQ,))})
    write_sharded_array_record(os.path.join(directory, "tokens"), [r.tobytes() for r in tokens], 4)
    return ArrayRecordSource(os.path.join(directory, "tokens@4"), spec)


def make_model(layers: int, mesh: Mesh) -> tuple[Callable, dict]:
    keys = jax.random.split(jax.random.key(0), layers + 1)
    params = {"embed": jax.random.normal(keys[0], (SEQ, WIDTH)) / SEQ,
              "layers": [jax.random.normal(k, (WIDTH, WIDTH)) / np.sqrt(WIDTH) for k in keys[1:]]}
    params = jax.device_put(params, NamedSharding(mesh, P()))

    @jax.jit
    def step(params: dict, batch: dict) -> tuple[dict, jax.Array]:
        def loss_fn(p: dict) -> jax.Array:
            h = (batch["tokens"].astype(jnp.float32) / 50_257.0) @ p["embed"]
            for w in p["layers"]:
                h = jnp.tanh(h @ w)
            return jnp.mean(h ** 2)
        loss, grads = jax.value_and_grad(loss_fn)(params)
        return jax.tree.map(lambda a, g: a - 1e-3 * g, params, grads), loss

    return step, params


def timed(batches: Iterator, steps: int, consume: Callable[[dict], None] | None = None) -> float:
    """Seconds per step of taking `steps` batches (and consuming each), after a first warm one.

    Creating and closing a loader stays outside the timing: a training loop does it once.
    """
    next(batches)
    t = time.perf_counter()
    for _ in range(steps):
        batch = next(batches)
        if consume is not None:
            consume(batch)
    return (time.perf_counter() - t) / steps


def measure(source: RecordSource, mesh: Mesh, args: argparse.Namespace) -> dict:
    """Every row of the table for one source, interleaved over rounds; medians in seconds."""
    plan = Source(len(source)).shuffle(seed=1).repeat().lanes(LANES).batch(args.batch)
    cursor = {"step": 0}  # every measurement reads batches no earlier one read

    def fresh_start(steps: int) -> int:
        start = cursor["step"]
        cursor["step"] += steps
        return start

    def numpy_run(steps: int) -> float:
        return timed(map(emit, Loader(Pipeline(plan, source), start_step=fresh_start(steps + 1))), steps)

    def jax_run(prefetch: int, consume: Callable[[dict], None] | None = None) -> Callable[[int], float]:
        def run(steps: int) -> float:
            start = fresh_start(steps + 1)
            with JaxLoader(Pipeline(plan, source), Where(mesh=mesh), How(prefetch=prefetch),
                           start_step=start) as loader:
                return timed(loader, steps, consume)
        return run

    def alone(consume: Callable[[dict], None]) -> Callable[[int], float]:
        return lambda steps: timed(itertools.repeat(sample), steps, consume)

    def fixed_step(train: Callable, params: Any) -> Callable[[dict], None]:
        """One jit step on these `params`, which stay as they are (a calibration, not training).
        Binds the model of the current round explicitly, not the loop variables by name."""
        def step(batch: dict) -> None:
            float(train(params, batch)[1])
        return step

    # Calibrate the jit step to cost about one batch load.
    with JaxLoader(Pipeline(plan, source), Where(mesh=mesh), How(prefetch=0)) as warm:
        sample = next(warm)
    t_load0 = min(jax_run(0)(20) for _ in range(3))  # min: the least disturbed estimate
    layers = 1
    for _ in range(6):
        train, params = make_model(layers, mesh)
        float(train(params, sample)[1])  # compile
        t_train0 = min(alone(fixed_step(train, params))(10) for _ in range(3))
        if t_train0 >= 0.8 * t_load0:
            break
        layers = max(layers + 1, int(layers * t_load0 / t_train0))

    def jit_step(batch: dict) -> None:
        nonlocal params
        params, loss = train(params, batch)
        float(loss)  # the host waits for the step, as a loop that logs the loss does

    def device_wait(batch: dict) -> None:
        time.sleep(t_load0)  # an accelerator step: the host waits without using a core

    rows: dict[str, Callable[[int], float]] = {"numpy": numpy_run, "jax sync": jax_run(0),
                                              "jax prefetch=2": jax_run(2)}
    for label, consume in (("jit step", jit_step), ("device wait", device_wait)):
        rows[f"{label} alone"] = alone(consume)
        rows[f"{label} + jax sync"] = jax_run(0, consume)
        rows[f"{label} + jax prefetch=2"] = jax_run(2, consume)
    times: dict[str, list[float]] = {k: [] for k in rows}
    for _ in range(args.rounds):
        for name, run in rows.items():
            times[name].append(run(args.steps))
    t = {k: statistics.median(v) for k, v in times.items()}

    load = t["jax sync"]
    overlap = {}
    for label in ("jit step", "device wait"):
        step, sync, pre = t[f"{label} alone"], t[f"{label} + jax sync"], t[f"{label} + jax prefetch=2"]
        overlap[label] = {"load_ms": load * 1e3, "step_ms": step * 1e3, "sync_ms": sync * 1e3,
                          "prefetch_ms": pre * 1e3, "ideal_ms": max(load, step) * 1e3,
                          "hidden": (sync - pre) / (sync - max(load, step))}
    return {
        "jit_step_layers": layers,
        "ms_per_step": {k: round(v * 1e3, 3) for k, v in t.items()},
        "samples_per_s": {k: round(args.batch / t[k]) for k in ("numpy", "jax sync", "jax prefetch=2")},
        "ratios": {"jax_sync_vs_numpy": round(t["numpy"] / t["jax sync"], 3),
                   "jax_prefetch_vs_numpy": round(t["numpy"] / t["jax prefetch=2"], 3)},
        "prefetch_overlap": {k: {m: round(x, 3) for m, x in v.items()} for k, v in overlap.items()},
    }


def report(name: str, r: dict) -> None:
    print(f"\n{name}")
    print(f"{'':30}{'ms/step':>9}{'samples/s':>11}{'vs numpy':>10}")
    numpy_ms = r["ms_per_step"]["numpy"]
    for k, ms in r["ms_per_step"].items():
        extra = f"{r['samples_per_s'][k]:>11}{numpy_ms / ms:>10.2f}" if k in r["samples_per_s"] else ""
        print(f"{k:30}{ms:>9.2f}{extra}")
    for label, o in r["prefetch_overlap"].items():
        print(f"prefetch overlap, {label}: load {o['load_ms']:.2f} + step {o['step_ms']:.2f} ms -> sync "
              f"{o['sync_ms']:.2f}, prefetch {o['prefetch_ms']:.2f} (ideal {o['ideal_ms']:.2f}): "
              f"hidden {o['hidden']:.0%} of the hideable time")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=100_000)
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()

    mesh = Mesh(np.array(jax.devices()), ("data",))
    tokens = (np.arange(args.records * SEQ, dtype=np.int64) % 50_257).astype(np.int32)
    tokens = tokens.reshape(args.records, SEQ)
    results = {}
    load_avg = []  # other work on the machine makes every row noisier
    with tempfile.TemporaryDirectory() as tmp:
        sources = {"array_record": write_data(tmp, tokens), "memory": ArraySource({"tokens": tokens})}
        for name, source in sources.items():
            results[name] = measure(source, mesh, args)
            load_avg.append(round(os.getloadavg()[0], 2))
    print(f"{jax.device_count()} CPU devices, {os.cpu_count()} cores, batch {args.batch} x {SEQ} int32, "
          f"median of {args.rounds} rounds x {args.steps} steps, load average {load_avg}")
    for name, r in results.items():
        report(name, r)
    out = {"config": {"records": args.records, "seq": SEQ, "batch": args.batch, "lanes": LANES,
                      "steps_per_round": args.steps, "rounds": args.rounds, "devices": jax.device_count(),
                      "cpus": os.cpu_count(), "load_avg_1min": load_avg, "jax": jax.__version__},
           **results}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
