"""Record sources read back exactly what was written, and fail loudly and precisely."""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import pickle
import shutil
import sys

import numpy as np
import pytest
import tensorflow_datasets as tfds
from _helpers import run_group

from zephon.errors import DecodeError, SourceError
from zephon.sources import (
    ArrayRecordSource,
    ArraySource,
    Decoder,
    FixedFields,
    JsonlSource,
    ParquetSource,
    RawBytes,
    RecordSource,
    TFDSSource,
    write_array_record,
    write_parquet,
    write_sharded_array_record,
)

RNG = np.random.default_rng(0)
SPEC = FixedFields({"tokens": ("int32", (8,)), "label": ("int64", ()), "weight": ("float16", (2,))})


def shuffled_with_repeats(n: int, size: int = 0) -> np.ndarray:
    idx = RNG.integers(0, n, size=size or 2 * n)
    idx[:3] = [n - 1, 0, n - 1]  # both ends, and a repeat
    return idx


def make_records(n: int) -> dict[str, np.ndarray]:
    return {
        "tokens": RNG.integers(-2**31, 2**31 - 1, size=(n, 8)).astype(np.int32),
        "label": np.arange(n, dtype=np.int64) * 7,
        "weight": RNG.standard_normal((n, 2)).astype(np.float16),
    }


def encode_all(cols: dict[str, np.ndarray]) -> list[bytes]:
    n = len(next(iter(cols.values())))
    return [SPEC.encode({k: v[i] for k, v in cols.items()}) for i in range(n)]


def assert_columns_equal(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert got.keys() == want.keys()
    for k in want:
        assert got[k].dtype == want[k].dtype, k
        assert got[k].shape == want[k].shape, k
        if want[k].dtype == object:
            for a, b in zip(got[k], want[k]):
                np.testing.assert_array_equal(a, b)
        else:
            np.testing.assert_array_equal(got[k], want[k])


# ---------------------------------------------------------------- in-memory


def test_array_source_reads_rows_in_request_order():
    cols = make_records(50)
    src = ArraySource(cols)
    assert isinstance(src, RecordSource) and len(src) == 50
    idx = shuffled_with_repeats(50)
    assert_columns_equal(src.read(idx), {k: v[idx] for k, v in cols.items()})
    bare = ArraySource(np.arange(10.0))
    np.testing.assert_array_equal(bare.read([3, 3, 1])["data"], [3.0, 3.0, 1.0])


def test_array_source_rejects_unequal_lengths_and_bad_indices():
    with pytest.raises(ValueError, match=r"different lengths .*'a': 3.*'b': 4"):
        ArraySource({"a": np.zeros(3), "b": np.zeros(4)})
    with pytest.raises(IndexError, match=r"record 10 is out of range \[0, 10\)"):
        ArraySource(np.arange(10)).read([0, 10])


# ---------------------------------------------------------------- ArrayRecord


def test_fixed_fields_round_trip_one_file(tmp_path):
    cols = make_records(100)
    path = tmp_path / "data.array_record"
    assert write_array_record(path, encode_all(cols)) == 100
    src = ArrayRecordSource(str(path), spec=SPEC)
    assert isinstance(src, RecordSource) and len(src) == 100
    idx = shuffled_with_repeats(100)
    got = src.read(idx)
    assert_columns_equal(got, {k: v[idx] for k, v in cols.items()})
    for arr in got.values():  # ready for zero-copy hand-off to torch/jax
        assert arr.flags.c_contiguous and arr.flags.writeable and arr.flags.aligned
    write_array_record(tmp_path / "tok.array_record", [r.tobytes() for r in cols["tokens"]])
    single = ArrayRecordSource(tmp_path / "tok.array_record", spec=FixedFields({"tokens": ("int32", (8,))}))
    np.testing.assert_array_equal(single.read(idx)["tokens"], cols["tokens"][idx])
    assert single.read(idx)["tokens"].flags.writeable
    assert src.read(np.array([], dtype=np.int64))["tokens"].shape == (0, 8)


def test_sharded_pattern_shard_name_glob_and_list_agree(tmp_path):
    cols = make_records(103)
    prefix = str(tmp_path / "set.array_record")
    shards = write_sharded_array_record(prefix, encode_all(cols), num_shards=4)
    assert [os.path.basename(s) for s in shards] == [
        f"set.array_record-0000{i}-of-00004" for i in range(4)]
    idx = shuffled_with_repeats(103)
    want = {k: v[idx] for k, v in cols.items()}
    for paths in (f"{prefix}@4", shards[2], f"{prefix}-*-of-00004", shards):
        src = ArrayRecordSource(paths, spec=SPEC)
        assert src.paths == shards and len(src) == 103
        assert_columns_equal(src.read(idx), want)
    subset = ArrayRecordSource([shards[1]], spec=SPEC)  # in a list, a shard name is literal
    assert subset.paths == [shards[1]]


def grain_digits() -> list[str]:
    spec = importlib.util.find_spec("grain")  # locate without importing (grain imports jax)
    assert spec is not None and spec.submodule_search_locations
    root = spec.submodule_search_locations[0]
    files = sorted(glob.glob(os.path.join(root, "_src/python/testdata/digits.array_record-*")))
    assert len(files) == 2, files
    return files


def test_grain_shipped_files_match_direct_reader():
    from array_record.python.array_record_module import ArrayRecordReader

    files = grain_digits()
    direct = [r for f in files for r in ArrayRecordReader(f).read_all()]
    src = ArrayRecordSource(files[0].replace("-00000-of-00002", "@2"), spec=RawBytes("digit"))
    assert len(src) == len(direct) == 10
    idx = shuffled_with_repeats(10, size=25)
    got = src.read(idx)["digit"]
    assert got.dtype == object and got.shape == (25,)
    assert got.tolist() == [direct[i] for i in idx]
    assert got.tolist()[:3] == [b"9", b"0", b"9"]


def test_pickled_source_reads_in_the_copy(tmp_path):
    cols = make_records(40)
    write_sharded_array_record(tmp_path / "p.array_record", encode_all(cols), num_shards=2)
    src = ArrayRecordSource(str(tmp_path / "p.array_record@2"), spec=SPEC)
    src.read([0, 39])  # opens readers, which must not travel
    copy = pickle.loads(pickle.dumps(src))
    idx = shuffled_with_repeats(40)
    assert_columns_equal(copy.read(idx), {k: v[idx] for k, v in cols.items()})


FORK_SCRIPT = """
import os, sys
import numpy as np
from zephon.sources import ArrayRecordSource, FixedFields
src = ArrayRecordSource(sys.argv[1], spec=FixedFields({"label": ("int64", ())}))
idx = np.array([int(i) for i in sys.argv[2].split(",")])
src.read(idx)  # the parent's readers are open when it forks
pid = os.fork()
if pid == 0:
    from zephon.errors import SourceError
    try:
        src.read(idx)
    except SourceError as e:
        print(e, flush=True)
        os._exit(0)
    os._exit(1)
_, status = os.waitpid(pid, 0)
print(src.read(idx)["label"].tolist(), flush=True)  # the parent reads on
sys.exit(os.waitstatus_to_exitcode(status))
"""


def test_forked_child_refuses_to_read_and_says_how_to_start_workers(tmp_path):
    # A child forked after the parent opened readers could block forever in the C++ reader
    # (issue 23, item 12); it refuses with a SourceError pointing to forkserver/spawn.
    # A fresh interpreter: forking the pytest process is unsafe once other tests imported jax.
    path = tmp_path / "f.array_record"
    write_array_record(path, [np.int64(7 * i).tobytes() for i in range(40)])
    idx = shuffled_with_repeats(40)
    child = run_group([sys.executable, "-c", FORK_SCRIPT, str(path), ",".join(map(str, idx))],
                           capture_output=True, text=True, timeout=60)
    assert child.returncode == 0, child.stderr
    refusal, parent = child.stdout.strip().splitlines()
    assert "forked (os.fork) from one that had opened ArrayRecord readers" in refusal
    assert "forkserver" in refusal and parent == str((7 * idx).tolist())


def test_missing_files_and_shards_name_what_was_expected(tmp_path):
    with pytest.raises(SourceError, match=r"nope\.array_record' does not exist.*expected an existing file"):
        ArrayRecordSource(str(tmp_path / "nope.array_record"))
    with pytest.raises(SourceError, match=r"no file matches the pattern .*\*\.array_record"):
        ArrayRecordSource(str(tmp_path / "*.array_record"))
    shards = write_sharded_array_record(tmp_path / "s.array_record", [b"a"] * 8, num_shards=4)
    os.remove(shards[2])
    with pytest.raises(SourceError, match=r"1 of 4 shards are missing \(.*s\.array_record-00002-of-00004\)"):
        ArrayRecordSource(str(tmp_path / "s.array_record@4"))
    with pytest.raises(SourceError, match=r"1 of 4 shards are missing"):
        ArrayRecordSource(shards[0])


def test_truncated_and_random_files_raise_source_error_naming_the_file(tmp_path):
    path = tmp_path / "good.array_record"
    write_array_record(path, [bytes([i]) * 300 for i in range(200)])
    data = path.read_bytes()
    cases = {
        "tail_chopped": data[:-100],
        "half": data[: len(data) // 2],  # this one reads back empty records if not caught
        "random_small": RNG.bytes(5000),
        "random_large": RNG.bytes(200_000),
        "empty": b"",
    }
    for name, content in cases.items():
        bad = tmp_path / f"{name}.array_record"
        bad.write_bytes(content)
        with pytest.raises(SourceError, match=rf"{name}\.array_record' cannot be opened: .*rewrite it"):
            ArrayRecordSource(str(bad))
    # Shards are counted at construction, so one bad shard fails the whole set up front.
    shutil.copy(path, tmp_path / "mix.array_record-00000-of-00002")
    (tmp_path / "mix.array_record-00001-of-00002").write_bytes(data[:-100])
    with pytest.raises(SourceError, match=r"mix\.array_record-00001-of-00002' cannot be opened"):
        ArrayRecordSource(str(tmp_path / "mix.array_record@2"))


def test_file_damaged_after_open_names_the_record(tmp_path):
    path = tmp_path / "late.array_record"
    records = [RNG.bytes(300) for _ in range(200)]  # incompressible, so findable in the file
    write_array_record(path, records)
    src = ArrayRecordSource(str(path))
    data = bytearray(path.read_bytes())
    start = data.index(records[150][:64])
    data[start:start + 40] = bytes(40)
    before = os.stat(path)
    path.write_bytes(bytes(data))
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))  # bit rot keeps the mtime
    assert src.read([3])["bytes"][0] == records[3]
    with pytest.raises(SourceError, match=r"late\.array_record: reading record 150 \(record 150 of "
                                          r"this shard\) failed: .*Corrupted.*rewrite it") as info:
        src.read([3, 150, 7])
    assert isinstance(info.value.__cause__, RuntimeError)


def test_fixed_fields_wrong_length_is_decode_error_naming_file_and_record(tmp_path):
    records = encode_all(make_records(10))
    records[6] = records[6][:-4]
    write_sharded_array_record(tmp_path / "w.array_record", records, num_shards=2)
    src = ArrayRecordSource(str(tmp_path / "w.array_record@2"), spec=SPEC)
    src.read([0, 4, 9])
    with pytest.raises(DecodeError, match=r"w\.array_record-00001-of-00002: record 6 \(record 1 of "
                                          r"shard 1\): record is 40 bytes but FixedFields.* expects 44"):
        src.read([9, 6, 0])


def test_fixed_fields_encode_validates():
    with pytest.raises(ValueError, match=r"field 'tokens' has shape \(7,\), expected \(8,\)"):
        SPEC.encode({"tokens": np.zeros(7), "label": 1, "weight": np.zeros(2)})
    with pytest.raises(ValueError, match=r"expected exactly \['label', 'tokens', 'weight'\]"):
        SPEC.encode({"tokens": np.zeros(8)})
    assert SPEC.record_nbytes == 8 * 4 + 8 + 2 * 2


def test_decoder_stacks_rows_and_chains_errors(tmp_path):
    rows = [{"id": i, "text": "x" * i, "vec": [i, i + 1], "ragged": list(range(i)),
             "meta": {"score": i / 2}} for i in range(20)]
    path = tmp_path / "json.array_record"
    write_array_record(path, [json.dumps(r).encode() for r in rows] + [b"{broken"])
    src = ArrayRecordSource(path, spec=Decoder(json.loads))
    idx = shuffled_with_repeats(20)
    got = src.read(idx)
    np.testing.assert_array_equal(got["id"], idx)
    np.testing.assert_array_equal(got["vec"], np.stack([idx, idx + 1], axis=1))
    np.testing.assert_array_equal(got["meta/score"], idx / 2)
    assert got["text"].dtype == object and got["text"].tolist() == ["x" * i for i in idx]
    assert got["ragged"].dtype == object and got["ragged"][1] == []
    with pytest.raises(DecodeError, match=r"json\.array_record: record 20 \(record 20 of shard 0\): "
                                          r"Decoder\('loads'\) raised JSONDecodeError") as info:
        src.read([1, 20])
    assert isinstance(info.value.__cause__, json.JSONDecodeError)


# ---------------------------------------------------------------- Parquet


def parquet_columns(n: int, offset: int = 0) -> dict[str, np.ndarray]:
    ids = np.arange(offset, offset + n)
    ragged = np.empty(n, dtype=object)
    ragged[:] = [np.arange(i % 5, dtype=np.int64) for i in ids]
    return {
        "id": ids.astype(np.int64),
        "tokens": RNG.integers(0, 1000, size=(n, 6)).astype(np.int32),
        "patch": RNG.standard_normal((n, 2, 3)).astype(np.float32),
        "text": np.array([f"row {i}" for i in ids], dtype=object),
        "ragged": ragged,
    }


def test_parquet_round_trip_across_files_and_row_groups(tmp_path):
    a, b = parquet_columns(23), parquet_columns(17, offset=23)
    write_parquet(tmp_path / "a.parquet", a, row_group_size=5)
    write_parquet(tmp_path / "b.parquet", b, row_group_size=6)
    src = ParquetSource(str(tmp_path / "*.parquet"), cache_row_groups=2)
    assert isinstance(src, RecordSource) and len(src) == 40
    assert src._group_ends.tolist() == [5, 10, 15, 20, 23, 29, 35, 40]
    full = {k: np.concatenate([a[k], b[k]]) for k in a}
    idx = shuffled_with_repeats(40)
    assert_columns_equal(src.read(idx), {k: v[idx] for k, v in full.items()})
    assert len(src._cache) == 2
    sub = ParquetSource([tmp_path / "b.parquet"], columns=["text", "id"])
    assert_columns_equal(sub.read([16, 0, 16]), {"text": b["text"][[16, 0, 16]], "id": b["id"][[16, 0, 16]]})
    empty = src.read(np.array([], dtype=np.int64))
    assert empty["patch"].shape == (0, 2, 3) and empty["text"].dtype == object
    assert_columns_equal(pickle.loads(pickle.dumps(src)).read(idx), {k: v[idx] for k, v in full.items()})


def test_parquet_variable_lists_declared_fixed_length(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    tokens = np.arange(30, dtype=np.int64).reshape(10, 3)
    pq.write_table(pa.table({"tok": pa.array(list(tokens)), "s": pa.array(
        [{"x": i, "y": f"{i}"} for i in range(10)])}), tmp_path / "v.parquet", row_group_size=4)
    assert pa.types.is_list(pq.read_schema(tmp_path / "v.parquet").field("tok").type)
    src = ParquetSource(tmp_path / "v.parquet", list_lengths={"tok": 3})
    got = src.read([9, 0, 5])
    np.testing.assert_array_equal(got["tok"], tokens[[9, 0, 5]])
    np.testing.assert_array_equal(got["s/x"], [9, 0, 5])
    assert got["s/y"].tolist() == ["9", "0", "5"]
    objects = ParquetSource(tmp_path / "v.parquet").read([9, 0])["tok"]
    assert objects.dtype == object and objects[0].tolist() == [27, 28, 29]
    with pytest.raises(DecodeError, match=r"v\.parquet: record 4 \(row 0 of row group 1\): column "
                                          r"'tok' has 3 items but list_lengths says 4"):
        ParquetSource(tmp_path / "v.parquet", list_lengths={"tok": 4}).read([5])


def test_parquet_errors_name_file_and_record(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"x": pa.array([1, 2, None, 4, 5, 6])}), tmp_path / "n.parquet",
                   row_group_size=2)
    src = ParquetSource(tmp_path / "n.parquet")
    np.testing.assert_array_equal(src.read([5, 0])["x"], [6, 1])
    with pytest.raises(DecodeError, match=r"n\.parquet: record 2 \(row 0 of row group 1\): column 'x' is null"):
        src.read([3])
    write_parquet(tmp_path / "i32.parquet", {"x": np.arange(3, dtype=np.int32)}, row_group_size=2)
    with pytest.raises(SourceError, match=r"i32\.parquet: column 'x' is int32 but in .*n\.parquet it is int64"):
        ParquetSource([tmp_path / "n.parquet", tmp_path / "i32.parquet"])
    with pytest.raises(SourceError, match=r"n\.parquet: has no column 'y'"):
        ParquetSource(tmp_path / "n.parquet", columns=["y"])
    data = (tmp_path / "n.parquet").read_bytes()
    (tmp_path / "cut.parquet").write_bytes(data[: len(data) // 2])
    with pytest.raises(SourceError, match=r"cut\.parquet' cannot be opened: .*rewrite it"):
        ParquetSource(tmp_path / "cut.parquet")
    with pytest.raises(SourceError, match=r"missing\.parquet' does not exist"):
        ParquetSource(tmp_path / "missing.parquet")


# ---------------------------------------------------------------- JSONL


def test_jsonl_round_trip_across_files(tmp_path):
    rows = [{"id": i, "text": f"t{i}", "vec": [i, -i], "toks": list(range(i % 4)), "m": {"f": i * 0.5}}
            for i in range(30)]
    lines = [json.dumps(r) for r in rows]
    # Blank lines are not records; CRLF endings and a missing final newline are fine.
    (tmp_path / "a.jsonl").write_text("\n".join(lines[:12]) + "\n\n")
    (tmp_path / "b.jsonl").write_bytes(("\r\n".join(lines[12:])).encode())
    src = JsonlSource([tmp_path / "a.jsonl", tmp_path / "b.jsonl"])
    assert isinstance(src, RecordSource) and len(src) == 30
    idx = shuffled_with_repeats(30)
    got = src.read(idx)
    np.testing.assert_array_equal(got["id"], idx)
    np.testing.assert_array_equal(got["vec"], np.stack([idx, -idx], axis=1))
    np.testing.assert_array_equal(got["m/f"], idx * 0.5)
    assert got["text"].tolist() == [f"t{i}" for i in idx]
    assert got["toks"].dtype == object and got["toks"].tolist() == [list(range(i % 4)) for i in idx]
    assert_columns_equal(pickle.loads(pickle.dumps(src)).read(idx), got)
    same_length = np.array([1, 5, 9])  # toks all of length 1, but ragged in the inferred lines
    assert src.read(same_length)["toks"].dtype == object  # so objects in every read (issue 23)
    assert JsonlSource(src.paths, ragged={"toks"}).read(same_length)["toks"].dtype == object
    assert src.read([0, 4])["toks"].dtype == object  # all empty: never a float64 (2, 0) array


def test_jsonl_errors_name_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"a": 1}\n\n{"a": 2}\n{"a": 3,,}\n[1, 2]\n{"b": 4}\n')
    src = JsonlSource(path)
    assert len(src) == 5
    np.testing.assert_array_equal(src.read([1, 0])["a"], [2, 1])
    with pytest.raises(DecodeError, match=r"bad\.jsonl: line 4 \(record 2\): not valid JSON") as info:
        src.read([0, 2])
    assert isinstance(info.value.__cause__, json.JSONDecodeError)
    with pytest.raises(DecodeError, match=r"bad\.jsonl: line 5 \(record 3\): is a JSON list"):
        src.read([3])
    with pytest.raises(DecodeError, match=r"bad\.jsonl: line 6 \(record 4\): field 'a' is missing and "
                                          r"field 'b' is not in the schema \(the line has fields "
                                          r"\['b'\]; the schema inferred from .*bad\.jsonl: line 1 "
                                          r"\(record 0\) .* has \['a'\]\)"):
        src.read([0, 4])
    path.write_text('{"a": 1}\n')  # shrunk after indexing
    with pytest.raises(SourceError, match=r"bad\.jsonl: line 2 \(record 1\): file is shorter"):
        src.read([1])


# ---------------------------------------------------------------- TFDS


class ZephonTinyDataset(tfds.core.GeneratorBasedBuilder):
    """12 records, no download; prepared without TensorFlow. Module level, so it pickles."""

    VERSION = tfds.core.Version("1.0.0")

    def _info(self):
        return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict({
            "x": tfds.features.Tensor(shape=(3,), dtype=np.int32),
            "label": tfds.features.ClassLabel(num_classes=4),
            "meta": {"id": tfds.features.Scalar(dtype=np.int64), "name": tfds.features.Text()},
            "toks": tfds.features.Tensor(shape=(None,), dtype=np.int32),
        }))

    def _split_generators(self, dl_manager):
        return {"train": self._generate_examples(12)}

    def _generate_examples(self, n):
        for i in range(n):
            yield i, {"x": np.arange(3, dtype=np.int32) + i, "label": i % 4,
                      "meta": {"id": i, "name": f"r{i}"},
                      "toks": np.full(1 + (i >= 6), i, dtype=np.int32)}


@pytest.fixture(scope="module")
def tfds_builder(tmp_path_factory):
    data_dir = tmp_path_factory.mktemp("tfds")
    builder = ZephonTinyDataset(data_dir=str(data_dir), file_format="array_record")
    builder.download_and_prepare(file_format="array_record")
    return builder, data_dir


def test_tfds_source_reads_prepared_dataset_without_tensorflow(tfds_builder):
    import sys

    builder, data_dir = tfds_builder
    assert "tensorflow" not in sys.modules
    direct = tfds.data_source("zephon_tiny_dataset", split="train", data_dir=str(data_dir))
    by_name = TFDSSource("zephon_tiny_dataset", "train", data_dir=data_dir)
    by_builder = TFDSSource(builder, "train")
    assert len(by_name) == len(by_builder) == len(direct) == 12
    idx = shuffled_with_repeats(12)
    want_rows = [direct[i] for i in idx.tolist()]
    for src in (by_name, by_builder, pickle.loads(pickle.dumps(by_name))):
        got = src.read(idx)
        assert set(got) == {"x", "label", "meta/id", "meta/name", "toks"}
        np.testing.assert_array_equal(got["meta/id"], [r["meta"]["id"] for r in want_rows])
        assert got["x"].dtype == np.int32 and got["x"].shape == (len(idx), 3)
        # TFDS shuffles records on write; each record must still be internally consistent.
        np.testing.assert_array_equal(got["x"], got["meta/id"][:, None] + np.arange(3))
        np.testing.assert_array_equal(got["label"], got["meta/id"] % 4)
        assert got["meta/name"].tolist() == [f"r{i}".encode() for i in got["meta/id"]]
        assert got["toks"].dtype == object
        assert [t.tolist() for t in got["toks"]] == [[i] * (1 + (i >= 6)) for i in got["meta/id"]]
    ids = by_name.read(np.arange(12))["meta/id"]
    assert sorted(ids.tolist()) == list(range(12))
    same_length = np.flatnonzero(ids < 6)  # a shape-(None,) feature stays ragged even then
    assert by_name.read(same_length)["toks"].dtype == object


def test_tfds_unprepared_dataset_is_source_error(tfds_builder, tmp_path):
    with pytest.raises(SourceError, match=r"TFDS dataset 'zephon_tiny_dataset' split 'train' "
                                          r"\(data_dir=.*\) cannot be opened: .*download_and_prepare"):
        TFDSSource("zephon_tiny_dataset", "train", data_dir=tmp_path)
    with pytest.raises(SourceError, match=r"split 'test'.*cannot be opened: Unknown split 'test'"):
        TFDSSource("zephon_tiny_dataset", "test", data_dir=tfds_builder[1])
