"""Reads that follow a block shuffle, on a real S3 server (SeaweedFS on 127.0.0.1, started and
stopped here): blocks fetched whole and reused, each rank of 64 fetching only its lanes' blocks
(≤ 1/64 request per row), Parquet fetching ≤ 1.2× the bytes it needs, and the same batches as
from local files."""

from __future__ import annotations

import os

import numpy as np
import pytest

import zephon as z
from zephon import storage
from zephon.sources import ArrayRecordSource, FixedFields, ParquetSource, write_array_record, write_parquet

BUCKET = "zephon-blocks"
N = 1 << 16
SPEC = FixedFields({"x": ("int32", (16,))})


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    from zephon.testing.object_servers import create_bucket, start_seaweedfs

    saved = dict(os.environ)
    server = start_seaweedfs()
    try:
        for key in ("AWS_PROFILE", "AWS_SESSION_TOKEN"):
            os.environ.pop(key, None)
        os.environ.update(server.env)
        storage.reset()
        create_bucket(server, BUCKET)
        local = tmp_path_factory.mktemp("blocks")
        rng = np.random.default_rng(0)
        write_array_record(local / "ar.array_record",
                           (np.arange(i, i + 16, dtype=np.int32).tobytes() for i in range(N)))
        write_parquet(local / "t.parquet", {"id": np.arange(20_000), "text": np.array(
            [f"doc {i} " + "w" * int(rng.integers(1, 80)) for i in range(20_000)], dtype=object)},
            row_group_size=500)
        for f in sorted(local.iterdir()):
            storage.put_atomic(f"s3://{BUCKET}/{f.name}", f.read_bytes())
        yield {"local": str(local), "base": f"s3://{BUCKET}"}
    finally:
        os.environ.clear()
        os.environ.update(saved)
        storage.reset()
        server.stop()


def _run(plan, src, rank: int, world: int, steps: int, read_ahead: int | None = None) -> tuple[list[np.ndarray], int]:
    """(this rank's rows of `steps` batches, requests it sent after opening the source)."""
    before = storage.STATS["requests"]
    with z.Loader(plan, src, rank=rank, world=world, read_ahead=read_ahead) as loader:
        rows = [next(loader).data["x"][:, 0].copy() for _ in range(steps)]
    return rows, storage.STATS["requests"] - before


def test_ranks_of_64_fetch_only_their_blocks_at_most_one_request_per_64_rows(s3):
    plan = z.Source(N).block_shuffle(3, block=256).repeat().lanes(64).batch(128)
    steps = 2 * N // 128  # two epochs: every rank's 1024 rows of each
    local = ArrayRecordSource(f"{s3['local']}/ar.array_record", SPEC)
    for rank in (0, 1, 37):  # a few ranks of D = 64, each as its own host would read
        src = ArrayRecordSource(f"{s3['base']}/ar.array_record", SPEC)
        # reads of 512 rows: what is read is what is counted (the loader's default read-ahead
        # would read 16 epochs of this rank's small rows at once)
        rows, requests = _run(plan, src, rank, 64, steps, read_ahead=512)
        want, _ = _run(plan, local, rank, 64, steps)
        assert all(np.array_equal(a, b) for a, b in zip(rows, want))
        n_rows = sum(len(r) for r in rows)
        assert n_rows == 2 * N // 64
        assert requests <= n_rows / 64, (rank, requests, n_rows)
        stats = src.block_stats()
        # a rank's lane reads a stripe of each epoch's window: 4 of the 256 blocks (+ the edges
        # it shares with the next stripe), and holds at most two windows' worth
        assert stats is not None and stats.fetched <= 2 * 6, stats
        assert stats.peak_bytes <= stats.capacity * 256 * 64
    # the global shuffle, for scale: a rank's rows are spread over the whole object
    src = ArrayRecordSource(f"{s3['base']}/ar.array_record", SPEC)
    _, global_requests = _run(z.Source(N).shuffle(3).repeat().lanes(64).batch(128), src, 0, 64, 64)
    assert global_requests > 20 * 5


@pytest.mark.parametrize("batch", [64, 1024])
def test_parquet_row_group_blocks_fetch_at_most_1_2x_the_bytes_needed(s3, batch):
    src = ParquetSource(f"{s3['base']}/t.parquet", columns=["text"], cache_row_groups=0)
    plan = z.Source(len(src)).block_shuffle(5).repeat().lanes(8).batch(batch)  # block: row groups
    bytes0 = storage.STATS["bytes"]
    with z.Loader(plan, src) as loader:
        assert loader.plan.lanes.child.child.block == 500
        got = [next(loader).data["text"] for _ in range(len(src) // batch)]
    fetched = storage.STATS["bytes"] - bytes0
    meta = src._meta[0]
    col = src._schema.get_field_index("text")
    needed = sum(meta.row_group(g).column(col).total_compressed_size for g in range(meta.num_row_groups))
    assert fetched <= 1.2 * needed, (fetched, needed)
    local = ParquetSource(f"{s3['local']}/t.parquet", columns=["text"])
    with z.Loader(plan, local) as loader:
        assert all(np.array_equal(a, next(loader).data["text"]) for a in got)
    # every column: a read's column chunks touch, so they are fetched in a few merged requests
    # ahead of pyarrow (not one request per column chunk: 80 here; 1 at B = 1024, 13 at B = 64)
    src = ParquetSource(f"{s3['base']}/t.parquet", cache_row_groups=0)
    req0 = storage.STATS["requests"]
    with z.Loader(plan, src) as loader:
        every = [next(loader).data for _ in range(len(src) // batch)]
    assert storage.STATS["requests"] - req0 <= 20
    assert all(np.array_equal(a["text"], b) for a, b in zip(every, got))


def test_threads_and_worker_processes_read_the_same_block_shuffled_batches(s3):
    from zephon.runners import processes, threads

    plan = z.Source(N).block_shuffle(9, block=512).repeat().lanes(8).batch(256)
    want = [b.data["x"][:, 0] for _, b in zip(range(12), z.Loader(plan, ArrayRecordSource(
        f"{s3['local']}/ar.array_record", SPEC)))]
    for runner in (threads(2), processes(2)):
        src = ArrayRecordSource(f"{s3['base']}/ar.array_record", SPEC)
        with z.Loader(plan, src, runner=runner, read_ahead=1024) as loader:
            got = [next(loader).data["x"][:, 0] for _ in range(12)]
        assert all(np.array_equal(a, b) for a, b in zip(got, want)), runner


def test_whole_block_reads_decode_every_round_and_touching_blocks_share_a_get(s3):
    """A read touching every block: blocks go out in rounds of `RUN_GROUP`, each round's
    touching blocks in one GET, decoded by the thread that fetched it — the records are the
    ones asked for, in the order asked, and each block is fetched once."""
    from zephon.sources.array_record_remote import RUN_GROUP

    src = ArrayRecordSource(f"{s3['base']}/ar.array_record", SPEC)
    src.follow_blocks(512, 1000)
    idx = np.random.default_rng(1).permutation(N)[:8192]
    blocks = len(np.unique(idx // 512))
    assert blocks == N // 512  # every block touched: many rounds in flight at once
    before = storage.STATS["requests"]
    got = src.read(idx)["x"]
    assert storage.STATS["requests"] - before == -(-blocks // RUN_GROUP)
    assert np.array_equal(got[:, 0], idx) and np.array_equal(got[:, 15], idx + 15)
    stats = src.block_stats()
    assert stats is not None and stats.fetched == blocks
    again = src.read(idx[::-1])["x"]  # from the cache: no request
    assert storage.STATS["requests"] - before == -(-blocks // RUN_GROUP)
    assert np.array_equal(again[:, 0], idx[::-1])
