"""Multi-process runs: a segment with `procs=N` runs in N local processes (jax.distributed or
torch gloo), each `python -m zephon.testing worker ARGS`; this module starts them (`run_processes`)
and is their side too (`_worker`, `main`)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from zephon.errors import PlanError
from zephon.exec.loader import merge_states
from zephon.fingerprints import LaneRecord, StepRecord, lane_records
from zephon.testing.configs import Config, Segment
from zephon.testing.pipeline import Builder
from zephon.testing.sessions import (
    FAKE_DEVICES_FLAG,
    JaxSession,
    NotApplicable,
    degree_problem,
    runner_from_spec,
    torch_columns,
    torch_round_trip,
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _subprocess_env(devices: int | None) -> dict[str, str]:
    env = dict(os.environ)
    paths = [os.getcwd()] + [p for p in sys.path if p and os.path.isdir(p)]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths + env.get("PYTHONPATH", "").split(os.pathsep)))
    flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith(FAKE_DEVICES_FLAG)]
    if devices:
        flags.append(f"{FAKE_DEVICES_FLAG}={devices}")
    env["XLA_FLAGS"] = " ".join(flags)
    env.setdefault("JAX_PLATFORMS", "cpu")
    return env


def run_processes(builder: Builder, seg: Segment, start: int, stop: int, state: dict[str, Any] | None,
                  ref_dtypes: Mapping[str, np.dtype], timeout: float
                  ) -> tuple[list[StepRecord], dict[str, Any], list[str]]:
    """Runs steps [start, stop) of a segment in `seg.procs` local processes; returns the merged
    lane records, the merged state after `stop` and the fields left out."""
    if builder.spec is None:
        raise NotApplicable("runs in several processes need a factory importable by name "
                             "(module:function or path/file.py:function), not a local function")
    with tempfile.TemporaryDirectory(prefix="zephon-procs-") as tmp:
        restore = None
        if state is not None:
            restore = os.path.join(tmp, "restore.json")
            Path(restore).write_text(json.dumps(state))
        port, procs, outs, logs = _free_port(), [], [], []
        args = {"factory": builder.spec, "segment": replace(seg, until=None).label(), "port": port, "start": start,
                "stop": stop, "restore": restore,
                "ref_dtypes": {k: np.dtype(v).str for k, v in ref_dtypes.items()}}
        devices = 8 // seg.procs if seg.backend == "jax" else None
        try:
            for i in range(seg.procs):
                outs.append(os.path.join(tmp, f"out{i}.json"))
                logs.append(os.path.join(tmp, f"log{i}.txt"))
                with open(logs[i], "wb") as log:  # a file, not a pipe: a chatty process cannot block
                    procs.append(subprocess.Popen(
                        [sys.executable, "-m", "zephon.testing", "worker",
                         json.dumps({**args, "process": i, "out": outs[i]})],
                        env=_subprocess_env(devices), stdout=log, stderr=subprocess.STDOUT))
            deadline = time.monotonic() + timeout
            for i, p in enumerate(procs):
                try:
                    code = p.wait(timeout=max(1.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    raise RuntimeError(f"process {i} of {seg.procs} did not finish in {timeout:.0f} s; "
                                       f"its log ends: {Path(logs[i]).read_text(errors='replace')[-800:]}") from None
                if code != 0:
                    tail = Path(logs[i]).read_text(errors="replace").strip().splitlines()
                    raise RuntimeError(f"process {i} of {seg.procs} exited with {code}: "
                                       + " | ".join(tail[-6:]))
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        results = [json.loads(Path(o).read_text()) for o in outs]
    for r in results:
        if "not_applicable" in r:
            raise NotApplicable(r["not_applicable"])
    ends = {len(r["records"]) for r in results}
    if len(ends) > 1:  # one rank would wait for the others at the end: a DDP hang in training
        raise RuntimeError(f"the processes' data ended at different steps: {[len(r['records']) for r in results]} "
                           f"steps after step {start}")
    records: list[StepRecord] = []
    for k in range(ends.pop()):
        merged: StepRecord = {}
        for r in results:
            merged.update({int(l): LaneRecord.from_json(v) for l, v in r["records"][k].items()})
        records.append(merged)
    return records, merge_states([r["state"] for r in results]), results[0]["excluded"]


def _worker(args: dict[str, Any]) -> None:
    """One of `procs` local processes running a segment (`python -m zephon.testing worker ARGS`)."""
    seg = Config.parse(args["segment"]).segments[0]
    builder = Builder(args["factory"])
    i, procs = int(args["process"]), seg.procs
    ref_dtypes = {k: np.dtype(v) for k, v in args["ref_dtypes"].items()}
    restore = json.loads(Path(args["restore"]).read_text()) if args["restore"] else None
    records: list[dict[str, Any]] = []
    excluded: list[str] = []
    if seg.backend == "jax":
        import jax

        jax.distributed.initialize(coordinator_address=f"127.0.0.1:{args['port']}",
                                   num_processes=procs, process_id=i)
        try:
            pipe = builder(procs, i)
            try:
                sess = JaxSession(pipe, replace(seg, procs=1), ref_dtypes)
            except (PlanError, NotApplicable) as e:
                Path(args["out"]).write_text(json.dumps({"not_applicable": str(e)}))
                return
            excluded = sess.excluded
            if restore is not None:
                sess.restore(restore)
            for _ in range(args["stop"] - args["start"]):
                try:
                    out = sess.step()
                except StopIteration:  # a finite plan's end: the same step in every process
                    break
                lanes, cols = out.parts[0]
                records.append({str(l): r.to_json() for l, r in lane_records(lanes, cols).items()})
            state = sess.state()
            sess.close()
        finally:
            jax.distributed.shutdown()
    else:
        import datetime

        import torch.distributed as dist

        from zephon.backends.torch import TorchLoader

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args['port']}", rank=i,
                                world_size=procs, timeout=datetime.timedelta(seconds=120))
        try:
            pipe = builder(procs, i)
            try:
                why = degree_problem(pipe, procs) or pipe.backend_refusal()
                if why:
                    raise NotApplicable(why)
                loader = TorchLoader(pipe.plan, pipe.sources, tuple(pipe.transforms),
                                     runner=runner_from_spec(seg.runner), **pipe.backend_kwargs())  # rank/world: gloo's
            except (PlanError, NotApplicable) as e:
                Path(args["out"]).write_text(json.dumps({"not_applicable": str(e)}))
                return
            if restore is not None:
                loader.load_state_dict(torch_round_trip(restore))
            owned = pipe.plan.lanes.owned(loader.rank, loader.world)
            for _ in range(args["stop"] - args["start"]):
                try:
                    batch = next(loader)
                except StopIteration:
                    break
                cols = torch_columns(batch, seg.micro)
                records.append({str(l): r.to_json() for l, r in lane_records(owned, cols).items()})
            state = torch_round_trip(loader.state_dict())
            loader.close()
        finally:
            dist.destroy_process_group()
    Path(args["out"]).write_text(json.dumps({"records": records, "state": state, "excluded": excluded}))


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) == 2 and argv[0] == "worker":
        _worker(json.loads(argv[1]))
        return 0
    print("zephon.testing is a library (see its package doc) and the process side of "
          "`zephon verify`'s multi-process runs; run `zephon verify --help`.", file=sys.stderr)
    return 2
