"""Media sources: WebDataset tar shards (local and s3://), Hugging Face save_to_disk Arrow files,
Parquet image-bytes columns and ArrayRecord media records, all feeding DecodeImage."""

from __future__ import annotations

import io
import os
import tarfile

import numpy as np
import pytest

import zephon as z
from zephon.errors import DecodeError, SourceError
from zephon.media.augment import RandomResizedCrop
from zephon.media.ops import DecodeImage
from zephon.sources.webdataset import WebDatasetSource, split_key, tar_members, write_webdataset

PIL = pytest.importorskip("PIL.Image")


def jpeg(i: int, h: int = 48, w: int = 64) -> bytes:
    y, x = np.mgrid[0:h, 0:w]
    a = np.stack([(x * 4 + i) % 256, (y * 5) % 256, (x + y + 3 * i) % 256], -1).astype(np.uint8)
    b = io.BytesIO()
    PIL.fromarray(a).save(b, "JPEG", quality=90)
    return b.getvalue()


def samples(n: int, start: int = 0) -> list[dict]:
    return [{"__key__": f"{i:06d}", "jpg": jpeg(i), "txt": f"caption {i}", "cls": i % 10,
             "json": {"id": i, "tags": ["a"] * (i % 3)}} for i in range(start, start + n)]


def test_split_key_uses_the_first_dot_of_the_file_name() -> None:
    assert split_key("dir.v1/000123.seg.png") == ("dir.v1/000123", "seg.png")
    assert split_key("000123.jpg") == ("000123", "jpg")
    assert split_key("noext") == ("noext", "")


def test_webdataset_source_reads_samples_by_key_in_any_order(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("ZEPHON_CACHE_DIR", str(tmp_path / "cache"))
    write_webdataset(str(tmp_path / "s-0.tar"), samples(7))
    write_webdataset(str(tmp_path / "s-1.tar"), samples(5, 7))
    src = WebDatasetSource(str(tmp_path / "s-*.tar"))
    assert len(src) == 12 and set(src.fields) == {"jpg", "txt", "cls", "json"}
    got = src.read(np.array([11, 0, 7, 7]))
    assert list(got["__key__"]) == ["000011", "000000", "000007", "000007"]
    assert list(got["txt"]) == ["caption 11", "caption 0", "caption 7", "caption 7"]
    assert got["cls"].dtype == np.int64 and list(got["cls"]) == [1, 0, 7, 7]
    assert got["json"][0] == {"id": 11, "tags": ["a", "a"]}
    assert got["jpg"][1] == jpeg(0)
    # the index is cached by (path, version): a second source reads it from disk, not the tar
    assert len(os.listdir(tmp_path / "cache" / "index")) == 2
    import zephon.sources.webdataset as wds
    monkeypatch.setattr(wds, "tar_members", lambda blob: pytest.fail("index rebuilt"))
    assert len(WebDatasetSource(str(tmp_path / "s-*.tar"))) == 12


def test_tar_index_follows_long_names_and_pax_headers(tmp_path) -> None:
    long_key = "d" * 120 + "/000001"
    for fmt in (tarfile.GNU_FORMAT, tarfile.PAX_FORMAT):
        path = tmp_path / f"long-{fmt}.tar"
        with tarfile.open(path, "w", format=fmt) as tf:
            for ext, data in (("jpg", b"J" * 1000), ("txt", "é".encode())):
                info = tarfile.TarInfo(f"{long_key}.{ext}")
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
        ix = tar_members(z.storage.open_blob(str(path)))
        assert list(ix["names"]) == [f"{long_key}.jpg", f"{long_key}.txt"]
        src = WebDatasetSource(str(path))
        assert src.read(np.array([0]))["txt"][0] == "é"


def test_a_missing_member_names_shard_key_and_member(tmp_path) -> None:
    s = samples(4)
    del s[2]["txt"]
    path = str(tmp_path / "broken.tar")
    write_webdataset(path, s)
    with pytest.raises(SourceError, match=r"broken.tar.*sample '000002' has no member 000002.txt"):
        WebDatasetSource(path)
    src = WebDatasetSource(path, missing="skip")
    assert list(src.read(np.arange(3))["__key__"]) == ["000000", "000001", "000003"]
    assert len(WebDatasetSource(path, fields=["jpg", "cls"])) == 4


def test_not_a_tar_and_a_truncated_tar_are_named(tmp_path) -> None:
    (tmp_path / "x.tar").write_bytes(b"\x1f\x8b" + b"\0" * 2000)
    with pytest.raises(SourceError, match="no valid tar header at byte 0"):
        WebDatasetSource(str(tmp_path / "x.tar"))
    write_webdataset(str(tmp_path / "t.tar"), samples(3))
    data = (tmp_path / "t.tar").read_bytes()
    (tmp_path / "t.tar").write_bytes(data[:1500])
    with pytest.raises(SourceError, match="truncated"):
        WebDatasetSource(str(tmp_path / "t.tar"))


def _fingerprint(loader: z.Loader, steps: int) -> list[bytes]:
    return [next(loader).data["image"].tobytes() for _ in range(steps)]


def test_webdataset_through_decode_is_the_same_at_every_d(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("ZEPHON_CACHE_DIR", str(tmp_path / "cache"))
    write_webdataset(str(tmp_path / "a.tar"), samples(32))
    src = WebDatasetSource(str(tmp_path / "a.tar"))
    ops = [DecodeImage("jpg", RandomResizedCrop(16), flip=0.5, out="image")]
    plan = z.Source(len(src)).shuffle(2).repeat().lanes(4).batch(8)
    one = _fingerprint(z.Loader(plan, src, ops, seed=1, read_ahead=8), 3)
    parts = [_fingerprint(z.Loader(plan, src, ops, seed=1, rank=r, world=4, read_ahead=8), 3) for r in range(4)]
    assert one == [b"".join(p[s] for p in parts) for s in range(3)]


def test_webdataset_shards_in_a_bucket_read_like_local_ones(tmp_path) -> None:
    from zephon import storage
    from zephon.testing.object_servers import create_bucket, start_seaweedfs

    saved = dict(os.environ)
    s3 = start_seaweedfs()
    try:
        os.environ.update({**s3.env, "ZEPHON_CACHE_DIR": str(tmp_path / "cache")})
        storage.reset()
        create_bucket(s3, "media")
        write_webdataset(str(tmp_path / "a.tar"), samples(9))
        storage.put_atomic("s3://media/wds/a.tar", (tmp_path / "a.tar").read_bytes())
        remote = WebDatasetSource(["s3://media/wds/a.tar"])
        local = WebDatasetSource(str(tmp_path / "a.tar"))
        idx = np.array([8, 1, 4])
        r, loc = remote.read(idx), local.read(idx)
        assert all(list(r[k]) == list(loc[k]) for k in ("__key__", "jpg", "txt", "cls"))
    finally:
        os.environ.clear()
        os.environ.update(saved)
        storage.reset()
        s3.stop()


def test_hugging_face_save_to_disk_image_columns(tmp_path) -> None:
    datasets = pytest.importorskip("datasets")
    from zephon.sources.hf_arrow import HFArrowSource

    ds = datasets.Dataset.from_dict(
        {"image": [{"bytes": jpeg(i), "path": None} for i in range(10)],
         "label": [i % 3 for i in range(10)], "caption": [f"c{i}" for i in range(10)]},
        features=datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(num_classes=3),
                                    "caption": datasets.Value("string")}))
    ds.save_to_disk(str(tmp_path / "hf"), num_shards=2)
    src = HFArrowSource(tmp_path / "hf")
    assert len(src) == 10
    got = src.read(np.array([9, 0, 5]))
    assert sorted(got) == ["caption", "image/bytes", "image/path", "label"]
    assert got["image/bytes"][0] == jpeg(9) and list(got["label"]) == [0, 0, 2]
    out = DecodeImage("image/bytes", RandomResizedCrop(8), out="pixels").apply(
        got, z.Refs(np.zeros(3, np.int64), np.array([9, 0, 5]), np.zeros(3, np.int64)), 0)[0]
    assert out["pixels"].shape == (3, 8, 8, 3)
    import pickle
    assert pickle.loads(pickle.dumps(src)).read(np.array([1]))["caption"][0] == "c1"
    with pytest.raises(SourceError, match="save_to_disk"):
        HFArrowSource(tmp_path)


def test_parquet_image_bytes_columns_struct_and_plain(tmp_path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from zephon.sources import ParquetSource

    imgs = [jpeg(i) for i in range(6)]
    table = pa.table({"image": pa.array([{"bytes": b, "path": f"{i}.jpg"} for i, b in enumerate(imgs)]),
                      "raw": pa.array(imgs, pa.binary()), "label": pa.array(range(6))})
    pq.write_table(table, tmp_path / "img.parquet", row_group_size=4)
    src = ParquetSource(str(tmp_path / "img.parquet"))
    got = src.read(np.array([5, 0]))
    assert got["image/bytes"][0] == imgs[5] and got["raw"][1] == imgs[0]
    loader = z.Loader(z.Source(6).lanes(2).batch(2), src, [DecodeImage("raw", RandomResizedCrop(8))])
    assert next(loader).data["raw"].shape == (2, 8, 8, 3)


def test_array_record_media_records(tmp_path) -> None:
    from zephon.sources import ArrayRecordSource, write_array_record
    from zephon.sources.media_record import MediaRecord

    recs = [MediaRecord.encode({"jpg": jpeg(i), "label": i, "caption": f"c{i}", "box": [i, i + 1]})
            for i in range(5)]
    write_array_record(tmp_path / "m.ar", recs)
    src = ArrayRecordSource(str(tmp_path / "m.ar"), MediaRecord())
    got = src.read(np.array([4, 2]))
    assert got["jpg"][0] == jpeg(4) and list(got["label"]) == [4, 2] and got["box"].shape == (2, 2)
    loader = z.Loader(z.Source(5).repeat().lanes(1).batch(2), src, [DecodeImage("jpg", RandomResizedCrop(8))])
    assert next(loader).data["jpg"].shape == (2, 8, 8, 3)
    write_array_record(tmp_path / "bad.ar", [b"not a media record"])
    with pytest.raises(DecodeError, match="not a MediaRecord"):
        ArrayRecordSource(str(tmp_path / "bad.ar"), MediaRecord()).read(np.array([0]))


def test_braces_expand_like_energon() -> None:
    from zephon.sources.energon import braces

    assert braces("parts/data-{000..002}.tar") == ["parts/data-000.tar", "parts/data-001.tar", "parts/data-002.tar"]
    assert braces("{a,b}-{1..2}") == ["a-1", "a-2", "b-1", "b-2"]
    assert braces("plain.tar") == ["plain.tar"]


def test_energon_prepared_dataset_splits_excludes_and_counts(tmp_path, monkeypatch) -> None:
    import json

    from zephon.sources.energon import energon_source

    monkeypatch.setenv("ZEPHON_CACHE_DIR", str(tmp_path / "cache"))
    root = tmp_path / "ds"
    (root / "parts").mkdir(parents=True)
    (root / ".nv-meta").mkdir()
    for k in range(3):
        write_webdataset(str(root / "parts" / f"data-{k}.tar"), samples(6, 6 * k))
    counts = {f"parts/data-{k}.tar": 6 for k in range(3)}
    (root / ".nv-meta" / ".info.json").write_text(json.dumps({"shard_counts": counts}))
    (root / ".nv-meta" / "split.yaml").write_text(
        "split_parts:\n  train:\n    - parts/data-{0..1}.tar\n  val:\n    - parts/data-2.tar\n"
        "exclude:\n  - parts/data-1.tar/000008\n")
    train = energon_source(root, "train", ["jpg", "txt"])
    keys = list(train.read(np.arange(len(train)))["__key__"])
    assert len(train) == 11 and "000008" not in keys and keys[0] == "000000"
    assert len(energon_source(root, "val")) == 6
    with pytest.raises(SourceError, match="no split 'test'"):
        energon_source(root, "test")
    (root / ".nv-meta" / ".info.json").write_text(json.dumps({"shard_counts": {**counts, "parts/data-0.tar": 5}}))
    with pytest.raises(SourceError, match=r"data-0.tar: 6 samples, but .nv-meta says 5"):
        energon_source(root, "train")
    with pytest.raises(SourceError, match="energon prepare"):
        energon_source(tmp_path / "parts-only", "train")
