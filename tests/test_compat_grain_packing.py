"""Packing (`zephon.compat.grain.packing`, `.experimental`): a Grain user's LM pipeline (tokenize,
mix by tokens, pack, batch) through the Grain-compatible API, on Zephon's lane engine: the packed
rows equal `zephon.Loader`'s for the same pipeline, are identical over data-parallel degrees,
resume from the one Zephon JSON state at another degree, reach JAX/torch unchanged, and
concat-then-split at one lane equals Grain's own packer.
"""

import json

import grain
import numpy as np
import pytest
from _corpus import corpora_fixture, objects

import zephon.compat.grain as zg
from zephon import DecodeError, Loader, Mix, PlanError, Repeat, Source, StateError
from zephon.compat.grain import GrainShuffle
from zephon.demo.textdata import EOS_ID
from zephon.ops.pack import Pack
from zephon.ops.tokenize import Tokenize
from zephon.runners import threads
from zephon.sources.memory import ArraySource

MODES = {"concat": zg.experimental.ConcatThenSplitIterDataset,
         "first_fit": zg.experimental.FirstFitPackIterDataset,
         "best_fit": zg.experimental.BestFitPackIterDataset}
MAXTEXT = {"inputs", "targets", "inputs_segmentation", "targets_segmentation", "inputs_position",
           "targets_position"}


corpora = corpora_fixture(prose=60, code=40, train=(40, 20), vocab_size=500)


SEQ = 512  # documents here are 114-1434 (median ~330) tokens: fit modes put several in a row


def packed(base, mode, seq_len=SEQ, **kw):
    extra = {} if mode == "concat" else {"num_packing_bins": 4}
    return MODES[mode](base, length_struct={"tokens": seq_len}, **extra, **kw)


def lm_dataset(corpora, mode="concat", order="grain", lanes=4, batch=8):
    """The Grain user's pipeline: Grain records in, a Zephon Tokenize in map(), Grain's packer."""
    prose, _, tok = corpora
    recs = [{"text": t, "id": i} for i, t in enumerate(prose)]  # a list is a Grain data source
    base = (zg.Dataset.source(recs, order=order).shuffle(seed=3).repeat()
            .map(Tokenize(tok, eos=EOS_ID)).to_iter_dataset())
    return packed(base, mode).batch(batch).lanes(lanes)


def direct_loader(corpora, mode, node, lanes=4, batch=8, **kw):
    """The same pipeline written for zephon.Loader."""
    prose, _, tok = corpora
    return Loader(node.lanes(lanes).batch(batch), ArraySource({"text": objects(prose)}),
                  [Tokenize(tok, eos=EOS_ID),
                   Pack(SEQ, mode, max_open_bins=4 if mode != "concat" else 8, names="maxtext")], **kw)


def take(it, n):
    return [next(it) for _ in range(n)]


def assert_same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert set(x) == set(y)
        for k in x:
            assert x[k].dtype == y[k].dtype and np.array_equal(x[k], y[k]), k


@pytest.mark.parametrize("mode", list(MODES))
def test_packed_rows_equal_the_direct_zephon_loader(corpora, mode):
    """Grain records -> Tokenize -> Grain's packer spelling compiles to Pack(seq_len, mode,
    names='maxtext') on the lane engine: the batches are the direct Loader's, field for field,
    in Zephon's order and in Grain's (GrainShuffle) order."""
    n = len(corpora[0])
    for order, node in (("zephon", Source(n).shuffle(3).repeat()),
                        ("grain", Repeat(GrainShuffle(Source(n), 3)))):
        ds = lm_dataset(corpora, mode, order)
        assert ds.plan.fingerprint() == node.lanes(4).batch(8, remainder="drop").fingerprint()  # Grain's end
        got = take(iter(ds), 6)
        assert set(got[0]) == MAXTEXT
        assert all(v.shape == (8, SEQ) and v.dtype == np.int32 for v in got[0].values())
        ref = [b.data for b in take(direct_loader(corpora, mode, node), 6)]
        assert_same(got, ref)
    seg = np.stack([b["inputs_segmentation"] for b in got])
    if mode == "concat":  # no padding, documents run across rows
        assert (seg > 0).all()
    else:  # several documents a row, a little padding
        assert (seg.max(axis=-1) > 1).mean() > 0.2 and 0 < (seg == 0).mean() < 0.2


@pytest.mark.parametrize("mode", ["concat", "best_fit"])
def test_shards_fingerprints_and_state_are_elastic(corpora, mode):
    """shard(rank, world) gives each rank its rows of the same global batches at D = 1, 2, 4;
    get_state() is the Zephon JSON state; states of 2 ranks merge and resume at D = 4 and 1."""
    ds = lm_dataset(corpora, mode)
    ref_fp = ds.fingerprints(8)
    assert ds.fingerprints(8, world=2) == ref_fp == ds.fingerprints(8, world=4)
    assert ds.runner(threads(2)).fingerprints(8, world=2) == ref_fp
    full = take(iter(ds), 8)
    its = [iter(ds.shard(r, 2)) for r in range(2)]
    for k in range(3):
        parts = [next(i) for i in its]
        for f in full[k]:
            assert np.array_equal(np.concatenate([p[f] for p in parts]), full[k][f])
    states = [json.loads(json.dumps(i.get_state())) for i in its]
    assert states[0]["zephon_state"] and states[0]["step"] == 3  # the one state document
    assert set(states[0]["lanes"]) == {"0", "1"}  # a rank's lanes, with their carries
    assert all("carry" in v for v in states[0]["lanes"].values())
    merged = zg.merge_states(states)
    for world in (4, 1):
        resumed = [iter(ds.shard(r, world)) for r in range(world)]
        for i in resumed:
            i.set_state(merged)
        for k in range(3, 8):
            parts = [next(i) for i in resumed]
            for f in full[k]:
                assert np.array_equal(np.concatenate([p[f] for p in parts]), full[k][f]), (world, k, f)
    # a single iterator round-trips its own state
    it = iter(ds)
    take(it, 2)
    st = it.get_state()
    again = iter(ds)
    again.set_state(st)
    assert_same(take(again, 3), full[2:5])


def test_concat_then_split_at_one_lane_is_grains_own_packer(corpora):
    """The MaxText-style Grain pipeline (a Grain map tokenizes into copies `inputs`/`targets`,
    then ConcatThenSplitIterDataset) with names='grain' gives Grain's fields, and at lanes(1)
    its batches equal real Grain's running `to_grain()`, bit for bit."""
    prose, _, tok = corpora

    class TokenizeInputs(grain.transforms.Map):
        def map(self, r):
            ids = np.array(tok.encode(r["text"], add_special_tokens=False).ids + [EOS_ID], np.int32)
            return {"inputs": ids, "targets": ids}

    base = (zg.Dataset.source([{"text": t} for t in prose]).seed(5).shuffle().repeat(2)
            .map(TokenizeInputs()).to_iter_dataset())
    ds = zg.experimental.ConcatThenSplitIterDataset(
        base, length_struct={"inputs": 64, "targets": 64}, names="grain").batch(8).lanes(1)
    b = next(iter(ds))
    assert set(b) == {"inputs", "targets", "inputs_segment_ids", "inputs_positions",
                      "targets_segment_ids", "targets_positions"}
    assert ds.fingerprints(20) == zg.grain_fingerprints(ds.to_grain(), 20)
    # the default names are MaxText's: next-token targets that never cross a document
    mt = next(iter(zg.experimental.ConcatThenSplitIterDataset(
        base, length_struct={"inputs": 64, "targets": 64}).batch(8).lanes(1)))
    assert set(mt) == MAXTEXT
    same_doc = mt["inputs_segmentation"][:, 1:] == mt["inputs_segmentation"][:, :-1]
    assert np.array_equal(mt["targets"][:, :-1][same_doc], mt["inputs"][:, 1:][same_doc])
    assert (mt["targets_segmentation"][:, :-1][~same_doc] == 0).all()


def test_features_that_are_not_copies_are_refused(corpora):
    prose, _, tok = corpora

    def two(r):
        ids = np.array(tok.encode(r["text"]).ids, np.int32)
        return {"inputs": ids, "targets": ids[::-1].copy()}

    ds = zg.experimental.FirstFitPackIterDataset(
        zg.Dataset.source([{"text": t} for t in prose]).map(two).to_iter_dataset(),
        length_struct={"inputs": 64, "targets": 64}, num_packing_bins=2).batch(2)
    with pytest.raises(DecodeError, match="'targets' differs from 'inputs'"):
        next(iter(ds))


def test_mix_by_tokens_equals_the_direct_loader_and_is_elastic(corpora):
    """zg.Dataset.mix(..., by='tokens'): each corpus tokenizes with its own field, the mix runs
    inside every lane by realised tokens, then packing; same rows as zephon.Loader's
    Mix(by='tokens') with per_source, identical over D."""
    prose, code, tok = corpora
    a = (zg.Dataset.source([{"text": t} for t in prose], order="zephon").shuffle(seed=1).repeat()
         .map(Tokenize(tok, eos=EOS_ID)))
    b = (zg.Dataset.source([{"body": t} for t in code], order="zephon").shuffle(seed=2).repeat()
         .map(Tokenize(tok, field="body", eos=EOS_ID)))
    mixed = zg.Dataset.mix([a, b], [0.7, 0.3], by="tokens")
    ds = packed(mixed, "concat").batch(8).lanes(4)
    with pytest.raises(TypeError, match="no length"):
        len(ds)
    got = take(iter(ds), 6)
    plan = Mix([Source(len(prose), id=0).shuffle(1).repeat(), Source(len(code), id=1).shuffle(2).repeat()],
               [0.7, 0.3], by="tokens").lanes(4).batch(8)
    direct = Loader(plan, [ArraySource({"text": objects(prose)}), ArraySource({"body": objects(code)})],
                    [Pack(SEQ, names="maxtext")],
                    per_source={0: [Tokenize(tok, eos=EOS_ID)], 1: [Tokenize(tok, field="body", eos=EOS_ID)]})
    assert_same(got, [b.data for b in take(direct, 6)])
    assert ds.fingerprints(6, world=2) == ds.fingerprints(6) == ds.fingerprints(6, world=4)
    with pytest.raises(PlanError, match="last ordering step"):
        next(iter(packed(mixed.map_with_index(lambda i, x: x), "concat").batch(8).lanes(4)))



def test_mix_by_tokens_takes_a_weight_schedule(corpora):
    """zg.Dataset.mix(..., by='tokens', schedule=...) compiles to zephon.Mix(schedule=...): the
    same rows as the direct loader across the change; refused for a mix by samples."""
    prose, code, tok = corpora
    schedule = ((3, (0.2, 0.8)),)
    a = (zg.Dataset.source([{"text": t} for t in prose], order="zephon").shuffle(seed=1).repeat()
         .map(Tokenize(tok, eos=EOS_ID)))
    b = (zg.Dataset.source([{"body": t} for t in code], order="zephon").shuffle(seed=2).repeat()
         .map(Tokenize(tok, field="body", eos=EOS_ID)))
    ds = packed(zg.Dataset.mix([a, b], [0.7, 0.3], by="tokens", schedule=schedule), "concat").batch(8).lanes(4)
    plan = Mix([Source(len(prose), id=0).shuffle(1).repeat(), Source(len(code), id=1).shuffle(2).repeat()],
               [0.7, 0.3], by="tokens", schedule=schedule).lanes(4).batch(8)
    direct = Loader(plan, [ArraySource({"text": objects(prose)}), ArraySource({"body": objects(code)})],
                    [Pack(SEQ, names="maxtext")],
                    per_source={0: [Tokenize(tok, eos=EOS_ID)], 1: [Tokenize(tok, field="body", eos=EOS_ID)]})
    assert_same(take(iter(ds), 6), [b.data for b in take(direct, 6)])
    unscheduled = packed(zg.Dataset.mix([a, b], [0.7, 0.3], by="tokens"), "concat").batch(8).lanes(4)
    scheduled, plain = ds.fingerprints(6), unscheduled.fingerprints(6)
    assert scheduled[:3] == plain[:3] and scheduled[3] != plain[3]  # the weights change at step 3
    with pytest.raises(PlanError, match="needs by='tokens'"):
        zg.Dataset.mix([a, b], [0.7, 0.3], schedule=schedule)

def test_packed_batches_reach_jax_and_torch(corpora):
    import jax
    import torch
    from jax.sharding import Mesh

    from zephon.backends.torch import ZephonDataLoader

    ds = lm_dataset(corpora, "best_fit")
    ref = take(iter(ds), 3)
    mesh = Mesh(np.array(jax.devices()[:4]), ("data",))
    with ds.to_jax(mesh) as jl:
        for k in range(3):
            got = next(jl)
            assert isinstance(got["inputs"], jax.Array)
            for f, v in ref[k].items():
                assert got[f].dtype == v.dtype and np.array_equal(np.asarray(got[f]), v), f
    tl = ds.to_torch(rank=0, world=1)
    for k in range(3):
        got = next(tl)
        for f, v in ref[k].items():
            assert isinstance(got[f], torch.Tensor) and np.array_equal(got[f].numpy(), v), f
    dl = ZephonDataLoader(ds.shard(1, 2).to_torch_dataset())
    got = next(iter(dl))
    assert np.array_equal(got["inputs"].numpy(), ref[0]["inputs"][4:])


def test_zephon_pack_in_map_and_grain_maps_after_packing(corpora):
    """A zephon Pack given to map() keeps its own field names; a Grain map after the packing
    step sees packed rows as dict records (and the batch still stacks into columns)."""
    prose, _, tok = corpora

    def add_len(row):
        return {**row, "n_docs": np.int32(row["segment_ids"].max())}

    ds = (zg.Dataset.source([{"text": t} for t in prose]).shuffle(seed=3).repeat()
          .map(Tokenize(tok, eos=EOS_ID)).map(Pack(64, "first_fit", max_open_bins=2))
          .map(add_len).batch(4).lanes(2))
    b = next(iter(ds))
    assert {"tokens", "segment_ids", "cu_seqlens", "loss_mask", "n_docs"} <= set(b)
    assert np.array_equal(b["n_docs"], b["segment_ids"].max(axis=1))
    assert ds.fingerprints(3, world=2) == ds.fingerprints(3)


def test_unsupported_packer_options_are_refused_with_a_reason(corpora):
    prose, _, tok = corpora
    it = zg.Dataset.source([{"text": t} for t in prose]).map(Tokenize(tok)).to_iter_dataset()
    cts = zg.experimental.ConcatThenSplitIterDataset
    with pytest.raises(PlanError, match="meta_features"):
        cts(it, length_struct={"tokens": 64}, meta_features=("id",))
    with pytest.raises(PlanError, match="bos_handling"):
        cts(it, length_struct={"tokens": 64}, bos_handling=grain.experimental.BOSHandling.REPLACE_FIRST_TOKEN_WITH_BOS,
            bos_features=("tokens",), bos_token_id=1)
    with pytest.raises(PlanError, match="different lengths"):
        cts(it, length_struct={"tokens": 64, "other": 32})
    with pytest.raises(PlanError, match="pack_alignment_struct"):
        zg.experimental.BestFitPackIterDataset(it, length_struct={"tokens": 64}, num_packing_bins=2,
                                               pack_alignment_struct={"tokens": 8})
    p = cts(it, length_struct={"tokens": 64})
    with pytest.raises(PlanError, match="packing step"):
        p.shuffle(seed=1)
    with pytest.raises(PlanError, match="packs once"):
        next(iter(cts(p, length_struct={"inputs": 64}).batch(2)))
    # a changed seq_len is refused at restore, naming it
    a = iter(p.batch(2))
    next(a)
    with pytest.raises(StateError, match="seq_len 64 != 32"):
        iter(cts(it, length_struct={"tokens": 32}).batch(2)).set_state(a.get_state())


def test_unbatched_packed_rows_resume_inside_a_step(corpora):
    """Without batch() the iterator yields packed rows one by one (one per lane a step); a state
    taken inside a step resumes at the same row. No len(), no ds[i]: like Grain's IterDataset."""
    prose, _, tok = corpora
    base = zg.Dataset.source([{"text": t} for t in prose]).shuffle(seed=3).repeat().map(Tokenize(tok))
    ds = zg.experimental.BestFitPackIterDataset(base, length_struct={"tokens": 256}, num_packing_bins=3).lanes(2)
    it = iter(ds)
    take(it, 7)
    state = json.loads(json.dumps(it.get_state()))
    assert state["elements_taken"] == 1 and state["step"] == 3
    rest = take(it, 5)
    again = iter(ds)
    again.set_state(state)
    assert_same(take(again, 5), rest)
    assert set(rest[0]) == MAXTEXT and rest[0]["inputs"].shape == (256,)
    with pytest.raises(TypeError, match="no length"):
        len(ds)
    with pytest.raises(PlanError, match="no random access"):
        ds[3]


def test_a_finite_stream_ends_cleanly(corpora):
    """Without repeat() the packed stream ends with StopIteration (windows past a lane's end
    hold no records; Zephon operators are not run on them). Only full global batches are
    emitted, and the rows still open at the end are not (see the module doc of compat.grain)."""
    prose, _, tok = corpora
    base = zg.Dataset.source([{"text": t} for t in prose[:20]]).map(Tokenize(tok, eos=EOS_ID))
    for mode in MODES:
        batches = list(packed(base, mode, seq_len=256).batch(2).lanes(2))
        assert 10 < len(batches) < 60
        seen = np.concatenate([b["inputs"][b["inputs_segmentation"] > 0] for b in batches])
        assert len(seen) <= sum(len(e.ids) + 1 for e in tok.encode_batch(prose[:20], add_special_tokens=False))
