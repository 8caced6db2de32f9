"""CLIP-style contrastive image-text training on CPU over the demo photographs.

    python examples/clip_torch.py --steps 30

Data: `zephon.demo.images.demo_images` — JPEGs of ImageNet-like sizes re-encoded from the
photographs scikit-image and scikit-learn ship (nothing downloads), with captions, as WebDataset
shards. The pipeline, in every lane:

  WebDatasetSource(shards, ["jpg", "txt"])        samples = members sharing a key
  DecodeImage("jpg", RandomResizedCrop(64), flip)  decode fused with the crop (JPEGs reduced in
                                                   the DCT when the crop allows) -> [B, 64, 64, 3]
  Map(hash_words, batched=True)                    caption -> [B, 16] word ids (hashed)

A tiny conv image encoder and a bag-of-words text encoder are trained with the symmetric InfoNCE
loss (learned temperature), batches from `TorchLoader` on 2 worker processes. Half-way the loader's
state is saved; a second pair of loaders (2 ranks: D changes from 1 to 2) resumes from it, and the
rest of the run's global batches — crops and flips included — equal the uninterrupted run's.
"""

from __future__ import annotations

import argparse
import json
import time
import zlib

import numpy as np
import torch
import torch.nn.functional as F

import zephon as z
from zephon.backends.torch import TorchLoader
from zephon.demo.images import demo_images
from zephon.media import DecodeImage, RandomResizedCrop
from zephon.runners import processes
from zephon.sources.webdataset import WebDatasetSource

SIZE, WORDS, VOCAB, DIM = 64, 16, 4096, 64


def hash_words(cols: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Captions -> [n, WORDS] int64 word ids (crc32 of the word, 0 = padding)."""
    ids = np.zeros((len(cols["txt"]), WORDS), np.int64)
    for i, text in enumerate(cols["txt"]):
        words = text.lower().replace(",", " ").split()[:WORDS]
        ids[i, :len(words)] = [1 + zlib.crc32(w.encode()) % (VOCAB - 1) for w in words]
    return {**{k: v for k, v in cols.items() if k != "txt"}, "words": ids}


class ImageEncoder(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Conv2d(3, 16, 5, stride=2, padding=2), torch.nn.GELU(),
            torch.nn.Conv2d(16, 32, 3, stride=2, padding=1), torch.nn.GELU(),
            torch.nn.Conv2d(32, 64, 3, stride=2, padding=1), torch.nn.GELU(),
            torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(64, DIM))

    def forward(self, images: torch.Tensor) -> torch.Tensor:   # uint8 [B, H, W, 3]
        x = images.permute(0, 3, 1, 2).float() / 127.5 - 1.0
        return F.normalize(self.net(x), dim=-1)


class TextEncoder(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.EmbeddingBag(VOCAB, DIM, mode="mean", padding_idx=0)
        self.proj = torch.nn.Linear(DIM, DIM)

    def forward(self, words: torch.Tensor) -> torch.Tensor:
        return F.normalize(self.proj(self.emb(words)), dim=-1)


def loader(shards: list[str], batch: int, rank: int = 0, world: int = 1, workers: int = 2) -> TorchLoader:
    src = WebDatasetSource(shards, ["jpg", "txt"])
    ops = [DecodeImage("jpg", RandomResizedCrop(SIZE, scale=(0.35, 1.0)), flip=0.5, out="image"),
           z.Map(hash_words, batched=True, name="clip.hash_words", version=1)]
    plan = z.Source(len(src), name="demo_images").shuffle(0).repeat().lanes(8).batch(batch)
    # read_ahead: rows per read task. Text pipelines read thousands of rows at once; a decoded
    # image costs ~1 ms, so a task of one batch keeps both workers busy without decoding far ahead
    return TorchLoader(z.Pipeline(plan, src, ops, seed=1), z.Where(rank=rank, world=world),
                       z.How(read_ahead=batch, runner=processes(workers) if workers else None))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--images", type=int, default=20_000)
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    shards = list(demo_images(args.images).shards)
    img, txt = ImageEncoder(), TextEncoder()
    scale = torch.nn.Parameter(torch.tensor(np.log(10.0), dtype=torch.float32))
    opt = torch.optim.AdamW([*img.parameters(), *txt.parameters(), scale], lr=3e-3)
    half = args.steps // 2
    seen: list[bytes] = []
    t0 = time.perf_counter()
    with loader(shards, args.batch, workers=args.workers) as data:
        for step in range(args.steps):
            if step == half:   # the state before batch `half`: what a checkpoint holds
                saved = json.loads(json.dumps(data.state_dict()))
            b = next(data)
            if step >= half:
                seen.append(b["image"].numpy().tobytes())
            logits = scale.exp() * img(b["image"]) @ txt(b["words"]).T
            target = torch.arange(len(logits))
            loss = (F.cross_entropy(logits, target) + F.cross_entropy(logits.T, target)) / 2
            opt.zero_grad()
            loss.backward()
            opt.step()
            acc = (logits.argmax(1) == target).float().mean().item()
            if step % 5 == 0 or step == args.steps - 1:
                print(f"step {step:3d}  loss {loss.item():.3f}  image->text top-1 {acc:.2f}  "
                      f"({(step + 1) * args.batch / (time.perf_counter() - t0):.0f} img/s)", flush=True)
    # resume the second half on 2 ranks (inline): the global batches must equal the ones trained on
    ranks = [loader(shards, args.batch, rank=r, world=2, workers=0) for r in range(2)]
    for r in ranks:
        r.load_state_dict(saved)
    same = 0
    for k in range(args.steps - half):
        parts = [next(r)["image"].numpy() for r in ranks]
        same += np.concatenate(parts).tobytes() == seen[k]
    for r in ranks:
        r.close()
    print(f"resumed at step {half} on 2 ranks: {same} of {args.steps - half} global batches identical")


if __name__ == "__main__":
    main()
