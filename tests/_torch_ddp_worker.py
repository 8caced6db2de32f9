"""One rank of a 2-process torch.distributed (gloo) run, started by tests/test_torch_backend.py.

The rank takes its rank and world from `torch.distributed` (never from arguments), then records:
- per lane, digests of the rows its `TorchLoader` emitted (the test merges ranks into step
  fingerprints and compares them with a single-process numpy run);
- fingerprints of the global batch rebuilt with a gloo `all_gather` of the emitted tensors;
- fingerprints of `DTensor` output over a 1-d device mesh, read back with `full_tensor()`;
- the refusal of DTensor output for an interleaved lane mapping;
- for a pipeline with a Filter, lane digests, plus a `torch.distributed.checkpoint` of the
  loader state after `--split` steps (the test loads it in one process, at world 1);
- the same pipeline through `ZephonDataLoader` with 2 workers per rank (each runs 2 of the
  rank's 4 lanes): lane digests, and a checkpoint of its state after `--split` steps.

`pipeline()`, `filtered()` and `source()` use numpy and zephon core only; the test imports them.
"""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path

import numpy as np

from zephon import Filter, Source
from zephon.exec.loader import LocalBatch
from zephon.fingerprints import global_fingerprint, lane_digests
from zephon.plan import Batching
from zephon.sources.memory import ArraySource

RECORDS = 211
LANES = 8
BATCH = 32


def source() -> ArraySource:
    """Records whose every field depends on the record id, in the dtypes the spec asks for."""
    ids = np.arange(RECORDS, dtype=np.int64)
    rng = np.random.default_rng(7)
    return ArraySource({
        "tokens": (ids[:, None] * 31 + np.arange(16)).astype(np.int32) % 5003,
        "label": ids * 3,
        "weight": rng.standard_normal(RECORDS).astype(np.float32),
    })


def pipeline(mapping: str = "contiguous") -> Batching:
    return Source(RECORDS).shuffle(5).repeat().lanes(LANES, mapping).batch(BATCH)  # type: ignore[arg-type]


def keep(record: dict) -> bool:
    """Drops about a third of the records, so lanes advance by data-dependent amounts."""
    return int(record["tokens"][0]) % 3 != 0


def filtered() -> tuple[Batching, tuple[Filter, ...]]:
    return Source(RECORDS).shuffle(9).repeat().lanes(LANES).batch(16), (Filter(keep),)


def local_digests(step: int, tensors: dict, loader) -> dict[str, str]:
    return owned_digests(step, tensors, loader.loader.plan, loader.loader.owned)


def owned_digests(step: int, tensors: dict, plan: Batching, owned) -> dict[str, str]:
    batch = LocalBatch(step, {k: v.numpy() for k, v in tensors.items()}, owned, plan.per_lane, plan.size)
    return {str(lane): d for lane, d in lane_digests(batch).items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--split", type=int, default=3)
    args = ap.parse_args()

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    from zephon.backends.torch import TorchLoader, ZephonDataLoader, ZephonIterableDataset
    from zephon.errors import PlanError

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    out: dict = {"rank": rank, "world": world}

    loader = TorchLoader(pipeline(), source())
    dataset = ZephonIterableDataset(pipeline(), source())
    out["loader_rank_world"] = [loader.rank, loader.world, dataset.rank, dataset.world]
    out["digests"], out["gathered"] = [], []
    for _ in range(args.steps):
        step = loader.step
        tensors = next(loader)
        out["digests"].append(local_digests(step, tensors, loader))
        full = {}
        for name, t in tensors.items():
            parts = [torch.empty_like(t) for _ in range(world)]
            dist.all_gather(parts, t)
            full[name] = torch.cat(parts).numpy()
        out["gathered"].append(global_fingerprint(full, LANES))

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    sharded = TorchLoader(pipeline(), source(), mesh=mesh)
    out["dtensor"] = []
    for _ in range(args.steps):
        fields = next(sharded)
        out["dtensor_local_rows"] = int(fields["tokens"].to_local().shape[0])
        out["dtensor"].append(global_fingerprint({k: v.full_tensor().numpy() for k, v in fields.items()},
                                                 LANES))
    try:
        TorchLoader(pipeline("interleaved"), source(), mesh=mesh)
        out["interleaved_error"] = None
    except PlanError as e:
        out["interleaved_error"] = str(e)

    plan, transforms = filtered()
    floader = TorchLoader(plan, source(), transforms)
    out["filtered"] = []
    for i in range(args.steps):
        if i == args.split:
            dcp.save({"data": floader.state_dict()}, checkpoint_id=str(args.out / "dcp"))
        step = floader.step
        out["filtered"].append(local_digests(step, next(floader), floader))

    workers = ZephonDataLoader(ZephonIterableDataset(plan, source(), transforms), num_workers=2,
                               timeout=60)
    owned = plan.lanes.owned(rank, world)
    out["filtered_workers"] = []
    for i, tensors in zip(range(args.steps), workers):
        out["filtered_workers"].append(owned_digests(i, tensors, plan, owned))
        if i + 1 == args.split:
            dcp.save({"data": workers.state_dict()}, checkpoint_id=str(args.out / "dcp_workers"))

    dist.barrier()
    dist.destroy_process_group()
    (args.out / f"rank{rank}.json").write_text(json.dumps(out))


if __name__ == "__main__":
    main()
