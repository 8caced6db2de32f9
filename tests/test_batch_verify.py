"""`zephon verify` with batch sizes: a factory whose plan ramps, and "resume with B -> B'"
configurations (`B=` on a segment after a stop), compared with numpy D=1 under the same changes,
whose lanes must continue the reference's rows."""

import dataclasses
import json

import numpy as np
import pytest

import zephon as z
from zephon import testing as zt
from zephon.errors import PlanError
from zephon.sources.memory import ArraySource
from zephon.testing import Config, Pipeline
from zephon.testing.pipeline import Builder
from zephon.testing.runs import Run, lane_stream_divergence, run_config

N = 1000
RAMP = ((0, 16), (3, 32), (6, 64))


def keep(cols):
    return cols["id"] % 10 != 7


def ramp() -> Pipeline:
    """A filter over a plan whose batch grows 16 -> 32 -> 64."""
    src = ArraySource({"id": np.arange(N, dtype=np.int64), "x": np.arange(N * 2, dtype=np.int32).reshape(N, 2)})
    return Pipeline(z.Source(N).shuffle(1).repeat().lanes(8).batch(schedule=RAMP), src,
                    [z.Filter(keep, batched=True, name="keep")])


def test_config_parses_a_batch_change_and_refuses_misuse():
    c = Config.parse("numpy D=2 @3 -> torch D=4 B=64 @5 -> numpy D=8")
    assert [s.batch for s in c.segments] == [None, 64, None] and c.changes_batch
    assert c.name == "numpy D=2 @3 -> torch D=4 B=64 @5 -> numpy D=8"
    assert [s.batch for s in c.batch_reference().segments] == [None, 64, None]
    with pytest.raises(PlanError, match="after '->'"):
        Config.parse("numpy D=2 B=64")
    with pytest.raises(PlanError, match="drop procs="):
        Config.parse("numpy @3 -> torch procs=2 B=64")


def test_verify_runs_a_ramp_and_resumes_at_other_sizes_on_every_emitter():
    configs = ["numpy D=4", "grain D=8",  # the ramp itself (every emitter: test_batch_emitters.py)
               "numpy D=2 @4 -> numpy D=8 B=24",
               "numpy D=8 @2 -> jax mesh=4x2 B=64 @5 -> torch D=2 micro=2",
               "grain D=2 @7 -> torch D=4 B=8"]
    rep = zt.verify(ramp, configs, 10)
    assert rep.ok, rep.table()
    assert [r.status for r in rep.results] == ["identical"] * 6
    assert "compared with numpy D=1 @4 -> numpy D=1 B=24" in rep.results[3].note


def test_a_lane_that_skips_rows_at_the_change_is_named():
    b = Builder(ramp)
    ref = run_config(b, zt.REFERENCE, 10)
    changed = run_config(b, Config.parse("numpy D=1 @4 -> numpy D=1 B=24"), 10)
    assert lane_stream_divergence(ref, changed) is None
    # a run whose lane 3 lost one row after step 4 (as a resume that skipped a record would)
    records = [dict(r) for r in changed.records]
    lane3 = records[5][3]
    fields = {k: (d, rows[1:] + rows[:1]) for k, (d, rows) in lane3.fields.items()}
    records[5][3] = dataclasses.replace(lane3, fields=fields)
    div = lane_stream_divergence(ref, Run(records=records))
    assert div is not None and (div.step, div.lane) == (5, 3) and "skipped or repeated" in div.detail


def test_zephon_verify_cli_runs_a_ramp_and_a_resume_at_another_size(tmp_path, capsys):
    from zephon.cli import main

    f = tmp_path / "ramp_pipeline.py"
    f.write_text("from test_batch_verify import ramp\n\ndef pipeline():\n    return ramp()\n")
    report = tmp_path / "r"
    assert main(["verify", f"{f}:pipeline", "--steps", "8", "--only", "--no-progress",
                 "--config", "numpy D=2 @3 -> numpy D=4 B=32", "--config", "torch D=8",
                 "--report", str(report)]) == 0
    out = capsys.readouterr().out
    assert "numpy D=2 @3 -> numpy D=4 B=32" in out and "all identical" in out
    doc = json.loads(report.with_suffix(".json").read_text())
    configs = doc["pipelines"][0]["configurations"]
    assert doc["ok"] and [c["status"] for c in configs] == ["identical"] * 3
    assert configs[1]["note"] == "compared with numpy D=1 @3 -> numpy D=1 B=32"
