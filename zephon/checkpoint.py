"""Loader states on disk: small JSON files, written so that no crash can tear or litter them.

`save_state` writes `.{name}.zephon-tmp-{host}-{pid}-{random}` beside the target, fsyncs it,
renames it over the target (`os.replace`, atomic on POSIX) and fsyncs the directory, so after a
crash at any instant the target holds either the previous state or the new one, never a mix. A
process killed mid-write (SIGKILL, OOM, preemption) leaves its temp file behind; the next save to
the same target removes temp files of that target whose writer is gone.

`load_state` reads JSON only: nothing is ever unpickled (unpickling a file can run arbitrary code).
A pickle, a zip (torch.save), a file that is not UTF-8 text, or a state from a newer Zephon gets a
`StateError` that says what the file is and what to do. Every file carries a SHA-256 checksum of
its canonical JSON, verified on load: a flipped bit or an edit is refused, never resumed from;
`resign_state` (`zephon state resign FILE`) re-signs a file edited on purpose.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import secrets
import socket
import threading
import time
from collections.abc import Mapping
from typing import Any

from zephon._distribution import version as installed_version
from zephon.errors import StateError
from zephon.plan.jsondoc import json_object
from zephon.storage.url import is_remote, local_path

#: The newest state format this Zephon reads and writes (`"zephon_state"` in every state).
#: 3: a state file carries `"checksum"` (format 2 had none; `zephon state resign` upgrades one).
STATE_VERSION = 3
#: The first state format whose files must carry a checksum.
_SIGNED_FROM = 3
_CHECKSUM = "checksum"

_TMP_MARK = ".zephon-tmp-"
#: A temp file of another host cannot be checked for a live writer; it is stale after this long.
_FOREIGN_TMP_SECONDS = 600.0

_writing: set[str] = set()  # temp files this process is writing right now (other threads' saves)
_writing_lock = threading.Lock()


def _host() -> str:
    return socket.gethostname().replace("-", "_").replace("/", "_") or "host"


def _tmp_prefix(path: str) -> str:
    d, base = os.path.split(path)
    return os.path.join(d, f".{base}{_TMP_MARK}")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def _stale_temps(path: str) -> list[str]:
    """Temp files of earlier saves to `path` whose writer is gone (never one being written)."""
    d, base = os.path.split(path)
    head = f".{base}{_TMP_MARK}"
    try:
        names = [n for n in os.listdir(d or ".") if n.startswith(head)]
    except OSError:
        return []
    stale, host, now = [], _host(), time.time()
    for name in names:
        full = os.path.join(d, name)
        with _writing_lock:
            if full in _writing:
                continue
        parts = name[len(head):].rsplit("-", 2)  # host, pid, random
        if len(parts) != 3 or not parts[1].isdigit():
            continue  # not one of ours after all
        if parts[0] == host:
            if int(parts[1]) == os.getpid() or not _pid_alive(int(parts[1])):
                stale.append(full)
        else:
            try:
                if now - os.stat(full).st_mtime > _FOREIGN_TMP_SECONDS:
                    stale.append(full)
            except OSError:
                pass
    return stale


def _fsync_dir(d: str) -> None:
    try:
        fd = os.open(d, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return  # a directory we may not open (or no such thing on this platform): rename stands
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


def state_checksum(state: Mapping[str, Any]) -> str:
    """SHA-256 of the state's canonical JSON (sorted keys, no spaces, ASCII), its `"checksum"`
    left out: what `save_state` writes and `load_state` verifies. Canonical, so re-indenting a
    file keeps it valid while changing any value, key or number does not."""
    doc = {k: v for k, v in state.items() if k != _CHECKSUM}
    text = json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


def resign_state(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Re-signs a state file after a deliberate hand edit (`zephon state resign FILE`): reads it
    without verifying its checksum, writes it back atomically with a fresh one, and returns it. A
    format-2 state (from before checksums) becomes format 3. Only for files you edited and checked
    yourself: this makes Zephon trust whatever the file says."""
    state = _read_state(path)
    version = state.get("zephon_state")
    check_state_version(state, f"loader state {os.fspath(path)}")
    if version == 2:
        state["zephon_state"] = STATE_VERSION
    save_state(path, state)
    return state


def save_state(path: str | os.PathLike[str], state: Mapping[str, Any]) -> None:
    """Writes `state` as JSON atomically (temp file, fsync, rename, fsync of the directory), with
    a `"checksum"` over its canonical form that `load_state` verifies.

    The target is never torn: a reader sees the old state or the new one. Temp files of earlier
    saves to the same target that were interrupted are removed. An `s3://` or `gs://` URL is
    written with one PUT, which the store makes visible only once complete (all or nothing).
    """
    name = local_path(path)
    path = name if is_remote(name) else os.path.abspath(name)
    try:
        signed = {**state, _CHECKSUM: state_checksum(state)}
        text = json.dumps(signed, sort_keys=True)
    except (TypeError, ValueError, RecursionError) as e:
        raise StateError(f"cannot save the state to {path}: it is not JSON ({e}). Save the dict "
                         "that Loader.state() returned, unchanged; add your own values to "
                         "another file.") from e
    if is_remote(path):
        from zephon.storage import put_atomic

        put_atomic(path, text.encode())
        return
    d = os.path.dirname(path)
    if not os.path.isdir(d):
        raise StateError(f"cannot save the state to {path}: the directory {d} does not exist; "
                         "create it first.")
    for stale in _stale_temps(path):
        try:
            os.unlink(stale)
        except FileNotFoundError:
            pass
    tmp = f"{_tmp_prefix(path)}{_host()}-{os.getpid()}-{secrets.token_hex(4)}"
    with _writing_lock:
        _writing.add(tmp)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        try:
            data = text.encode()
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        _fsync_dir(d)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    finally:
        with _writing_lock:
            _writing.discard(tmp)


def _what_binary(data: bytes) -> str | None:
    """Names a non-JSON file format from its first bytes, or None."""
    if data[:1] == b"\x80":
        proto = data[1] if len(data) > 1 else "?"
        return (f"a Python pickle (protocol {proto}), not a Zephon JSON state. Zephon never "
                "unpickles a checkpoint (unpickling can run arbitrary code)")
    if data[:1] in (b"(", b"}", b"]") and data.rstrip().endswith(b"."):
        return ("a Python pickle (protocol 0 or 1), not a Zephon JSON state. Zephon never "
                "unpickles a checkpoint (unpickling can run arbitrary code)")
    if data[:4] == b"PK\x03\x04":
        return ("a zip archive (torch.save's format), not a Zephon JSON state. Load it with "
                "torch.load(path, weights_only=True) and pass the loader's part to "
                "load_state_dict()")
    if data[:4] == b"PAR1":
        return "a Parquet file, not a Zephon JSON state"
    return None


def check_state_version(state: Mapping[str, Any], where: str = "the state") -> None:
    """Raises StateError when `state` declares a format this Zephon cannot read."""
    version = state.get("zephon_state")
    if version is None:
        return
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise StateError(f"{where}: 'zephon_state' is {version!r}, not a format number; the file "
                         "was edited or is not a Zephon state. Restore an earlier checkpoint.")
    if version > STATE_VERSION:
        wrote = state.get("zephon_version")
        to = f" to {wrote} or newer" if isinstance(wrote, str) else ""
        raise StateError(f"{where} has state format {version}, written by a newer Zephon; this "
                         f"Zephon ({installed_version()}) reads formats up to {STATE_VERSION}. "
                         f"Upgrade Zephon{to} (pip install -U zephon-loader) to resume from it.")


def _read(name: str) -> bytes:
    if is_remote(name):
        from zephon.storage import read_object

        return read_object(name)  # a missing object raises ObjectMissingError, a FileNotFoundError
    with open(name, "rb") as f:
        return f.read()


def load_state(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Reads a state written by `save_state` (JSON only; nothing is unpickled) and verifies its
    checksum, so a flipped bit or a hand edit cannot resume another stream; returns the state
    without the checksum. After a deliberate edit, `zephon state resign FILE` re-signs it."""
    name = local_path(path)
    state = _read_state(path)
    check_state_version(state, f"loader state {name}")
    saved = state.pop(_CHECKSUM, None)
    version = state.get("zephon_state")
    if saved is None and isinstance(version, int) and version >= _SIGNED_FROM:
        raise StateError(f"loader state {name} has no 'checksum' (format {version} files always carry "
                         "one): the file was edited or is corrupt. Restore an earlier checkpoint; if "
                         f"you edited it on purpose, re-sign it with `zephon state resign {name}`.")
    if saved is not None:
        actual = state_checksum(state)
        if saved != actual:
            raise StateError(f"loader state {name} fails its checksum ({saved!r} saved, {actual} "
                             "computed): the file changed after save_state wrote it (a flipped bit, "
                             "a partial copy or a hand edit) and could resume another stream. Restore "
                             "an earlier checkpoint; if you edited it on purpose, re-sign it with "
                             f"`zephon state resign {name}`.")
    return state


def _read_state(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The JSON object in the file `path`, or a StateError saying what the file is instead."""
    name = local_path(path)
    try:
        data = _read(name)
    except FileNotFoundError:
        raise StateError(f"no loader state at {name}; check the checkpoint directory") from None
    except IsADirectoryError:
        raise StateError(f"{name} is a directory, not a loader state; pass the JSON file that "
                         "save_state() wrote (e.g. ckpt/loader.json).") from None
    except OSError as e:
        raise StateError(f"cannot read the loader state {name}: {e}") from e
    if not data.strip():
        raise StateError(f"loader state {name} is empty; it was not written by save_state "
                         "(which never leaves an empty file): restore an earlier checkpoint.")
    binary = _what_binary(data)
    if binary is not None:
        raise StateError(f"{name} is {binary}. Pass the JSON file that zephon.save_state() wrote, "
                         "or re-save the loader's state with save_state().")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise StateError(f"{name} is not UTF-8 text (byte 0x{data[e.start]:02x} at offset "
                         f"{e.start}), so it is not a loader state written by save_state; pass "
                         "the right file, or restore an earlier checkpoint.") from None
    state = json_object(
        text,
        lambda e: StateError(f"loader state {name} is not valid JSON ({e}); the file is corrupt — "
                             "restore an earlier checkpoint."),
        lambda kind: StateError(f"loader state {name} holds a JSON {kind}, not an object; pass "
                                "the file save_state(path, loader.state()) wrote."))
    return state
