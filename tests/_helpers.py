"""Helpers several test modules share (tests/ is on sys.path under pytest's rootdir conftest)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def deadline(seconds: int) -> Iterator[None]:
    """Fails the test instead of hanging it (a guard, not a timing assertion)."""
    def fail(*_: object) -> None:
        raise TimeoutError(f"no result within {seconds} s: the consumer hung")
    old = signal.signal(signal.SIGALRM, fail)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def run_group(cmd: list[str], *, timeout: float, capture_output: bool = False, check: bool = False,
              **kwargs: Any) -> subprocess.CompletedProcess:
    """`subprocess.run` in a process group of its own: on timeout the whole group is killed
    (processes the command forked too), and anything of the group still alive when the command
    exits is killed as well, so no test leaves a hung grandchild behind."""
    if capture_output:
        kwargs.setdefault("stdout", subprocess.PIPE)
        kwargs.setdefault("stderr", subprocess.PIPE)
    proc = subprocess.Popen(cmd, start_new_session=True, **kwargs)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc.pid)
        proc.communicate()
        raise
    finally:
        _kill_group(proc.pid)
    result = subprocess.CompletedProcess(cmd, proc.returncode, out, err)
    if check:
        result.check_returncode()
    return result


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def text_corpus(d: Any) -> Any:
    """Two JSONL files in `d` (prose.jsonl, code.jsonl) and a BPE tokenizer directory `d/tok` with
    a 2,000-token vocabulary (under the debug models' 2,048): the trainer integrations' data."""
    from zephon.demo.textdata import generate_corpus, train_bpe, write_jsonl

    prose, code = generate_corpus(200, seed=1), generate_corpus(150, seed=2, style="code")
    write_jsonl(str(d / "prose.jsonl"), prose)
    write_jsonl(str(d / "code.jsonl"), code)
    (d / "tok").mkdir()
    train_bpe(prose + code, vocab_size=2000).save(str(d / "tok" / "tokenizer.json"))
    return d
