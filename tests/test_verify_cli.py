"""`zephon verify` and `zephon explain` as a user meets them.

- help written for users (what a command does, examples);
- user mistakes: one line on stderr naming the problem and the fix, exit 2, no traceback;
- `zephon verify examples/verify_pipeline.py:pipeline` (a module outside the package) passes,
  and a broken copy of it fails with the divergence named (step, lane, row, field, and the
  record the reference holds there); the JSON report and the PNG heat map are written;
- `zephon verify plan.json` verifies a saved plan without its data;
- `zephon explain` reads Grain-compatible plans (in a fresh interpreter) and, given a factory
  and --step, lists the document pieces of packed rows.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from _helpers import run_group

import zephon as z
from zephon.cli import main

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "verify_pipeline.py"
QUICK = ["--backends", "numpy,grain", "--degrees", "1,2,4", "--runners", "threads:2", "--workers", "0",
         "--micro", "2", "--processes", "0", "--steps", "8", "--cross-steps", "0", "--no-progress"]


def zephon_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).with_name("zephon")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "zephon.cli"]
    return run_group(cmd + list(args), capture_output=True, text=True, timeout=timeout, cwd=ROOT)


@pytest.mark.parametrize("argv, needles", [
    ([], ["commands:", "examples:", "zephon verify my_project.data:pipeline", "zephon explain plan.json"]),
    (["verify"], ["MODULE:FACTORY", "path/to/file.py:FACTORY", "plan.json", "Exits 0 only when every",
                  "--backends", "--resume STEP:D1->D2", "examples:", "heat map"]),
    (["explain"], ["document piece", "Grain-compatible", "--step", "examples:"]),
    (["demo"], ["example:", "--records"]),
    (["bench"], ["example:", "zephon bench --quick"]),
])
def test_help_is_written_for_users(capsys, argv, needles):
    with pytest.raises(SystemExit) as e:
        main(argv + ["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for n in needles:
        assert n in out, n


def bad_plan(tmp_path: Path) -> str:
    f = tmp_path / "not_a_plan.json"
    f.write_text('{"lanes": 8}')
    return str(f)


def raising_factory(tmp_path: Path) -> str:
    f = tmp_path / "raising_data.py"
    f.write_text("def pipeline():\n    raise ValueError('data/train.array_record not found')\n")
    return f"{f}:pipeline"


@pytest.mark.parametrize("argv, message", [
    (["verify", "no_such_pkg.data:pipeline"], "cannot import module 'no_such_pkg.data'"),
    (["verify", f"{EXAMPLE}:nope"], "has no 'nope'; its functions: augment, not_label_7, packed, pipeline"),
    (["verify", "missing/plan.json"], "no such file: missing/plan.json"),
    (["verify", "examples/nowhere.py:pipeline"], "no such file: examples/nowhere.py"),
    (["verify", "just_a_word"], "does not name a factory; write MODULE:FUNCTION"),
    (["verify", bad_plan], "holds JSON but not a plan"),
    (["verify", raising_factory], "raised ValueError: data/train.array_record not found (--traceback shows where)"),
    (["verify", "--degrees", "1,x"], "--degrees '1,x': give comma-separated integers"),
    (["verify", "--runners", "gpus:2"], "--runners: unknown runner 'gpus:2'"),
    (["verify", "--only", "--config", "tf D=2"], "--config: unknown backend 'tf'"),
    (["verify", "--only"], "--only needs at least one --config"),
    (["verify", "--steps", "1"], "--steps 1: run at least 2 steps"),
    (["explain", f"{EXAMPLE}:packed", "--rows", "5:2"], "--rows '5:2' is outside"),
    (["explain", "missing.json"], "no such file: missing.json"),
])
def test_user_errors_are_one_line_and_exit_2(tmp_path, capsys, argv, message):
    argv = [a(tmp_path) if callable(a) else a for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    lines = [l for l in err.splitlines() if l.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(f"zephon {argv[0]}: error: ") and message in lines[0], lines[0]


def test_the_console_script_prints_no_traceback():
    done = zephon_cli("verify", "my_project.data:pipeline")
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and "cannot import module 'my_project.data'" in done.stderr
    done = zephon_cli("verfy")
    assert done.returncode == 2 and "invalid choice: 'verfy'" in done.stderr and "Traceback" not in done.stderr


def test_verify_passes_on_the_example_module_and_writes_the_report(tmp_path, capsys):
    report = tmp_path / "out" / "verify"
    assert main(["verify", f"{EXAMPLE}:pipeline", *QUICK, "--report", str(report)]) == 0
    out = capsys.readouterr().out
    assert re.search(r"pipeline: \d+ configurations, 8 steps, all identical", out), out
    for name in ("numpy D=4", "grain D=2 micro=2", "numpy D=2 runner=threads:2", "numpy D=2 @2 -> numpy D=8"):
        assert name in out
    assert "ALL IDENTICAL" in out.splitlines()[-1]
    doc = json.loads(Path(f"{report}.json").read_text())
    assert doc["ok"] and doc["pipelines"][0]["configurations"][0]["name"] == "numpy D=1 (reference)"
    assert all(c["status"] in ("identical", "n/a") for c in doc["pipelines"][0]["configurations"])
    assert Path(f"{report}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_verify_fails_on_a_broken_copy_naming_the_divergence(tmp_path, capsys):
    """The copy's filter keeps label-7 images only in the main thread: with the threads runner
    they vanish, and the report names the first row that differs and the record it should hold."""
    text = EXAMPLE.read_text()
    good = 'def not_label_7(record: dict) -> bool:\n    return int(record["label"]) != 7\n'
    assert good in text
    broken = tmp_path / "broken_pipeline.py"
    text = text.replace("from __future__ import annotations\n",
                        "from __future__ import annotations\n\nimport threading\n")
    broken.write_text(text.replace(good, (
        'def not_label_7(record: dict) -> bool:\n    return int(record["label"]) != 7 or '
        'threading.current_thread() is threading.main_thread()\n')))
    report = tmp_path / "broken"
    assert main(["verify", f"{broken}:pipeline", *QUICK, "--report", str(report)]) == 1
    out = capsys.readouterr().out
    m = re.search(r"numpy D=2 runner=threads:2 +\d+ +\w+ +[\d.]+s +DIFFERS at step (\d+), lane (\d+), row (\d+), "
                  r"field '(\w+)'", out)
    assert m, out
    step, lane, row = (int(x) for x in m.groups()[:3])
    rec = re.search(rf"reference row: lane {lane}, source 0 record (\d+) epoch \d+", out)
    assert rec and int(rec.group(1)) % 10 == 7  # a label-7 image the worker thread dropped
    assert "1 differs — first: 'numpy D=2 runner=threads:2' at step" in out
    assert "DIFFERENCES FOUND" in out.splitlines()[-1]
    div = json.loads(Path(f"{report}.json").read_text())["pipelines"][0]["configurations"]
    bad = [c for c in div if c["status"] == "differs"]
    assert len(bad) == 1 and [bad[0]["divergence"][k] for k in ("step", "lane", "row")] == [step, lane, row]
    assert bad[0]["matches"][:step] == [True] * step and bad[0]["matches"][step] is False


def test_verify_a_saved_plan_without_its_data(tmp_path, capsys):
    plan = z.Mix([z.Source(300, id=0).shuffle(1).repeat(), z.Source(200, id=1).shuffle(2).repeat()],
                 [0.75, 0.25]).lanes(4).batch(16)
    f = tmp_path / "plan.json"
    f.write_text(plan.canonical_json())
    assert main(["verify", str(f), "--backends", "numpy,torch", "--degrees", "1,2,4", "--runners", "none",
                 "--workers", "0", "--micro", "4", "--processes", "0", "--steps", "6", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "plan.json: " in out and "all identical" in out and "torch D=2 micro=4" in out


def test_explain_reads_a_grain_compatible_plan_in_a_fresh_interpreter(tmp_path):
    import zephon.compat.grain as zg

    ds = zg.Dataset.source(list(range(50))).seed(3).shuffle().repeat().batch(4).lanes(2)
    f = tmp_path / "grain_plan.json"
    f.write_text(ds.plan.canonical_json())
    assert "Grain" in f.read_text()  # Grain-order nodes: they load only once zephon.compat.grain is imported
    done = zephon_cli("explain", str(f), "--step", "2")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert lines[0].split() == ["row", "lane", "source", "record", "epoch"]
    assert [int(l.split()[3]) for l in lines[1:]] == ds.plan.refs(2).record.tolist()
    # a saved state holds its plan: explain takes it too
    it = iter(ds)
    next(it)
    state = tmp_path / "state.json"
    state.write_text(json.dumps(it.get_state()))
    assert main(["explain", str(state), "--step", "2"]) == 0


def test_explain_lists_the_pieces_of_packed_rows(capsys):
    assert main(["explain", f"{EXAMPLE}:packed", "--step", "5", "--rows", "0:2"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("global batch 5, rank 0 of 1: 16 rows of 16")
    sys.path.insert(0, str(EXAMPLE.parent))
    try:
        import verify_pipeline
    finally:
        sys.path.remove(str(EXAMPLE.parent))
    loader = verify_pipeline.packed().loader()
    for _ in range(5):
        next(loader)
    want = next(loader).explain()[:2]
    pieces = [l.split() for l in out if l.startswith("    source")]
    assert pieces == [["source", str(s["source"]), "record", str(s["record"]), "epoch", str(s["epoch"]),
                       "tokens", f"{s['tokens'][0]}:{s['tokens'][1]}"] for r in want for s in r["segments"]]
    heads = [l for l in out if l.startswith("row")]
    assert heads[0].startswith("row    0  lane   0") and "64 tokens" in heads[0]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_verify_the_example_module_over_the_whole_default_matrix(capsys):
    """Every backend and degree, runners, DataLoader workers, micro-batches, jax.distributed and
    gloo in 2 local processes, resumes across degrees and emitters."""
    assert main(["verify", f"{EXAMPLE}:pipeline", f"{EXAMPLE}:packed", "--steps", "16", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "jax procs=2 mesh=2x4" in out and "torch procs=2" in out and "ALL IDENTICAL" in out
