"""Fault injection: every fault is either detected with an error that names the file / record /
field and the fix, or harmless. No silent wrong data, no crash of the training process, nothing
leaked. Every test here is time-limited (bounded loops, subprocess timeouts, `deadline`).

The measured numbers (flips detected / tried, segments left after N kills, ...) are printed with
`-s` and quoted in the README's Reliability section.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import pickle
import random
import re
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
from _helpers import deadline, run_group  # tests/ is on sys.path under pytest's rootdir conftest

from zephon.checkpoint import STATE_VERSION, load_state, save_state
from zephon.errors import DecodeError, PlanError, SourceError, StateError

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def report(line: str) -> None:
    print(f"\n[reliability] {line}")


# ---------------------------------------------------------------- checkpoint writes

def temps(d) -> list[str]:
    return sorted(n for n in os.listdir(d) if ".zephon-tmp-" in n)


_KILL_DURING_SAVES = """
import os, random, signal, sys, time
from zephon.checkpoint import load_state, save_state
from zephon.errors import StateError
path, kills = sys.argv[1], int(sys.argv[2])
state = {"zephon_state": int(sys.argv[3]), "step": -1, "blob": "x" * (2 << 20)}
save_state(path, state)
temps = lambda: sorted(n for n in os.listdir(os.path.dirname(path)) if ".zephon-tmp-" in n)
torn = left_behind = 0
rng = random.Random(0)
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
    left_behind += bool(temps())
print(torn, left_behind)
"""


def test_kill_during_checkpoint_writes_never_tears_the_target_and_leaves_no_temp(tmp_path):
    # the forking runs in a fresh interpreter: this one may have imported JAX (its threads make
    # os.fork() here a deadlock risk), that one imports only the checkpoint module
    path = tmp_path / "loader.json"
    state = {"zephon_state": STATE_VERSION, "step": -1, "blob": "x" * (2 << 20)}
    kills = 40
    done = run_group([sys.executable, "-c", _KILL_DURING_SAVES, str(path), str(kills), str(STATE_VERSION)],
                     timeout=60, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    torn, left_behind = (int(x) for x in done.stdout.split())
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


# ---------------------------------------------------------------- Parquet bit flips

def _varint(buf, i):
    shift = result = 0
    while True:
        b = buf[i]
        i += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, i
        shift += 7


def _skip(buf, i, t):
    """Skips one thrift-compact value of type `t` at `i`."""
    if t in (1, 2):
        return i
    if t == 3:
        return i + 1
    if t in (4, 5, 6):
        return _varint(buf, i)[1]
    if t == 7:
        return i + 8
    if t == 8:
        n, i = _varint(buf, i)
        return i + n
    if t in (9, 10):
        n, et = buf[i] >> 4, buf[i] & 0x0F
        i += 1
        if n == 15:
            n, i = _varint(buf, i)
        for _ in range(n):
            i = _skip(buf, i, et)
        return i
    if t == 11:
        n, i = _varint(buf, i)
        if n:
            kv = buf[i]
            i += 1
            for _ in range(n):
                i = _skip(buf, _skip(buf, i, kv >> 4), kv & 0x0F)
        return i
    if t == 12:
        return _page_header(buf, i)[1]
    raise ValueError(f"thrift type {t}")


def _page_header(buf, i):
    """The i32 fields 1-4 of a thrift-compact struct (a PageHeader: type, uncompressed size,
    compressed size, crc) and the offset just past it."""
    fields, fid = {}, 0
    while True:
        h = buf[i]
        i += 1
        if h == 0:
            return fields, i
        t, delta = h & 0x0F, h >> 4
        if delta:
            fid += delta
        else:
            v, i = _varint(buf, i)
            fid = (v >> 1) ^ -(v & 1)
        if t == 5 and fid in (1, 2, 3, 4):
            v, i = _varint(buf, i)
            fields[fid] = (v >> 1) ^ -(v & 1)
        else:
            i = _skip(buf, i, t)


def parquet_pages(path):
    """[(header_start, body_start, body_end)] of every page (dictionary and data) in the file."""
    import pyarrow.parquet as pq

    with open(path, "rb") as f:
        buf = f.read()
    md = pq.ParquetFile(path).metadata
    out = []
    for g in range(md.num_row_groups):
        for c in range(md.num_columns):
            col = md.row_group(g).column(c)
            i = col.dictionary_page_offset if col.has_dictionary_page else col.data_page_offset
            end = i + col.total_compressed_size
            while i < end:
                fields, body = _page_header(buf, i)
                out.append((i, body, body + fields[3]))
                i = body + fields[3]
    return out


N_ROWS = 2000


def parquet_data():
    rng = np.random.default_rng(0)
    return {"id": np.arange(N_ROWS, dtype=np.int64),
            "tokens": rng.integers(0, 50_000, (N_ROWS, 16)).astype(np.int32),
            "score": rng.standard_normal(N_ROWS).astype(np.float32),
            "text": np.array([f"document {i} " + "w" * (i % 13) for i in range(N_ROWS)], dtype=object)}


def flip_outcomes(tmp_path, path, read, want, positions, rng):
    """Flips one random bit at each position (each in a fresh copy of the file) and classifies
    the read: 'detected' (SourceError/DecodeError naming the copy), 'harmless' (the data read
    equals the original) or 'silent' (wrong data, no error)."""
    with open(path, "rb") as f:
        data = f.read()
    out = {"detected": 0, "harmless": 0, "silent": 0}
    for k, pos in enumerate(positions):
        bad = bytearray(data)
        bad[pos] ^= 1 << rng.randrange(8)
        copy = tmp_path / f"flip{k}{os.path.splitext(path)[1]}"
        copy.write_bytes(bytes(bad))
        try:
            got = read(str(copy))
        except (SourceError, DecodeError) as e:
            assert copy.name in str(e), e
            out["detected"] += 1
            continue
        same = got.keys() == want.keys() and all(
            list(got[k]) == list(want[k]) if want[k].dtype == object
            else got[k].dtype == want[k].dtype and np.array_equal(got[k], want[k]) for k in want)
        out["harmless" if same else "silent"] += 1
        copy.unlink()
    return out


def read_parquet_all(path):
    from zephon.sources import ParquetSource

    return ParquetSource(path, decode_threads=1).read(np.arange(N_ROWS))


def test_bit_flips_in_zephon_written_parquet_pages_are_all_detected(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from zephon.sources import write_parquet

    want = parquet_data()
    rng = random.Random(0)
    path = tmp_path / "z.parquet"
    write_parquet(path, want, row_group_size=500)
    pages = parquet_pages(path)
    assert len(pages) >= 16  # 4 row groups x 4 columns, dictionary pages included
    with deadline(40):
        bodies = [rng.randrange(b, e) for _ in range(4) for _, b, e in pages]
        body = flip_outcomes(tmp_path, str(path), read_parquet_all, want, bodies, rng)
        headers = [rng.randrange(h, b) for _ in range(2) for h, b, _ in pages]
        header = flip_outcomes(tmp_path, str(path), read_parquet_all, want, headers, rng)
        # The same data written by pyarrow's defaults (no page checksums), for the README.
        plain = tmp_path / "plain.parquet"
        table = pq.read_table(path)
        pq.write_table(pa.table(table.columns, names=table.column_names), plain, row_group_size=500)
        plain_bodies = [rng.randrange(b, e) for _ in range(4) for _, b, e in parquet_pages(plain)]
        unprotected = flip_outcomes(tmp_path, str(plain), read_parquet_all, want, plain_bodies, rng)
        # The footer (schema, row-group metadata) has no checksum: measured, for the README.
        size = os.path.getsize(path)
        footer_len = int.from_bytes(path.read_bytes()[-8:-4], "little")
        feet = [rng.randrange(size - 8 - footer_len, size) for _ in range(100)]
        footer = flip_outcomes(tmp_path, str(path), read_parquet_all, want, feet, rng)
    report(f"parquet write_parquet page bodies: {body['detected']}/{len(bodies)} flips detected "
           f"({body})")
    report(f"parquet write_parquet page headers: {header['detected']}/{len(headers)} detected, "
           f"the rest harmless ({header})")
    report(f"parquet without checksums, page bodies: {unprotected['detected']}/{len(plain_bodies)} "
           f"detected ({unprotected})")
    report(f"parquet write_parquet footer: {footer['detected']}/{len(feet)} detected, "
           f"{footer['harmless']} harmless, {footer['silent']} read with another schema or "
           f"wrong values ({footer})")
    assert body == {"detected": len(bodies), "harmless": 0, "silent": 0}
    assert header["silent"] == 0
    from zephon.sources import ParquetSource

    unverified = 0  # opting out (verify_checksums=False) reads most of those flips silently
    for pos in bodies[:20]:
        data = bytearray(path.read_bytes())
        data[pos] ^= 1
        copy = tmp_path / "unverified.parquet"
        copy.write_bytes(bytes(data))
        with contextlib.suppress(SourceError, DecodeError):
            ParquetSource(copy, verify_checksums=False, decode_threads=1).read(np.arange(N_ROWS))
            unverified += 1
    assert unverified > 0


def test_bit_flips_in_array_record_never_give_silent_wrong_data(tmp_path):
    from zephon.sources import ArrayRecordSource, FixedFields, write_array_record

    spec = FixedFields({"tokens": ("int32", (64,))})
    tokens = np.random.default_rng(1).integers(0, 50_000, (500, 64)).astype(np.int32)
    path = tmp_path / "a.array_record"
    write_array_record(path, [spec.encode({"tokens": t}) for t in tokens])
    size = os.path.getsize(path)
    rng = random.Random(1)
    with deadline(30):
        out = flip_outcomes(tmp_path, str(path), lambda p: ArrayRecordSource(p, spec).read(np.arange(500)),
                            {"tokens": tokens}, [rng.randrange(size) for _ in range(128)], rng)
    report(f"array_record: {out['detected']}/128 flips detected, {out['harmless']} harmless "
           f"(padding), {out['silent']} silent ({out})")
    assert out["silent"] == 0


# ---------------------------------------------------------------- files changed under a job

def _rewrite_in_place(path, content: bytes) -> None:
    time.sleep(0.01)  # a later mtime even on filesystems with coarse timestamps
    with open(path, "r+b") as f:  # same inode: what `cp new old` or a writer reopening does
        f.truncate(0)
        f.write(content)


def test_array_record_rewritten_under_a_reader_is_an_error_not_empty_records(tmp_path):
    from zephon.sources import ArrayRecordSource, RawBytes, write_array_record

    path = tmp_path / "a.array_record"
    records = [bytes([i % 256]) * 300 for i in range(400)]
    write_array_record(path, records)
    src = ArrayRecordSource(str(path), RawBytes())
    assert src.read([5, 399])["bytes"].tolist() == [records[5], records[399]]
    other = tmp_path / "other.array_record"
    write_array_record(other, [b"y" * 10] * 50)  # fewer, shorter records
    _rewrite_in_place(path, other.read_bytes())
    for _ in range(3):  # every read after the change, not just the first
        with pytest.raises(SourceError, match=r"a\.array_record: the file changed while "
                                              r"ArrayRecordSource was reading it \(.*it was "
                                              r"modified; it was inode \d+, \d+ bytes.*restore the original"):
            src.read([5, 399])
    # A fresh copy of the source (what a worker process gets) refuses it too.
    with pytest.raises(SourceError, match="the file changed"):
        pickle.loads(pickle.dumps(src)).read([1])


def test_file_replaced_by_rename_is_detected(tmp_path):
    from zephon.sources import ArrayRecordSource, write_array_record

    path = tmp_path / "r.array_record"
    write_array_record(path, [b"a" * 64] * 100)
    src = ArrayRecordSource(str(path))
    src.read([1])
    st = os.stat(path)
    write_array_record(tmp_path / "new.array_record", [b"b" * 64] * 100)  # same size
    os.utime(tmp_path / "new.array_record", ns=(st.st_atime_ns, st.st_mtime_ns))  # same mtime
    os.replace(tmp_path / "new.array_record", path)  # rsync / atomic writers do this
    with pytest.raises(SourceError, match=r"r\.array_record: .*it was replaced by another file"):
        src.read([1])
    os.unlink(path)
    with pytest.raises(SourceError, match=r"r\.array_record: .*it no longer exists"):
        src.read([1])


def test_parquet_and_jsonl_rewritten_during_a_loader_run(tmp_path):
    from zephon import Loader, Source
    from zephon.sources import JsonlSource, ParquetSource, write_parquet

    data = parquet_data()
    pq_path, jl_path = tmp_path / "d.parquet", tmp_path / "d.jsonl"
    write_parquet(pq_path, data, row_group_size=250)
    jl_path.write_text("".join(json.dumps({"id": i, "text": f"t{i}"}) + "\n" for i in range(N_ROWS)))
    for path, make, new in [
            (pq_path, lambda: ParquetSource(str(pq_path)),
             lambda: _rewrite_in_place(pq_path, pq_path.read_bytes()[:3000])),
            (jl_path, lambda: JsonlSource(str(jl_path)),
             lambda: _rewrite_in_place(jl_path, b'{"id": 1, "text": "x"}\n' * 3000))]:
        plan = Source(N_ROWS).shuffle(3).repeat().lanes(4).batch(64)
        loader = Loader(plan, make(), read_ahead=64)
        with deadline(20):
            for _ in range(3):
                next(loader)
            new()
            with pytest.raises(SourceError, match=rf"{path.name}: .*the file changed"):
                for _ in range(10):
                    next(loader)
        loader.close()


def test_array_record_rewritten_while_worker_processes_read_it(tmp_path):
    from zephon import Loader, Source
    from zephon.runners import processes
    from zephon.sources import ArrayRecordSource, FixedFields, write_array_record

    spec = FixedFields({"x": ("int64", (8,))})
    path = tmp_path / "w.array_record"
    write_array_record(path, [spec.encode({"x": np.full(8, i)}) for i in range(1000)])
    plan = Source(1000).shuffle(1).repeat().lanes(4).batch(32)
    with (Loader(plan, ArrayRecordSource(str(path), spec), runner=processes(2), read_ahead=64) as loader,
          deadline(60)):
        for _ in range(4):
            next(loader)
        _rewrite_in_place(path, path.read_bytes()[: 70_000])  # cut short (not readable)
        with pytest.raises(SourceError, match=r"w\.array_record: the file changed"):
            for _ in range(200):
                next(loader)


TRUNCATED_UNDER_READER = textwrap.dedent("""
    import os, sys, numpy as np
    from zephon.errors import SourceError
    from zephon.sources import ParquetSource
    if sys.argv[2] == "mmap":  # what ParquetSource did before: memory-mapped files
        import pyarrow.parquet as pq
        ParquetSource._open = staticmethod(lambda p, verify=True, metadata=None: pq.ParquetFile(
            p, memory_map=True, metadata=metadata))
    src = ParquetSource(sys.argv[1], cache_row_groups=0, decode_threads=1)
    src.read(np.arange(10))  # the file is open now
    os.truncate(sys.argv[1], os.path.getsize(sys.argv[1]) // 2)  # another process shrinks it
    try:
        src.read(np.arange(len(src) - 10, len(src)))
    except SourceError as e:
        print(e)
        sys.exit(3)
""")


def test_parquet_truncated_under_its_reader_is_an_error_never_sigbus(tmp_path):
    """Rows past the new end of a memory-mapped file kill the reader with SIGBUS (shown with a
    mapped reader); ParquetSource reads through the descriptor and stops with a SourceError."""
    from zephon.sources import write_parquet

    codes = {}
    for mode in ("mmap", "zephon"):
        path = tmp_path / f"{mode}.parquet"
        write_parquet(path, parquet_data(), row_group_size=100)
        proc = run_group([sys.executable, "-c", TRUNCATED_UNDER_READER, str(path), mode],
                              capture_output=True, text=True, timeout=60, cwd=ROOT)
        codes[mode] = proc.returncode
        if mode == "zephon":
            assert proc.returncode == 3, proc.stderr[-2000:]
            assert re.search(r"zephon\.parquet: the file changed .*size went from \d+ to \d+",
                             proc.stdout), proc.stdout
    report(f"parquet truncated under its reader: exit {codes['mmap']} memory-mapped, "
           f"{codes['zephon']} (SourceError) with ParquetSource")
    assert codes["mmap"] in (-signal.SIGBUS, 3)  # SIGBUS unless the kernel kept the pages


# ---------------------------------------------------------------- JSONL schema

def write_lines(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))


def test_jsonl_type_drift_and_missing_fields_name_file_line_and_field(tmp_path):
    from zephon.sources import JsonlSource

    rows = [{"id": i, "score": 0.5 * i, "toks": [i, i + 1], "meta": {"lang": "en"}} for i in range(300)]
    rows[0]["score"] = 0  # an integer where the column is float: still a float column
    rows[200]["id"] = "200"            # drift, past the lines the schema is inferred from
    del rows[250]["score"]             # a missing field
    rows[260]["meta"] = {"lang": None}  # a null
    rows[270]["toks"] = [1, "two"]      # drift inside a list
    rows[280]["extra"] = 1              # an unknown field
    path = tmp_path / "drift.jsonl"
    write_lines(path, rows)
    src = JsonlSource(path)
    assert src.schema == {"id": "int", "score": "float", "toks": "list[int]", "meta/lang": "str"}
    ok = src.read([0, 2, 4])
    assert ok["score"].dtype == np.float64 and ok["id"].dtype == np.int64
    assert src.read([0])["score"].dtype == np.float64  # not int64 because line 1 has 0
    cases = {
        200: r"drift\.jsonl: line 201 \(record 200\): field 'id' is str \(\"200\"\) but the schema "
             r"inferred from .*drift\.jsonl: line 1 \(record 0\) \.\. line 100 says int",
        250: r"drift\.jsonl: line 251 \(record 250\): field 'score' is missing \(the line has fields "
             r"\['id', 'meta/lang', 'toks'\]",
        260: r"line 261 \(record 260\): field 'meta/lang' is null .* says str.*fill the nulls",
        270: r"line 271 \(record 270\): field 'toks' is list \(\[1, \"two\"\]\) but .* says list\[int\]",
        280: r"line 281 \(record 280\): field 'extra' is not in the schema",
    }
    for record, message in cases.items():
        with pytest.raises(DecodeError, match=message):
            src.read([3, record, 5])  # blamed on that line, not on another of the read
    pinned = JsonlSource(path, schema={**src.schema, "id": "any"})
    assert pinned.read([200, 1])["id"].tolist() == ["200", 1]  # an object column, by choice


def test_jsonl_inferred_conflicts_are_logged_and_given_schemas_are_validated(tmp_path, caplog):
    from zephon.sources import JsonlSource

    path = tmp_path / "early.jsonl"
    write_lines(path, [{"x": 1}, {"x": "one"}, {"x": 3}])
    with caplog.at_level("WARNING"):
        src = JsonlSource(path)
    assert src.schema == {"x": "int"}
    assert re.search(r"early\.jsonl: line 2 \(record 1\): field 'x' is str but .*line 1 \(record 0\) "
                     r"has it int", caplog.text)
    with pytest.raises(DecodeError, match=r"line 2 \(record 1\): field 'x' is str"):
        src.read([1])
    with pytest.raises(ValueError, match=r"schema entries \{'x': 'integer'\}.*'int'"):
        JsonlSource(path, schema={"x": "integer"})
    with pytest.raises(ValueError, match=r"ragged names \['y'\].*\['x'\]"):
        JsonlSource(path, ragged={"y"})
    (tmp_path / "second.jsonl").write_text('{"y": 1}\n')
    with pytest.raises(DecodeError, match=r"second\.jsonl: line 1 \(record 3\): field 'x' is missing"):
        JsonlSource([path, tmp_path / "second.jsonl"])  # another file's first line, at construction


def test_jsonl_non_utf8_and_foreign_files_are_named(tmp_path):
    from zephon.sources import JsonlSource, write_array_record, write_parquet

    latin = tmp_path / "latin.jsonl"
    latin.write_bytes('{"t": "ok"}\n{"t": "caf\xe9"}\n'.encode("latin-1"))
    src = JsonlSource(latin)
    with pytest.raises(DecodeError, match=r"latin\.jsonl: line 2 \(record 1\): not UTF-8 text \(byte "
                                          r"0xe9 at column 11\).*Re-encode"):
        src.read([0, 1])
    write_parquet(tmp_path / "x.parquet", {"a": np.arange(10)}, row_group_size=5)
    with pytest.raises(DecodeError, match=r"x\.parquet: none of the first \d+ lines is a JSON object.*"
                                          r"looks like a Parquet file \(use ParquetSource\)"):
        JsonlSource(tmp_path / "x.parquet")
    write_array_record(tmp_path / "x.array_record", [b"\x00\x01" * 50] * 10)
    with pytest.raises(DecodeError, match=r"x\.array_record: .*looks like a binary file"):
        JsonlSource(tmp_path / "x.array_record")


# ---------------------------------------------------------------- consumer SIGKILL

CONSUMER = textwrap.dedent("""
    import os, sys, threading, time
    import numpy as np
    from zephon import Loader, Map, Source
    from zephon.runners import processes
    from zephon.sources import ArraySource

    def work(cols):  # workers are busy most of the time: kills land mid-batch
        time.sleep(60 if sys.argv[1] == "stuck" and os.getpid() != int(sys.argv[2]) else 0.01)
        return cols

    if __name__ == "__main__":
        sys.argv.append(str(os.getpid()))
        src = ArraySource({"x": np.arange(701 * 512, dtype=np.float32).reshape(701, 512)})
        plan = Source(701).shuffle(5).repeat().lanes(8).batch(32)
        loader = Loader(plan, src, [Map(work, batched=True)], runner=processes(2), read_ahead=64)

        def announce():  # the workers' pids, as soon as they run
            while len(loader.runner.pids) < 2:
                time.sleep(0.01)
            print(" ".join(map(str, loader.runner.pids)), flush=True)

        threading.Thread(target=announce, daemon=True).start()
        kept = []
        for batch in loader:
            kept = (kept + [batch])[-20:]  # batches alive in shared memory
""")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def _zephon_memory_of(consumer: int) -> list[str]:
    """/dev/shm segments of that consumer, and mappings of its slots in any process."""
    found = [n for n in os.listdir("/dev/shm") if n.startswith(f"zephon-{consumer}-")]
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/maps") as f:
                if f"zephon-{consumer}-" in f.read():
                    found.append(f"mapped in pid {pid}")
        except OSError:
            pass
    return found


def test_consumer_sigkill_leaves_no_shared_memory_and_no_worker(tmp_path):
    script = tmp_path / "consumer.py"
    script.write_text(CONSUMER)
    rng = random.Random(0)
    trials = [("busy", "consumer")] * 4 + [("stuck", "consumer"), ("busy", "group")]
    left, orphans = [], []
    for mode, target in trials:
        proc = subprocess.Popen([sys.executable, str(script), mode], stdout=subprocess.PIPE,
                                text=True, cwd=ROOT, start_new_session=True)
        try:
            with deadline(60):
                workers = [int(p) for p in proc.stdout.readline().split()]
            assert len(workers) == 2, "the consumer did not start"
            time.sleep(rng.uniform(0.05, 0.3))
            if target == "group":  # consumer, workers, forkserver and resource tracker at once
                os.killpg(proc.pid, signal.SIGKILL)
            else:
                os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
            end = time.monotonic() + 5  # workers notice within milliseconds; bounded anyway
            while time.monotonic() < end and (any(map(_alive, workers)) or _zephon_memory_of(proc.pid)):
                time.sleep(0.05)
            left.append(_zephon_memory_of(proc.pid))
            orphans.append([w for w in workers if _alive(w)])
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            for w in orphans[-1] if orphans else ():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(w, signal.SIGKILL)
    report(f"consumer SIGKILL: {len(trials)} kills ({sum(t == 'group' for _, t in trials)} of the "
           f"whole process group, 1 with workers stuck in a 60 s item): "
           f"{sum(map(len, left))} segments or mappings left, {sum(map(len, orphans))} workers left")
    assert left == [[]] * len(trials)
    assert orphans == [[]] * len(trials)


# ---------------------------------------------------------------- foreign files, bad arguments

def test_every_source_names_a_foreign_file_and_never_raises_a_raw_builtin(tmp_path):
    from zephon.sources import ArrayRecordSource, JsonlSource, ParquetSource, write_array_record, write_parquet

    write_parquet(tmp_path / "f.parquet", {"a": np.arange(10)}, row_group_size=5)
    write_array_record(tmp_path / "f.array_record", [b"x" * 10] * 10)
    (tmp_path / "f.jsonl").write_text('{"a": 1}\n' * 10)
    (tmp_path / "f.pkl").write_bytes(pickle.dumps({"a": np.arange(10)}))
    (tmp_path / "f.latin1").write_bytes('{"a": "caf\xe9"}\n'.encode("latin-1") * 3)
    own = {ArrayRecordSource: "f.array_record", ParquetSource: "f.parquet", JsonlSource: "f.jsonl"}
    for cls, mine in own.items():
        for name in ("f.parquet", "f.array_record", "f.jsonl", "f.pkl", "f.latin1"):
            if name == mine:
                assert len(cls(tmp_path / name).read([0, 9])) == 1
                continue
            with pytest.raises((SourceError, DecodeError), match=re.escape(name)):
                cls(tmp_path / name).read([0])
    with pytest.raises(DecodeError, match=r"f\.pkl: .*looks like a Python pickle"):
        JsonlSource(tmp_path / "f.pkl")


def test_bad_arguments_are_value_errors_that_say_what_to_write(tmp_path):
    from zephon.runners import from_spec
    from zephon.sources import ArraySource, Decoder, FixedFields, ParquetSource, write_parquet

    for fields in ({"x": ("int33", (4,))}, {"x": ("int32",)}, {"x": ("int32", "ab")}):
        with pytest.raises(ValueError, match=r"FixedFields field 'x': .* is not \(dtype, shape\).*write e\.g\."):
            FixedFields(fields)
    with pytest.raises(ValueError, match=r"record indices must be integers, got float64"):
        ArraySource({"x": np.arange(4)}).read(np.array([1.5]))
    with pytest.raises(ValueError, match=r"worker count 'two' is not a number"):
        from_spec("processes:two")
    with pytest.raises(ValueError, match=r"write_parquet .*column 'mixed' .*cannot be stored in Parquet"):
        write_parquet(tmp_path / "m.parquet", {"mixed": np.array([1, "a"], dtype=object)}, row_group_size=2)
    write_parquet(tmp_path / "p.parquet", {"a": np.arange(4)}, row_group_size=2)
    with pytest.raises(SourceError, match=r"p\.parquet: has no column 'b'"):
        ParquetSource(tmp_path / "p.parquet", columns=["b"])
    with pytest.raises(DecodeError, match=r"ragged names \['typo'\]"):
        Decoder(json.loads, ragged={"typo"}).decode(np.array([b'{"a": [1]}'], dtype=object), lambda i: f"rec {i}")
    assert ArraySource([1, 2, 3]).read([2])["data"].tolist() == [3]


# ---------------------------------------------------------------- Mix weights (item 4)

def _kids():
    return [Source_(100, 0), Source_(50, 1), Source_(70, 2)]


def Source_(n, i):
    from zephon import Source

    return Source(n, id=i).shuffle(i + 1).repeat()


_WEIGHT_MESSAGE = r"Mix weights must be finite, non-negative and sum to a positive number, got "
BAD_WEIGHTS = [
    ("negative", [0.5, -0.1], _WEIGHT_MESSAGE + r"\[0\.5, -0\.1\]"),
    ("all zero", [0, 0], _WEIGHT_MESSAGE + r"\[0, 0\]"),
    ("NaN", [float("nan"), 1.0], _WEIGHT_MESSAGE + r"\[nan, 1\.0\]"),
    ("inf", [float("inf"), 1.0], _WEIGHT_MESSAGE + r"\[inf, 1\.0\]"),
    ("-inf", [1.0, float("-inf")], _WEIGHT_MESSAGE),
    ("numpy negative", np.array([0.7, -0.3]), _WEIGHT_MESSAGE),
    ("too few", [1.0], r"Mix has 2 children but 1 weights; give one weight per child"),
    ("too many", [1, 1, 1], r"Mix has 2 children but 3 weights; give one weight per child"),
    ("text", ["a", 1], r"Mix weights must be numbers, got \['a', 1\]"),
    ("None", [None, 1], r"Mix weights must be numbers, got \[None, 1\]"),
    ("nested", [[0.5], 0.5], r"Mix weights must be numbers"),
    ("complex", [1j, 1], r"Mix weights must be numbers"),
]
# Once open (found by these tests, fixed in 4ae62c8): each note says what happened before the fix.
BAD_WEIGHTS_OPEN = [
    ("numeric text", ["0.5", 0.5], "float('0.5') is accepted: a weight read from a config "
     "as text passes unnoticed (zephon/plan.py:307)"),
    ("bools", [True, False], "True/False become 1.0/0.0 and silently drop a child (zephon/plan.py:307)"),
    ("a bare number", 0.5, "raw TypeError \"'float' object is not iterable\" (zephon/plan.py:298, "
     "Node.mix at zephon/plan.py:124)"),
    ("a dict", {0: 0.5, 1: 0.5}, "tuple(dict) takes the KEYS: weights become (0.0, 1.0) and child 0 "
     "is silently dropped (zephon/plan.py:298)"),
    ("overflowing sum", [1e308, 1e308], "the sum overflows to inf, every normalised weight is 0 and "
     "Mix._tree recurses forever: raw RecursionError (zephon/plan.py:319-336)"),
]


@pytest.mark.parametrize("by", ["samples", "tokens"])
@pytest.mark.parametrize("name,weights,message", BAD_WEIGHTS, ids=[c[0] for c in BAD_WEIGHTS])
def test_invalid_mix_weights_are_refused_with_the_weights_named(name, weights, message, by):
    from zephon import Mix, Node

    kids = _kids()[:2]
    with pytest.raises(PlanError, match=message):
        Mix(kids, weights, by=by)
    with pytest.raises(PlanError, match=message):
        Node.mix(kids, weights, by=by)
    with pytest.raises(PlanError, match=message):  # the same refusal when a plan file is loaded
        Node.from_json({"type": "Mix", "children": [k.to_json() for k in kids],
                        "weights": list(weights) if not isinstance(weights, np.ndarray)
                        else weights.tolist(), "by": by})


@pytest.mark.parametrize("weights", [
    pytest.param(w, id=name) for name, w, why in BAD_WEIGHTS_OPEN if name != "overflowing sum"])
def test_invalid_mix_weights_refused(weights):
    """Once open (see BAD_WEIGHTS_OPEN's notes), now each is a PlanError naming the weights."""
    from zephon import Mix

    with deadline(5), pytest.raises(PlanError, match="Mix weights"):
        m = Mix(_kids()[:2], weights)
        m.route(np.arange(4))


def test_huge_equal_weights_are_normalised_not_overflowed():
    from zephon import Mix

    with deadline(5):
        m = Mix(_kids()[:2], [1e308, 1e308])
        assert np.allclose(m.normalized, [0.5, 0.5])
        assert np.bincount(m.route(np.arange(1000))[0]).tolist() == [500, 500]


def _tree_depth(k):
    """Levels of the balanced split tree over k children with positive weight."""
    return math.ceil(math.log2(k)) if k > 1 else 0


@pytest.mark.parametrize("weights", [(0.999, 0.001), (1 - 1e-6, 1e-6), (1.0, 1e-6),
                                     (0.5, 0.3, 0.2 - 1e-6, 1e-6, 0.0), (1e-6, 1e-6, 1e-6)])
def test_mix_weights_are_kept_exactly_and_realised_within_half_a_record_per_level(weights):
    """zephon/plan.py Mix: each side of a split gets floor(n·w + 1/2) of the first n positions,
    so every child is within half a record per tree level of n·w_i, for EVERY prefix n."""
    from zephon import Mix, Node, Source

    kids = [Source(10**6, id=i).repeat() for i in range(len(weights))]
    m = Mix(kids, list(weights))
    assert m.weights == tuple(float(w) for w in weights)  # as given: no rounding to a ratio
    assert m.to_json()["weights"] == list(weights)
    back = Node.from_json(json.loads(json.dumps(m.to_json())))
    assert back == m and back.weights == m.weights and back.fingerprint() == m.fingerprint()
    w = np.asarray(weights, np.float64) / sum(weights)
    bound = 0.5 * _tree_depth(int((w > 0).sum())) + 1e-9
    # every prefix up to 2·10^6 (routes position by position) ...
    n = 2_000_000
    child, inner = m.route(np.arange(n))
    for i in range(len(weights)):
        mine = child == i
        prefix = np.cumsum(mine)
        dev = np.abs(prefix - np.arange(1, n + 1) * w[i])
        assert dev.max() <= bound, (weights, i, dev.max())
        # inner indices of a child are 0, 1, 2, ...: no record skipped or repeated
        assert np.array_equal(inner[mine], np.arange(mine.sum()))
        if w[i] == 0:
            assert not mine.any()
        elif w[i] * n >= 1:
            assert mine.any(), f"weight {weights[i]} never realised in {n} positions"
    # ... and far-away prefixes through counts() (what length and random access use)
    rng = np.random.default_rng(0)
    for big in [n, 10**9 + 7, 10**12, 3 * 10**15] + rng.integers(1, 10**15, 20).tolist():
        c = m.counts(int(big))
        assert c.sum() == big
        assert np.all(np.abs(c - big * w) <= bound + big * 1e-15), (big, c, big * w)
    assert np.array_equal(m.counts(n), np.bincount(child, minlength=len(weights)))


def test_sample_mix_weights_hold_inside_every_lane():
    from zephon import Mix, Source

    p = Mix([Source(10**6, id=0).repeat(), Source(10**6, id=1).repeat()], [0.999, 0.001]).lanes(4).batch(8)
    n = 200_000
    for lane in range(4):
        src = p.lanes.resolve_lanes(np.full(n, lane), np.arange(n)).source
        dev = np.abs(np.cumsum(src == 1) - 0.001 * np.arange(1, n + 1))
        assert dev.max() <= 0.5 + 1e-9, (lane, dev.max())


def _token_docs(n, seed):
    rng = np.random.default_rng(seed)
    out = np.empty(n, object)
    for i in range(n):
        out[i] = rng.integers(1, 1000, rng.integers(1, 40)).astype(np.int32)
    return out


@pytest.mark.parametrize("weights", [(0.999, 0.001), (1 - 1e-6, 1e-6)])
def test_token_mix_tiny_weights_within_one_document(weights):
    """Mix(by='tokens'): every lane's token counters stay within one document (< 40 tokens here)
    of each weight's share, after every step — at 1e-6 too (the small source is taken once)."""
    from zephon import Loader, Mix, Source
    from zephon.ops.pack import Pack
    from zephon.sources.memory import ArraySource

    p = Mix([Source(300, id=0).shuffle(1).repeat(), Source(200, id=1).shuffle(2).repeat()],
            list(weights), by="tokens").lanes(4).batch(8)
    srcs = [ArraySource({"tokens": _token_docs(300, 1)}), ArraySource({"tokens": _token_docs(200, 2)})]
    loader = Loader(p, srcs, [Pack(32)])
    with deadline(20):
        for _ in range(60):
            next(loader)
            for lane, st in loader.state()["lanes"].items():
                mix = np.array(st["mix"], np.float64)
                share = np.array(weights) / sum(weights) * mix.sum()
                assert np.all(np.abs(mix - share) < 40), (lane, mix, share)
    assert all(st["mix"][1] > 0 for st in loader.state()["lanes"].values())  # never dropped


@pytest.mark.parametrize("by", ["samples", "tokens"])
def test_mix_children_as_list_or_tuple_are_the_same_plan_everywhere(tmp_path, by):
    from zephon import Loader, Mix, Node, Source
    from zephon.fingerprints import run_fingerprints
    from zephon.ops.pack import Pack
    from zephon.sources.memory import ArraySource

    def kids():
        return [Source(300, id=0).shuffle(1).repeat(), Source(200, id=1).shuffle(2).repeat()]

    as_list, weights = kids(), [0.7, 0.3]
    plans = {
        "list": Mix(as_list, weights, by=by),
        "tuple": Mix(tuple(kids()), tuple(weights), by=by),
        "generator": Mix((k for k in kids()), (w for w in weights), by=by),
        "Node.mix": Node.mix(kids(), weights, by=by),
        "numpy weights": Mix(kids(), np.array(weights), by=by),
    }
    as_list.append(Source(5, id=2).repeat())  # the caller's lists are copied, not kept
    weights.append(1.0)
    plans = {k: v.lanes(4).batch(8) for k, v in plans.items()}
    ref = plans["list"]
    assert len(ref.lanes.child.children) == 2 and ref.lanes.child.weights == (0.7, 0.3)
    srcs = [ArraySource({"tokens": _token_docs(300, 1)}), ArraySource({"tokens": _token_docs(200, 2)})]
    ops = [Pack(32)] if by == "tokens" else []
    fps = {}
    for name, p in plans.items():
        assert p == ref and p.fingerprint() == ref.fingerprint(), name
        back = Node.from_json(json.loads(json.dumps(p.to_json())))
        assert back == ref and isinstance(back.lanes.child.children, tuple)
        fps[name] = run_fingerprints([Loader(p, srcs, ops)], 4)
    assert len(set(map(tuple, fps.values()))) == 1
    # state() of one restores into a loader of another, also through save_state/load_state
    a = Loader(plans["list"], srcs, ops)
    head = run_fingerprints([a], 3)
    save_state(tmp_path / "s.json", a.state())
    state = load_state(tmp_path / "s.json")
    assert state["plan"]["child"]["child"]["weights"] == [0.7, 0.3]
    b = Loader(plans["tuple"], srcs, ops)
    b.restore(state)
    assert head + run_fingerprints([b], 1) == fps["list"]
    # and a near-miss weight is refused, naming it
    other = Mix(kids(), [0.7000001, 0.2999999], by=by).lanes(4).batch(8)
    with pytest.raises(StateError, match=r"weights\[0\]: 0\.7 != 0\.7000001"):
        Loader(other, srcs, ops).restore(state)


# ---------------------------------------------------------------- hand-edited states (item 7)

def words(text):
    """A named tokenizer (module level, so a state can record it): 'w12 w3' -> [13, 4]."""
    return [int(w[1:]) + 1 for w in text.split()]


def _texts(n, seed):
    rng = np.random.default_rng(seed)
    out = np.empty(n, object)
    for i in range(n):
        out[i] = " ".join(f"w{v}" for v in rng.integers(0, 50, rng.integers(3, 60)))
    return out


_LM_SOURCES = None


def lm_loader(mode="concat", finite=False, weights=(0.6, 0.4), lanes=4, seq_len=16, seed=0):
    """Two text sources mixed by tokens, tokenized per source, packed: the LM pipeline."""
    global _LM_SOURCES
    from zephon import Loader, Mix, Source
    from zephon.ops.pack import Pack
    from zephon.ops.tokenize import Tokenize
    from zephon.sources.memory import ArraySource

    if _LM_SOURCES is None:
        _LM_SOURCES = [ArraySource({"text": _texts(60, 1)}), ArraySource({"body": _texts(40, 2)})]
    kids = [Source(60, id=0).shuffle(1), Source(40, id=1).shuffle(2)]
    if not finite:
        kids = [k.repeat() for k in kids]
    plan = Mix(kids, list(weights), by="tokens").lanes(lanes).batch(2 * lanes)
    return Loader(plan, _LM_SOURCES, [Pack(seq_len, mode)], seed=seed,
                  per_source={0: [Tokenize(words, name="words", eos=0)],
                              1: [Tokenize(words, field="body", name="words", eos=0)]})


@pytest.fixture(scope="module")
def lm_states():
    """{mode: (state after 3 steps as JSON, a lane whose accumulator holds inputs)}."""
    out = {}
    for mode in ("concat", "best_fit"):
        loader = lm_loader(mode)
        for _ in range(3):
            next(loader)
        state = json.loads(json.dumps(loader.state()))
        lane = max(state["lanes"], key=lambda k: (len(state["lanes"][k]["held"]), k != "0"))
        assert state["lanes"][lane]["held"] and state["lanes"][lane]["carry"], state["lanes"][lane]
        out[mode] = state, lane
    return out


def names(lane, field):
    """A message that names the lane and the field, in any order."""
    return rf"(?s)(?=.*\blane {lane}\b)(?=.*{field})"


def restore_and_step(make, state, steps=3):
    loader = make()
    loader.restore(state)
    for _ in range(steps):
        next(loader)


def _lane(fn):
    """An edit of the chosen lane's state."""
    return lambda s, lane: fn(s["lanes"][lane])


def _set(key, value):
    return _lane(lambda st: st.__setitem__(key, value))


def _held(fn):
    return _lane(lambda st: st.__setitem__("held", fn(st["held"], st)))


# (id, pack mode, edit(state, lane), expected message: a regex over the StateError, {lane} filled in)
HAND_EDITS = [
    ("cursor negative", "concat", _lane(lambda st: st["cursor"].__setitem__(0, -1)), names("{lane}", "'cursor'")),
    ("cursor text", "concat", _lane(lambda st: st["cursor"].__setitem__(0, "3")), names("{lane}", "'cursor'")),
    ("cursor float", "concat", _lane(lambda st: st["cursor"].__setitem__(0, 3.0)), names("{lane}", "'cursor'")),
    ("cursor bool", "concat", _lane(lambda st: st["cursor"].__setitem__(1, True)), names("{lane}", "'cursor'")),
    ("cursor null", "concat", _set("cursor", None), names("{lane}", "'cursor'")),
    ("cursor one branch of two", "best_fit", _lane(lambda st: st["cursor"].pop()), names("{lane}", "'cursor'")),
    ("skip negative", "concat", _set("skip", [0, -2]), names("{lane}", "'skip'")),
    ("mix missing", "concat", _lane(lambda st: st.pop("mix")), names("{lane}", "'mix'")),
    ("mix negative", "best_fit", _lane(lambda st: st["mix"].__setitem__(0, -5)), names("{lane}", "'mix'")),
    ("lane state a list", "concat", lambda s, lane: s["lanes"].__setitem__(lane, [1, 2]),
     r"lane {lane} of the state is list, expected an object"),
    ("lanes a list", "concat", lambda s, lane: s.__setitem__("lanes", [s["lanes"][lane]]),
     r"the state's 'lanes' is list, expected an object"),
    ("lane missing", "concat", lambda s, lane: s["lanes"].pop(lane), r"the state lacks lanes \[{lane}\].*merge_states"),
    ("step negative", "concat", lambda s, lane: s.__setitem__("step", -1), r"step -1 is not a non-negative integer"),
    ("step text", "concat", lambda s, lane: s.__setitem__("step", "3"), r"step '3' is not a non-negative integer"),
    ("held a string", "concat", _set("held", "x"), names("{lane}", "'held'")),
    ("held pairs", "best_fit", _held(lambda h, st: [x[:2] for x in h]), names("{lane}", "'held'")),
    ("held negative", "concat", _held(lambda h, st: [[x[0], -x[1] - 1, x[2]] for x in h]), names("{lane}", "'held'")),
    ("held branch out of range", "concat", _held(lambda h, st: [[2, x[1], x[2]] for x in h]),
     names("{lane}", "'held'")),
    ("held output the input does not give", "best_fit", _held(lambda h, st: [[x[0], x[1], 7] for x in h]),
     r"lane {lane} holds output 7 of input \d+ but re-processing that input gives fewer outputs"),
]

# Once open (found by these tests, fixed in f8a8561): each note says what happened before the fix
# (file:line of that time).
HAND_EDITS_OPEN = [
    ("cursor past int64", "concat", _lane(lambda st: st["cursor"].__setitem__(0, 2**63)), names("{lane}", "'cursor'"),
     "raw OverflowError 'Python int too large to convert to C long' at zephon/exec/lanes.py:67; "
     "zephon/exec/state.py:50 ints() accepts any Python int"),
    ("held ahead of the cursor", "concat", _held(lambda h, st: [[x[0], x[1] + 10_000, x[2]] for x in h]),
     names("{lane}", "'held'"),
     "silent: the accumulator is handed another document; held [b, i, o] must come before "
     "(cursor[b], skip[b]) — check in zephon/exec/state.py:65 or Loader.seek_position"),
    ("held emptied, carry kept", "concat", _set("held", []), names("{lane}", "(held|carry)"),
     "silent: the rest of the held document is dropped (tokens lost); Pack never checks its carry "
     "against held (zephon/ops/pack.py:101)"),
    ("held with an extra input", "concat", _held(lambda h, st: h + [[0, max(0, st["cursor"][0] - 2), 0]]),
     names("{lane}", "(held|carry)"), "silent: the extra document is packed again (tokens duplicated)"),
    ("carry null while holding", "concat", _set("carry", None), names("{lane}", "(held|carry)"),
     "silent: concat restarts the held document at offset 0 (tokens duplicated), zephon/ops/pack.py:101"),
    ("carry a string", "concat", _set("carry", "garbage"), names("{lane}", "carry"),
     "raw TypeError 'string indices must be integers' at zephon/ops/pack.py:101"),
    ("carry offset negative", "concat", _set("carry", {"offset": -3}), names("{lane}", "carry"),
     "raw ValueError 'could not broadcast input array' at zephon/ops/pack.py:189"),
    ("carry offset past the document", "concat", _set("carry", {"offset": 10**6}), names("{lane}", "carry"),
     "silent: the held document's tail is dropped (zephon/ops/pack.py:101-118)"),
    ("carry offset text", "concat", _set("carry", {"offset": "x"}), names("{lane}", "carry"),
     "raw ValueError 'invalid literal for int()' at zephon/ops/pack.py:101"),
    ("fit carry a list", "best_fit", _set("carry", [1, 2]), names("{lane}", "carry"),
     "raw AttributeError \"'list' object has no attribute 'get'\" at zephon/ops/pack.py:130"),
    ("fit bins not triples", "best_fit", _set("carry", {"bins": [[[0, 1]]], "pending": None}), names("{lane}", "carry"),
     "raw ValueError 'not enough values to unpack' at zephon/ops/pack.py:133"),
    ("fit pending too short", "best_fit", _set("carry", {"bins": [], "pending": [0]}), names("{lane}", "carry"),
     "raw IndexError 'list index out of range' at zephon/ops/pack.py:134"),
    ("fit segment with a negative start", "best_fit",
     _lane(lambda st: st["carry"]["bins"][0][0].__setitem__(1, -4)), names("{lane}", "carry"),
     "raw ValueError 'could not broadcast input array' at zephon/ops/pack.py:189 "
     "(no check that 0 <= start < stop <= len(doc))"),
]


def _edited(lm_states, mode, edit):
    state, lane = lm_states[mode]
    state = json.loads(json.dumps(state))
    edit(state, lane)
    return state, lane


@pytest.mark.parametrize("name,mode,edit,message", HAND_EDITS, ids=[c[0] for c in HAND_EDITS])
def test_hand_edited_lm_state_is_refused_naming_lane_and_field(lm_states, name, mode, edit, message):
    state, lane = _edited(lm_states, mode, edit)
    with deadline(20), pytest.raises(StateError, match=message.format(lane=lane)):
        restore_and_step(lambda: lm_loader(mode), state)


@pytest.mark.parametrize("mode,edit,message", [
    pytest.param(mode, edit, message, id=name) for name, mode, edit, message, why in HAND_EDITS_OPEN])
def test_hand_edited_lm_state_once_open_is_refused(lm_states, mode, edit, message):
    state, lane = _edited(lm_states, mode, edit)
    with deadline(20), pytest.raises(StateError, match=message.format(lane=lane)):
        restore_and_step(lambda: lm_loader(mode), state, steps=6)


def keep_even(record):
    return record["x"] % 2 == 0


def test_cursor_beyond_its_lane_is_refused():
    from zephon import Filter, Loader, Source
    from zephon.sources.memory import ArraySource

    src = ArraySource({"x": np.arange(100)})

    def filtered():  # finite: 100 records in 4 lanes, 25 inputs each
        return Loader(Source(100).shuffle(3).lanes(4).batch(8), src, [Filter(keep_even)])

    a = filtered()
    next(a)
    state = json.loads(json.dumps(a.state()))
    state["lanes"]["2"]["cursor"] = [26]
    with pytest.raises(StateError, match=r"lane 2 of the state is at input 26, beyond its 25 inputs"):
        filtered().restore(state)
    # a one-to-one plan: every lane must be at step × rows
    one = Loader(Source(100).shuffle(3).repeat().lanes(4).batch(8), src)
    next(one)
    state = json.loads(json.dumps(one.state()))
    state["lanes"]["3"]["cursor"] = [5]
    with pytest.raises(StateError, match=r"lane 3 of the state is at input 5, but step 1 .* puts every lane at 2"):
        Loader(Source(100).shuffle(3).repeat().lanes(4).batch(8), src).restore(state)


def test_cursor_beyond_a_finite_token_mix_lane_is_refused():
    a = lm_loader(finite=True)
    next(a)
    state = json.loads(json.dumps(a.state()))
    state["lanes"]["1"]["cursor"] = [10**6, 0]
    with pytest.raises(StateError, match=names(1, "cursor")):
        restore_and_step(lambda: lm_loader(finite=True), state, steps=1)


def test_state_of_another_plan_or_pipeline_is_refused_naming_the_difference(lm_states):
    from zephon import Filter, Loader, Source
    from zephon.sources.memory import ArraySource

    state, _ = lm_states["concat"]
    cases = [
        (lambda: lm_loader(weights=(0.5, 0.5)), r"another plan .*weights\[0\]: 0\.6 != 0\.5"),
        (lambda: lm_loader(lanes=8), r"another plan .*count: 4 != 8"),
        (lambda: lm_loader(finite=True), r"another plan .*children\[0\]"),
        (lambda: lm_loader(seed=1), r"seed 0 differs from the loader's 1"),
        (lambda: lm_loader(seq_len=32), r"different pipeline: .*Pack\): config seq_len 16 != 32"),
        (lambda: lm_loader("best_fit"), r"different pipeline: .*config mode 'concat' != 'best_fit'"),
    ]
    for make, message in cases:
        with pytest.raises(StateError, match=message):
            make().restore(state)
    filtered = Loader(Source(100).lanes(4).batch(8), ArraySource({"x": np.arange(100)}), [Filter(keep_even)])
    with pytest.raises(StateError, match=r"another plan .*plan\.child"):
        filtered.restore(state)
    with pytest.raises(StateError, match=r"another plan"):
        lm_loader().restore(json.loads(json.dumps(filtered.state())))


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_a_pickled_state_is_named_never_unpickled(tmp_path, lm_states, protocol):
    state, _ = lm_states["concat"]
    path = tmp_path / "loader.json"
    path.write_bytes(pickle.dumps(state, protocol=protocol))
    with pytest.raises(StateError, match=r"loader\.json is a Python pickle .*never unpickles"):
        load_state(path)


def test_restore_and_merge_refuse_what_is_not_a_state(lm_states):
    from zephon import merge_states

    state, _ = lm_states["concat"]
    for thing in (pickle.dumps(state), "ckpt/loader.json", [state], None):
        with pytest.raises(StateError, match=r"not a Zephon loader state .*pass the dict"):
            lm_loader().restore(thing)
    with pytest.raises(StateError, match=r"merge_states needs at least one state"):
        merge_states([])
    with pytest.raises(StateError, match=r"cannot merge states with different step"):
        merge_states([state, {**state, "step": state["step"] + 1}])


def test_merge_states_refuses_malformed_lanes(lm_states):
    from zephon import merge_states

    state, _ = lm_states["concat"]
    with pytest.raises(StateError, match=r"'lanes'"):
        merge_states([state, {**state, "lanes": list(state["lanes"].values())}])


def test_plan_explain_of_a_token_mix_is_refused_not_wrong():
    from zephon import Mix, Source

    p = Mix([Source(50, id=0).repeat(), Source(50, id=1).repeat()], [0.5, 0.5], by="tokens").lanes(2).batch(4)
    with pytest.raises(PlanError, match="by tokens"):
        p.explain(0)
