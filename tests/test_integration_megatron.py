"""zephon.integrations.megatron against Megatron's own code on CPU.

Which Megatron code runs here: megatron-core 0.16.1 (the version that installs on Python 3.11)
for `parallel_state` on gloo and `MockGPTDataset`, and Megatron's data samplers as Megatron-Bridge
0.3.1 ships them (`megatron/bridge/data/samplers.py`: `build_pretraining_data_loader`,
`MegatronPretrainingSampler`), loaded by file path by tests/_megatron_samplers.py because the
megatron-core wheel has no `megatron.training` and Megatron-Bridge's package `__init__` imports
transformers. `pretrain()` does not run: it is CUDA-only.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")

import _megatron_samplers
import torch
from _helpers import run_group, text_corpus

if _megatron_samplers.samplers_path() is None:
    pytest.skip("Megatron's samplers (megatron-bridge, installed --no-deps by the Makefile) are missing",
                allow_module_level=True)

from zephon.errors import PlanError
from zephon.testing.object_servers import free_port

WORKER = Path(__file__).with_name("_megatron_worker.py")
GLOBAL, MICRO, SEQ, EOD = 8, 2, 32, 2  # as in the worker


TOTAL = 10**6  # samples the map-style dataset and Megatron's sampler see


def megatron_sampler(consumed: int, micro: int, rank: int, dp: int):
    """Megatron's own `MegatronPretrainingSampler` (the `single` dataloader type): the sample
    indices of each of rank `rank`'s micro-batches from `consumed` on."""
    samplers = _megatron_samplers.load()
    return iter(samplers.MegatronPretrainingSampler(total_samples=TOTAL, consumed_samples=consumed,
                                                    micro_batch_size=micro, data_parallel_rank=rank,
                                                    data_parallel_size=dp))


def test_megatrons_sampler_is_the_chunked_layout():
    """What the layout tests hold the iterators to: from the count, chunks of micro × dp, rank r
    takes `[r·micro, (r+1)·micro)` of each (so a wrong rank order or a contiguous split fails)."""
    assert [next(megatron_sampler(16, 2, r, 2)) for r in range(2)] == [[16, 17], [18, 19]]
    it = megatron_sampler(24, 2, 3, 4)
    assert [next(it), next(it)] == [[30, 31], [38, 39]]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return text_corpus(tmp_path_factory.mktemp("mg_data"))


@pytest.fixture(scope="module")
def data(corpus):
    from tokenizers import Tokenizer

    from zephon.integrations.megatron import ZephonGPTData

    return ZephonGPTData([str(corpus / "prose.jsonl"), str(corpus / "code.jsonl")], weights=[0.7, 0.3],
                         tokenizer=Tokenizer.from_file(str(corpus / "tok" / "tokenizer.json")), seq_len=SEQ,
                         global_batch_size=GLOBAL, micro_batch_size=MICRO, eod=EOD, create_attention_mask=True)


@pytest.fixture(scope="module")
def samples(data):
    """The map-style dataset: global sample index → sample (the reference layout)."""
    return data.dataset(TOTAL)


def _expected(samples, indices, key="tokens"):
    return torch.stack([samples[i][key] for i in indices])


@pytest.mark.parametrize("dp", [1, 2, 4])
@pytest.mark.parametrize("consumed", [0, 16, 24])
def test_each_rank_gets_the_single_samplers_samples_from_the_count(data, samples, dp, consumed):
    """At dp = 1, 2, 4, from sample 0 and resumed from a count (a resume across dp: the count
    is all that is carried), every rank's micro-batches are the samples Megatron's single
    sampler assigns it."""
    seen = []
    for rank in range(dp):
        it = data.iterator(consumed, rank, dp)
        indices = megatron_sampler(consumed, MICRO, rank, dp)
        for _ in range(3 * GLOBAL // (MICRO * dp)):  # three global batches
            idx = next(indices)
            batch = next(it)
            for key in ("tokens", "labels", "loss_mask", "position_ids", "attention_mask"):
                assert torch.equal(batch[key], _expected(samples, idx, key)), (dp, consumed, rank, idx, key)
            seen += idx
        assert it.consumed_samples == consumed + 3 * GLOBAL
    # the ranks together cover the three global batches after the count, each sample once, and the
    # samples differ (so a rank holding another rank's rows could not pass)
    assert sorted(seen) == list(range(consumed, consumed + 3 * GLOBAL))
    assert len({tuple(samples[i]["tokens"].tolist()) for i in seen}) == len(seen)


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_map_style_dataset_under_megatrons_single_dataloader(data, dp):
    """The map-style variant with Megatron's own `build_pretraining_data_loader(dataset,
    consumed, "single", ...)` (its sampler and a torch DataLoader with default collate): each
    rank's micro-batches equal the external iterator's, resumed from a count, and the padded
    per-sample `cu_seqlens` collate (rows with different document counts) and cut back at
    `cu_seqlens_argmin` to the iterator's boundaries."""
    samplers = _megatron_samplers.load()
    consumed, steps, multi_doc_rows = 24, 4, 0
    for rank in range(dp):
        loader = samplers.build_pretraining_data_loader(
            data.dataset(TOTAL), consumed, "single", MICRO, num_workers=0, data_sharding=False,
            pin_memory=False, data_parallel_rank=rank, data_parallel_size=dp)
        it = data.iterator(consumed, rank, dp)
        for theirs, _ in zip(loader, range(steps * GLOBAL // (MICRO * dp))):
            ours = next(it)
            for key in ("tokens", "labels", "loss_mask", "position_ids", "attention_mask"):
                assert torch.equal(theirs[key], ours[key]), (dp, rank, key)
            assert theirs["cu_seqlens"].shape == (MICRO, SEQ + 2)
            rows = [theirs["cu_seqlens"][j, : theirs["cu_seqlens_argmin"][j]] + j * SEQ for j in range(MICRO)]
            assert torch.equal(torch.unique(torch.cat(rows)), ours["cu_seqlens"])
            assert (theirs["cu_seqlens"][:, -1] == -1).all()
            multi_doc_rows += int((theirs["cu_seqlens_argmin"] > 2).sum())
    assert multi_doc_rows > 0  # some rows held several documents: their cu_seqlens lengths differ


def test_global_batches_do_not_depend_on_dp_and_differ_between_steps(data):
    def global_batches(dp, consumed, steps):
        its = [data.iterator(consumed, r, dp) for r in range(dp)]
        out = []
        for _ in range(steps):
            chunks = [torch.cat([next(it)["tokens"] for it in its]) for _ in range(GLOBAL // (MICRO * dp))]
            out.append(torch.cat(chunks))
        return out

    ref = global_batches(1, 0, 4)
    assert not torch.equal(ref[0], ref[1])
    for dp in (2, 4):
        assert all(torch.equal(a, b) for a, b in zip(global_batches(dp, 0, 4), ref))
        assert all(torch.equal(a, b) for a, b in zip(global_batches(dp, 2 * GLOBAL, 2), ref[2:]))


def test_the_batch_contract_matches_megatrons_mock_gpt_dataset(data):
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset

    class Tok:  # what MockGPTDataset reads from a Megatron tokenizer
        vocab_size, eod, pad, unique_identifiers = 2000, EOD, 0, {"class": "Tok"}

    cfg = GPTDatasetConfig(random_seed=1, sequence_length=SEQ, reset_position_ids=True, reset_attention_mask=True,
                           eod_mask_loss=True, create_attention_mask=True, tokenizer=Tok(), split="1,0,0")
    mock = BlendedMegatronDatasetBuilder(MockGPTDataset, [8, None, None], lambda: True, cfg).build()[0]
    theirs = torch.utils.data.default_collate([mock[i] for i in range(MICRO)])
    ours = next(data.iterator(0, 0, 1))
    assert set(theirs) <= set(ours) and set(ours) - set(theirs) == {"cu_seqlens", "max_seqlen"}
    for key, value in theirs.items():
        assert (ours[key].dtype, ours[key].shape) == (value.dtype, value.shape), key
    # semantics: labels follow tokens within a document, the loss skips a document's last token,
    # the mask is causal within documents, positions restart at each one
    it, boundaries = data.iterator(0, 0, 1), 0
    for _ in range(16):
        b = next(it)
        tokens, labels, mask, pos = b["tokens"], b["labels"], b["loss_mask"], b["position_ids"]
        keep = mask[:, :-1] > 0
        assert torch.equal(labels[:, :-1][keep], tokens[:, 1:][keep])
        assert torch.equal(mask == 0, (tokens == EOD))  # concat packing: every row is full
        starts = torch.nonzero(pos[:, 1:] == 0).tolist()
        boundaries += len(starts)
        for row, col in starts:  # token col+1 starts a document: it sees nothing before it
            assert b["attention_mask"][row, 0, col + 1, : col + 1].all()
            assert not b["attention_mask"][row, 0, col + 1, col + 1]
        flat = torch.nonzero(pos.reshape(-1) == 0).reshape(-1).to(torch.int32)
        rows = torch.arange(0, MICRO * SEQ + 1, SEQ, dtype=torch.int32)
        assert torch.equal(b["cu_seqlens"], torch.unique(torch.cat([flat, rows])))
    assert boundaries > 0


def _ranks(corpus: Path, out: Path, consumed: int, steps: int, nproc: int = 2, state_dir: Path | None = None
           ) -> list[dict]:
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", str(nproc),
           "--master_addr", "127.0.0.1", "--master_port", str(free_port()), str(WORKER), str(out), str(corpus),
           str(consumed), str(steps), *([str(state_dir)] if state_dir else [])]
    res = run_group(cmd, timeout=300, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
    return [torch.load(out / f"rank{r}.pt") for r in range(nproc)]


def test_provider_under_megatron_parallel_state_on_gloo_resumes_at_another_dp(corpus, samples, tmp_path, data):
    """Two processes, `initialize_model_parallel` on gloo (dp = 2), the provider's iterators
    passed through Megatron's `build_pretraining_data_loader(..., consumed_samples, "external")`
    and `RerunDataIterator`: from sample 0 and from a count saved at dp = 1 (16 samples) they
    hold the samples `MegatronPretrainingSampler` assigns each rank, and the dp = 2 global
    batches equal dp = 1's. With a `state_dir` the fresh run saves its states and a resume from
    the count restores one and replays nothing, with the same batches as the full replay."""
    fresh = _ranks(corpus, tmp_path / "fresh", 0, 3, state_dir=tmp_path / "states")
    resumed = _ranks(corpus, tmp_path / "resumed", 2 * GLOBAL, 1)
    restored = _ranks(corpus, tmp_path / "restored", 2 * GLOBAL, 1, state_dir=tmp_path / "states")
    assert [(r["restored_from"], r["replayed"]) for r in resumed] == [(0, 2), (0, 2)]
    assert [(r["restored_from"], r["replayed"]) for r in restored] == [(2 * GLOBAL, 0), (2 * GLOBAL, 0)]
    for a, b in zip(resumed, restored):
        assert all(torch.equal(x["tokens"], y["tokens"]) for x, y in zip(a["batches"], b["batches"], strict=True))
    one = data.iterator(0, 0, 1)
    dp1 = [torch.cat([next(one)["tokens"] for _ in range(GLOBAL // MICRO)]) for _ in range(3)]
    for run, consumed, steps in ((fresh, 0, 3), (resumed, 2 * GLOBAL, 1)):
        assert [(r["dp"], r["rank"]) for r in run] == [(2, 0), (2, 1)]
        assert all(r["external_is_provider_output"] for r in run)
        for r in run:
            assert r["consumed_after"] == consumed + steps * GLOBAL
            for b, idx in zip(r["batches"], megatron_sampler(consumed, MICRO, r["rank"], 2)):
                assert torch.equal(b["tokens"], _expected(samples, idx)), (consumed, r["rank"], idx)
        for s in range(steps):  # Megatron's global batch: chunk by chunk, rank 0's slice then rank 1's
            chunks = [run[k]["batches"][s * 2 + c]["tokens"] for c in range(2) for k in range(2)]
            assert torch.equal(torch.cat(chunks), dp1[consumed // GLOBAL + s])


def test_bad_counts_and_layouts_are_refused_with_the_rule(data):
    with pytest.raises(PlanError, match="not a whole number of micro × dp"):
        data.iterator(3, 0, 2)
    with pytest.raises(PlanError, match="multiple of micro × dp"):
        data.iterator(0, 0, 3)
    from zephon.integrations.megatron import ZephonGPTData

    with pytest.raises(PlanError, match="not a multiple of micro_batch_size"):
        ZephonGPTData(["x.jsonl"], tokenizer=None, seq_len=8, global_batch_size=6, micro_batch_size=4)


def test_provider_without_megatron_training_says_where_the_count_comes_from(data):
    import importlib.util

    from zephon.integrations.megatron import datasets_provider

    if importlib.util.find_spec("megatron.training") is not None:
        pytest.skip("Megatron-LM's megatron.training is installed here: the count comes from it")

    provider = datasets_provider(data, data_parallel=lambda: (0, 1))
    with pytest.raises(PlanError, match="consumed_samples="):
        provider([8, 0, 0])
    train, _, _ = datasets_provider(data, data_parallel=lambda: (0, 1), consumed_samples=lambda: 8)([8, 0, 0])
    assert train.consumed_samples == 8


def test_map_style_dataset_serves_indices_out_of_order(data, samples):
    """A step back (re-reading, a second sampler) restarts from a kept position, same samples."""
    fresh = data.dataset(10**6)
    later, earlier = fresh[5 * GLOBAL + 3]["tokens"], fresh[GLOBAL + 1]["tokens"]
    assert torch.equal(later, samples[5 * GLOBAL + 3]["tokens"])
    assert torch.equal(earlier, samples[GLOBAL + 1]["tokens"])
    with pytest.raises(IndexError):
        fresh[10**6]


def _tokenizer(corpus):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(corpus / "tok" / "tokenizer.json"))


def _tokens(it, n):
    return [next(it)["tokens"] for _ in range(n)]


def test_saved_states_shorten_the_resume_and_change_no_batch(data, tmp_path, monkeypatch):
    """With `state_dir`, dp = 2 saves each rank's state every 2 global batches; a resume from
    the count at dp = 1 and 4 (on a step boundary and inside a step) restores the nearest saved
    state and replays only the rest, and its batches equal a resume by full replay."""
    from zephon.checkpoint import load_state

    state_dir = tmp_path / "states"
    per_rank = GLOBAL // (MICRO * 2)
    writers = [data.iterator(0, r, 2, state_dir=state_dir, save_every=2) for r in range(2)]
    for _ in range(5):  # five global batches: snapshots at samples 16 and 32 (before steps 2 and 4)
        for it in writers:
            _tokens(it, per_rank)
    assert sorted(p.name for p in state_dir.iterdir()) == ["samples-000000000000016", "samples-000000000000032"]
    assert load_state(state_dir / "samples-000000000000032" / "rank-00001-of-00002.json")["step"] == 4
    import zephon.integrations.snapshots as snapshots

    read = []
    monkeypatch.setattr(snapshots, "load_state", lambda path: read.append(path) or load_state(path))
    assert data.iterator(5 * GLOBAL, 3, 4, state_dir=state_dir).restored_from == 4 * GLOBAL
    assert [p.rsplit("/", 2)[-2:] for p in map(str, read)] == [["samples-000000000000032", "rank-00001-of-00002.json"]]
    monkeypatch.undo()  # rank 3 of 4 holds lane 3, which rank 1 of 2 saved: the one file it reads
    for dp in (1, 4):
        for consumed in (5 * GLOBAL, 4 * GLOBAL + MICRO * dp):
            for rank in range(dp):
                fast = data.iterator(consumed, rank, dp, state_dir=state_dir, save_every=2)
                slow = data.iterator(consumed, rank, dp)
                assert (fast.restored_from, fast.replayed) == (4 * GLOBAL, consumed // GLOBAL - 4), (dp, consumed)
                assert (slow.restored_from, slow.replayed) == (0, consumed // GLOBAL)
                n = 2 * GLOBAL // (MICRO * dp)
                assert all(torch.equal(a, b) for a, b in zip(_tokens(fast, n), _tokens(slow, n))), (dp, rank)


def test_a_partial_or_damaged_snapshot_falls_back_to_an_older_one(data, corpus, tmp_path):
    """Snapshots are a cache: rank 1's missing file at sample 32 sends the dp = 4 ranks that need
    its lanes back to sample 16 (the others still use 32), a damaged file is skipped, and the
    batches stay those of a full replay; a directory of other data is refused."""
    from zephon.errors import StateError
    from zephon.integrations.megatron import ZephonGPTData

    state_dir = tmp_path / "states"
    writers = [data.iterator(0, r, 2, state_dir=state_dir, save_every=2) for r in range(2)]
    for _ in range(5):
        for it in writers:
            _tokens(it, GLOBAL // (MICRO * 2))
    (state_dir / "samples-000000000000032" / "rank-00001-of-00002.json").unlink()
    damaged = state_dir / "samples-000000000000016" / "rank-00000-of-00002.json"
    restored = {}
    for rank in range(4):
        fast = data.iterator(5 * GLOBAL, rank, 4, state_dir=state_dir, save_every=2)
        restored[rank] = fast.restored_from
        assert torch.equal(next(fast)["tokens"], next(data.iterator(5 * GLOBAL, rank, 4))["tokens"])
    # interleaved lanes: at dp = 2 rank 0 held lanes 0 and 2, rank 1 lanes 1 and 3; at dp = 4 rank r holds lane r
    assert restored == {0: 32, 1: 16, 2: 32, 3: 16}
    text = damaged.read_text()
    assert '"step": 2' in text
    damaged.write_text(text.replace('"step": 2', '"step": 3'))  # fails its checksum: skipped
    assert data.iterator(5 * GLOBAL, 1, 4, state_dir=state_dir, save_every=2).restored_from == 16  # intact file
    assert data.iterator(5 * GLOBAL, 0, 4, state_dir=state_dir, save_every=2).restored_from == 32
    (state_dir / "samples-000000000000032" / "rank-00000-of-00002.json").unlink()
    assert data.iterator(5 * GLOBAL, 0, 4, state_dir=state_dir, save_every=2).restored_from == 0  # full replay

    other = ZephonGPTData([str(corpus / "prose.jsonl"), str(corpus / "code.jsonl")], weights=[0.7, 0.3],
                          tokenizer=_tokenizer(corpus),
                          seq_len=SEQ, global_batch_size=GLOBAL, micro_batch_size=MICRO, eod=EOD, seed=7)
    with pytest.raises(StateError, match="separate snapshot directory"):
        other.iterator(5 * GLOBAL, 1, 4, state_dir=state_dir)
    with pytest.raises(PlanError, match="positive number of global batches"):
        data.iterator(0, 0, 1, state_dir=state_dir, save_every=0)


def test_saved_states_in_object_storage(data, monkeypatch):
    """The same on `s3://` (a local SeaweedFS server): one PUT per state, listed to resume."""
    from zephon import storage
    from zephon.testing.object_servers import create_bucket, start_seaweedfs

    s3 = start_seaweedfs()
    try:
        for key, value in s3.env.items():
            monkeypatch.setenv(key, value)
        for key in ("AWS_PROFILE", "AWS_SESSION_TOKEN"):
            monkeypatch.delenv(key, raising=False)
        storage.reset()
        create_bucket(s3, "zephon-test")
        state_dir = "s3://zephon-test/run/zephon"
        writers = [data.iterator(0, r, 2, state_dir=state_dir, save_every=2) for r in range(2)]
        for _ in range(5):
            for it in writers:
                _tokens(it, GLOBAL // (MICRO * 2))
        names = [url.rsplit("/", 2)[-2] for url, _ in storage.list_objects(state_dir + "/")]
        assert names == ["samples-000000000000016"] * 2 + ["samples-000000000000032"] * 2
        fast, slow = data.iterator(5 * GLOBAL, 3, 4, state_dir=state_dir), data.iterator(5 * GLOBAL, 3, 4)
        assert (fast.restored_from, fast.replayed) == (4 * GLOBAL, 1)
        assert torch.equal(next(fast)["tokens"], next(slow)["tokens"])
    finally:
        s3.stop()
        monkeypatch.undo()
        storage.reset()
