"""Elastic training: does a training run change when the number of data-parallel ranks changes?

    make experiment                    # = python benchmarks/elastic_training.py (~10 min, 2 cores)
    python benchmarks/elastic_training.py --quick     # a smoke run of the whole thing (~1 min)

The same tiny language model is trained from the same initial weights on the same data with the
same global batch, once for every data-parallel degree D in {1, 2, 4, 8}, with three loaders:

  distributed_sampler  what PyTorch users do today: one map-style data set of all documents
                       (ConcatDataset of the two corpora), `DistributedSampler(num_replicas=D,
                       rank=r, shuffle=True, seed)` per rank with `set_epoch`, and per-rank
                       concat-then-split packing of the rank's documents (an IterableDataset
                       under `DataLoader(batch_size=B/D)`).
  grain                what Grain users do: `MapDataset.source(corpus).shuffle(seed).repeat()` per
                       corpus, `MapDataset.mix` of the two, sliced per rank with
                       `ShardOptions(shard_index=r, shard_count=D)` as `ds[r::D]`, tokenized in a
                       `map`, packed with `grain.experimental.ConcatThenSplitIterDataset`, batched
                       `B/D`. (Grain's `ElasticIterator` refuses packing, so it is not an option.)
  zephon               `Mix([...], by="tokens").lanes(16).batch(B)` with per-source `Tokenize` and
                       `Pack(seq_len, "concat")`, through `zephon.Loader(rank=r, world=D)` (whose
                       rows `TorchLoader` would hand out as `torch.from_numpy` views).

Data: real text that exists offline everywhere — the Python standard library's own source files —
and generated English-like prose (`zephon.demo.textdata.generate_corpus`), the prose cut to as many
tokens as the code so that every loader's mixture is 50/50 in tokens (Zephon mixes by tokens
with weights 0.5/0.5; the baselines mix documents in proportion to their counts). A byte-level
BPE (vocab 1024) is trained in-process on the training documents. Held-out documents of both
corpora, packed once into 64 fixed rows, are the eval set.

DDP in one process. Each step, every rank's local batch (B/D rows) is built by that rank's own
loader; the D local batches are concatenated in rank order into the global batch, and the loss is
the mean over its loss tokens. That is the gradient DDP's all-reduce average computes when each
rank normalises its summed loss by the global count of loss tokens (so ranks holding more real
tokens weigh more, as they should); computing it in one pass removes only the float summation
order of the all-reduce. To show how small that part is, one more Zephon run at D = 8 computes
every rank's gradient separately and sums them (DDP's arithmetic); its final eval loss is
reported next to the one-pass run's ("ddp_float_order").

Model: a decoder-only transformer (d=128, 4 layers, 4 heads, ~0.94M parameters, tied
embeddings, learned positions from the packer's `positions`, attention causal within each
document via `segment_ids`), AdamW with warm-up and cosine decay, gradient clipping, float32,
one CPU thread per run and `torch.use_deterministic_algorithms(True)`, no dropout. Runs go two at
a time (the machine has 2 cores).

Resume: each loader's D = 2 run saves model + optimizer at step S; a run resumed from there under
D = 8 trains to the end. Zephon restores its loader state (the two ranks' states merged) on 8
ranks. Neither baseline has a loader state that transfers to another D (Grain's per-shard
iterator states describe shards of another pipeline; DistributedSampler has only an epoch), so
they resume the common way: the new D = 8 pipeline skips the S global batches already trained on.

Also recorded, for every global batch: the share of its tokens that come from the code corpus
(`code_share_per_global_batch`: mean and spread over steps per loader and D). Every loader aims at
50/50; how evenly each batch holds it is what per-rank packing changes with D.

Writes benchmarks/results/elastic_training.json (config, "spread": {loader: max - min final eval
loss over D}, curves, resume, which global batches equal D = 1's, batch composition) and
elastic_training.png, and prints the table.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import multiprocessing as mp
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

RESULTS = Path(__file__).resolve().parent / "results"
LOADERS = ("distributed_sampler", "grain", "zephon")
LABELS = {"distributed_sampler": "DistributedSampler + per-rank packing",
          "grain": "Grain ShardOptions + ConcatThenSplit",
          "zephon": "Zephon"}
DEGREES = (1, 2, 4, 8)
FIELDS = ("tokens", "targets", "loss_mask", "segment_ids", "positions")


@dataclass(frozen=True)
class Config:
    steps: int = 250
    eval_every: int = 25
    stop_step: int = 125          # S: stop under D=2, resume under D=8
    seq_len: int = 128
    batch: int = 16               # global batch (rows of seq_len tokens)
    lanes: int = 16               # Zephon lanes (any D dividing 16)
    vocab: int = 1024
    d_model: int = 128
    layers: int = 4
    heads: int = 4
    lr: float = 3e-3
    warmup: int = 20
    seed: int = 0
    max_doc_chars: int = 16_000   # stdlib files longer than this are left out
    prose_pool: int = 4000        # generated prose documents, cut to the code's token count
    eval_rows: int = 32           # per corpus
    code_every: int = 3           # every 3rd eligible stdlib file is a training document
    workers: int = 2              # runs in parallel


QUICK = Config(steps=12, eval_every=4, stop_step=8, d_model=32, layers=1, heads=2, vocab=512,
               eval_rows=4, code_every=24, prose_pool=500)


# --- data ---------------------------------------------------------------------------------------
def prepare(cfg: Config, workdir: Path) -> dict[str, Any]:
    """Corpora, tokenizer and eval rows, written to `workdir` for the worker processes."""
    from zephon.demo.textdata import EOS_ID, generate_corpus, python_stdlib_corpus, train_bpe

    eligible = [t for t in python_stdlib_corpus() if 200 <= len(t) <= cfg.max_doc_chars]
    code_train = [t for i, t in enumerate(eligible) if i % cfg.code_every == 0]
    code_eval = [t for i, t in enumerate(eligible) if i % 30 == 1]   # disjoint from training
    prose_pool = generate_corpus(cfg.prose_pool, seed=1)
    prose_eval = generate_corpus(80, seed=7)
    tok = train_bpe(code_train + prose_pool, vocab_size=cfg.vocab)

    def lengths(texts: list[str]) -> np.ndarray:
        return np.array([len(e.ids) + 1 for e in tok.encode_batch(texts, add_special_tokens=False)])

    code_tokens = int(lengths(code_train).sum())
    keep = int(np.searchsorted(np.cumsum(lengths(prose_pool)), code_tokens)) + 1
    prose_train = prose_pool[:keep]
    prose_tokens = int(lengths(prose_train).sum())

    def eval_rows(texts: list[str]) -> dict[str, np.ndarray]:
        packer = ConcatSplit(cfg.seq_len)
        rows: list[dict[str, np.ndarray]] = []
        for e in tok.encode_batch(texts, add_special_tokens=False):
            packer.add(np.array(e.ids + [EOS_ID], np.int64))
            rows += packer.rows()
            if len(rows) >= cfg.eval_rows:
                break
        if len(rows) < cfg.eval_rows:
            raise RuntimeError(f"eval documents fill only {len(rows)} rows of {cfg.seq_len}")
        return {k: np.stack([r[k] for r in rows[:cfg.eval_rows]]) for k in FIELDS}

    ev = [eval_rows(code_eval), eval_rows(prose_eval)]
    np.savez(workdir / "eval.npz", **{k: np.concatenate([e[k] for e in ev]) for k in FIELDS})
    tok.save(str(workdir / "tokenizer.json"))
    (workdir / "corpora.json").write_text(json.dumps({"code": code_train, "prose": prose_train}))
    return {"code_docs": len(code_train), "code_tokens": code_tokens, "prose_docs": len(prose_train),
            "prose_tokens": prose_tokens, "eval_rows": 2 * cfg.eval_rows,
            "eval_docs": {"code": len(code_eval), "prose": len(prose_eval)},
            "vocab": tok.get_vocab_size(), "stdlib_files_eligible": len(eligible)}


class ConcatSplit:
    """Concat-then-split packing of one stream of documents (the baselines' per-rank packer and
    the eval set's): documents laid end to end, cut every `seq_len` tokens; a document crossing a
    row continues in the next row. Fields as Zephon's `Pack`: `targets` is the next token of the
    same document (pad after its last token, where `loss_mask` is 0), `segment_ids` count the
    pieces of a row from 1, `positions` restart at 0 in every piece."""

    def __init__(self, seq_len: int, pad: int = 0) -> None:
        self.seq_len, self.pad = seq_len, pad
        self.pieces: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        self.held = 0

    def add(self, tokens: np.ndarray, source: int = 0) -> None:
        targets = np.append(tokens[1:], self.pad)
        mask = np.ones(len(tokens), np.int64)
        mask[-1] = 0
        self.pieces.append((tokens, targets, mask, np.full(len(tokens), source, np.int64)))
        self.held += len(tokens)

    def rows(self) -> list[dict[str, np.ndarray]]:
        out = []
        while self.held >= self.seq_len:
            row = {k: [] for k in (*FIELDS, "source")}
            need, seg = self.seq_len, 0
            while need:
                piece = self.pieces[0]
                n = min(need, len(piece[0]))
                seg += 1
                for k, v in zip(("tokens", "targets", "loss_mask", "source"), piece):
                    row[k].append(v[:n])
                row["segment_ids"].append(np.full(n, seg, np.int64))
                row["positions"].append(np.arange(n, dtype=np.int64))
                if n == len(piece[0]):
                    self.pieces.pop(0)
                else:
                    self.pieces[0] = tuple(v[n:] for v in piece)
                need -= n
            self.held -= self.seq_len
            out.append({k: np.concatenate(v) for k, v in row.items()})
        return out


_DATA: dict[str, Any] = {}


def data(workdir: str) -> dict[str, Any]:
    """The prepared data, loaded once per worker process."""
    if _DATA.get("dir") != workdir:
        from tokenizers import Tokenizer

        corpora = json.loads(Path(workdir, "corpora.json").read_text())
        with np.load(Path(workdir, "eval.npz")) as f:
            ev = {k: f[k] for k in f.files}
        _DATA.clear()
        _DATA.update(dir=workdir, code=corpora["code"], prose=corpora["prose"], eval=ev,
                     tokenizer=Tokenizer.from_file(str(Path(workdir, "tokenizer.json"))))
    return _DATA


# --- the three loaders: each yields rank r's local batches ------------------------------------------
def distributed_sampler_rank(d: dict[str, Any], cfg: Config, rank: int, world: int) -> Iterator[dict]:
    import torch
    from torch.utils.data import ConcatDataset, DataLoader, DistributedSampler, IterableDataset

    from zephon.demo.textdata import EOS_ID

    docs = ConcatDataset([d["code"], d["prose"]])
    tok = d["tokenizer"]

    class PackedDocuments(IterableDataset):
        def __iter__(self):
            sampler = DistributedSampler(docs, num_replicas=world, rank=rank, shuffle=True,
                                         seed=cfg.seed)
            packer = ConcatSplit(cfg.seq_len)
            epoch = 0
            while True:
                sampler.set_epoch(epoch)
                for i in sampler:
                    packer.add(np.array(tok.encode(docs[i], add_special_tokens=False).ids + [EOS_ID], np.int64),
                               source=int(i >= len(d["code"])))   # (source only for the statistics)
                    yield from packer.rows()
                epoch += 1

    del torch
    return iter(DataLoader(PackedDocuments(), batch_size=cfg.batch // world, num_workers=0))


def grain_rank(d: dict[str, Any], cfg: Config, rank: int, world: int) -> Iterator[dict]:
    import grain
    from grain.experimental import ConcatThenSplitIterDataset

    from zephon.demo.textdata import EOS_ID

    tok = d["tokenizer"]
    shard = grain.sharding.ShardOptions(shard_index=rank, shard_count=world, drop_remainder=True)

    def tokenize(doc: tuple[str, int]) -> dict[str, np.ndarray]:
        text, source = doc
        tokens = np.array(tok.encode(text, add_special_tokens=False).ids + [EOS_ID], np.int64)
        mask = np.ones(len(tokens), np.int64)
        mask[-1] = 0
        return {"tokens": tokens, "targets": np.append(tokens[1:], 0), "loss_mask": mask,
                "source": np.full(len(tokens), source, np.int64)}   # (source only for the statistics)

    code = grain.MapDataset.source(d["code"]).shuffle(seed=cfg.seed).repeat().map(lambda t: (t, 0))
    prose = grain.MapDataset.source(d["prose"]).shuffle(seed=cfg.seed + 1).repeat().map(lambda t: (t, 1))
    ds = grain.MapDataset.mix([code, prose], weights=[len(d["code"]), len(d["prose"])])
    # in-memory data: Grain recommends num_threads=0 (no read threads contending for the GIL)
    ds = ds[shard.shard_index::shard.shard_count].map(tokenize)
    ds = ds.to_iter_dataset(grain.ReadOptions(num_threads=0))
    ds = ConcatThenSplitIterDataset(
        ds, length_struct=dict.fromkeys(("tokens", "targets", "loss_mask", "source"), cfg.seq_len))
    ds = ds.batch(cfg.batch // world)
    for b in ds:
        yield {"tokens": b["tokens"], "targets": b["targets"], "loss_mask": b["loss_mask"],
               "segment_ids": b["tokens_segment_ids"], "positions": b["tokens_positions"], "source": b["source"]}


def zephon_plan(d: dict[str, Any], cfg: Config):
    import zephon as z

    return z.Mix([z.Source(len(d["code"]), id=0).shuffle(cfg.seed).repeat(),
                  z.Source(len(d["prose"]), id=1).shuffle(cfg.seed + 1).repeat()],
                 [0.5, 0.5], by="tokens").lanes(cfg.lanes).batch(cfg.batch)


class ZephonRank:
    """Rank r's `zephon.Loader`, its local batches as numpy rows (torch.from_numpy of them is what
    `TorchLoader` hands out) plus each token's source, from the batch's segments."""

    def __init__(self, loader) -> None:
        self.loader = loader

    def __next__(self) -> dict[str, np.ndarray]:
        batch = next(self.loader)
        out = dict(batch.data)
        source = np.zeros(out["tokens"].shape, np.int64)
        for j, row in enumerate(batch.segments):
            at = 0
            for s, _, _, a, b in row:
                source[j, at:at + b - a] = s
                at += b - a
        out["source"] = source
        return out

    def state_dict(self) -> dict:
        return self.loader.state()

    def load_state_dict(self, state: dict) -> None:
        self.loader.restore(state)


def zephon_rank(d: dict[str, Any], cfg: Config, rank: int, world: int) -> ZephonRank:
    import zephon as z
    from zephon.demo.textdata import EOS_ID
    from zephon.ops.pack import Pack
    from zephon.ops.tokenize import Tokenize
    from zephon.sources.memory import ArraySource

    def texts(xs: list[str]) -> ArraySource:
        a = np.empty(len(xs), object)
        a[:] = xs
        return ArraySource({"text": a})

    tokenize = [Tokenize(d["tokenizer"], eos=EOS_ID)]
    return ZephonRank(z.Loader(z.Pipeline(zephon_plan(d, cfg), [texts(d["code"]), texts(d["prose"])],
                                          [Pack(cfg.seq_len, "concat")], per_source={0: tokenize, 1: tokenize}),
                               z.Where(rank=rank, world=world)))


class GlobalBatches:
    """D ranks' loaders; `next()` is the global batch: their local batches in rank order."""

    def __init__(self, loader: str, d: dict[str, Any], cfg: Config, world: int, *, skip: int = 0,
                 zephon_state: dict | None = None) -> None:
        make = {"distributed_sampler": distributed_sampler_rank, "grain": grain_rank,
                "zephon": zephon_rank}[loader]
        self.loader, self.world = loader, world
        self.ranks = [make(d, cfg, r, world) for r in range(world)]
        if zephon_state is not None:
            for r in self.ranks:
                r.load_state_dict(zephon_state)
        for _ in range(skip):      # the baselines' resume: skip the batches already trained on
            for r in self.ranks:
                next(r)

    def __next__(self) -> tuple[dict[str, Any], float]:
        """(global batch as int64 tensors, share of its real tokens that come from the code corpus)."""
        import torch

        local = [next(r) for r in self.ranks]
        batch = {k: torch.cat([torch.as_tensor(np.asarray(b[k])) for b in local]).long() for k in FIELDS}
        source = np.concatenate([np.asarray(b["source"]) for b in local])
        real = batch["segment_ids"].numpy() > 0
        return batch, float((source[real] == 0).mean())

    def state(self) -> dict[str, Any] | None:
        if self.loader != "zephon":
            return None
        from zephon import merge_states

        return merge_states([r.state_dict() for r in self.ranks])


def digest(batch: dict[str, Any]) -> str:
    h = hashlib.sha1()
    for k in FIELDS:
        h.update(batch[k].numpy().astype(np.int32).tobytes())
    return h.hexdigest()[:16]


# --- the model ------------------------------------------------------------------------------------
def make_model(cfg: Config):
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            d = cfg.d_model
            self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

        def forward(self, x, mask):
            b, t, d = x.shape
            q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, cfg.heads, d // cfg.heads).permute(2, 0, 3, 1, 4)
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
            return x + self.out(F.gelu(self.fc(self.ln2(x))))

    class TinyLM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(cfg.vocab, cfg.d_model)
            self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)
            self.blocks = nn.ModuleList(Block() for _ in range(cfg.layers))
            self.ln = nn.LayerNorm(cfg.d_model)
            for m in self.modules():
                if isinstance(m, (nn.Linear, nn.Embedding)):
                    nn.init.normal_(m.weight, std=0.02)
                if isinstance(m, nn.Linear):
                    nn.init.zeros_(m.bias)

        def forward(self, tokens, segment_ids, positions):
            t = tokens.shape[1]
            causal = torch.ones(t, t, dtype=torch.bool).tril()
            mask = (segment_ids[:, :, None] == segment_ids[:, None, :]) & causal  # within a document
            x = self.embed(tokens) + self.pos(positions)
            for block in self.blocks:
                x = block(x, mask[:, None])
            return self.ln(x) @ self.embed.weight.T   # tied output embedding

    torch.manual_seed(cfg.seed)   # the same initial weights in every run
    return TinyLM()


def token_losses(model, batch):
    import torch.nn.functional as F

    logits = model(batch["tokens"], batch["segment_ids"], batch["positions"])
    ce = F.cross_entropy(logits.flatten(0, 1), batch["targets"].flatten(), reduction="none")
    return ce, batch["loss_mask"].flatten().float()


def lr_at(cfg: Config, step: int) -> float:
    warm = min(1.0, (step + 1) / cfg.warmup)
    progress = max(0, step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def evaluate(model, ev) -> float:
    import torch

    model.eval()
    with torch.no_grad():
        ce, m = token_losses(model, ev)
        loss = float((ce * m).sum() / m.sum())
    model.train()
    return loss


# --- one training run -------------------------------------------------------------------------------
def run(job: dict[str, Any]) -> dict[str, Any]:
    """Trains one (loader, D) configuration; see the module doc."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    cfg = Config(**job["cfg"])
    d = data(job["workdir"])
    ev = {k: torch.from_numpy(v).long() for k, v in d["eval"].items()}
    loader, world, ckpt = job["loader"], job["world"], Path(job["workdir"], f"ckpt-{job['loader']}.pt")
    model = make_model(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.1)
    start, state = 0, None
    if job.get("resume"):
        saved = torch.load(ckpt, weights_only=True)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optim"])
        start = saved["step"]
        state = json.loads(saved["loader"]) if saved["loader"] else None
    t0 = time.perf_counter()
    batches = GlobalBatches(loader, d, cfg, world, skip=0 if state is not None else start, zephon_state=state)
    evals = [[start, evaluate(model, ev)]]
    train, digests, shares = [], [], []
    for step in range(start, cfg.steps):
        batch, code_share = next(batches)
        digests.append(digest(batch))
        shares.append(code_share)
        for g in opt.param_groups:
            g["lr"] = lr_at(cfg, step)
        opt.zero_grad()
        if job.get("per_rank_gradients"):
            # DDP's arithmetic: every rank's gradient separately, summed (all-reduce) — each rank
            # normalised by the global loss-token count, so the sum is the global mean's gradient
            total, loss, rows = batch["loss_mask"].sum().float(), 0.0, cfg.batch // world
            for r in range(world):
                part = {k: v[r * rows:(r + 1) * rows] for k, v in batch.items()}
                ce_r, m_r = token_losses(model, part)
                local = (ce_r * m_r).sum() / total
                local.backward()
                loss += float(local.detach())
        else:
            ce, m = token_losses(model, batch)
            mean = (ce * m).sum() / m.sum()
            mean.backward()
            loss = float(mean.detach())
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        train.append(loss)
        if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps:
            evals.append([step + 1, evaluate(model, ev)])
        if job.get("save_at") == step + 1:
            loader_state = batches.state()
            torch.save({"model": model.state_dict(), "optim": opt.state_dict(), "step": step + 1,
                        "loader": json.dumps(loader_state) if loader_state else ""}, ckpt)
    return {"loader": loader, "world": world, "start": start, "resume": bool(job.get("resume")),
            "per_rank_gradients": bool(job.get("per_rank_gradients")), "eval": evals,
            "train_loss": train, "digests": digests, "code_share": shares, "seconds": time.perf_counter() - t0}


# --- the experiment ---------------------------------------------------------------------------------
def experiment(cfg: Config, workdir: Path, log=print) -> dict[str, Any]:
    t0 = time.perf_counter()
    corpus = prepare(cfg, workdir)
    log(f"data: {corpus['code_docs']} stdlib files ({corpus['code_tokens']:,} tokens) + "
        f"{corpus['prose_docs']} prose documents ({corpus['prose_tokens']:,} tokens), BPE vocab "
        f"{corpus['vocab']}; eval {corpus['eval_rows']} rows of {cfg.seq_len} "
        f"({time.perf_counter() - t0:.1f}s)")
    base = {"cfg": dataclasses.asdict(cfg), "workdir": str(workdir)}
    jobs = [{**base, "loader": name, "world": world, "save_at": cfg.stop_step if world == 2 else None}
            for world in (2, 1, 4, 8) for name in LOADERS]
    jobs.append({**base, "loader": "zephon", "world": 8, "per_rank_gradients": True})
    results = run_all(jobs, base, cfg.workers, log)
    return summarize(cfg, corpus, results, time.perf_counter() - t0)


def describe(r: dict[str, Any]) -> str:
    what = (f"D=2 -> 8 at step {r['start']}" if r["resume"] else
            f"D={r['world']}{' per-rank gradients' if r['per_rank_gradients'] else ''}")
    return f"  {r['loader']:>19} {what}: final eval loss {r['eval'][-1][1]:.6f} ({r['seconds']:.0f}s)"


def run_all(jobs: list[dict], base: dict, workers: int, log=print, retries: int = 2) -> list[dict]:
    """Runs the jobs `workers` at a time in fresh processes; each D=2 job's resume under D=8 is
    queued once its checkpoint exists. A worker killed from outside (e.g. by the kernel's OOM
    killer when something else fills the machine) breaks the pool: its unfinished jobs run again
    in a new one (training is deterministic, so a rerun gives the same result)."""
    from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
    from concurrent.futures.process import BrokenProcessPool

    todo, results = list(jobs), []
    for attempt in range(retries + 1):
        failed: list[dict] = []
        with ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as pool:
            running = {pool.submit(run, j): j for j in todo}
            while running and not failed:
                done, _ = wait(running, return_when=FIRST_COMPLETED)
                for f in done:
                    job = running.pop(f)
                    try:
                        r = f.result()
                    except BrokenProcessPool:
                        failed.append(job)
                        continue
                    results.append(r)
                    log(describe(r))
                    if job["world"] == 2 and job.get("save_at"):   # its checkpoint exists now
                        resume = {**base, "loader": job["loader"], "world": 8, "resume": True}
                        if failed:
                            failed.append(resume)
                        else:
                            running[pool.submit(run, resume)] = resume
            todo = failed + list(running.values())
        if not todo:
            return results
        log(f"  a worker process died (killed from outside?); running {len(todo)} unfinished jobs again "
            f"(attempt {attempt + 2} of {retries + 1})")
    raise RuntimeError("worker processes kept dying; see the kernel log (dmesg) for the OOM killer")


def summarize(cfg: Config, corpus: dict, results: list[dict], wall: float) -> dict[str, Any]:
    main = {(r["loader"], r["world"]): r for r in results if not r["resume"] and not r["per_rank_gradients"]}
    curves = {name: {str(w): {"eval": main[name, w]["eval"], "train_loss": main[name, w]["train_loss"],
                              "seconds": round(main[name, w]["seconds"], 1)} for w in DEGREES}
              for name in LOADERS}
    final = {name: {str(w): main[name, w]["eval"][-1][1] for w in DEGREES} for name in LOADERS}
    spread = {name: max(final[name].values()) - min(final[name].values()) for name in LOADERS}
    composition = {name: {str(w): {"mean": float(np.mean(main[name, w]["code_share"])),
                                   "std_over_steps": float(np.std(main[name, w]["code_share"])),
                                   "min": float(np.min(main[name, w]["code_share"])),
                                   "max": float(np.max(main[name, w]["code_share"]))} for w in DEGREES}
                   for name in LOADERS}
    same_batches = {name: {str(w): sum(a == b for a, b in zip(main[name, w]["digests"], main[name, 1]["digests"]))
                           for w in DEGREES} for name in LOADERS}
    resume = {}
    for r in results:
        if r["resume"]:
            ref = main[r["loader"], 2]
            tail = [e for e in ref["eval"] if e[0] >= r["start"]]
            resume[r["loader"]] = {
                "stop_step": r["start"], "from_world": 2, "to_world": 8, "eval": r["eval"],
                "final_eval_loss": r["eval"][-1][1],
                "max_abs_eval_diff_vs_uninterrupted_D2": max(abs(a[1] - b[1])
                                                             for a, b in zip(r["eval"], tail)),
                "batches_equal_to_uninterrupted_D2": sum(a == b for a, b
                                                         in zip(r["digests"], ref["digests"][r["start"]:])),
                "batches": len(r["digests"])}
    floor = next(r for r in results if r["per_rank_gradients"])
    ddp = {"world": 8, "final_eval_loss": floor["eval"][-1][1],
           "one_pass_final_eval_loss": final["zephon"]["8"],
           "abs_diff": abs(floor["eval"][-1][1] - final["zephon"]["8"]),
           "max_abs_eval_diff_over_curve": max(abs(a[1] - b[1])
                                               for a, b in zip(floor["eval"], main["zephon", 8]["eval"])),
           "note": "Zephon, D=8, every rank's gradient computed separately and summed (DDP's "
                   "arithmetic) vs one pass over the same global batch: the float summation order "
                   "of the all-reduce, with identical data"}
    params = sum(int(np.prod(s)) for s in _param_shapes(cfg))
    out = {"what": "final eval loss of the same training job at D = 1, 2, 4, 8 data-parallel ranks, "
                   "per loader; DDP simulated in one process (local batches concatenated in rank "
                   "order, loss = mean over the global batch's loss tokens)",
           "command": "make experiment  (python benchmarks/elastic_training.py)",
           "config": dataclasses.asdict(cfg), "model_parameters": params, "data": corpus,
           "spread": spread, "final_eval_loss": final, "global_batches_equal_to_D1": same_batches,
           "code_share_per_global_batch": composition,
           "resume": resume, "ddp_float_order": ddp, "curves": curves, "wall_seconds": round(wall, 1),
           "python": sys.version.split()[0]}
    out["table"] = table(out)
    return out


def _param_shapes(cfg: Config) -> list[tuple[int, ...]]:
    d = cfg.d_model
    block = [(3 * d, d), (3 * d,), (d, d), (d,), (4 * d, d), (4 * d,), (d, 4 * d), (d,), (d,), (d,), (d,), (d,)]
    return [(cfg.vocab, d), (cfg.seq_len, d), (d,), (d,)] + block * cfg.layers


def fmt(x: float) -> str:
    return "0 (exactly)" if x == 0 else f"{x:.4f}"


def table(out: dict[str, Any]) -> str:
    steps = out["config"]["steps"]
    stop = out["config"]["stop_step"]
    lines = ["| loader | D=1 | D=2 | D=4 | D=8 | spread (max − min) | global batches equal to D=1's "
             f"(of {steps:d}) | resume D=2→8 at step {stop:d}: max eval-loss diff | code share of a batch, "
             "std over steps, D=1 / 8 |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name in LOADERS:
        f = out["final_eval_loss"][name]
        same = out["global_batches_equal_to_D1"][name]
        r = out["resume"][name]
        lines.append(f"| {LABELS[name]} | " + " | ".join(f"{f[str(w)]:.4f}" for w in DEGREES) +
                     f" | **{fmt(out['spread'][name])}** | " + " / ".join(f"{same[str(w)]}" for w in DEGREES) +
                     f" | {fmt(r['max_abs_eval_diff_vs_uninterrupted_D2'])} | " +
                     " / ".join(f"{out['code_share_per_global_batch'][name][str(w)]['std_over_steps']:.2f}"
                                for w in (1, 8)) + " |")
    return "\n".join(lines)


def plot(out: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(LOADERS), figsize=(5 * len(LOADERS), 7.5), sharex=True,
                             gridspec_kw={"height_ratios": [2, 1]})
    colors = dict(zip(DEGREES, ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728")))
    widths = dict(zip(DEGREES, (4.0, 3.0, 2.0, 1.2)))
    lo = min(e[1] for c in out["curves"].values() for w in c.values() for e in w["eval"][1:])
    hi = max(e[1] for c in out["curves"].values() for w in c.values() for e in w["eval"][2:])
    dmax = max(abs(e[1] - b[1]) for c in out["curves"].values() for w in c.values()
               for e, b in zip(w["eval"], c["1"]["eval"])) * 1.1 or 1.0
    for col, name in enumerate(LOADERS):
        top, bottom = axes[0, col], axes[1, col]
        ref = dict(map(tuple, out["curves"][name]["1"]["eval"]))
        for w in DEGREES:
            ev = np.array(out["curves"][name][str(w)]["eval"])
            lw = widths[w]   # wider first: curves that coincide stay visible
            top.plot(ev[:, 0], ev[:, 1], color=colors[w], lw=lw, label=f"D={w}")
            bottom.plot(ev[:, 0], ev[:, 1] - [ref[s] for s in ev[:, 0]], color=colors[w], lw=lw)
        r = out["resume"][name]
        ev = np.array(r["eval"])
        top.plot(ev[:, 0], ev[:, 1], "k--", lw=1.2, label=f"D=2, resumed at {r['stop_step']} on D=8")
        bottom.plot(ev[:, 0], ev[:, 1] - [ref[s] for s in ev[:, 0]], "k--", lw=1.2)
        top.set_title(f"{LABELS[name]}\nspread of final eval loss over D: {fmt(out['spread'][name])}", fontsize=10)
        top.set_ylim(lo - 0.05 * (hi - lo), hi)
        top.grid(alpha=0.3)
        bottom.set_ylim(-dmax, dmax)
        bottom.axhline(0, color="grey", lw=0.8)
        bottom.grid(alpha=0.3)
        bottom.set_xlabel("step")
        if col == 0:
            top.set_ylabel("held-out eval loss")
            bottom.set_ylabel("eval loss − D=1's")
        top.legend(fontsize=8)
    cfg = out["config"]
    fig.suptitle(f"Same job at D = 1, 2, 4, 8 ranks: {out['model_parameters'] / 1e6:.2f}M-param LM, global "
                 f"batch {cfg['batch']}×{cfg['seq_len']} packed tokens, stdlib code + prose mixed 50/50, "
                 f"{cfg['steps']} steps",
                 fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a tiny smoke run (seconds per run)")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--out", type=Path, default=None, help="results directory (default benchmarks/results; "
                    "--quick writes to a temp directory unless given)")
    args = ap.parse_args(argv)
    cfg = QUICK if args.quick else Config()
    if args.steps:
        every = min(cfg.eval_every, args.steps)
        cfg = dataclasses.replace(cfg, steps=args.steps, eval_every=every,
                                  stop_step=args.steps // 2 // every * every)
    if cfg.stop_step % cfg.eval_every or not 0 < cfg.stop_step < cfg.steps:
        raise SystemExit(f"the resume step {cfg.stop_step} must be an eval step (a multiple of {cfg.eval_every}) "
                         f"inside the run of {cfg.steps} steps")
    out_dir = args.out or (Path(tempfile.mkdtemp(prefix="zephon-elastic-")) if args.quick else RESULTS)
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="zephon-elastic-work-") as work:
        out = experiment(cfg, Path(work))
    (out_dir / "elastic_training.json").write_text(json.dumps(out, indent=1))
    plot(out, out_dir / "elastic_training.png")
    print()
    print(out["table"])
    d = out["ddp_float_order"]
    print(f"\nDDP float order (Zephon, D=8, per-rank gradients summed vs one pass): final eval loss "
          f"{d['final_eval_loss']:.6f} vs {d['one_pass_final_eval_loss']:.6f} (|diff| {d['abs_diff']:.2e})")
    print(f"wall time {out['wall_seconds']:.0f}s; wrote {out_dir / 'elastic_training.json'} and .png")


if __name__ == "__main__":
    main()
