"""Per-token fields through `Pack`: masks and weights cut with their documents in every mode,
across steps and resumes (also in the middle of a split document); unaligned fields refused."""

from __future__ import annotations

import numpy as np
import pytest

from zephon import Loader, PlanError, Source
from zephon.ops.pack import Pack
from zephon.sources.columns import objects
from zephon.sources.memory import ArraySource

N = 96


def _docs(n: int = N, longest: int = 40) -> dict[str, np.ndarray]:
    """Documents of 2..longest tokens; a mask that trains a random suffix ("the answer") and
    per-token float weights, both different per token so a misplaced value is seen."""
    rng = np.random.default_rng(7)
    toks, mask, weight = [], [], []
    for i in range(n):
        m = int(rng.integers(2, longest + 1))
        toks.append(np.arange(1, m + 1, dtype=np.int32) + 1000 * i)
        cut = int(rng.integers(0, m))
        mask.append((np.arange(m) >= cut).astype(np.uint8))
        weight.append(rng.random(m).astype(np.float32))
    return {"tokens": objects(toks), "response_mask": objects(mask), "weight": objects(weight)}


DOCS = _docs()


def _check_rows(batch, mask_field: str = "response_mask") -> int:
    """Every packed row against its documents (by provenance); returns the trained tokens seen."""
    d = batch.data
    trained = 0
    for r, row in enumerate(batch.segments):
        at = 0
        for k, (_, rec, _, a, b) in enumerate(row):
            tok, m, w = DOCS["tokens"][rec], DOCS["response_mask"][rec], DOCS["weight"][rec]
            n = b - a
            assert np.all(d["segment_ids"][r, at:at + n] == k + 1)
            assert np.array_equal(d["tokens"][r, at:at + n], tok[a:b])
            assert np.array_equal(d[mask_field][r, at:at + n], m[a:b])
            assert np.array_equal(d["weight"][r, at:at + n], w[a:b])
            # position i's target is token a+i+1 of the document: trained iff the mask says so
            want = np.zeros(n, np.int32)
            has = min(b + 1, len(tok)) - (a + 1)
            want[:has] = m[a + 1:a + 1 + has]
            assert np.array_equal(d["loss_mask"][r, at:at + n], want)
            trained += int(want.sum())
            at += n
        assert not d["loss_mask"][r, at:].any() and not d["weight"][r, at:].any()
        assert not d[mask_field][r, at:].any()
    return trained


def _loader(mode: str, seq_len: int = 16, **kw):
    plan = Source(N).shuffle(3).repeat().lanes(4).batch(8)
    return Loader(plan, ArraySource(DOCS), [Pack(seq_len, mode, mask="response_mask", **kw)])


@pytest.mark.parametrize("mode", ["concat", "first_fit", "best_fit"])
def test_per_token_fields_are_packed_with_their_documents(mode):
    loader = _loader(mode)
    trained = sum(_check_rows(next(loader)) for _ in range(6))
    assert trained > 0
    b = next(loader)
    assert b.data["weight"].dtype == np.float32 and b.data["response_mask"].dtype == np.uint8


@pytest.mark.parametrize("mode", ["concat", "best_fit"])
def test_a_resume_in_the_middle_of_a_split_document_keeps_its_mask(mode):
    """Documents longer than a row are split; a state taken while a lane holds the rest of one
    restores into a new loader that continues with the same tokens, masks and weights."""
    whole = _loader(mode, seq_len=8)
    ref = [next(whole) for _ in range(8)]
    for b in ref:
        _check_rows(b)
    probe = _loader(mode, seq_len=8)
    mid = None
    for step in range(6):
        next(probe)
        lanes = probe.state()["lanes"]
        carries = [lane.get("carry") for lane in (lanes.values() if isinstance(lanes, dict) else lanes)]
        split = [c for c in carries if c and (c.get("offset") or c.get("pending"))]
        if split:
            mid = (step + 1, probe.state())
            break
    assert mid is not None, "no lane held a split document: the test data does not exercise it"
    at, state = mid
    resumed = _loader(mode, seq_len=8)
    resumed.restore(state)
    for want in ref[at:]:
        got = next(resumed)
        assert got.segments == want.segments
        for k in want.data:
            assert np.array_equal(got.data[k], want.data[k]), k


def test_record_mask_named_loss_mask_is_combined_not_emitted_twice():
    src = ArraySource({"tokens": DOCS["tokens"], "loss_mask": DOCS["response_mask"]})
    b = next(Loader(Source(N).repeat().lanes(2).batch(4), src, [Pack(12, "best_fit")]))
    assert sorted(b.data) == ["cu_seqlens", "loss_mask", "positions", "segment_ids", "targets", "tokens"]
    for r, row in enumerate(b.segments):
        at = 0
        for _, rec, _, a, e in row:
            m = DOCS["response_mask"][rec]
            has = min(e + 1, len(m)) - (a + 1)
            assert np.array_equal(b.data["loss_mask"][r, at:at + has], m[a + 1:a + 1 + has])
            at += e - a


def test_maxtext_names_carry_the_mask_in_targets_segmentation():
    src = ArraySource({"tokens": DOCS["tokens"], "loss_mask": DOCS["response_mask"]})
    b = next(Loader(Source(N).repeat().lanes(2).batch(4), src, [Pack(12, "concat", names="maxtext")]))
    z = next(Loader(Source(N).repeat().lanes(2).batch(4), src, [Pack(12, "concat")]))
    assert np.array_equal(b.data["targets_segmentation"], z.data["segment_ids"] * z.data["loss_mask"])
    assert 0 < z.data["loss_mask"].sum() < (z.data["segment_ids"] > 0).sum()


def test_fields_that_are_not_per_token_are_refused_naming_them():
    ragged = objects([t[:-1] for t in DOCS["tokens"]])
    plan = Source(N).repeat().lanes(2).batch(4)
    with pytest.raises(PlanError, match=r"column 'short' is not one value per token.*drop=\('short',\)"):
        next(Loader(plan, ArraySource({"tokens": DOCS["tokens"], "short": ragged}), [Pack(12)]))
    with pytest.raises(PlanError, match=r"column 'id' is not one value per token"):
        next(Loader(plan, ArraySource({"tokens": DOCS["tokens"], "id": np.arange(N)}), [Pack(12)]))
    with pytest.raises(PlanError, match=r"Pack emits 'positions' itself"):
        next(Loader(plan, ArraySource({"tokens": DOCS["tokens"], "positions": DOCS["tokens"]}), [Pack(12)]))
    # dropped on request, and only then
    b = next(Loader(plan, ArraySource({"tokens": DOCS["tokens"], "id": np.arange(N)}), [Pack(12, drop=("id",))]))
    assert "id" not in b.data
    with pytest.raises(PlanError, match="Pack.drop must be a tuple"):
        Pack(12, drop="id")  # type: ignore[arg-type]


def test_the_record_mask_is_part_of_the_identity():
    assert Pack(8).identity() != Pack(8, mask="response_mask").identity()
    assert Pack(8).identity()["version"] == 2
