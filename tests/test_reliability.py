"""Fault injection: every fault is either detected with an error that names the file / record /
field and the fix, or harmless. No silent wrong data, no crash of the training process, nothing
leaked. Every test here is time-limited (bounded loops, subprocess timeouts, `deadline`).

The measured numbers (flips detected / tried, segments left after N kills, ...) are printed with
`-s` and quoted in docs_reliability.md.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import random
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from zephon.checkpoint import STATE_VERSION, load_state, save_state
from zephon.errors import DecodeError, SourceError, StateError

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # os.fork() beside threads

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


@contextlib.contextmanager
def deadline(seconds):
    """Fails the test instead of hanging it (a guard, not a timing assertion)."""
    def fail(*_):
        raise TimeoutError(f"no result within {seconds} s")
    old = signal.signal(signal.SIGALRM, fail)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def report(line: str) -> None:
    print(f"\n[reliability] {line}")


# ---------------------------------------------------------------- checkpoint writes

def temps(d) -> list[str]:
    return sorted(n for n in os.listdir(d) if ".zephon-tmp-" in n)


def test_kill_during_checkpoint_writes_never_tears_the_target_and_leaves_no_temp(tmp_path):
    path = tmp_path / "loader.json"
    state = {"zephon_state": STATE_VERSION, "step": -1, "blob": "x" * (2 << 20)}
    save_state(path, state)
    kills, torn, left_behind = 40, 0, 0
    rng = random.Random(0)
    with deadline(30):
        for _ in range(kills):
            pid = os.fork()
            if pid == 0:  # the child saves in a loop until it is killed
                try:
                    for step in range(1 << 30):
                        save_state(path, {**state, "step": step})
                finally:
                    os._exit(0)
            time.sleep(rng.uniform(0.002, 0.04))
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            try:
                got = load_state(path)
                torn += not (isinstance(got["step"], int) and got["blob"] == state["blob"])
            except StateError:
                torn += 1
            left_behind += bool(temps(tmp_path))
    save_state(path, state)  # the next save cleans up after the killed writers
    report(f"checkpoint: {kills} SIGKILLs during saves: {torn} torn targets, {left_behind} kills "
           f"left a temp file, {len(temps(tmp_path))} temp files after the next save")
    assert torn == 0
    assert temps(tmp_path) == [] and load_state(path) == state


def test_stale_temps_are_removed_only_when_their_writer_is_gone(tmp_path):
    from zephon.checkpoint import _host

    path = tmp_path / "s.json"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f".s.json.zephon-tmp-{_host()}-{dead.pid}-abcd"
    live = tmp_path / f".s.json.zephon-tmp-{_host()}-{os.getppid()}-abcd"  # a live writer
    other = tmp_path / f".t.json.zephon-tmp-{_host()}-{dead.pid}-abcd"     # another target
    for p in (stale, live, other):
        p.write_text("{")
    save_state(path, {"zephon_state": 1})
    assert temps(tmp_path) == sorted([live.name, other.name])
    assert (os.stat(path).st_mode & 0o777) == 0o666 & ~_umask()


def _umask() -> int:
    old = os.umask(0)
    os.umask(old)
    return old


def test_load_state_names_foreign_and_newer_files(tmp_path):
    cases = {
        "pickle.json": (pickle.dumps({"step": 3}), r"is a Python pickle \(protocol \d+\).*never unpickles"),
        "torch.pt": (b"PK\x03\x04" + bytes(60), r"zip archive \(torch\.save's format\).*weights_only=True"),
        "latin1.json": ('{"name": "caf\xe9"}'.encode("latin-1"), r"not UTF-8 text \(byte 0xe9 at offset 13\)"),
        "empty.json": (b"", r"is empty"),
        "list.json": (b"[1, 2]", r"holds a JSON list, not an object"),
        "newer.json": (json.dumps({"zephon_state": STATE_VERSION + 1, "zephon_version": "9.0"}).encode(),
                       rf"state format {STATE_VERSION + 1}, written by a newer Zephon.*Upgrade Zephon to 9\.0"),
        "edited.json": (b'{"zephon_state": "one"}', r"'zephon_state' is 'one', not a format number"),
    }
    for name, (content, message) in cases.items():
        (tmp_path / name).write_bytes(content)
        with pytest.raises(StateError, match=message) as info:
            load_state(tmp_path / name)
        assert name in str(info.value)
    with pytest.raises(StateError, match="is a directory"):
        load_state(tmp_path)
    with pytest.raises(StateError, match="not JSON.*Save the dict"):
        save_state(tmp_path / "x.json", {"step": object()})
    with pytest.raises(StateError, match="directory .* does not exist"):
        save_state(tmp_path / "no" / "x.json", {"step": 1})
    assert temps(tmp_path) == []
