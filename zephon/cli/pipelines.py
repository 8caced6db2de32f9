"""The demo pipelines `zephon verify` checks by default, importable by name (also in the other
processes of a multi-process run) as `zephon.cli:demo_shuffle`, `:demo_filter`, `:demo_lm`,
`:demo_eval` (a finite, padded one), `:demo_block_shuffle`, `:demo_images` (decode +
random-resized crop + flip), `:demo_images_skip` (the same skipping corrupt JPEGs) and
`zephon.cli.pipelines:demo_vlm` (vision-language packing)."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from zephon.cli.demo import SPEC, make_dataset
from zephon.ops import Filter
from zephon.plan import Source
from zephon.sources import ArrayRecordSource


def _demo_dir() -> Path:
    """Generated demo data, made once per machine and reused (ZEPHON_DEMO_DATA moves it)."""
    root = Path(os.environ.get("ZEPHON_DEMO_DATA") or Path(tempfile.gettempdir()) / f"zephon-demo-data-{os.getuid()}")
    final = root / "v1"
    if (final / "done").exists():
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="building-", dir=root))
    try:
        make_dataset(tmp, 4096)
        from zephon.demo.textdata import generate_corpus, train_bpe, write_jsonl

        prose, code = generate_corpus(400, seed=1), generate_corpus(300, seed=2, style="code")
        write_jsonl(tmp / "prose.jsonl", prose)
        write_jsonl(tmp / "code.jsonl", code)
        train_bpe(prose[:200] + code[:150], vocab_size=2000).save(str(tmp / "tokenizer.json"))
        (tmp / "done").write_text("ok")
        try:
            os.rename(tmp, final)
        except OSError:  # another process made it first
            pass
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def _keep_3_of_4(cols: Any) -> Any:
    return cols["tokens"][:, 0] % 4 != 0


def demo_shuffle() -> Any:
    """Generated ArrayRecord data (4 shards), shuffled, repeated, 8 lanes dealt *interleaved*."""
    from zephon.testing import Pipeline

    src = ArrayRecordSource(f"{_demo_dir() / 'demo.array_record'}@4", SPEC)
    return Pipeline(Source(len(src), name="demo").shuffle(7).repeat().lanes(8, "interleaved").batch(64), src)


def demo_filter() -> Any:
    """The same data through a filter keeping 3 records of 4: lanes advance by the data."""
    from zephon.testing import Pipeline

    src = ArrayRecordSource(f"{_demo_dir() / 'demo.array_record'}@4", SPEC)
    keep = Filter(_keep_3_of_4, batched=True, name="demo.keep_3_of_4")
    return Pipeline(Source(len(src), name="demo").shuffle(8).repeat().lanes(8).batch(64), src, [keep])


def demo_lm() -> Any:
    """Two JSONL corpora mixed 0.7/0.3 by tokens in every lane, BPE-tokenized online, packed
    into rows of 256 tokens (concat-then-split): the LM pretraining pipeline."""
    from zephon.demo.textdata import EOS_ID
    from zephon.ops.pack import Pack
    from zephon.ops.tokenize import Tokenize
    from zephon.plan import Mix
    from zephon.sources import JsonlSource
    from zephon.testing import Pipeline

    d = _demo_dir()
    srcs = [JsonlSource(str(d / "prose.jsonl")), JsonlSource(str(d / "code.jsonl"))]
    plan = Mix([Source(400, id=0, name="prose").shuffle(1).repeat(),
                Source(300, id=1, name="code").shuffle(2).repeat()], [0.7, 0.3],
               by="tokens").lanes(8).batch(16)
    return Pipeline(plan, srcs, [Tokenize(str(d / "tokenizer.json"), eos=EOS_ID), Pack(256, "concat")])


def demo_eval() -> Any:
    """An evaluation set: the two corpora once each (a finite mix by tokens that reads every
    document, `stop="all"`), tokenized and packed, the last steps padded (`remainder="pad"`):
    every token exactly once, the same end at every D."""
    from zephon.demo.textdata import EOS_ID
    from zephon.ops.pack import Pack
    from zephon.ops.tokenize import Tokenize
    from zephon.plan import Mix
    from zephon.sources import JsonlSource
    from zephon.testing import Pipeline

    d = _demo_dir()
    srcs = [JsonlSource(str(d / "prose.jsonl")), JsonlSource(str(d / "code.jsonl"))]
    plan = Mix([Source(400, id=0, name="prose"), Source(300, id=1, name="code").shuffle(3)], [0.7, 0.3],
               by="tokens", stop="all").lanes(8).batch(32, remainder="pad")
    return Pipeline(plan, srcs, [Tokenize(str(d / "tokenizer.json"), eos=EOS_ID), Pack(256, "first_fit")])


def demo_block_shuffle() -> Any:
    """The demo data under a block shuffle (blocks of 16 records, windows of 2 × 64 blocks,
    one stripe per lane) through the 3-of-4 filter: the object-storage order, lanes advancing
    by the data."""
    from zephon.testing import Pipeline

    src = ArrayRecordSource(f"{_demo_dir() / 'demo.array_record'}@4", SPEC)
    keep = Filter(_keep_3_of_4, batched=True, name="demo.keep_3_of_4")
    plan = Source(len(src), name="demo").block_shuffle(9, block=16).repeat().lanes(8).batch(64)
    return Pipeline(plan, src, [keep])


def demo_vlm() -> Any:
    """Conversations with images (generated in-process), image placeholders sized from the image
    headers, packed per lane under two budgets (512 tokens, 288 patches per row); pixels decoded
    once the rows are fixed: the vision-language pipeline (zephon.media)."""
    from zephon.demo.vlmdata import BOS_ID, IMAGE_ID, demo_columns, vlm_tokenizer
    from zephon.media.patches import Patches
    from zephon.media.vision_tokens import VisionTokens
    from zephon.media.vlm_pack import VLMPack
    from zephon.ops.chat import ChatTemplate
    from zephon.sources.memory import ArraySource
    from zephon.testing import Pipeline

    src = ArraySource(demo_columns())
    px = Patches(patch=14, merge=2, max_pixels=112 * 112, min_pixels=28 * 28)
    ops = [VisionTokens(vlm_tokenizer(), IMAGE_ID, px, field="messages", template=ChatTemplate(), bos=BOS_ID),
           VLMPack(512, 288, px, max_images=8)]
    return Pipeline(Source(len(src), name="vlm").shuffle(11).repeat().lanes(8).batch(16), src, ops)


def _image_shards() -> tuple[list[str], list[str]]:
    """Tiny JPEGs made once next to the demo data: 256 clean ones in 2 shards, and a third
    shard of 64 in which samples 7 and 40 are truncated (for `on_error='skip'`)."""
    final = _demo_dir().parent / "images-v2"
    clean = [str(final / f"tiny-{k}.tar") for k in range(2)]
    bad = [str(final / "tiny-skip-0.tar")]
    if not (final / "done").exists():
        from zephon.demo.images import tiny_images

        final.mkdir(parents=True, exist_ok=True)
        tiny_images(str(final), 256)
        tiny_images(str(final), 64, corrupt=(7, 40), seed=1, name="tiny-skip", shards=1)
        (final / "done").write_text("ok")
    return clean, bad


def demo_images() -> Any:
    """Image classification: WebDataset shards -> decode fused with random-resized crop 32 and a
    flip -> [16, 32, 32, 3] uint8 batches. One-to-one, so O(1) random access (`batch(k)`)."""
    from zephon.media import DecodeImage, RandomResizedCrop
    from zephon.sources.webdataset import WebDatasetSource
    from zephon.testing import Pipeline

    src = WebDatasetSource(_image_shards()[0], ["jpg", "cls"])
    op = DecodeImage("jpg", RandomResizedCrop(32, scale=(0.25, 1.0)), flip=0.5, out="image")
    return Pipeline(Source(len(src), name="tiny_images").shuffle(9).repeat().lanes(8).batch(16), src, [op])


def demo_images_skip() -> Any:
    """The same with two truncated JPEGs among the data and `on_error="skip"`: decode becomes a
    filter (count-changing, the lane engine), and drops the same records at every D."""
    from zephon.media import DecodeImage, RandomResizedCrop
    from zephon.sources.webdataset import WebDatasetSource
    from zephon.testing import Pipeline

    clean, bad = _image_shards()
    src = WebDatasetSource(bad + clean[:1], ["jpg", "cls"])
    op = DecodeImage("jpg", RandomResizedCrop(24), flip=0.5, out="image", on_error="skip")
    return Pipeline(Source(len(src), name="tiny_images_skip").shuffle(4).repeat().lanes(8).batch(16), src, [op])


DEMO_PIPELINES = ("zephon.cli:demo_shuffle", "zephon.cli:demo_filter", "zephon.cli:demo_lm",
                  "zephon.cli:demo_eval", "zephon.cli:demo_block_shuffle", "zephon.cli:demo_images",
                  "zephon.cli:demo_images_skip", "zephon.cli.pipelines:demo_vlm")
