"""Vision-language packing: documents of text and image placeholders into rows under two budgets.

`VLMPack` is a lane accumulator after `VisionTokens`. A row holds at most `seq_len` tokens (text
and image placeholders) and at most `max_patches` vision patches (and `max_images` images); each
document (a caption or a conversation with its images) goes whole into the open row it fills
best — the one whose token and patch fill (fractions of the two budgets, summed) is highest
after it — else a new row opens; when `max_open_bins` rows are open, the fullest is emitted. A
row is emitted as soon as one budget is exactly full. Documents are never split (an image's
patches and its placeholders stay in one row); one that cannot fit an empty row is an error
naming its record and the fix.

Why per lane, before sharding: lanes are the canonical unit of the stream (rank r owns a fixed
block of lanes at every D), so the rows — and with them each rank's vision work — are the same
at every D, and every row's patch count is near the budget: the vision work per rank is
balanced by construction, not by a per-rank repacking after sharding.

Planning uses header sizes only: `VisionTokens` computed every image's grid from its header, and
the placement above reads nothing else. Pixels are decoded when a row is emitted (its contents
fixed), by `zephon.media.decode.decode_image` (reduced-size DCT decode when the image is
resized smaller), resized to the grid's size and cut into patches (`Patches.cut`). The carry
names the open rows' documents by position (`{"bins": [[input, ...], ...]}`), never their data:
a restore re-reads and re-tokenizes just those documents (headers only) and decodes their
images when their row is emitted, as an uninterrupted run would.

Fields of each row (static shapes; `R` rows, `L = seq_len`, `P = max_patches`, `M = max_images`):

- `tokens`, `targets` (the next token of the same document, `pad_id` at a document's end),
  `loss_mask` (1 where the target is trained: the chat masks; never an image token), `positions`
  (0-based within each document), `segment_ids` (1, 2, ... per document, 0 for padding),
  `cu_seqlens` (`[R, max_segments + 1]`, padded with the row's token count), `image_mask` (1 on
  image placeholder tokens): `[R, L]` int32 (uint8 for the masks).
- `pixel_values` `[R, P, patch_dim]` uint8: the row's patches, images in token order, padded with
  zeros; `patch_mask` `[R, P]` uint8 (1 on real patches).
- `image_grid` `[R, M, 3]` int32: each image's (t, h, w) in patches (zeros for no image);
  `image_offsets` `[R, M + 1]` int32: where each image's patches start in the row, padded with the
  row's patch count (as `cu_seqlens` for tokens).

`zephon.media.vlm_batch.packed_patches` turns a batch into the dynamic form
(`pixel_values [N_patches, patch_dim]`, `grid_thw [N_images, 3]`, ...).
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from dataclasses import field as dc_field
from functools import cache
from typing import Any

import numpy as np

from zephon.errors import DecodeError, PlanError, check_positive_int
from zephon.media.patches import Patches
from zephon.ops.base import Accumulator, AccumulatorStep
from zephon.sources.base import Columns

__all__ = ["VLMPack"]

#: the columns VLMPack reads (VisionTokens' outputs and the image bytes)
INPUTS = frozenset({"tokens", "loss_mask", "image_mask", "image_grid", "image_size", "images", "doc_ref"})
OUTPUTS = ("tokens", "targets", "loss_mask", "positions", "segment_ids", "cu_seqlens", "image_mask",
           "pixel_values", "patch_mask", "image_grid", "image_offsets")


@cache
def _pool(threads: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(threads, thread_name_prefix="zephon-vlm-decode")


@dataclass(frozen=True)
class VLMPack(Accumulator):
    """Packs `VisionTokens` documents into rows of `seq_len` tokens and `max_patches` patches.

    Args:
      seq_len: tokens per row (text and image placeholders).
      max_patches: vision patches per row (the static patch budget `P`).
      patches: the same `Patches` as the `VisionTokens` before it (patch size, merge, sizing).
      max_images: most images per row (`M`, the width of `image_grid`).
      max_open_bins: open rows (bounds the carry and how long a document waits).
      max_segments: most documents per row (the width of `cu_seqlens` minus one; default seq_len).
      pad_id: id of padding tokens and of targets with no next token.
      decoder: the decoder `decode_image` uses (None: the fastest installed); part of the identity.
      threads: threads decoding a step's images (0: up to 4); pixels do not depend on it.
      drop: other columns of the records, left out (any other column is refused, naming it).
    """

    streams = True  # documents are placed one at a time, however the inputs are cut into calls

    seq_len: int
    max_patches: int
    patches: Patches = dc_field(default_factory=Patches)
    max_images: int = 16
    max_open_bins: int = 8
    max_segments: int | None = None
    pad_id: int = 0
    decoder: str | None = None
    threads: int = 0
    drop: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        check_positive_int(self.seq_len, "VLMPack.seq_len")
        check_positive_int(self.max_patches, "VLMPack.max_patches")
        check_positive_int(self.max_images, "VLMPack.max_images")
        check_positive_int(self.max_open_bins, "VLMPack.max_open_bins")
        if self.max_segments is not None:
            check_positive_int(self.max_segments, "VLMPack.max_segments")
        if not isinstance(self.patches, Patches):
            raise PlanError(f"VLMPack.patches must be a Patches, got {type(self.patches).__name__}")
        if isinstance(self.threads, bool) or not isinstance(self.threads, int) or self.threads < 0:
            raise PlanError(f"VLMPack.threads must be an int >= 0, got {self.threads!r}")
        if isinstance(self.drop, str) or not all(isinstance(d, str) for d in self.drop):
            raise PlanError(f"VLMPack.drop must be a tuple of column names, got {self.drop!r}")
        object.__setattr__(self, "drop", tuple(self.drop))

    def config(self) -> dict[str, Any]:
        return {"seq_len": self.seq_len, "max_patches": self.max_patches, "patches": self.patches.config(),
                "max_images": self.max_images, "max_open_bins": self.max_open_bins,
                "max_segments": self.max_segments, "pad_id": self.pad_id,
                "decoder": _decoder_identity(self.decoder), "drop": list(self.drop)}

    # --- placement (sizes only) ----------------------------------------------------------------
    def _sizes(self, cols: Columns) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(tokens, patches, images) of each document."""
        toks = np.fromiter((len(t) for t in cols["tokens"]), np.int64, len(cols["tokens"]))
        grids = cols["image_grid"]
        pats = np.fromiter((int(np.asarray(g, np.int64).reshape(-1, 3).prod(axis=1).sum()) for g in grids),
                           np.int64, len(grids))
        imgs = np.fromiter((len(g) for g in grids), np.int64, len(grids))
        return toks, pats, imgs

    def _check(self, cols: Columns) -> None:
        if not cols:
            return
        missing = sorted(INPUTS - set(cols))
        if missing:
            raise PlanError(f"VLMPack reads the columns VisionTokens writes; the rows lack {missing} "
                            f"(they have {sorted(cols)}). Put VisionTokens(...) before VLMPack.")
        extra = sorted(set(cols) - INPUTS - set(self.drop))
        if extra:
            raise PlanError(f"VLMPack emits only its own fields and the records carry {extra}; "
                            f"name them in VLMPack(drop={tuple(extra)!r}) to leave them out.")

    def _too_big(self, cols: Columns, i: int, t: int, p: int, k: int) -> DecodeError:
        s, r, e = (int(x) for x in cols["doc_ref"][i])
        return DecodeError(
            f"record {r} of source {s} (epoch {e}) has {t} tokens, {p} patches and {k} images, more "
            f"than one row holds (seq_len={self.seq_len}, max_patches={self.max_patches}, "
            f"max_images={self.max_images}); documents are never split. Raise the budgets, lower "
            "Patches.max_pixels, or filter such records before packing.")

    def check_carry(self, carry: Any, held: Columns) -> None:
        n = len(held.get("tokens", ())) if held else 0
        if carry is None:
            if n:
                raise ValueError(f"{n} held inputs but no carry naming them")
            return
        if not isinstance(carry, dict) or set(carry) != {"bins"} or not isinstance(carry["bins"], list):
            raise ValueError(f"VLMPack's carry is {{'bins': [[input, ...], ...]}}; got {carry!r}")
        seen: list[int] = []
        for b in carry["bins"]:
            if not isinstance(b, list) or not b or any(isinstance(x, bool) or not isinstance(x, int) for x in b):
                raise ValueError(f"bin {b!r} is not a non-empty list of held input indices")
            seen += b
        if sorted(seen) != list(range(n)):
            raise ValueError(f"the carry's bins name held inputs {sorted(seen)}, but {n} are held")
        if len(carry["bins"]) > self.max_open_bins:
            raise ValueError(f"{len(carry['bins'])} open bins, more than max_open_bins {self.max_open_bins}")
        toks, pats, imgs = self._sizes(held)
        for b in carry["bins"]:
            if (int(toks[b].sum()) > self.seq_len or int(pats[b].sum()) > self.max_patches
                    or int(imgs[b].sum()) > self.max_images):
                raise ValueError(f"bin {b!r} exceeds the row budgets")

    def step(self, carry: Any, held: Columns, new: Columns, demand: int) -> AccumulatorStep:
        return self._step(carry, held, new, demand, final=False)

    def finish(self, carry: Any, held: Columns, new: Columns, demand: int) -> AccumulatorStep:
        """The lane ended (a finite plan): every open row is emitted, so no document is lost."""
        return self._step(carry, held, new, demand, final=True)

    def _step(self, carry: Any, held: Columns, new: Columns, demand: int, final: bool) -> AccumulatorStep:
        self._check(held)
        self._check(new)
        h = len(held["tokens"]) if held else 0
        cols: Columns = {k: np.concatenate([held[k], new[k]]) if held and new else (held or new)[k]
                         for k in INPUTS} if (held or new) else {}
        n = len(cols["tokens"]) if cols else 0
        toks, pats, imgs = self._sizes(cols) if n else (np.zeros(0, np.int64),) * 3
        L, P, M = self.seq_len, self.max_patches, self.max_images
        cap = self.max_segments or L
        bins: list[list[int]] = [list(b) for b in carry["bins"]] if carry else []
        used = [[int(toks[b].sum()), int(pats[b].sum()), int(imgs[b].sum())] for b in bins]
        rows: list[list[int]] = []

        def fill(u: list[int]) -> float:
            return u[0] / L + u[1] / P

        q = h
        while q < n and len(rows) < demand:
            t, p, k = int(toks[q]), int(pats[q]), int(imgs[q])
            if t > L or p > P or k > M:
                raise self._too_big(cols, q, t, p, k)
            best, score = -1, -1.0
            for j, u in enumerate(used):
                if (u[0] + t <= L and u[1] + p <= P and u[2] + k <= M and len(bins[j]) < cap):
                    s = (u[0] + t) / L + (u[1] + p) / P
                    if s > score:
                        best, score = j, s
            if best < 0:
                if len(bins) < self.max_open_bins:
                    bins.append([])
                    used.append([0, 0, 0])
                    best = len(bins) - 1
                else:  # every row open: the fullest goes out (first of equals)
                    j = max(range(len(bins)), key=lambda x: (fill(used[x]), -x))
                    rows.append(bins.pop(j))
                    used.pop(j)
                    continue
            bins[best].append(q)
            u = used[best]
            u[0] += t
            u[1] += p
            u[2] += k
            if u[0] == L or u[1] == P or u[2] == M or len(bins[best]) >= cap:
                rows.append(bins.pop(best))
                used.pop(best)
            q += 1
        while final and q >= n and bins and len(rows) < demand:  # the end: open rows out, in order
            rows.append(bins.pop(0))
        referenced = sorted(x for b in bins for x in b)
        slot = {d: i for i, d in enumerate(referenced)}
        new_carry = {"bins": [[slot[d] for d in b] for b in bins]} if bins else None
        segments = [[(d, 0, int(toks[d])) for d in row] for row in rows]
        return AccumulatorStep(self._emit(cols, rows), max(0, q - h), referenced, new_carry, segments)

    # --- rows (pixels decoded here, once the rows are fixed) ------------------------------------
    def _emit(self, cols: Columns, rows: list[list[int]]) -> Columns:
        R, L, P, M = len(rows), self.seq_len, self.max_patches, self.max_images
        width = (self.max_segments or L) + 1
        dt = np.int32
        tokens = np.full((R, L), self.pad_id, dt)
        targets = np.full((R, L), self.pad_id, dt)
        seg = np.zeros((R, L), dt)
        pos = np.zeros((R, L), dt)
        loss = np.zeros((R, L), np.uint8)
        imask = np.zeros((R, L), np.uint8)
        cu = np.zeros((R, width), dt)
        pixels = np.zeros((R, P, self.patches.dim), np.uint8)
        pmask = np.zeros((R, P), np.uint8)
        grid = np.zeros((R, M, 3), dt)
        ioff = np.zeros((R, M + 1), dt)
        count = np.arange(L + 1)
        jobs: list[tuple[int, int, int, int]] = []  # (row, patch offset, document, image)
        for r, row in enumerate(rows):
            at = pat = img = 0
            for k, d in enumerate(row):
                x = cols["tokens"][d]
                n = len(x)
                tokens[r, at:at + n] = x
                targets[r, at:at + n - 1] = x[1:]
                loss[r, at:at + n - 1] = np.asarray(cols["loss_mask"][d][1:]) != 0
                imask[r, at:at + n] = cols["image_mask"][d]
                seg[r, at:at + n] = k + 1
                pos[r, at:at + n] = count[:n]
                at += n
                cu[r, k + 1] = at
                for j, g in enumerate(np.asarray(cols["image_grid"][d], np.int64).reshape(-1, 3)):
                    grid[r, img] = g
                    ioff[r, img] = pat
                    jobs.append((r, pat, d, j))
                    pat += int(g.prod())
                    img += 1
            cu[r, len(row) + 1:] = at
            ioff[r, img:] = pat
            pmask[r, :pat] = 1

        def one(job: tuple[int, int, int, int]) -> None:
            r, at, d, j = job
            cut = self._patches(cols, d, j)
            pixels[r, at:at + len(cut)] = cut

        threads = self.threads or 4
        if len(jobs) > 1 and threads > 1:
            list(_pool(threads).map(one, jobs))
        else:
            for job in jobs:
                one(job)
        return {"tokens": tokens, "targets": targets, "loss_mask": loss, "positions": pos,
                "segment_ids": seg, "cu_seqlens": cu, "image_mask": imask, "pixel_values": pixels,
                "patch_mask": pmask, "image_grid": grid, "image_offsets": ioff}

    def _patches(self, cols: Columns, d: int, j: int) -> np.ndarray:
        """Image j of document d: decoded, checked against its header size, resized, cut."""
        from zephon.media.decode import decode_image, reduction
        from zephon.media.headers import image_format

        data = cols["images"][d][j]
        h, w = (int(v) for v in cols["image_size"][d][j])
        H, W = self.patches.resized(h, w)
        s, r, e = (int(v) for v in cols["doc_ref"][d])
        try:
            a = decode_image(data, min_size=(H, W), decoder=self.decoder,
                             mode="RGB" if self.patches.channels == 3 else "L")
        except DecodeError as err:
            raise DecodeError(f"image {j} of record {r} of source {s} (epoch {e}): {err}") from err
        f = reduction((h, w), (H, W)) if image_format(data) == "jpeg" else 1  # DCT scaling: JPEG only
        if a.shape[:2] != (math.ceil(h / f), math.ceil(w / f)):
            raise DecodeError(f"image {j} of record {r} of source {s} (epoch {e}): its header says "
                              f"{h}x{w} but it decodes to {a.shape[0]}x{a.shape[1]} (at 1/{f}); the "
                              "file is inconsistent. Re-encode or remove it.")
        if a.shape[:2] != (H, W):
            a = _resize(a, H, W, self.decoder)
        return self.patches.cut(a)


def _decoder_identity(decoder: str | None) -> dict[str, str]:
    from zephon.media.decode import as_decoder

    return as_decoder(decoder).identity()


def _resize(a: np.ndarray, h: int, w: int, decoder: str | None) -> np.ndarray:
    """`a` resized to h x w by the library the decoder's identity names (area filter when shrinking,
    bicubic when enlarging)."""
    from zephon.media.decode import as_decoder

    lib = as_decoder(decoder).resolve().resize
    shrink = h <= a.shape[0] and w <= a.shape[1]
    if lib == "opencv":
        import cv2

        out = cv2.resize(a, (w, h), interpolation=cv2.INTER_AREA if shrink else cv2.INTER_CUBIC)
        return out[:, :, None] if out.ndim == 2 else out
    from PIL import Image

    im = Image.fromarray(a[:, :, 0] if a.shape[2] == 1 else a)
    out = np.asarray(im.resize((w, h), Image.Resampling.BOX if shrink else Image.Resampling.BICUBIC))
    return out[:, :, None] if out.ndim == 2 else out
