"""Pretrain a tiny language model with flax + optax on 8 CPU devices, a (data, fsdp) mesh, packed
batches from Zephon as sharded jax.Arrays; checkpoint with Orbax and resume under another mesh.

    pip install -e '.[lm,examples]'       # flax, optax, orbax-checkpoint: optional extras
    python examples/lm_jax_flax.py        # ~1-2 min on 2 CPU cores

What it does:

1. Data (`lm_data.py`, shared with `lm_torch_ddp.py`): real code (the Python standard library's
   own sources) and generated prose as two JSONL files, a byte-level BPE trained in-process.
   Zephon mixes them 60/40 by tokens in every lane, tokenizes (`Tokenize`, EOS appended) and
   packs rows of `--seq-len` tokens (`Pack`, concat). The batch size warms up by tokens (half of
   `--batch` rows a step for two steps' tokens, then `--batch`): the arrays' leading dimension
   changes once, so the jitted train step compiles once per size (twice in all).
2. Run A on mesh (data=2, fsdp=4): `JaxLoader(pipeline, Where(mesh=mesh, batch_axes=("data", "fsdp")))` gives
   every field as a global `jax.Array` sharded over all 8 devices; parameters (and Adam's moments)
   are sharded over `fsdp` on their largest divisible dimension, replicated over `data` (FSDP).
   The model's attention is causal *within each packed document*: the mask comes from
   `segment_ids`, the position embedding from `positions`. At step `--steps // 2` an Orbax
   checkpoint holds parameters, optimizer state and the loader state (JSON) in one step folder.
3. Run B on mesh (data=4, fsdp=2) restores that checkpoint — Orbax reshards every array onto the
   new mesh, the loader resumes from its state — and trains the remaining steps.

4. Evaluation: A's and B's final models score a held-out set (`lm_data.eval_pipeline`): a finite
   plan read whole, packed, its last steps padded (`remainder="pad"`), through the same
   `JaxLoader` path; padding rows (`valid` False) are skipped and every held-out token is scored
   exactly once, each row alone, summed exactly — the same loss on any mesh or number of ranks.

B's losses equal A's bit for bit at every step after the checkpoint, and so do its global batches
(a digest of every batch is compared; the script exits non-zero otherwise). The batches are
Zephon's doing: the same global arrays on every mesh. The float arithmetic is the train step's:
it constrains the gradient to be replicated, so XLA sums it with one all-reduce over all 8
devices, in the same order on any mesh. With `--no-replicated-grads` the gradient takes FSDP's
usual path (reduce-scatter over `fsdp`, then all-reduce over `data`), whose summation order
depends on the mesh shape: the batches stay identical and the losses can differ by float
rounding (up to 4.8e-7 in some configurations here, e.g. `--batch 8`; identical in others) — at
scale you would keep that cheaper path and accept rounding-level noise.

Each step reads the loss (a per-step sync): on 8 *fake* CPU devices XLA can otherwise queue
hundreds of asynchronous steps and starve its collectives' rendezvous.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from lm_data import add_data_args, eval_pipeline, evaluate, lm_pipeline, write_data

import zephon
from zephon.backends.jax import JaxLoader


# --- data: the corpora, the tokenizer and the packed, mixed pipeline are in lm_data.py ------------
def make_loader(out: Path, args: argparse.Namespace, mesh: Mesh) -> JaxLoader:
    return JaxLoader(lm_pipeline(out, args), zephon.Where(mesh=mesh, batch_axes=("data", "fsdp")),
                     zephon.How(prefetch=2), exclude=("cu_seqlens",))


# --- model --------------------------------------------------------------------------------------
class Block(nn.Module):
    d: int
    heads: int

    @nn.compact
    def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
        x = x + nn.MultiHeadDotProductAttention(num_heads=self.heads, qkv_features=self.d)(nn.LayerNorm()(x), mask=mask)
        h = nn.Dense(4 * self.d)(nn.LayerNorm()(x))
        return x + nn.Dense(self.d)(nn.gelu(h))


class TinyLM(nn.Module):
    vocab: int
    seq_len: int
    d: int = 64
    layers: int = 2
    heads: int = 4

    @nn.compact
    def __call__(self, tokens: jax.Array, segment_ids: jax.Array, positions: jax.Array) -> jax.Array:
        embed = nn.Embed(self.vocab, self.d, embedding_init=nn.initializers.normal(0.02))
        x = embed(tokens) + nn.Embed(self.seq_len, self.d, embedding_init=nn.initializers.normal(0.02))(positions)
        # attend only to earlier tokens of the same packed document
        mask = nn.combine_masks(nn.make_causal_mask(tokens),
                                nn.make_attention_mask(segment_ids, segment_ids, jnp.equal))
        for _ in range(self.layers):
            x = Block(self.d, self.heads)(x, mask)
        return embed.attend(nn.LayerNorm()(x))  # tied output embedding


def make_mesh(shape: tuple[int, int]) -> Mesh:
    return Mesh(np.array(jax.devices()).reshape(shape), ("data", "fsdp"))


def fsdp_sharding(x: jax.ShapeDtypeStruct | jax.Array, mesh: Mesh) -> NamedSharding:
    """FSDP: split the largest dimension the fsdp axis divides; replicate small or odd arrays."""
    n = mesh.shape["fsdp"]
    dims = [i for i in np.argsort(x.shape)[::-1] if x.shape[i] % n == 0 and x.shape[i] >= 4 * n]
    spec = [None] * len(x.shape)
    if dims:
        spec[dims[0]] = "fsdp"
    return NamedSharding(mesh, P(*spec))


class Trainer:
    """Model, optimizer and a jitted step for one mesh."""

    def __init__(self, args: argparse.Namespace, mesh: Mesh) -> None:
        self.mesh = mesh
        self.replicated_grads = args.replicated_grads
        self.model = TinyLM(args.vocab, args.seq_len)
        self.tx = optax.adamw(args.lr, weight_decay=0.1)
        abstract = jax.eval_shape(self.init_state)
        self.shardings = jax.tree.map(lambda x: fsdp_sharding(x, mesh), abstract)
        self.abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                                     abstract, self.shardings)
        self.step = jax.jit(self._step, in_shardings=(self.shardings, None),
                            out_shardings=(self.shardings, NamedSharding(mesh, P())), donate_argnums=0)

    def init_state(self) -> dict:
        dummy = jnp.zeros((1, self.model.seq_len), jnp.int32)
        params = self.model.init(jax.random.key(0), dummy, dummy, dummy)["params"]
        return {"params": params, "opt": self.tx.init(params)}

    def fresh(self) -> dict:
        return jax.jit(self.init_state, out_shardings=self.shardings)()

    def _step(self, state: dict, batch: dict[str, jax.Array]) -> tuple[dict, jax.Array]:
        def loss_fn(params):
            logits = self.model.apply({"params": params}, batch["tokens"], batch["segment_ids"], batch["positions"])
            ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
            mask = batch["loss_mask"].astype(jnp.float32)
            return (ce * mask).sum() / mask.sum()  # mean over the global batch's loss tokens

        loss, grads = jax.value_and_grad(loss_fn)(state["params"])
        if self.replicated_grads:  # one all-reduce over every device: mesh-independent sums
            grads = jax.lax.with_sharding_constraint(grads, NamedSharding(self.mesh, P()))
        updates, opt = self.tx.update(grads, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, loss


def held_out_loss(args: argparse.Namespace, mesh: Mesh, trainer: Trainer, state: dict) -> tuple[float, int]:
    """Mean token loss of the model in `state` on the held-out set: each row scored alone on one
    device (parameters gathered), so the result cannot depend on the mesh."""
    params = jax.device_get(state["params"])
    apply = jax.jit(lambda p, tokens, seg, pos, targets: optax.softmax_cross_entropy_with_integer_labels(
        trainer.model.apply({"params": p}, tokens, seg, pos), targets))
    with JaxLoader(eval_pipeline(args.out, args), zephon.Where(mesh=mesh, batch_axes=("data", "fsdp")),
                   exclude=("cu_seqlens",)) as loader:
        return evaluate(loader, lambda r: apply(params, r["tokens"], r["segment_ids"], r["positions"], r["targets"]))


def checkpointer(path: Path) -> ocp.CheckpointManager:
    # synchronous saves: no background thread touching device buffers between steps
    return ocp.CheckpointManager(path.absolute(),
                                 options=ocp.CheckpointManagerOptions(enable_async_checkpointing=False))


def train(args: argparse.Namespace, shape: tuple[int, int], stop: int, *, save_at: int | None = None,
          resume: bool = False) -> tuple[dict[int, float], dict[int, str], tuple[float, int]]:
    """Trains on a mesh of `shape` until global step `stop`; returns {step: loss},
    {step: digest of the global batch} and the final model's held-out (loss, tokens)."""
    mesh = make_mesh(shape)
    trainer = Trainer(args, mesh)
    losses, digests, sizes = {}, {}, {}
    with make_loader(args.out, args, mesh) as loader, checkpointer(args.out / "ckpt") as ckpt:
        if resume:
            step = ckpt.latest_step()
            restored = ckpt.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(trainer.abstract),   # resharded onto this mesh
                loader=ocp.args.JsonRestore()))
            state = restored["state"]
            # the loader state may also live beside the checkpoint in a bucket (--loader-state URL)
            loader.restore(zephon.load_state(args.loader_state) if args.loader_state else restored["loader"])
        else:
            state = trainer.fresh()
        while loader.step < stop:
            step = loader.step
            batch = next(loader)   # {field: jax.Array sharded over ("data", "fsdp")}
            state, loss = trainer.step(state, batch)
            losses[step] = float(loss)   # a per-step sync (see the module doc)
            digests[step] = digest(batch)
            sizes[step] = int(batch["tokens"].shape[0])
            if save_at == step + 1:
                if args.loader_state:
                    zephon.save_state(args.loader_state, loader.state())
                ckpt.save(step + 1, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                            loader=ocp.args.JsonSave(loader.state())))
    print(f"mesh {shape}: global batch rows per step {sizes}")
    return losses, digests, held_out_loss(args, mesh, trainer, state)


def digest(batch: dict[str, jax.Array]) -> str:
    """A hash of the global batch (np.asarray gathers every shard to the host)."""
    h = hashlib.sha256()
    for name in sorted(batch):
        h.update(name.encode() + np.asarray(batch[name]).tobytes())
    return h.hexdigest()[:16]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=40)
    add_data_args(ap, batch_help="global batch (rows): 2 per device")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--mesh-a", default="2,4", help="run A's (data, fsdp) mesh")
    ap.add_argument("--mesh-b", default="4,2", help="run B's (data, fsdp) mesh")
    ap.add_argument("--replicated-grads", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--out", type=Path, default=None, help="directory for data and the checkpoint")
    ap.add_argument("--loader-state", default=None, metavar="URL",
                    help="also save the loader state here (a path, s3:// or gs:// URL) and resume from it")
    args = ap.parse_args()
    args.out = args.out or Path(tempfile.mkdtemp(prefix="zephon-lm-flax-"))
    args.out.mkdir(parents=True, exist_ok=True)
    mesh_a, mesh_b = (tuple(int(v) for v in m.split(",")) for m in (args.mesh_a, args.mesh_b))
    split = args.steps // 2

    t0 = time.perf_counter()
    write_data(args.out, args)
    print(f"{jax.device_count()} devices; data and checkpoint in {args.out}")
    a, a_batches, a_eval = train(args, mesh_a, args.steps, save_at=split)
    b, b_batches, b_eval = train(args, mesh_b, args.steps, resume=True)
    print(f"{'step':>5} {'A: mesh ' + str(mesh_a):>16} {'B: mesh ' + str(mesh_b):>16}")
    for step in sorted({0, split - 1, split, args.steps - 1} | set(range(0, args.steps, max(1, args.steps // 10)))):
        print(f"{step:>5} {a[step]:>16.6f} " + (f"{b[step]:>16.6f}" if step in b else ""))
    diff = max(abs(b[s] - a[s]) for s in b)
    same = sum(b_batches[s] == a_batches[s] for s in b)
    print(f"\nloss {a[0]:.3f} -> {a[args.steps - 1]:.3f} over {args.steps} steps")
    print(f"B (mesh {mesh_b}, resumed at step {split} from A's Orbax checkpoint on mesh {mesh_a}) vs A: "
          f"max |loss diff| = {diff:.3g}{'  (identical)' if diff == 0 else ''}")
    print(f"global batches of B equal to A's: {same} of {len(b)}")
    print(f"held-out loss ({a_eval[1]} tokens, each once; padding rows skipped): A {a_eval[0]:.6f}, "
          f"B {b_eval[0]:.6f}{'  (identical)' if a_eval == b_eval else ''}")
    print(f"{time.perf_counter() - t0:.0f}s")
    if same != len(b) or (args.replicated_grads and (diff != 0 or a_eval != b_eval)):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
