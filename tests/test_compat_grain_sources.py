"""Grain data sources (and Zephon's) in the Grain API (`zephon.compat.grain.sources`).

Every equality is checked against Grain itself, never against numbers written down by hand."""

from __future__ import annotations

import glob
import os

import grain
import numpy as np
from _grain import quiet_remainder_warning, same_all  # noqa: F401 - an autouse fixture

import zephon.compat.grain as zg
from zephon.sources import ArraySource, write_array_record

GRAIN_TESTDATA = os.path.join(os.path.dirname(grain.__file__), "_src", "python", "testdata")


def test_array_record_sources_grain_testdata_and_written(tmp_path) -> None:
    digits = grain.sources.ArrayRecordDataSource(
        sorted(glob.glob(os.path.join(GRAIN_TESTDATA, "digits.array_record-*"))))
    g = grain.MapDataset.source(digits).shuffle(seed=2).repeat(3).batch(4)
    z = zg.Dataset.source(digits).shuffle(seed=2).repeat(3).batch(4)
    assert same_all(g, z) == 8 and next(iter(z)).dtype == next(iter(g)).dtype == "S1"
    assert z.fingerprints(7) == zg.grain_fingerprints(g, 7)

    path = str(tmp_path / "recs.array_record")
    rng = np.random.default_rng(0)
    payloads = [rng.integers(0, 256, rng.integers(1, 40), dtype=np.uint8).tobytes() + b"\x01" for _ in range(300)]
    write_array_record(path, payloads)
    src = grain.sources.ArrayRecordDataSource([path])
    parse = lambda b: {"n": len(b), "head": np.frombuffer(b[:1], np.uint8)[0], "raw": b}
    g = grain.MapDataset.source(src).shuffle(seed=3).map(parse).batch(32)
    z = zg.Dataset.source(src).shuffle(seed=3).map(parse).lanes(4).batch(32)
    assert same_all(g, z) == 10
    assert z.fingerprints(9, world=2) == zg.grain_fingerprints(g, 9, lanes=4)


def test_user_source_uses_getitems_and_in_memory_source() -> None:
    class Squares:
        def __init__(self) -> None:
            self.bulk_calls = self.single_calls = 0

        def __len__(self) -> int:
            return 37

        def __getitem__(self, i):
            self.single_calls += 1
            return {"v": np.int64(i * i)}

        def __getitems__(self, keys):
            self.bulk_calls += 1
            return [{"v": np.int64(k * k)} for k in keys]

    sq = Squares()
    z = zg.Dataset.source(sq).shuffle(seed=6).repeat(2).batch(8)
    g = list(grain.MapDataset.source(sq).shuffle(seed=6).repeat(2).batch(8))
    sq.bulk_calls = sq.single_calls = 0
    assert same_all(g, z) == 10
    assert sq.bulk_calls >= 1 and sq.single_calls == 0  # Zephon reads through __getitems__ only
    mem = grain.sources.SharedMemoryDataSource([f"word{i}" for i in range(25)])
    try:
        gm = grain.MapDataset.source(mem).shuffle(seed=2).map(lambda w: {"w": w, "n": len(w)}).batch(5)
        zm = zg.Dataset.source(mem).shuffle(seed=2).map(lambda w: {"w": w, "n": len(w)}).batch(5)
        assert same_all(gm, zm) == 5
    finally:
        mem.close()
        mem.unlink()


def test_zephon_sources_work_in_the_grain_api() -> None:
    arr = ArraySource({"x": np.arange(40, dtype=np.int32), "y": np.arange(80.0).reshape(40, 2)})
    z = zg.Dataset.source(arr).shuffle(seed=1).batch(8)
    lst = [{"x": np.int32(i), "y": np.array([2.0 * i, 2.0 * i + 1])} for i in range(40)]
    same_all(grain.MapDataset.source(lst).shuffle(seed=1).batch(8), z)
    mixed = zg.Dataset.mix([zg.Dataset.source(arr), zg.Dataset.source(lst)]).map(lambda r: r["x"] * 2).batch(4)
    assert next(iter(mixed)).tolist() == [0, 0, 2, 2]
