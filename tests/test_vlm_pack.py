"""Vision-language packing: Patches geometry, VisionTokens (placeholders from header sizes, chat
masks), VLMPack (two budgets, every token and image once in pad mode, pixels, carry of references,
elastic and resumable) and the dynamic patch form."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest

import zephon as z
from zephon import testing as zt
from zephon.demo.vlmdata import (
    BOS_ID,
    EOS_ID,
    IMAGE_ID,
    VISION_END_ID,
    VISION_START_ID,
    encode_image,
    generate_vlm,
    vlm_tokenizer,
)
from zephon.errors import DecodeError, PlanError
from zephon.media.patches import Patches
from zephon.media.vision_tokens import VisionTokens
from zephon.media.vlm_batch import packed_patches
from zephon.media.vlm_pack import VLMPack
from zephon.ops.chat import ChatTemplate
from zephon.plan import Refs
from zephon.sources.memory import ArraySource

Image = pytest.importorskip("PIL.Image")

PX = Patches(patch=14, merge=2, max_pixels=112 * 112, min_pixels=28 * 28)


@pytest.fixture(scope="module")
def tok():
    return vlm_tokenizer()


@pytest.fixture(scope="module")
def captions():
    return generate_vlm(90, seed=4, kind="caption")


@pytest.fixture(scope="module")
def chats():
    return generate_vlm(60, seed=5, kind="chat")


def _refs(n: int, source: int = 0) -> Refs:
    return Refs(np.full(n, source, np.int64), np.arange(n, dtype=np.int64), np.zeros(n, np.int64))


def _pil_size(data: bytes) -> tuple[int, int]:
    w, h = Image.open(io.BytesIO(data)).size
    return h, w


# --- geometry -----------------------------------------------------------------------------------
def test_native_resolution_sizes_are_multiples_under_the_budget():
    rng = np.random.default_rng(0)
    f = PX.factor
    for h, w in list(rng.integers(1, 900, (300, 2))) + [(1, 5000), (5000, 3), (28, 28), (10, 10)]:
        H, W = PX.resized(int(h), int(w))
        assert H % f == 0 and W % f == 0 and f <= H and f <= W
        assert PX.max_pixels >= H * W
        t, gh, gw = PX.grid(int(h), int(w))
        assert (t, gh * PX.patch, gw * PX.patch) == (1, H, W)
        assert PX.tokens(np.array([t, gh, gw]))[0] * PX.merge ** 2 == t * gh * gw
        if min(h, w) >= 200 and max(h, w) <= 2 * min(h, w):  # moderate aspect: kept within a merge step
            assert abs(H / W - h / w) <= 2 * f / min(H, W) + 1e-9
    big = Patches(patch=14, merge=2, max_pixels=448 * 448, min_pixels=56 * 56)
    assert big.resized(480, 640) == (364, 504)  # scaled by sqrt(area / budget), floored to multiples of 28
    assert big.resized(60, 60) == (56, 56) and big.resized(20, 20) == (56, 56)  # min_pixels


def test_fixed_tiles():
    tiles = Patches(patch=14, merge=2, tile=56, max_tiles=6)
    assert tiles.tiles(100, 300) == (1, 3) and tiles.grid(100, 300) == (3, 4, 4)
    assert tiles.tiles(300, 100) == (3, 1) and tiles.resized(300, 100) == (168, 56)
    assert tiles.tiles(50, 50) == (1, 1) and tiles.tiles(120, 120) == (2, 2)
    with pytest.raises(PlanError, match="multiple of patch × merge"):
        Patches(patch=14, merge=2, tile=50)
    pixels = np.arange(168 * 56 * 3, dtype=np.int64).reshape(168, 56, 3) % 251
    cut = tiles.cut(pixels.astype(np.uint8))
    assert cut.shape == (3 * 16, 14 * 14 * 3)
    np.testing.assert_array_equal(cut[16:32], tiles.cut(pixels[56:112].astype(np.uint8)))  # tile 2


def test_patch_order_groups_merge_blocks():
    p, m = 14, 2
    px = Patches(patch=p, merge=m, max_pixels=10**6)
    H, W = 56, 84
    yy, xx = np.meshgrid(np.arange(H), np.arange(W), indexing="ij")
    img = np.stack([yy, xx, yy * 0 + 7], axis=2).astype(np.uint8)
    cut = px.cut(img)
    assert cut.shape == ((H // p) * (W // p), p * p * 3)

    def origin(k: int) -> tuple[int, int]:
        v = cut[k].reshape(p, p, 3)
        return int(v[0, 0, 0]), int(v[0, 0, 1])

    # the first merge x merge patches are the top-left 2x2 block, row-major inside it
    assert [origin(k) for k in range(4)] == [(0, 0), (0, 14), (14, 0), (14, 14)]
    assert origin(4) == (0, 28)  # then the next block to the right
    assert origin(4 * (W // (p * m))) == (28, 0)  # then the next block row
    v = cut[5].reshape(p, p, 3)  # inside a patch: row-major pixels, channels last
    np.testing.assert_array_equal(v[:, :, 0], np.arange(p)[:, None] + 0 * np.arange(p)[None, :])
    np.testing.assert_array_equal(v[:, :, 1] - v[0, 0, 1], np.arange(p)[None, :] + 0 * np.arange(p)[:, None])


# --- VisionTokens ---------------------------------------------------------------------------------
def _runs(mask: np.ndarray) -> list[int]:
    """Lengths of the runs of ones in a 0/1 vector."""
    d = np.diff(np.concatenate([[0], mask.astype(np.int8), [0]]))
    return list(np.flatnonzero(d == -1) - np.flatnonzero(d == 1))


def test_caption_tokens_placeholders_from_headers(tok, captions):
    vt = VisionTokens(tok, IMAGE_ID, PX, bos=BOS_ID, eos=EOS_ID, vision_start=VISION_START_ID,
                      vision_end=VISION_END_ID)
    n = len(captions["text"])
    out, rows = vt.apply(dict(captions), _refs(n), 0)
    assert rows is None
    for i in range(n):
        t, m, im = out["tokens"][i], out["loss_mask"][i], out["image_mask"][i]
        grids = out["image_grid"][i]
        sizes = [_pil_size(b) for b in captions["images"][i]]
        np.testing.assert_array_equal(out["image_size"][i], sizes)
        np.testing.assert_array_equal(grids, [PX.grid(*s) for s in sizes])
        # one run of placeholders per image, of patches / merge² tokens, images first (a caption)
        assert _runs(im) == [int(g.prod()) // 4 for g in grids]
        assert np.all(t[im == 1] == IMAGE_ID) and np.all(m[im == 1] == 0)
        assert t[0] == BOS_ID and m[0] == 0 and t[-1] == EOS_ID and m[-1] == 1
        assert t[1] == VISION_START_ID and (t == VISION_END_ID).sum() == len(grids)
        text = t[(im == 0) & (t > VISION_END_ID)]
        assert tok.decode(text.tolist()) == captions["text"][i]
        assert np.all(m[(im == 0) & (t > VISION_END_ID)] == 1)  # captions are trained
        np.testing.assert_array_equal(out["doc_ref"][i], [0, i, 0])
        assert out["images"][i] == tuple(captions["images"][i])


def test_chat_tokens_keep_the_chat_masks(tok, chats):
    from zephon.ops.chat import Chat

    vt = VisionTokens(tok, IMAGE_ID, PX, field="messages", template=ChatTemplate())
    n = len(chats["messages"])
    out, _ = vt.apply(dict(chats), _refs(n), 0)
    # without the images, the same conversations through Chat: the same text tokens and masks
    plain = {"messages": np.array([json.dumps([{**m, "content": m["content"].replace("<image>\n", "\n")}
                                               for m in json.loads(c)]) for c in chats["messages"]], object)}
    ref, _ = Chat(tok).apply(plain, _refs(n), 0)
    seen_image = 0
    for i in range(n):
        t, m, im = out["tokens"][i], out["loss_mask"][i], out["image_mask"][i]
        k = len(chats["images"][i])
        assert len(_runs(im)) == k and sum(_runs(im)) == int(PX.tokens(out["image_grid"][i]).sum())
        seen_image += k
        assert np.all(m[im == 1] == 0)
        # the user turns (where images sit) are never trained; answers are
        trained = tok.decode(t[m == 1].tolist())
        assert trained == tok.decode(ref["tokens"][i][ref["loss_mask"][i] == 1].tolist())
        assert "What does picture" not in trained and len(trained) > 0
    assert seen_image > 20


def test_placeholder_count_and_bad_images_name_the_record(tok):
    img = encode_image(np.zeros((30, 40, 3), np.uint8), "png")
    vt = VisionTokens(tok, IMAGE_ID, PX)
    imgs = np.empty(2, object)
    imgs[:] = [(img,), (img, img)]
    with pytest.raises(DecodeError, match="record 1 of source 0: the text has 1 '<image>' placeholders for 2"):
        vt.apply({"text": np.array(["<image> a cat", "<image> two"], object), "images": imgs}, _refs(2), 0)
    imgs[:] = [(img,), (img, img[:20])]
    with pytest.raises(DecodeError, match="image 1 of record 1 of source 0 .*cut short"):
        vt.apply({"text": np.array(["a", "b"], object), "images": imgs}, _refs(2), 0)
    with pytest.raises(PlanError, match="lack \\['images'\\]"):
        vt.apply({"text": np.array(["a"], object)}, _refs(1), 0)


# --- VLMPack ---------------------------------------------------------------------------------------
def _loader(data, tok, plan, pack=None, **kw):
    ops = [VisionTokens(tok, IMAGE_ID, PX, bos=BOS_ID, eos=EOS_ID),
           pack or VLMPack(192, 256, PX, max_images=6, max_segments=12)]
    return z.Loader(plan, ArraySource(data), ops, **kw)


def test_pad_mode_every_token_and_image_exactly_once(tok, captions):
    n = len(captions["text"])
    pack = VLMPack(192, 256, PX, max_images=6, max_segments=12)
    loader = _loader(captions, tok, z.Source(n).shuffle(2).lanes(4).batch(8, remainder="pad"), pack)
    vt = VisionTokens(tok, IMAGE_ID, PX, bos=BOS_ID, eos=EOS_ID)
    docs, _ = vt.apply(dict(captions), _refs(n), 0)
    seen: dict[int, int] = {}
    images = tokens = 0
    for b in loader:
        d = b.data
        for j, row in enumerate(b.explain()):
            segs = row.get("segments", [])
            assert bool(d["valid"][j]) == bool(segs)
            at = pat = img = 0
            assert (d["image_mask"][j].sum() * 4) == d["patch_mask"][j].sum()  # placeholders = patches / merge²
            for k, s in enumerate(segs):
                r = s["record"]
                seen[r] = seen.get(r, 0) + 1
                t = docs["tokens"][r]
                assert s["tokens"] == [0, len(t)]
                np.testing.assert_array_equal(d["tokens"][j, at:at + len(t)], t)
                np.testing.assert_array_equal(d["targets"][j, at:at + len(t) - 1], t[1:])
                assert d["targets"][j, at + len(t) - 1] == 0 and d["loss_mask"][j, at + len(t) - 1] == 0
                np.testing.assert_array_equal(d["loss_mask"][j, at:at + len(t) - 1],
                                              docs["loss_mask"][r][1:] & (docs["image_mask"][r][1:] == 0))
                np.testing.assert_array_equal(d["positions"][j, at:at + len(t)], np.arange(len(t)))
                assert np.all(d["segment_ids"][j, at:at + len(t)] == k + 1)
                at += len(t)
                assert d["cu_seqlens"][j, k + 1] == at
                for g, data in zip(docs["image_grid"][r], captions["images"][r]):
                    np.testing.assert_array_equal(d["image_grid"][j, img], g)
                    assert d["image_offsets"][j, img] == pat
                    _check_pixels(d["pixel_values"][j, pat:pat + int(g.prod())], data, g)
                    pat += int(g.prod())
                    img += 1
                images += len(docs["image_grid"][r])
                tokens += len(t)
            assert at <= 192 and pat <= 256 and img <= 6
            assert np.all(d["segment_ids"][j, at:] == 0) and np.all(d["tokens"][j, at:] == 0)
            assert np.all(d["patch_mask"][j, :pat] == 1) and np.all(d["patch_mask"][j, pat:] == 0)
            assert not d["pixel_values"][j, pat:].any() and np.all(d["image_grid"][j, img:] == 0)
            assert np.all(d["image_offsets"][j, img:] == pat)
    assert seen == dict.fromkeys(range(n), 1)  # every document exactly once
    assert images == sum(len(x) for x in captions["images"])
    assert tokens == sum(len(t) for t in docs["tokens"])


def _check_pixels(patches: np.ndarray, data: bytes, grid: np.ndarray) -> None:
    """The patches put back together look like the image (decoded and resized by Pillow)."""
    _t, gh, gw = (int(x) for x in grid)
    p, m = PX.patch, PX.merge
    x = patches.reshape(gh // m, gw // m, m, m, p, p, 3).transpose(0, 2, 4, 1, 3, 5, 6)
    img = x.reshape(gh * p, gw * p, 3).astype(np.float32)
    want = np.asarray(Image.open(io.BytesIO(data)).convert("RGB").resize((gw * p, gh * p), Image.BICUBIC),
                      np.float32)
    assert np.abs(img - want).mean() < 12, np.abs(img - want).mean()


def test_rows_respect_both_budgets_and_fill(tok, captions):
    loader = _loader(captions, tok, z.Source(len(captions["text"])).shuffle(1).repeat().lanes(4).batch(8))
    binding = []
    for _ in range(8):
        d = next(loader).data
        used = (d["segment_ids"] > 0).sum(1)
        pats = d["patch_mask"].sum(1)
        assert used.max() <= 192 and pats.max() <= 256
        # the budget the data makes scarce is the one that fills (here: patches)
        binding.append(np.maximum(used / 192, pats / 256))
    assert np.mean(binding) > 0.9, np.mean(binding)


def test_state_holds_references_and_resumes(tok, captions):
    n = len(captions["text"])
    plan = z.Source(n).shuffle(3).repeat().lanes(4).batch(8)
    ref = _loader(captions, tok, plan)
    want = [next(ref).data for _ in range(7)]
    a = _loader(captions, tok, plan)
    for _ in range(3):
        next(a)
    state = a.state()
    text = json.dumps(state)
    assert len(text) < 5_000  # positions and bins of held inputs, never image bytes or pixels
    assert '"carry": {"bins": [[' in text
    b = _loader(captions, tok, plan)
    b.restore(json.loads(text))
    for k in range(3, 7):
        got = next(b).data
        for f in want[k]:
            np.testing.assert_array_equal(got[f], want[k][f], err_msg=f"step {k} field {f}")


def test_documents_too_big_and_foreign_columns_are_refused(tok, captions):
    n = len(captions["text"])
    plan = z.Source(n).repeat().lanes(1).batch(1)
    with pytest.raises(DecodeError, match="record .* more than one row holds .*never split"):
        next(_loader(captions, tok, plan, VLMPack(192, 20, PX)))
    extra = {**captions, "label": np.arange(n)}
    with pytest.raises(PlanError, match="drop=\\('label',\\)"):
        next(_loader(extra, tok, plan))
    assert next(_loader(extra, tok, plan, VLMPack(192, 256, PX, drop=("label",)))).data["tokens"].shape == (1, 192)


def test_corrupt_image_found_at_decode_names_the_record(tok, captions):
    data = {k: v.copy() for k, v in captions.items()}
    # a JPEG cut after its frame header: planning reads its size, the decode names the record
    cut = encode_image(np.zeros((40, 40, 3), np.uint8), "jpeg")[:300]
    assert cut.index(b"\xff\xc0") < 290
    data["images"][5] = (cut,)
    plan = z.Source(len(data["text"])).lanes(1).batch(1, remainder="pad")
    with pytest.raises(DecodeError, match="record 5 of source 0"):
        for _ in _loader(data, tok, plan):
            pass


def test_elastic_runners_and_resume(tok):
    report = zt.verify("zephon.cli.pipelines:demo_vlm",
                       ["numpy D=2", "numpy D=8", "numpy D=2 runner=threads:2", "numpy D=4 @2 -> numpy D=1"],
                       steps=4)
    assert report.ok, report.summary()


def test_dynamic_form(tok, captions):
    d = next(_loader(captions, tok, z.Source(len(captions["text"])).repeat().lanes(2).batch(4))).data
    dyn = packed_patches(d)
    valid = d["patch_mask"].astype(bool)
    assert dyn["pixel_values"].shape == (int(valid.sum()), PX.dim)
    assert dyn["cu_patches"][-1] == len(dyn["pixel_values"])
    # image i of the dynamic form is the same patches as in its row
    for i, (g, r) in enumerate(zip(dyn["grid_thw"], dyn["image_row"])):
        slot = int((dyn["image_row"][:i] == r).sum())  # images keep their order within a row
        np.testing.assert_array_equal(d["image_grid"][r, slot], g)
        a = int(d["image_offsets"][r, slot])
        np.testing.assert_array_equal(dyn["pixel_values"][dyn["cu_patches"][i]:dyn["cu_patches"][i + 1]],
                                      d["pixel_values"][r, a:a + int(g.prod())])
    assert len(dyn["grid_thw"]) == int((d["image_grid"].prod(2) > 0).sum())
    with pytest.raises(PlanError, match="needs a VLMPack batch"):
        packed_patches({"tokens": d["tokens"]})


def test_fixed_tiles_pipeline(tok, captions):
    tiles = Patches(patch=14, merge=2, tile=56, max_tiles=4)
    ops = [VisionTokens(tok, IMAGE_ID, tiles, eos=EOS_ID), VLMPack(256, 400, tiles, max_images=8)]
    n = len(captions["text"])
    loader = z.Loader(z.Source(n).lanes(2).batch(2, remainder="pad"), ArraySource(captions), ops)
    images = 0
    for b in loader:
        d = b.data
        g = d["image_grid"]
        real = g.prod(2) > 0
        images += int(real.sum())
        assert np.all(g[real][:, 1:] == 4)  # every tile is 4 x 4 patches, t = tiles per image
        assert int(g[real].prod(1).sum()) == int(d["patch_mask"].sum()) == 4 * int(d["image_mask"].sum())
        assert np.all((g[real][:, 0] >= 1) & (g[real][:, 0] <= 4))  # at most max_tiles tiles
    assert images == sum(len(x) for x in captions["images"])


@pytest.mark.parametrize("fmt", ["jpeg", "jpeg-progressive", "png", "webp"])
def test_large_images_of_every_format_decode_to_their_grid(tok, fmt):
    """Images more than twice the target size: JPEGs decode at a reduced DCT scale, the others
    at full size; both are checked against the header and resized to the grid."""
    from zephon.demo.vlmdata import draw_image

    rng = np.random.default_rng(9)
    imgs = np.empty(3, object)
    sizes = [(394, 447), (300, 700), (251, 260)]
    imgs[:] = [(encode_image(draw_image(rng, h, w), fmt),) for h, w in sizes]
    data = {"text": np.array(["a cat", "a dog", "a cow"], object), "images": imgs}
    loader = _loader(data, tok, z.Source(3).lanes(1).batch(1, remainder="pad"))
    grids = []
    for b in loader:
        d = b.data
        for j, row in enumerate(b.explain()):
            for k, s in enumerate(row.get("segments", [])):  # one image per document here
                g, a = d["image_grid"][j, k], int(d["image_offsets"][j, k])
                grids.append((s["record"], tuple(int(x) for x in g)))
                _check_pixels(d["pixel_values"][j, a:a + int(g.prod())], imgs[s["record"]][0], g)
    assert sorted(grids) == [(i, PX.grid(*hw)) for i, hw in enumerate(sizes)]


def test_a_hand_edited_carry_is_refused(tok, captions, tmp_path):
    n = len(captions["text"])
    plan = z.Source(n).shuffle(3).repeat().lanes(4).batch(8)
    a = _loader(captions, tok, plan)
    for _ in range(2):
        next(a)
    path = tmp_path / "state.json"
    z.save_state(str(path), a.state())
    text = path.read_text()
    assert '"carry": {"bins": [[0' in text
    path.write_text(text.replace('"carry": {"bins": [[0', '"carry": {"bins": [[0, 0', 1))
    z.resign_state(str(path))
    b = _loader(captions, tok, plan)
    with pytest.raises(z.StateError, match="bins name held inputs"):
        b.restore(z.load_state(str(path)))
        next(b)  # the carry is checked when its lane's held inputs are read back
