"""Pretrain a tiny language model with PyTorch DDP on packed, mixed text from Zephon; resume on 1 process.

    python examples/lm_torch_ddp.py                       # ~1 min on 2 CPU cores
    python examples/lm_torch_ddp.py --steps 200 --workers 2 --micro-batches 4

What it does, all on CPU:

1. Data (`lm_data.py`, shared with `lm_jax_flax.py`): two JSONL corpora written to the output
   directory — real code (the Python standard library's own sources) and generated English-like
   prose — and a byte-level BPE trained on them in-process (no hub). Zephon mixes them 60/40
   *by tokens* inside every lane, tokenizes each document in the DataLoader workers (`Tokenize`,
   EOS appended) and packs them into rows of `--seq-len` tokens (`Pack(..., "concat")`: no
   padding, no token lost). The batch size warms up by tokens: half of `--batch` rows a step for
   the first two steps' tokens, then `--batch` (`batch(schedule=..., by="tokens")`, part of the plan).
2. Run A: DDP over 2 local gloo processes. Every rank iterates a `ZephonDataLoader` with
   `--workers` DataLoader workers (a packing pipeline: each worker runs a block of the rank's
   lanes) and gets only its rows of each global batch. `batch.micro_batches(n)` cuts the local
   batch into `--micro-batches` consecutive row blocks (views) for gradient accumulation
   (`net.no_sync()` on all but the last), each micro-batch's summed token loss divided by the
   global number of loss tokens (one all-reduce), so the update is the global batch's token-mean
   gradient whatever the split.
   At step `--steps // 2` it writes a checkpoint: model, optimizer and the loader state (every
   rank's state merged with `zephon.merge_states`) in one `torch.save` file.
3. Run B: a single process loads that checkpoint, builds the same loader (world size 1, the same
   workers) with `load_state_dict`, and trains the remaining steps.

4. Evaluation: at the end, A's 2 ranks and B's single process score a held-out set
   (`lm_data.eval_pipeline`): a finite plan read whole, packed, its last steps padded
   (`remainder="pad"`; the ranks agree on its end through `torch.distributed`), each rank its own
   rows, padding rows (`valid` False) skipped, every held-out token scored exactly once; the
   ranks' token losses are gathered and summed exactly. Same model, same loss at 2 ranks or 1.

B's loss curve continues A's bit for bit: the loader hands B the identical global batches (B
sees all rows that the two ranks saw together), and B reduces the gradient the way the two DDP
ranks did — each rank's row block accumulated over its micro-batches, the blocks averaged —
which is what `--same-reduction` (the default) does. With `--no-same-reduction` B simply
accumulates all micro-batches in order: the same gradient up to float rounding.

Model: a decoder-only transformer (tied embeddings, learned positions from the packer's
`positions`, attention causal *within each document* using `segment_ids`).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import gc
import json
import math
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from lm_data import add_data_args, describe_batches, eval_pipeline, lm_pipeline, row_losses, write_data
from torch.nn.parallel import DistributedDataParallel as DDP

import zephon as z
from zephon.backends.torch import ZephonDataLoader, ZephonIterableDataset


# --- data: the corpora, the tokenizer and the packed, mixed pipeline are in lm_data.py ------------
def make_loader(out: Path, args: argparse.Namespace) -> ZephonDataLoader:
    """The packed, mixed LM pipeline; rank and world come from torch.distributed (if initialised)."""
    dataset = ZephonIterableDataset(
        lm_pipeline(out, args),
        how=z.How(micro_batches=args.micro_batches),  # must split this rank's rows at every size of the ramp
        dtypes={"tokens": torch.int64, "targets": torch.int64, "segment_ids": torch.int64,
                "positions": torch.int64, "loss_mask": torch.float32})
    return ZephonDataLoader(dataset, num_workers=args.workers)


def held_out_losses(model: nn.Module, args: argparse.Namespace) -> list[float]:
    """This rank's token losses on the held-out set (its rows of every padded global batch)."""
    loader = ZephonDataLoader(ZephonIterableDataset(eval_pipeline(args.out, args)))

    def row_loss(r: dict) -> torch.Tensor:
        t = {k: torch.from_numpy(v).long() for k, v in r.items() if k != "valid"}
        logits = model(t["tokens"], t["segment_ids"], t["positions"])
        return F.cross_entropy(logits.flatten(0, 1), t["targets"].flatten(), reduction="none")

    with torch.no_grad():
        return [x for batch in loader for x in row_losses({k: v.numpy() for k, v in batch.items()}, row_loss)]


# --- model --------------------------------------------------------------------------------------
class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class TinyLM(nn.Module):
    def __init__(self, vocab: int, seq_len: int, d: int = 64, layers: int = 2, heads: int = 4) -> None:
        super().__init__()
        self.embed, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq_len, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)

    def forward(self, tokens: torch.Tensor, segment_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        causal = torch.ones(t, t, dtype=torch.bool).tril()
        mask = ((segment_ids[:, :, None] == segment_ids[:, None, :]) & causal)[:, None]  # within a document
        x = self.embed(tokens) + self.pos(positions)
        for block in self.blocks:
            x = block(x, mask)
        return self.ln(x) @ self.embed.weight.T


def summed_loss(model: nn.Module, mb: dict[str, torch.Tensor]) -> torch.Tensor:
    """Sum of the token losses of a micro-batch (padding and documents' last tokens masked)."""
    logits = model(mb["tokens"], mb["segment_ids"], mb["positions"])
    ce = F.cross_entropy(logits.flatten(0, 1), mb["targets"].flatten(), reduction="none")
    return (ce * mb["loss_mask"].flatten()).sum()


def build(args: argparse.Namespace) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)  # the same initial weights on every rank and in every run
    model = TinyLM(args.vocab, args.seq_len)
    return model, torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)


# --- run A: DDP ---------------------------------------------------------------------------------
def ddp_rank(rank: int, world: int, args: argparse.Namespace, port: int) -> None:
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    try:
        model, opt = build(args)
        net = DDP(model)
        loader = make_loader(args.out, args)  # rank/world from torch.distributed: this rank's rows only
        losses, sizes = [], []
        for step, batch in zip(range(args.steps), loader):  # range first: zip must not pull an extra batch
            sizes.append(len(batch["tokens"]) * world)  # the global batch: it grows with the ramp
            tokens = batch["loss_mask"].sum()
            dist.all_reduce(tokens)  # the global batch's loss-token count
            opt.zero_grad()
            parts = batch.micro_batches(args.micro_batches)   # row blocks of this rank's batch
            local = torch.zeros(())
            for i, mb in enumerate(parts):
                last = i == len(parts) - 1
                with net.no_sync() if not last else contextlib.nullcontext():  # all-reduce on the last
                    loss = summed_loss(net, mb) / tokens
                    # DDP averages the ranks' gradients; * world makes the sum the global mean's gradient
                    (loss * world).backward()
                local += loss.detach()
            opt.step()
            dist.all_reduce(local)  # for the log: the global batch's mean token loss
            losses.append(local.item())
            if step + 1 == args.steps // 2:
                states = [None] * world
                dist.all_gather_object(states, loader.state_dict())  # each rank's lanes
                if rank == 0:
                    data = z.merge_states(states)
                    if args.loader_state:  # also beside the model checkpoint, e.g. in a bucket
                        z.save_state(args.loader_state, data)
                    torch.save({"step": step + 1, "model": model.state_dict(), "optim": opt.state_dict(),
                                "data": data}, args.out / "checkpoint.pt")
        held = [None] * world
        dist.all_gather_object(held, held_out_losses(model, args))  # every rank's rows' token losses
        if rank == 0:
            (args.out / "run_A.json").write_text(json.dumps({"losses": losses, "sizes": sizes}))
            scores = [x for part in held for x in part]
            (args.out / "eval_A.json").write_text(json.dumps([math.fsum(scores) / len(scores), len(scores)]))
        gc.collect()  # DDP's reducer must be gone before its process group is destroyed
        dist.barrier()
    finally:
        dist.destroy_process_group()


# --- run B: one process resumes ---------------------------------------------------------------------
def resume(args: argparse.Namespace, ranks_before: int) -> list[float]:
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    ckpt = torch.load(args.out / "checkpoint.pt", weights_only=True)  # the loader state is plain data
    model, opt = build(args)
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["optim"])
    loader = make_loader(args.out, args)  # world size 1: the whole global batch
    loader.load_state_dict(z.load_state(args.loader_state) if args.loader_state else ckpt["data"])
    losses = []
    for _, batch in zip(range(ckpt["step"], args.steps), loader):
        tokens = batch["loss_mask"].sum()
        # The global batch's row blocks are exactly the ranks' local batches of run A.
        blocks = batch.micro_batches(ranks_before) if args.same_reduction else [batch]
        grads, total = [], torch.zeros(())
        for block in blocks:
            opt.zero_grad()
            local = torch.zeros(())
            for mb in block.micro_batches(args.micro_batches * (1 if args.same_reduction else ranks_before)):
                loss = summed_loss(model, mb) / tokens
                (loss * len(blocks)).backward()
                local += loss.detach()
            grads.append([p.grad.clone() for p in model.parameters()])
            total += local
        for p, *gs in zip(model.parameters(), *grads):  # the all-reduce average of run A's ranks
            p.grad = functools.reduce(torch.add, [g / len(blocks) for g in gs])
        opt.step()
        losses.append(total.item())
    scores = held_out_losses(model, args)
    (args.out / "eval_B.json").write_text(json.dumps([math.fsum(scores) / len(scores), len(scores)]))
    return losses


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--workers", type=int, default=2, help="DataLoader workers per rank")
    ap.add_argument("--micro-batches", type=int, default=2, help="gradient-accumulation slices of the local batch")
    add_data_args(ap, batch_help="global batch (rows)")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--same-reduction", action=argparse.BooleanOptionalAction, default=True,
                    help="run B reduces the gradient as run A's 2 ranks did (bit-for-bit losses)")
    ap.add_argument("--out", type=Path, default=None, help="directory for data, checkpoint and logs")
    ap.add_argument("--loader-state", default=None, metavar="URL",
                    help="also save the loader state here (a path, s3:// or gs:// URL) and resume from it")
    args = ap.parse_args()
    args.out = args.out or Path(tempfile.mkdtemp(prefix="zephon-lm-ddp-"))
    args.out.mkdir(parents=True, exist_ok=True)
    world, split = 2, args.steps // 2

    t0 = time.perf_counter()
    write_data(args.out, args)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(ddp_rank, args=(world, args, port), nprocs=world, join=True)
    run_a = json.loads((args.out / "run_A.json").read_text())
    a = run_a["losses"]
    b = resume(args, world)

    print(f"{'step':>5} {'A: 2 DDP ranks':>15} {'B: 1 process':>14}")
    for step in sorted({0, split - 1, split, args.steps - 1} | set(range(0, args.steps, max(1, args.steps // 10)))):
        print(f"{step:>5} {a[step]:>15.6f} " + (f"{b[step - split]:>14.6f}" if step >= split else ""))
    diff = max(abs(x - y) for x, y in zip(b, a[split:]))
    print(f"\nloss {a[0]:.3f} -> {a[-1]:.3f} over {args.steps} steps ({args.workers} DataLoader workers per rank, "
          f"{args.micro_batches} micro-batches per rank-step)")
    print(f"B (1 process, resumed at step {split} from A's checkpoint) vs A: max |loss diff| = {diff:.3g}"
          f"{'  (bit for bit)' if diff == 0 else ''}")
    print(f"batch sizes: {describe_batches(lm_pipeline(args.out, args).plan, args.seq_len)}; "
          f"run A's global batches had {run_a['sizes']} rows")
    print(f"{time.perf_counter() - t0:.0f}s; data, checkpoint and logs in {args.out}")
    eval_a, eval_b = (json.loads((args.out / f"eval_{x}.json").read_text()) for x in "AB")
    print(f"held-out loss ({eval_a[1]} tokens, each once; padding rows skipped): A (2 ranks) {eval_a[0]:.6f}, "
          f"B (1 process) {eval_b[0]:.6f}{'  (identical)' if eval_a == eval_b else ''}")
    if args.same_reduction and (diff != 0 or eval_a != eval_b):
        sys.exit(1)


if __name__ == "__main__":
    main()
