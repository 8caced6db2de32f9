"""The console script: demo proves what it says, explain reads a plan's JSON."""

from zephon.cli import main
from zephon.plan import Source


def test_demo_proves_elastic_determinism(capsys):
    assert main(["demo", "--records", "3000", "--steps", "12"]) == 0
    out = capsys.readouterr().out
    assert "PROVED" in out and "NO (" not in out
    # 6 configurations x 3 pipelines (the third tokenizes, mixes, packs), plus the third's run
    # with Tokenize's pre-token cache off
    assert out.count(" yes") == 19
    assert "Tokenize pre-token cache off" in out


def test_explain_prints_rows_of_a_plan_file(tmp_path, capsys):
    plan = Source(100).shuffle(1).repeat().lanes(2).batch(4)
    f = tmp_path / "plan.json"
    f.write_text(plan.canonical_json())
    assert main(["explain", str(f), "--step", "3"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 5
    assert [int(l.split()[3]) for l in lines[1:]] == plan.refs(3).record.tolist()


def test_verify_checks_a_demo_pipeline_with_runners_and_resumes(capsys):
    """`zephon verify` with no target checks the demo pipelines (make verify); here one of them,
    numpy only, with the threads and processes runners."""
    assert main(["verify", "zephon.cli:demo_filter", "--backends", "numpy", "--runners", "threads:2,processes:2",
                 "--workers", "0", "--processes", "0", "--steps", "6", "--cross-steps", "0", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "numpy D=2 runner=processes:2" in out and "numpy D=2 runner=threads:2" in out
    assert "numpy D=8 @2 -> numpy D=1 @3 -> numpy D=4 micro=2" in out
    assert "demo_filter: 11 configurations, 6 steps, all identical" in out and "DIFFERS" not in out


def test_one_version_everywhere(capsys):
    """pyproject's version, `zephon.__version__`, the installed metadata and `zephon --version` agree."""
    import importlib.metadata
    import re
    from pathlib import Path

    import pytest

    import zephon

    text = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    declared = re.search(r'^version = "([^"]+)"$', text, re.M).group(1)
    assert zephon.__version__ == declared
    assert importlib.metadata.version("zephon-loader") == declared, "reinstall: pip install -e ."
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.strip() == f"zephon {declared}"
