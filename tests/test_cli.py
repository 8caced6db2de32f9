"""The console script: demo proves what it says, explain reads a plan's JSON."""

from zephon.cli import main
from zephon.plan import Source


def test_demo_proves_elastic_determinism(capsys):
    assert main(["demo", "--records", "3000", "--steps", "12"]) == 0
    out = capsys.readouterr().out
    assert "PROVED" in out and "NO (" not in out
    assert out.count(" yes") == 18  # 6 configurations x 3 pipelines (the third tokenizes, mixes, packs)


def test_explain_prints_rows_of_a_plan_file(tmp_path, capsys):
    plan = Source(100).shuffle(1).repeat().lanes(2).batch(4)
    f = tmp_path / "plan.json"
    f.write_text(plan.canonical_json())
    assert main(["explain", str(f), "--step", "3"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 5
    assert [int(l.split()[3]) for l in lines[1:]] == plan.refs(3).record.tolist()


def test_verify_matrix_includes_runners_and_all_agree(capsys):
    assert main(["verify", "--records", "2000", "--steps", "8"]) == 0
    out = capsys.readouterr().out
    assert "runner processes:2" in out and "runner threads:2" in out
    assert out.count(" yes") == 16 and "NO (" not in out  # 8 configurations x 2 mappings
