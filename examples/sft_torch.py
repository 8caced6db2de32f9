"""Supervised fine-tuning on chat conversations: loss on the answers only, best-fit packed.

    python examples/sft_torch.py --steps 40

Everything is made in-process (no downloads): two chat data sets (`zephon.demo.chatdata`) — short
answers (arithmetic, spelling) and long ones (counting) — and a byte-level BPE trained on them.
The pipeline, in every lane:

  Chat(tokenizer)            renders each conversation ("<|role|>\\n...<|end|>\\n" turns),
                             tokenizes it and marks the assistant's tokens (loss_mask column)
  Mix(by="trained_tokens")   1:1 in *trained* tokens, though one domain's answers are ~20x longer
  Pack(128, "best_fit")      rows of 128 tokens; the records' mask travels with the tokens and
                             loss_mask = answer token AND same document

A tiny causal transformer (attention kept inside each packed document by `segment_ids`) trains
with the loss summed over `loss_mask` only; `How(domains=True)` adds `source_id` per token,
so the loop logs the loss per domain. Half-way, the loader's state is saved and a second loader
resumes from it: the resumed run's batches and losses equal the uninterrupted run's.
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch
import torch.nn.functional as F

from zephon import How, Mix, Pipeline, Source, Where
from zephon.backends.torch import TorchLoader
from zephon.demo.chatdata import chat_texts, generate_chats
from zephon.demo.textdata import PAD_ID, train_bpe
from zephon.ops.chat import Chat, ChatTemplate
from zephon.ops.pack import Pack
from zephon.sources.columns import objects
from zephon.sources.memory import ArraySource

SEQ, LANES, BATCH = 128, 8, 16
DOMAINS = (("short", ("add", "multiply", "spell")), ("long", ("count",)))
TEMPLATE = ChatTemplate(turn="<|{role}|>\n{content}<|end|>\n")


def data(n: int = 600, vocab: int = 512):
    """The two domains' sources (conversations as JSON text, as a JSONL file would hold them)
    and a tokenizer trained on them."""
    sets = [generate_chats(n, seed=i, kinds=kinds) for i, (_, kinds) in enumerate(DOMAINS)]
    texts = [t for s in sets for t in chat_texts(s)] + ["<|user|>\n<|assistant|>\n<|system|>\n<|end|>\n"] * 50
    tokenizer = train_bpe(texts, vocab_size=vocab)
    sources = [ArraySource({"messages": objects([json.dumps(c["messages"]) for c in s])}) for s in sets]
    return sources, tokenizer


def plan(n: int = 600, lanes: int = LANES, batch: int = BATCH):
    return Mix([Source(n, id=0).shuffle(1).repeat(), Source(n, id=1).shuffle(2).repeat()], [0.5, 0.5],
               by="trained_tokens").lanes(lanes).batch(batch)


def transforms(tokenizer, seq_len: int = SEQ, mode: str = "best_fit"):
    return [Chat(tokenizer, template=TEMPLATE), Pack(seq_len, mode, max_open_bins=8)]


class TinyLM(torch.nn.Module):
    """One causal self-attention block; attention never crosses a packed document boundary."""

    def __init__(self, vocab: int, dim: int = 64) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, dim)
        self.pos = torch.nn.Embedding(SEQ, dim)
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(), torch.nn.Linear(4 * dim, dim))
        self.out = torch.nn.Linear(dim, vocab)

    def forward(self, tokens, positions, segment_ids):
        x = self.emb(tokens) + self.pos(positions)
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        L = tokens.shape[1]
        causal = torch.ones(L, L, dtype=torch.bool).tril()
        same = segment_ids[:, :, None] == segment_ids[:, None, :]
        mask = (causal & same)[:, None]
        x = x + F.scaled_dot_product_attention(q[:, None], k[:, None], v[:, None], attn_mask=mask)[:, 0]
        return self.out(x + self.mlp(x))


def sft_loss(model, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean loss over trained tokens, per-token loss * mask): nothing but loss_mask-1 positions
    — answer tokens whose predecessor is in the same document — reaches the loss."""
    logits = model(batch["tokens"].long(), batch["positions"].long(), batch["segment_ids"])
    ce = F.cross_entropy(logits.flatten(0, 1), batch["targets"].long().flatten(), reduction="none")
    masked = ce.view(batch["targets"].shape) * batch["loss_mask"]
    return masked.sum() / batch["loss_mask"].sum().clamp(min=1), masked


def train(loader, model, opt, steps: int, log: bool = True) -> list[float]:
    losses = []
    for _ in range(steps):
        batch = next(loader)
        loss, masked = sft_loss(model, batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
        if log:
            per = {name: float(masked[batch["source_id"] == d].sum()
                               / max(1, int(batch["trained_by_source"][:, d].sum())))
                   for d, (name, _) in enumerate(DOMAINS)}
            trained = batch["trained_by_source"].sum(0).tolist()
            print(f"step {loader.step - 1:3d}  loss {loss:.3f}  per domain "
                  + "  ".join(f"{k} {v:.3f}" for k, v in per.items())
                  + f"  trained tokens {trained}  padding {float((batch['segment_ids'] == 0).float().mean()):.3f}")
    return losses


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=40)
    args = ap.parse_args()
    t0 = time.perf_counter()
    sources, tok = data()
    torch.manual_seed(0)

    def fresh():
        torch.manual_seed(0)
        model = TinyLM(tok.get_vocab_size())
        return model, torch.optim.AdamW(model.parameters(), lr=3e-3)

    model, opt = fresh()
    loader = TorchLoader(Pipeline(plan(), sources, transforms(tok)), Where(rank=0, world=1), How(domains=True))
    full = train(loader, model, opt, args.steps)
    # stop half-way, save the loader (and the model), resume with a new loader
    half = args.steps // 2
    model, opt = fresh()
    first = TorchLoader(Pipeline(plan(), sources, transforms(tok)), Where(rank=0, world=1), How(domains=True))
    part = train(first, model, opt, half, log=False)
    saved = json.loads(json.dumps(first.state_dict()))  # what a checkpoint file would hold
    resumed = TorchLoader(Pipeline(plan(), sources, transforms(tok)), Where(rank=0, world=1), How(domains=True))
    resumed.load_state_dict(saved)
    part += train(resumed, model, opt, args.steps - half, log=False)
    diff = max(abs(a - b) for a, b in zip(full, part))
    print(f"resumed at step {half}: max |loss diff| = {diff:g}" + ("  (bit for bit)" if diff == 0 else ""))
    print(f"first loss {full[0]:.3f} -> last {full[-1]:.3f} ({'down' if full[-1] < full[0] else 'NOT down'}); "
          f"ln(vocab) = {math.log(tok.get_vocab_size()):.3f}; pad id {PAD_ID}; {time.perf_counter() - t0:.1f}s")


if __name__ == "__main__":
    main()
