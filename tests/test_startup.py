"""Start-up on many shard files: per-file work in parallel chunks, no file left open by it."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from zephon import Loader, Source
from zephon.errors import SourceError
from zephon.sources import ArrayRecordSource, FixedFields, JsonlSource, ParquetSource, write_parquet
from zephon.sources.array_record import write_array_record
from zephon.sources.parallel import map_files

SHARDS, PER = 70, 3  # more than MIN_FILES_PER_THREAD x 2: the chunked pool really runs


def open_files() -> set[str]:
    return {os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")
            if os.path.exists(f"/proc/self/fd/{fd}")}


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    root = tmp_path_factory.mktemp("shards")
    ids = np.arange(SHARDS * PER).reshape(SHARDS, PER)
    out = {"array_record": [], "parquet": [], "jsonl": []}
    for i, block in enumerate(ids):
        a, p, j = (str(root / f"part-{i:03d}.{ext}") for ext in ("ar", "parquet", "jsonl"))
        write_array_record(a, [np.int64(x).tobytes() for x in block])
        write_parquet(p, {"id": block}, row_group_size=2)
        with open(j, "w") as f:
            f.writelines(json.dumps({"id": int(x)}) + "\n" for x in block)
        out["array_record"].append(a)
        out["parquet"].append(p)
        out["jsonl"].append(j)
    return out


def make(fmt, paths):
    if fmt == "array_record":
        return ArrayRecordSource(paths, FixedFields({"id": ("int64", ())}))
    if fmt == "parquet":
        return ParquetSource(paths)
    return JsonlSource(paths, schema={"id": "int"})


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors in /proc")
@pytest.mark.parametrize("fmt", ["array_record", "parquet", "jsonl"])
def test_many_shards_construct_with_no_file_open_and_read_every_record(shards, fmt):
    before = open_files()
    src = make(fmt, shards[fmt])
    assert not {p for p in open_files() - before if p in set(shards[fmt])}, "construction kept files open"
    assert len(src) == SHARDS * PER
    got = src.read(np.arange(len(src))[::-1])["id"]
    np.testing.assert_array_equal(np.asarray(got, np.int64), np.arange(len(src))[::-1])
    # the first batch of a shuffled plan opens only the shards it touches
    before = open_files()
    batch = next(Loader(Source(len(src)).shuffle(3).lanes(2).batch(4), make(fmt, shards[fmt])))
    touched = {shards[fmt][int(i) // PER] for i in np.asarray(batch.data["id"])}
    assert {p for p in open_files() - before if p in set(shards[fmt])} <= touched


def test_map_files_keeps_file_order_and_raises_the_first_failing_file():
    paths = [f"f{i:03d}" for i in range(200)]
    assert map_files(str.upper, paths, threads=4) == [p.upper() for p in paths]

    def fail(p: str) -> str:
        if p in ("f150", "f090"):
            raise SourceError(p)
        return p

    with pytest.raises(SourceError, match="f090"):
        map_files(fail, paths, threads=4)
