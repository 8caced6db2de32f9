"""LM pretraining pipelines: tokenize, mix by tokens, pack — with every loader guarantee.

Every token of every document appears exactly once, in order, for each packing mode, also across
stop/resume and a change of data-parallel degree; packed fields are consistent; fingerprints do
not depend on D, the runner or the emitter; every lane follows the mixture; identities are
checked at restore.
"""

import json

import numpy as np
import pytest
from _corpus import corpora_fixture, objects

from zephon import Loader, Mix, Source, StateError, merge_states
from zephon.demo.textdata import EOS_ID, generate_corpus, train_bpe
from zephon.fingerprints import run_fingerprints
from zephon.ops.pack import Pack
from zephon.ops.tokenize import Tokenize
from zephon.runners import processes, threads
from zephon.sources.memory import ArraySource

corpora = corpora_fixture(prose=120, code=80, train=(60, 40), vocab_size=600)


def pipeline(tok, seq_len=64, mode="concat", **kw):
    return [Tokenize(tok, eos=EOS_ID), Pack(seq_len, mode, **kw)]


def plan_one(n, lanes=4, batch=8, seed=1):
    return Source(n).shuffle(seed).repeat().lanes(lanes).batch(batch)


def doc_tokens(tok, texts):
    return [np.array(e.ids + [EOS_ID], np.int32) for e in tok.encode_batch(texts, add_special_tokens=False)]


def collect(loaders_batches):
    """(source, record, epoch) -> list of (start, stop, tokens) pieces, in emission order."""
    pieces = {}
    for b in loaders_batches:
        for j, row in enumerate(b.segments):
            at = 0
            for s, r, e, a, z in row:
                pieces.setdefault((s, r, e), []).append((a, z, b.data["tokens"][j, at:at + z - a]))
                at += z - a
    return pieces


def check_exactly_once(pieces, docs, epochs=(0,)):
    for rec, toks in enumerate(docs):
        for ep in epochs:
            got = pieces.get((0, rec, ep))
            assert got, f"record {rec} epoch {ep} never emitted"
            covered = sorted((a, z) for a, z, _ in got)
            assert covered[0][0] == 0 and covered[-1][1] == len(toks), (rec, covered)
            assert all(covered[i][1] == covered[i + 1][0] for i in range(len(covered) - 1)), covered
            for a, z, t in got:
                assert np.array_equal(t, toks[a:z])
            # in order: a document's pieces come in token order within its lane
            assert [a for a, _, _ in got] == sorted(a for a, _, _ in got)


@pytest.mark.parametrize("mode", ["concat", "first_fit", "best_fit"])
def test_every_token_exactly_once_in_order_across_resume_and_degree(corpora, mode):
    prose, _, tok = corpora
    prose = prose[:40]  # ~24k tokens: one epoch is ~12 steps of 8 x 256
    src = ArraySource({"text": objects(prose)})
    p = plan_one(len(prose))
    steps = 60
    full = Loader(p, src, pipeline(tok, 256, mode=mode))
    ref = [next(full) for _ in range(steps)]
    docs = doc_tokens(tok, prose)
    check_exactly_once(collect(ref), docs)
    ref_fp = run_fingerprints([Loader(p, src, pipeline(tok, 256, mode=mode))], steps)
    # stop at D=2 at a few steps, merge, resume at D=4 and D=1: same batches, same tokens
    for stop, D in ((3, 4), (23, 1)):
        loaders = [Loader(p, src, pipeline(tok, 256, mode=mode), rank=r, world=2) for r in range(2)]
        head = run_fingerprints(loaders, stop)
        state = json.loads(json.dumps(merge_states([l.state() for l in loaders])))
        resumed = [Loader(p, src, pipeline(tok, 256, mode=mode), rank=r, world=D) for r in range(D)]
        for l in resumed:
            l.restore(state)
        assert head + run_fingerprints(resumed, steps - stop) == ref_fp, (mode, stop)


def test_long_documents_are_split_not_dropped_and_padding_is_counted(corpora):
    prose, _, tok = corpora
    long_doc = " ".join(prose[:6])
    src = ArraySource({"text": objects([long_doc] + prose[:30])})
    docs = doc_tokens(tok, [long_doc] + prose[:30])
    assert len(docs[0]) > 3 * 64
    for mode in ("first_fit", "best_fit"):
        l = Loader(plan_one(31, lanes=1, batch=4), src, pipeline(tok, mode=mode, max_open_bins=4))
        got = [next(l) for _ in range(sum(map(len, docs)) // 256 + 40)]
        check_exactly_once(collect(got), docs)
        pad = np.mean([(b.data["segment_ids"] == 0).mean() for b in got])
        assert 0 < pad < 0.2


@pytest.mark.parametrize("mode", ["concat", "best_fit"])
def test_packed_fields_are_consistent(corpora, mode):
    prose, _, tok = corpora
    l = Loader(plan_one(len(prose)), ArraySource({"text": objects(prose)}), pipeline(tok, mode=mode))
    docs = dict(enumerate(doc_tokens(tok, prose)))
    for _ in range(10):
        b = next(l)
        d = b.data
        assert all(d[k].dtype == np.int32 and d[k].shape == (8, 64)
                   for k in ("tokens", "targets", "segment_ids", "positions", "loss_mask"))
        assert d["cu_seqlens"].shape == (8, 65)
        for j, row in enumerate(b.segments):
            seg = d["segment_ids"][j]
            at = 0
            for k, (_, r, _, a, z) in enumerate(row):
                n = z - a
                assert (seg[at:at + n] == k + 1).all()
                assert np.array_equal(d["positions"][j, at:at + n], np.arange(n))
                doc = docs[r]
                nxt = doc[a + 1:z + 1]  # next tokens of the same document only
                assert np.array_equal(d["targets"][j, at:at + len(nxt)], nxt)
                assert d["loss_mask"][j, at:at + len(nxt)].all()
                if z == len(doc):  # a document's last token predicts nothing
                    assert d["loss_mask"][j, at + n - 1] == 0
                assert d["cu_seqlens"][j, k + 1] == at + n
                at += n
            assert (seg[at:] == 0).all() and (d["loss_mask"][j, at:] == 0).all()


def test_maxtext_names(corpora):
    prose, _, tok = corpora
    l = Loader(plan_one(len(prose)), ArraySource({"text": objects(prose)}), pipeline(tok, names="maxtext"))
    d = next(l).data
    assert set(d) == {"inputs", "targets", "inputs_segmentation", "targets_segmentation",
                      "inputs_position", "targets_position"}


def mixed_plan(n_a, n_b, weights=(0.7, 0.3), lanes=4, batch=8, by="tokens"):
    return Mix([Source(n_a, id=0).shuffle(1).repeat(), Source(n_b, id=1).shuffle(2).repeat()],
               weights, by=by).lanes(lanes).batch(batch)


def mixed_sources(corpora):
    prose, code, _ = corpora
    return [ArraySource({"text": objects(prose)}), ArraySource({"body": objects(code)})]


def mixed_pipeline(tok, seq_len=64, mode="concat"):
    return {"transforms": [Pack(seq_len, mode)],
            "per_source": {0: [Tokenize(tok, eos=EOS_ID)], 1: [Tokenize(tok, field="body", eos=EOS_ID)]}}


def test_token_mix_fingerprints_identical_over_degree_and_runners(corpora):
    tok = corpora[2]
    p = mixed_plan(120, 80)
    srcs = mixed_sources(corpora)

    def fp(world=1, runner=None):
        ls = [Loader(p, srcs, rank=r, world=world, runner=runner, **mixed_pipeline(tok)) for r in range(world)]
        try:
            return run_fingerprints(ls, 12)
        finally:
            for l in ls:
                l.close()

    ref = fp()
    for D in (2, 4):
        assert fp(D) == ref
    assert fp(runner=threads(2)) == ref
    assert fp(world=2, runner=processes(2)) == ref


def realised_shares(batches, n_sources=2, by="tokens"):
    """Per lane, the share of each source among its packed tokens (by segments)."""
    lanes = {}
    for b in batches:
        for j, row in enumerate(b.segments):
            lane = int(b.lanes[j // b.rows_per_lane])
            c = lanes.setdefault(lane, np.zeros(n_sources))
            for s, _, _, a, z in row:
                c[s] += (z - a) if by == "tokens" else 1
    return {k: v / v.sum() for k, v in lanes.items()}


@pytest.mark.parametrize("weights", [(0.9, 0.1), (0.999, 0.001)])
def test_every_lane_follows_the_token_mixture(corpora, weights):
    """Stated bound: in every lane, each source's token count stays within one document (here
    at most 256 tokens: long documents are split) of its weight's share of the tokens so far, so
    a window of W tokens holds a share within 2 documents / W of the weight."""
    tok = corpora[2]
    p = mixed_plan(120, 80, weights, lanes=4, batch=8)
    per_source = {0: [Tokenize(tok, eos=EOS_ID, max_tokens=256)],
                  1: [Tokenize(tok, field="body", eos=EOS_ID, max_tokens=256)]}
    l = Loader(p, mixed_sources(corpora), [Pack(128)], per_source=per_source)
    seen = []
    for _ in range(8):
        seen += [next(l) for _ in range(10)]
        for lane, v in l.state()["lanes"].items():
            mix = np.array(v["mix"], float)
            assert np.all(np.abs(mix - np.array(weights) * mix.sum()) <= 256), (lane, mix)
    for lane, s in realised_shares(seen[40:]).items():  # a window of 40 steps, ~10k tokens a lane
        assert abs(s[1] - weights[1]) <= 2 * 256 / (40 * 2 * 128) + 0.01, (lane, s)


def test_sample_mix_under_lanes_gives_every_lane_the_mixture():
    """Mix by samples is applied inside every lane: with 8 lanes and 8 ranks at 0.5/0.5 each rank
    sees both corpora (the regression: rank 0 got only one), and small weights are not dropped."""
    p = Mix([Source(100, id=0).repeat(), Source(100, id=1).repeat()], [0.5, 0.5]).lanes(8).batch(64)
    for r in range(8):
        refs = p.refs(3, p.lanes.owned(r, 8))
        assert (refs.source == 0).sum() == (refs.source == 1).sum() == 4
    q = Mix([Source(10**6, id=0).repeat(), Source(10, id=1).repeat()], [0.9996, 0.0004]).lanes(2).batch(2)
    n = 20000
    got = q.lanes.resolve_lanes(np.zeros(n, np.int64), np.arange(n)).source
    assert abs((got == 1).sum() - 0.0004 * n) <= 1


def test_changed_seq_len_tokenizer_or_weight_is_refused(corpora):
    prose, code, tok = corpora
    src = ArraySource({"text": objects(prose)})
    l = Loader(plan_one(len(prose)), src, pipeline(tok, seq_len=64))
    next(l)
    state = l.state()
    with pytest.raises(StateError, match=r"Pack\): config seq_len 64 != 32"):
        Loader(plan_one(len(prose)), src, pipeline(tok, seq_len=32)).restore(state)
    other_tok = train_bpe(code[:40], vocab_size=500)
    with pytest.raises(StateError, match=r"Tokenize\): config tokenizer_sha256"):
        Loader(plan_one(len(prose)), src, pipeline(other_tok, seq_len=64)).restore(state)
    m = Loader(mixed_plan(120, 80, (0.7, 0.3)), mixed_sources(corpora), **mixed_pipeline(tok))
    next(m)
    with pytest.raises(StateError, match=r"weights\[0\]: 0.7 != 0.6"):
        Loader(mixed_plan(120, 80, (0.6, 0.4)), mixed_sources(corpora), **mixed_pipeline(tok)).restore(m.state())


def test_state_of_64_lanes_3_sources_is_a_few_kb(corpora):
    prose, code, tok = corpora
    third = generate_corpus(50, seed=3)
    p = Mix([Source(120, id=0).shuffle(1).repeat(), Source(80, id=1).shuffle(2).repeat(),
             Source(50, id=2).shuffle(3).repeat()], [0.5, 0.3, 0.2], by="tokens").lanes(64).batch(64)
    srcs = [ArraySource({"text": objects(prose)}), ArraySource({"text": objects(code)}),
            ArraySource({"text": objects(third)})]
    for mode in ("concat", "best_fit"):
        l = Loader(p, srcs, [Tokenize(tok, eos=EOS_ID), Pack(256, mode, max_open_bins=4)])
        for _ in range(3):
            next(l)
        size = len(json.dumps(l.state()))
        assert size < (16_000 if mode == "concat" else 48_000), (mode, size)


def test_split_and_truncate_tokenize_options(corpora):
    prose, _, tok = corpora
    src = ArraySource({"text": objects(prose[:20])})
    docs = doc_tokens(tok, prose[:20])
    split = Loader(Source(20).lanes(1).batch(1), src, [Tokenize(tok, eos=EOS_ID, max_tokens=50)])
    pieces = [next(split).data["tokens"][0] for _ in range(sum(-(-len(d) // 50) for d in docs))]
    assert np.array_equal(np.concatenate(pieces), np.concatenate(docs))
    trunc = Loader(Source(20).lanes(1).batch(20), src,
                   [Tokenize(tok, eos=EOS_ID, max_tokens=50, overflow="truncate")])
    d = next(trunc).data
    assert all(len(t) <= 50 for t in d["tokens"])
    assert d["truncated"].sum() == sum(max(0, len(x) - 50) for x in docs)


def test_explain_names_each_segment(corpora):
    prose, _, tok = corpora
    l = Loader(plan_one(len(prose)), ArraySource({"text": objects(prose)}), pipeline(tok))
    b = next(l)
    rows = b.explain()
    assert len(rows) == 8 and all(r["segments"] for r in rows)
    s = rows[0]["segments"][0]
    assert set(s) == {"source", "record", "epoch", "tokens"}


def to_bf16_mask(cols):
    import ml_dtypes

    return {**cols, "loss_mask": cols["loss_mask"].astype(ml_dtypes.bfloat16)}


def test_packed_batches_identical_in_numpy_jax_and_torch(corpora):
    """The same packed global batches as numpy arrays, sharded jax.Arrays (two meshes) and torch
    tensors; a bf16 field made after packing passes through to JAX and torch unchanged."""
    import jax
    import torch
    from jax.sharding import Mesh

    from zephon import Map
    from zephon.backends.jax import JaxLoader
    from zephon.backends.torch import TorchLoader

    prose, _, tok = corpora
    src = ArraySource({"text": objects(prose)})
    p = plan_one(len(prose), lanes=8, batch=16)
    ops = pipeline(tok) + [Map(to_bf16_mask, batched=True)]
    ref = []
    l = Loader(p, src, ops)
    for _ in range(5):
        ref.append(next(l).data)
    assert ref[0]["loss_mask"].dtype.name == "bfloat16"
    devices = np.array(jax.devices()[:8])
    for shape, axes in (((8,), ("data",)), ((2, 4), ("data", "fsdp"))):
        mesh = Mesh(devices.reshape(shape), axes)
        with JaxLoader(p, src, ops, mesh=mesh, batch_axes=axes) as jl:
            for k in range(5):
                got = next(jl)
                for f, v in ref[k].items():
                    assert got[f].dtype == v.dtype and np.array_equal(np.asarray(got[f]), v), (shape, f)
    tl = TorchLoader(p, src, pipeline(tok), dtypes={"loss_mask": torch.bfloat16})
    for k in range(5):
        got = next(tl)
        for f, v in ref[k].items():
            t = got[f]
            if f == "loss_mask":
                assert t.dtype == torch.bfloat16
                assert np.array_equal(t.float().numpy(), v.astype(np.float32))
            else:
                assert np.array_equal(t.numpy(), v)


def test_token_mix_without_packing_is_elastic_and_names_records(corpora):
    prose, code, tok = corpora
    p = mixed_plan(120, 80)
    per_source = {0: [Tokenize(tok)], 1: [Tokenize(tok, field="body")]}
    ref = run_fingerprints([Loader(p, mixed_sources(corpora), per_source=per_source)], 10)
    for D in (2, 4):
        ls = [Loader(p, mixed_sources(corpora), per_source=per_source, rank=r, world=D) for r in range(D)]
        assert run_fingerprints(ls, 10) == ref
    b = next(Loader(p, mixed_sources(corpora), per_source=per_source))
    assert b.refs is not None and set(b.refs.source.tolist()) == {0, 1}
    assert [len(t) for t in b.data["tokens"]] == [len(e.ids) for e in tok.encode_batch(
        [prose[r] if s == 0 else code[r] for s, r in zip(b.refs.source, b.refs.record)], add_special_tokens=False)]


@pytest.mark.parametrize("mode", ["concat", "first_fit", "best_fit"])
def test_a_finite_plan_ends_with_every_token_packed(corpora, mode):
    """At the end of a finite plan the last partial row and the open rows come out padded."""
    prose, _, tok = corpora
    src = ArraySource({"text": objects(prose[:30])})
    batches = list(Loader(Source(30).shuffle(2).lanes(1).batch(1), src, pipeline(tok, 256, mode=mode)))
    docs = doc_tokens(tok, prose[:30])
    check_exactly_once(collect(batches), docs)
    assert sum(int((b.data["segment_ids"] > 0).sum()) for b in batches) == sum(map(len, docs))


class _CountedPack(Pack):
    """Pack taken through the engine's fixed-count path (as an accumulator that does not stream)."""

    streams = False


@pytest.mark.parametrize("mode", ["concat", "best_fit"])
@pytest.mark.parametrize("finite", [False, True])
def test_pack_taking_the_rows_that_arrived_emits_what_fixed_counts_emit(corpora, mode, finite):
    """Pack streams: fed whatever windows have arrived, it emits the rows the engine's fixed
    candidate counts give, at every degree, with threads reading ahead, to the end of the data."""
    prose, _, tok = corpora
    src = ArraySource({"text": objects(prose[:60])})
    p = (Source(60).shuffle(3).lanes(4).batch(8) if finite else plan_one(60))

    def batches(pack_cls, world, runner=None):
        out = []
        for r in range(world):
            loader = Loader(p, src, [Tokenize(tok, eos=EOS_ID), pack_cls(128, mode)], rank=r, world=world,
                            runner=runner)
            out.append([b.data for b in (loader if finite else (next(loader) for _ in range(30)))])
            loader.close()
        return out

    assert Pack.streams and not _CountedPack.streams
    for world in (1, 2):
        want = batches(_CountedPack, world)
        for runner in (None, threads(2)):
            got = batches(Pack, world, runner)
            assert [len(g) for g in got] == [len(w) for w in want]
            for g, w in zip(got, want):
                for gb, wb in zip(g, w):
                    assert gb.keys() == wb.keys()
                    for k in wb:
                        np.testing.assert_array_equal(gb[k], wb[k], err_msg=f"{mode} world {world} {k}")
