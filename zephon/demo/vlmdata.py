"""Vision-language samples generated in-process (captions and conversations with images), for the
VLM packing tests, the `zephon verify` pipeline, the benchmark and the docs.

Images are drawn with numpy (gradients, bands and noise, so they compress like photographs
rather than like flat colour) and encoded by Pillow as JPEG (baseline and progressive), PNG or
WebP at random sizes; nothing is downloaded. The same `(n, seed)` gives the same bytes on every
machine with the same Pillow. The tokenizer is a byte-level BPE trained here (`train_bpe`) whose
first ids are the special tokens `SPECIAL` (`<image>` = `IMAGE_ID`).
"""

from __future__ import annotations

import io
import json
from typing import Any

import numpy as np

from zephon.demo.textdata import train_bpe

SPECIAL = ("<pad>", "<bos>", "<eos>", "<image>", "<vision_start>", "<vision_end>")
PAD_ID, BOS_ID, EOS_ID, IMAGE_ID, VISION_START_ID, VISION_END_ID = range(6)

_NOUNS = ("cat", "harbor", "lantern", "mountain", "bicycle", "meadow", "violin", "glacier", "falcon",
          "market", "rocket", "teapot", "river", "orchard", "lighthouse", "astronaut")
_ADJ = ("red", "quiet", "tiny", "ancient", "bright", "wet", "striped", "golden", "blurry", "distant")
_VERBS = ("stands near", "floats above", "rests beside", "hides behind", "faces", "leans on")
_FORMATS = ("jpeg", "jpeg-progressive", "png", "webp")


def encode_image(pixels: np.ndarray, fmt: str) -> bytes:
    """`pixels` (uint8 HWC) encoded as 'jpeg', 'jpeg-progressive', 'png' or 'webp' by Pillow."""
    from PIL import Image

    buf = io.BytesIO()
    im = Image.fromarray(pixels)
    if fmt == "jpeg":
        im.save(buf, "JPEG", quality=85)
    elif fmt == "jpeg-progressive":
        im.save(buf, "JPEG", quality=80, progressive=True)
    elif fmt == "png":
        im.save(buf, "PNG", compress_level=1)
    elif fmt == "webp":
        im.save(buf, "WEBP", quality=80)
    else:
        raise ValueError(f"unknown image format {fmt!r}; use one of {_FORMATS}")
    return buf.getvalue()


def draw_image(rng: np.random.Generator, h: int, w: int) -> np.ndarray:
    """A uint8 [h, w, 3] picture: two gradients, a band and some noise."""
    y = np.linspace(0, 1, h, dtype=np.float32)[:, None, None]
    x = np.linspace(0, 1, w, dtype=np.float32)[None, :, None]
    c0, c1, c2 = (rng.random((1, 1, 3), dtype=np.float32) for _ in range(3))
    img = c0 * (1 - y) + c1 * x + 0.3 * c2 * np.sin(6.28 * (x * rng.integers(1, 5) + y * rng.integers(1, 5)))
    img = img + rng.normal(0, 0.03, (h, w, 1)).astype(np.float32)
    return (np.clip(img, 0, 1) * 255).astype(np.uint8)


def _caption(rng: np.random.Generator) -> str:
    def pick(xs: tuple[str, ...]) -> str:
        return xs[int(rng.integers(0, len(xs)))]
    words = [f"A {pick(_ADJ)} {pick(_NOUNS)} {pick(_VERBS)} a {pick(_ADJ)} {pick(_NOUNS)}."]
    for _ in range(int(rng.integers(0, 4))):
        words.append(f"It is {pick(_ADJ)} and {pick(_ADJ)}.")
    return " ".join(words)


def generate_vlm(n: int, seed: int = 0, *, kind: str = "caption", sizes: tuple[int, int] = (32, 160),
                 max_images: int = 2) -> dict[str, np.ndarray]:
    """`n` samples as columns: `images` (object: a tuple of image bytes per sample) and `text`
    (captions: images first, no placeholder) or `messages` (conversations as JSON text, one
    `<image>` placeholder per image in the user turns). Image sides are uniform in `sizes`."""
    if kind not in ("caption", "chat"):
        raise ValueError(f"kind must be 'caption' or 'chat', got {kind!r}")
    rng = np.random.default_rng(seed)
    texts: list[str] = []
    images: list[tuple[bytes, ...]] = []
    for _ in range(n):
        k = 1 + int(rng.integers(0, max_images)) if kind == "caption" else int(rng.integers(0, max_images + 1))
        imgs = []
        for _ in range(k):
            h, w = (int(v) for v in rng.integers(sizes[0], sizes[1] + 1, 2))
            imgs.append(encode_image(draw_image(rng, h, w), _FORMATS[int(rng.integers(0, len(_FORMATS)))]))
        images.append(tuple(imgs))
        if kind == "caption":
            texts.append(_caption(rng))
        else:
            msgs: list[dict[str, str]] = []
            left = k
            for turn in range(int(rng.integers(1, 3))):
                show = left if turn else min(left, 1)
                q = "<image>\n" * show + f"What does picture {turn + 1} show?"
                left -= show
                msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": _caption(rng)}]
            if left:
                msgs[0]["content"] = "<image>\n" * left + msgs[0]["content"]
            texts.append(json.dumps(msgs))
    col = np.empty(n, object)
    col[:] = images if n else []
    text = np.empty(n, object)
    text[:] = texts if n else []
    return {"images": col, "text" if kind == "caption" else "messages": text}


def vlm_tokenizer(vocab_size: int = 600) -> Any:
    """A BPE trained on generated captions and chat turns; `SPECIAL` are ids 0-5."""
    rng = np.random.default_rng(123)
    texts = [_caption(rng) for _ in range(400)] + [f"<|user|>\nWhat does picture {i} show?<|end|>\n"
                                                    f"<|assistant|>\n" for i in range(1, 4)] * 20
    return train_bpe(texts, vocab_size=vocab_size, special_tokens=SPECIAL)


__all__ = ["BOS_ID", "EOS_ID", "IMAGE_ID", "PAD_ID", "SPECIAL", "VISION_END_ID", "VISION_START_ID",
           "draw_image", "encode_image", "generate_vlm", "vlm_tokenizer"]


_CACHE: dict[tuple[int, int, str], dict[str, np.ndarray]] = {}


def demo_columns(n: int = 256, seed: int = 0, kind: str = "chat") -> dict[str, np.ndarray]:
    """`generate_vlm(n, seed, kind=kind)`, made once per process (the verify pipeline's data)."""
    key = (n, seed, kind)
    if key not in _CACHE:
        _CACHE[key] = generate_vlm(n, seed, kind=kind)
    return _CACHE[key]
