"""Interleaved text and images -> tokens with image placeholders, as a row operator.

`VisionTokens` is the row half of vision-language packing (`VLMPack` is the accumulator half).
Per record it reads a caption (`text`) or a conversation (`messages`, rendered by a
`ChatTemplate` with the fine-tuning work's trained-token masks) and a list of image bytes
(`images`). Each occurrence of `placeholder` (default `<image>`) in the text stands for the next
image; a text with no placeholder gets its images first (the caption convention). Each image's
stored size is read from its header (`zephon.media.headers`, no pixel decoded), its patch grid
follows (`zephon.media.patches.Patches`), and it becomes `image_token` repeated patches ÷ merge²
times, optionally between `vision_start` and `vision_end` ids.

Columns written (the image bytes are kept for the packer, which decodes them only once the rows
are fixed): `tokens` (int32), `loss_mask` (uint8, 1 on trained tokens: the chat template's
answers, or all caption text; never an image or vision marker token), `image_mask` (uint8, 1 on
placeholder tokens), `image_grid` (int32 `[n_images, 3]`: t, h, w in patches), `image_size`
(int32 `[n_images, 2]`: the stored height and width) and `doc_ref` (int64 `[3]`: source, record,
epoch — how the packer names a record in its errors).

It runs in the read-ahead windows, in parallel like every row operator; it is pure, so a
restored packer re-reads and re-runs it for the documents its carry names.
"""

from __future__ import annotations

from dataclasses import dataclass
from dataclasses import field as dc_field
from typing import Any

import numpy as np

from zephon.errors import DecodeError, PlanError
from zephon.media.headers import image_sizes
from zephon.media.patches import Patches
from zephon.ops.base import Transform
from zephon.ops.chat import Chat, ChatTemplate
from zephon.plan import Refs
from zephon.sources.base import Columns
from zephon.sources.columns import objects

__all__ = ["VisionTokens"]

#: the columns VisionTokens writes (and VLMPack reads)
OUTPUTS = ("tokens", "loss_mask", "image_mask", "image_grid", "image_size", "doc_ref")


@dataclass(frozen=True, eq=False)
class VisionTokens(Transform):
    """Tokens with image placeholders, their masks and each image's patch grid (module doc).

    Args:
      tokenizer: as `Tokenize` / `Chat` (a `tokenizers.Tokenizer`, a `tokenizer.json` path...).
      image_token: the placeholder id (one per merged patch).
      patches: patch size, merge factor and sizing rule (`Patches`).
      field: the text column: a caption (str) or, with `template`, a conversation (messages).
      images: the column of image bytes (a list or array of bytes per record; may be empty).
      template: a `ChatTemplate` for conversations (None: `field` is caption text, all trained).
      train: the trained roles of a `ChatTemplate(turn=...)` template.
      placeholder: the text that stands for an image.
      vision_start, vision_end: ids around each image's placeholders (None: none).
      bos, eos: ids at the start (not trained) / end (trained) of every document (None: none).
    """

    tokenizer: Any
    image_token: int
    patches: Patches = dc_field(default_factory=Patches)
    field: str = "text"
    images: str = "images"
    template: ChatTemplate | None = None
    train: tuple[str, ...] = ("assistant",)
    placeholder: str = "<image>"
    vision_start: int | None = None
    vision_end: int | None = None
    bos: int | None = None
    eos: int | None = None
    name: str | None = None
    version: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.patches, Patches):
            raise PlanError(f"VisionTokens.patches must be a Patches, got {type(self.patches).__name__}")
        for k in ("image_token", "vision_start", "vision_end", "bos", "eos"):
            v = getattr(self, k)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
                raise PlanError(f"VisionTokens.{k} must be a token id (an int >= 0), got {v!r}")
        if not isinstance(self.placeholder, str) or not self.placeholder:
            raise PlanError("VisionTokens.placeholder must be a non-empty string")
        if self.images == self.field or self.images in OUTPUTS or self.field in OUTPUTS[1:]:
            raise PlanError(f"VisionTokens: field {self.field!r} and images {self.images!r} must be "
                            f"two columns other than the ones it writes {list(OUTPUTS)}")
        chat = Chat(self.tokenizer, template=self.template or ChatTemplate(), train=tuple(self.train),
                    field=self.field)
        object.__setattr__(self, "_chat", chat)

    @property
    def op_name(self) -> str:
        return self.name or "VisionTokens"

    def config(self) -> dict[str, Any]:
        chat: Chat = self._chat  # type: ignore[attr-defined]
        return {"image_token": self.image_token, "patches": self.patches.config(), "field": self.field,
                "images": self.images, "template": None if self.template is None else self.template.identity(),
                "train": list(self.train), "placeholder": self.placeholder,
                "vision_start": self.vision_start, "vision_end": self.vision_end, "bos": self.bos,
                "eos": self.eos, "tokenizer": chat._tok.identity()}  # type: ignore[attr-defined]

    def _pieces(self, value: Any, refs: Refs, i: int) -> list[tuple[str, bool]]:
        chat: Chat = self._chat  # type: ignore[attr-defined]
        if self.template is not None:
            return chat.template.render(chat._messages(value, refs, i), frozenset(self.train))
        if isinstance(value, (bytes, np.bytes_)):
            try:
                value = bytes(value).decode("utf-8")
            except UnicodeDecodeError as e:
                raise DecodeError(f"record {int(refs.record[i])} of source {int(refs.source[i])}: field "
                                  f"{self.field!r} is not UTF-8 ({e}); fix the record.") from None
        if not isinstance(value, str):
            raise DecodeError(f"record {int(refs.record[i])} of source {int(refs.source[i])}: field "
                              f"{self.field!r} is {type(value).__name__}, not caption text (give "
                              "VisionTokens(template=...) for conversations).")
        return [(value, True)]

    def apply(self, cols: Columns, refs: Refs, seed: int) -> tuple[Columns, np.ndarray | None]:
        missing = [k for k in (self.field, self.images) if k not in cols]
        if missing:
            raise PlanError(f"VisionTokens reads columns {self.field!r} (text) and {self.images!r} "
                            f"(image bytes); the rows lack {missing} (they have {sorted(cols)}). Set "
                            "VisionTokens(field=..., images=...).")
        n = len(refs)
        # 1. every image's size from its header, the whole window at once
        per_images: list[list[Any]] = []
        for i, imgs in enumerate(cols[self.images]):
            if imgs is None:
                imgs = []
            elif isinstance(imgs, (bytes, bytearray, np.bytes_)):
                imgs = [imgs]
            if not isinstance(imgs, (list, tuple, np.ndarray)):
                raise DecodeError(f"record {int(refs.record[i])} of source {int(refs.source[i])}: field "
                                  f"{self.images!r} is {type(imgs).__name__}; give a list of image bytes.")
            per_images.append(list(imgs))
        counts = np.fromiter((len(x) for x in per_images), np.int64, n)
        owner = np.repeat(np.arange(n), counts)
        starts = np.concatenate([[0], np.cumsum(counts)])

        def name(j: int) -> str:
            i = int(owner[j])
            return (f"image {j - int(starts[i])} of record {int(refs.record[i])} of source "
                    f"{int(refs.source[i])} (epoch {int(refs.epoch[i])})")

        flat = [x for imgs in per_images for x in imgs]
        sizes = image_sizes(flat, names=name)
        grids = self.patches.grids(sizes)
        ntok = self.patches.tokens(grids)
        # 2. the text pieces, split at the placeholders, all encoded in one call
        texts: list[str] = []
        plan: list[list[tuple[int, int, bool]]] = []  # per record: (kind 0 text / 1 image, index, trained)
        field = cols[self.field]
        for i in range(n):
            items: list[tuple[int, int, bool]] = []
            pieces = self._pieces(field[i], refs, i)
            k = 0
            for text, trained in pieces:
                parts = text.split(self.placeholder)
                for j, part in enumerate(parts):
                    if j:
                        items.append((1, k, False))
                        k += 1
                    if part:
                        items.append((0, len(texts), trained))
                        texts.append(part)
            if k == 0 and counts[i]:  # a caption: images first
                items = [(1, j, False) for j in range(int(counts[i]))] + items
            elif k != counts[i]:
                raise DecodeError(f"record {int(refs.record[i])} of source {int(refs.source[i])}: the "
                                  f"text has {k} {self.placeholder!r} placeholders for "
                                  f"{int(counts[i])} images; give one per image (or none: the images "
                                  "then come first).")
            plan.append(items)
        chat: Chat = self._chat  # type: ignore[attr-defined]
        ids, lens = chat._encode(texts)
        offs = np.concatenate([[0], np.cumsum(lens)])
        head = [] if self.vision_start is None else [self.vision_start]
        tail = [] if self.vision_end is None else [self.vision_end]
        toks: list[np.ndarray] = []
        masks: list[np.ndarray] = []
        imasks: list[np.ndarray] = []
        for i, items in enumerate(plan):
            t: list[np.ndarray] = []
            m: list[np.ndarray] = []
            im: list[np.ndarray] = []
            if self.bos is not None:
                t.append(np.array([self.bos], np.int32))
                m.append(np.zeros(1, np.uint8))
                im.append(np.zeros(1, np.uint8))
            for kind, j, trained in items:
                if kind == 0:
                    piece = ids[offs[j]:offs[j + 1]]
                    t.append(piece)
                    m.append(np.full(len(piece), int(trained), np.uint8))
                    im.append(np.zeros(len(piece), np.uint8))
                else:
                    c = int(ntok[starts[i] + j])
                    t.append(np.array(head + [self.image_token] * c + tail, np.int32))
                    m.append(np.zeros(c + len(head) + len(tail), np.uint8))
                    im.append(np.concatenate([np.zeros(len(head), np.uint8), np.ones(c, np.uint8),
                                              np.zeros(len(tail), np.uint8)]))
            if self.eos is not None:
                t.append(np.array([self.eos], np.int32))
                m.append(np.ones(1, np.uint8))
                im.append(np.zeros(1, np.uint8))
            toks.append(np.concatenate(t).astype(np.int32, copy=False) if t else np.zeros(0, np.int32))
            masks.append(np.concatenate(m) if m else np.zeros(0, np.uint8))
            imasks.append(np.concatenate(im) if im else np.zeros(0, np.uint8))
        rest = {k: v for k, v in cols.items() if k not in (self.field, self.images)}
        per = [slice(int(starts[i]), int(starts[i + 1])) for i in range(n)]
        imgs_col = np.empty(n, object)
        imgs_col[:] = [tuple(x) for x in per_images] if n else []
        refs_arr = np.stack([refs.source, refs.record, refs.epoch], axis=1).astype(np.int64) if n else \
            np.zeros((0, 3), np.int64)
        out = {**rest, "tokens": objects(toks), "loss_mask": objects(masks), "image_mask": objects(imasks),
               "image_grid": objects([grids[s] for s in per]),
               "image_size": objects([sizes[s].astype(np.int32) for s in per]),
               "images": imgs_col, "doc_ref": refs_arr}
        return out, None

