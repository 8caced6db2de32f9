"""The cross-product matrix and the baseline comparison of `zephon verify`.

- `cross_matrix` crosses the dimensions: every emitter x degree under every runner, and stops at
  every emitter/degree resuming on another emitter/degree, with micro-batches and batch-size
  changes; configurations `matrix` already has are left out (their names and step counts stay);
- a cross-product run on a small pipeline is all identical, and the steps shared between
  configurations that stop alike give what running them again gives;
- `--baseline PATH.json` compares every configuration also in a saved report step by step: equal
  on an unchanged pipeline (and says how much it compared), exit 1 naming the configuration and
  step once one fingerprint in the saved report is changed, exit 2 on a file that is no report.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

from zephon.cli import main
from zephon.testing import BACKENDS, Builder, Config, matrix, run_config
from zephon.testing.configs import cross_matrix, placements
from zephon.testing.sessions import SharedRunners, runner_from_spec

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "verify_pipeline.py"
SMALL = ["--backends", "numpy,grain", "--degrees", "1,2", "--runners", "threads:2", "--workers", "0",
         "--micro", "2", "--processes", "0", "--no-progress"]


def test_the_cross_product_crosses_every_dimension():
    cross = cross_matrix(10, batch=64)
    singles = [c for c in cross if len(c.segments) == 1]
    resumes = [c for c in cross if len(c.segments) == 2]
    places = placements()
    assert len(places) == 15  # numpy, torch, grain at D=1,2,4,8; jax at meshes 8, 4x2, 2x4
    # emitter x degree x runner: every placement under both runners
    assert {(s.segments[0].backend, s.segments[0].degree, s.segments[0].mesh, s.segments[0].runner)
            for s in singles} == {(p.backend, p.degree, p.mesh, r) for p in places
                                  for r in ("threads:2", "processes:2")}
    assert all(c.steps == 10 for c in cross)
    # stop at every placement, resume on another: every ordered pair of emitters
    assert {(c.segments[0].backend, c.segments[1].backend) for c in resumes} == set(
        itertools.product(BACKENDS, BACKENDS))
    assert {c.segments[0].until for c in resumes} == {5}
    assert all(c.segments[0] != c.segments[1] for c in resumes)
    firsts = {(c.segments[0].backend, c.segments[0].degree, c.segments[0].mesh) for c in resumes}
    assert firsts == {(p.backend, p.degree, p.mesh) for p in places}
    # micro-batches on both sides of a stop, batch-size changes both ways, every runner
    assert any(c.segments[0].micro == 2 for c in resumes) and any(c.segments[1].micro == 2 for c in resumes)
    assert {c.segments[1].batch for c in resumes} == {None, 128, 32}
    assert {s.runner for c in resumes for s in c.segments} == {"inline", "threads:2", "processes:2"}
    # degrees change at the stop, across emitters too
    assert len({(c.segments[0].degree, c.segments[1].degree) for c in resumes
                if "jax" not in (c.segments[0].backend, c.segments[1].backend)}) >= 8
    # names are unique and parse back to the same configuration (what --config takes)
    names = [c.name for c in cross]
    assert len(set(names)) == len(names)
    for c in cross:
        assert Config.parse(c.name).segments == c.segments
    # what `matrix` has keeps its name and step count: left out of the cross-product
    main_names = [c.name for c in matrix(steps=80)]
    again = cross_matrix(10, batch=64, skip=main_names + ["numpy D=4 runner=threads:2"])
    left = {"numpy D=4 runner=threads:2", "numpy D=2 runner=threads:2", "numpy D=2 runner=processes:2"}
    assert left <= set(names) and not left & {c.name for c in again}  # the last two: in `matrix`
    assert len(again) == len(cross) - 3


def test_a_cross_product_run_is_identical_and_says_so(tmp_path, capsys):
    report = tmp_path / "cross"
    assert main(["verify", f"{EXAMPLE}:pipeline", *SMALL, "--steps", "8", "--cross-steps", "6",
                 "--report", str(report)]) == 0
    out = capsys.readouterr().out
    assert "+ 11 x 6 steps (the cross-product)" in out  # numpy D=2 runner=threads:2: matrix's
    for name in ("grain D=2 runner=threads:2", "numpy D=1 @3 -> grain D=2 B=64",
                 "numpy D=2 runner=threads:2 micro=2 @3 -> grain D=1 B=16"):
        assert name in out, name
    doc = json.loads(Path(f"{report}.json").read_text())
    confs = doc["pipelines"][0]["configurations"]
    cross = [c for c in confs if c["steps"] == 6]
    assert len(cross) == 11 and all(c["status"] == "identical" for c in cross)
    assert doc["cross_steps"] == 6 and doc["steps"] == 8
    assert "ALL IDENTICAL" in out.splitlines()[-1]


def test_steps_shared_before_a_stop_are_what_running_them_again_gives():
    b = Builder(f"{EXAMPLE}:packed")
    a = Config.parse("numpy D=2 @3 -> grain D=4")
    c = Config.parse("numpy D=2 @3 -> numpy D=1 micro=2")
    stops: dict = {}
    run_a = run_config(b, a, 6, stops=stops)
    assert list(stops) == [("numpy D=2 @3 read_ahead=None", 3)]
    shared = run_config(b, c, 6, stops=stops)
    alone = run_config(b, c, 6)
    assert shared.records == alone.records and len(alone.records) == 6  # the prefix: shared vs run again
    assert shared.records[:3] == run_a.records[:3]


def test_process_runners_are_lent_not_closed_by_a_loader():
    with SharedRunners() as pool:
        r0, r1 = runner_from_spec("processes:1", 0), runner_from_spec("processes:1", 1)
        assert r0._inner is not r1._inner and runner_from_spec("processes:1", 0)._inner is r0._inner
        assert list(r0.imap(abs, [-1, -2, 3])) == [1, 2, 3]
        pids = r0.pids
        r0.close()  # a loader's close at the end of its segment: the workers stay
        assert r0.pids == pids and list(r0.imap(abs, [-4])) == [4]
        inner = r0._inner
    assert inner.pids == [] and pool.runners == {}
    assert runner_from_spec("threads:2", 0).__class__.__name__ == "Threads"


def _report(tmp_path: Path, name: str) -> Path:
    report = tmp_path / name
    assert main(["verify", f"{EXAMPLE}:pipeline", "--only", "--config", "numpy D=2",
                 "--config", "grain D=4 @2 -> numpy D=1 micro=2", "--steps", "5", "--no-progress",
                 "--report", str(report)]) == 0
    return Path(f"{report}.json")


def test_baseline_equal_then_a_changed_fingerprint_fails_naming_it(tmp_path, capsys):
    saved = _report(tmp_path, "before")
    capsys.readouterr()
    args = ["verify", f"{EXAMPLE}:pipeline", "--only", "--config", "numpy D=2",
            "--config", "grain D=4 @2 -> numpy D=1 micro=2", "--config", "numpy D=8", "--steps", "5",
            "--no-progress", "--baseline", str(saved)]
    assert main(args) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last == (f"baseline {saved}: 3 configurations, 15 steps compared with it: all equal "
                    "(1 configurations of this run not in it)")
    doc = json.loads(saved.read_text())
    conf = next(c for c in doc["pipelines"][0]["configurations"] if c["name"].startswith("grain D=4"))
    conf["fingerprints"][3] = "0" * 32  # as if the loader now gave another batch at step 3
    tampered = tmp_path / "tampered.json"
    tampered.write_text(json.dumps(doc))
    assert main(args[:-1] + [str(tampered)]) == 1
    out = capsys.readouterr().out
    want = (f"{EXAMPLE}:pipeline: 'grain D=4 @2 -> numpy D=1 micro=2' differs from the baseline at step 3: "
            "fingerprint ")
    assert f"BASELINE: {want}" in out
    assert out.strip().splitlines()[-1].startswith(
        f"baseline {tampered}: 3 configurations, 15 steps compared with it: 1 differs — first: {want}")
    assert "ALL IDENTICAL" in out  # the configurations agree with each other: only the baseline moved


def test_a_baseline_that_is_no_report_is_a_usage_error(tmp_path, capsys):
    bad = tmp_path / "plan.json"
    bad.write_text('{"type": "Batch"}')
    for path, msg in ((bad, "is not a `zephon verify --report` document"),
                      (tmp_path / "none.json", "no such file")):
        assert main(["verify", f"{EXAMPLE}:pipeline", "--baseline", str(path)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and msg in err[0], err
