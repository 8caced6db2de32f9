"""`BlockShuffle`: a shuffle that object storage can serve with whole-block reads.

A global per-record shuffle sends every row to a random place in the data, so a batch read from
a bucket costs about one ranged GET per row. The block shuffle keeps I/O units together while
mixing them (the scheme of Marin/Levanter, and CorgiPile's block + buffer shuffle):

1. the epoch's records are cut into blocks of `block` consecutive records, and the blocks are
   permuted by a keyed Feistel bijection (per epoch);
2. the permuted blocks are grouped into windows of `window` blocks, and the records of each
   window are permuted among themselves (keyed by epoch and window). The epoch's last window
   takes the remainder (between `window` and `2 × window` blocks), so no small window — with
   batches drawn from few blocks — ends an epoch.

So a window's `window × block` rows come from `window` blocks, each read whole once, and two
rows of one global batch share a block with probability about `1 / window`
(`zephon.plan.quality` measures it). Everything is a pure function of (seed, epoch, position): O(1)
random access and memory, exactly once per epoch, the same global batches at every D, runner
and emitter.

**Stripes.** A window's records are laid out block after block and cut into `stripes`
contiguous segments; positions `s, s + stripes, s + 2·stripes, …` of the window take the records
of segment `s`, permuted. Under `lanes(L)` with `stripes = L` (what "auto" resolves to), lane
`l` reads only segment `l`: about `window / L` blocks, so a rank of `D` fetches about
`window / D` blocks of each window rather than all of them. A global batch still mixes every
segment (one per lane), so the chance that two of its rows share a block stays about
`1 / window`.

**"auto".** `window="auto"` and `stripes="auto"` are resolved when the plan's root is built
(`Lanes.batch`): the window becomes twice the largest global batch size of the plan (in blocks,
so a batch's rows come from at least `2·B` blocks), the stripes the lane count. `block="auto"`
is the record sources' natural unit (an ArrayRecord chunk group of about 256 KiB, a Parquet row
group), resolved by the `Loader` from the sources it is given (`resolve_blocks`). The resolved
numbers are in the plan's JSON and fingerprint.

Terms (docs/glossary.md): window, lane, epoch.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import numpy as np

from zephon.errors import PlanError
from zephon.plan.node import Node, PassThrough, check_int
from zephon.plan.permute import permute, splitmix64
from zephon.plan.refs import Refs
from zephon.plan.walk import leaf_sources, plan_nodes, rebuild

log = logging.getLogger(__name__)

Auto = Literal["auto"]
N = TypeVar("N", bound=Node)
_WINDOW_SALT = np.uint64(0xB10C5EED0000A11D)


def _check_auto_int(name: str, v: Any, minimum: int) -> None:
    if v != "auto":
        check_int(name, v, minimum)


@dataclass(frozen=True)
class BlockShuffle(PassThrough, kind="BlockShuffle"):
    """Permute blocks of `block` records, then records within windows of `window` blocks.

    See the module doc. Over a repeated stream it permutes within each epoch (like `Shuffle`):
    every record appears exactly once per epoch, and every epoch has fresh block and window
    orders. When the epoch is not a multiple of `block`, its short last block stays last.
    """

    child: Node
    seed: int
    block: int | Auto = "auto"
    window: int | Auto = "auto"
    stripes: int | Auto = "auto"

    def __post_init__(self) -> None:
        check_int("BlockShuffle.seed", self.seed, 0)
        _check_auto_int("BlockShuffle.block", self.block, 1)
        _check_auto_int("BlockShuffle.window", self.window, 1)
        _check_auto_int("BlockShuffle.stripes", self.stripes, 1)
        if self.child.length is None and self.child.period is None:
            raise PlanError("cannot block-shuffle an infinite stream that has no epoch length (e.g. "
                            "a mix of repeated sources); block-shuffle each source before repeat/mix.")

    @property
    def epoch_length(self) -> int:
        p = self.child.period
        return p if p is not None else self.child.length  # type: ignore[return-value]

    @property
    def resolved(self) -> bool:
        return "auto" not in (self.block, self.window, self.stripes)

    def _resolve(self, pos: np.ndarray, epoch: np.ndarray) -> Refs:
        if self.block == "auto" or self.window == "auto":
            raise PlanError("this BlockShuffle has block='auto' or window='auto', which are resolved "
                            "when the plan meets its sources: build the root with .lanes(L).batch(B) "
                            "(resolves the window) and read it with a Loader, or call "
                            "zephon.plan.blockshuffle.resolve_blocks(plan, sources) (resolves the block); "
                            "or give block= and window= as numbers.")
        n = self.epoch_length
        outer, q = np.divmod(pos, n)
        return self.child._resolve(outer * n + self.records(q, epoch + outer), epoch)

    def records(self, q: np.ndarray, key_epoch: np.ndarray) -> np.ndarray:
        """Record index within the epoch of epoch positions `q` (keyed by `key_epoch`)."""
        b, w = int(self.block), int(self.window)
        g = 1 if self.stripes == "auto" else int(self.stripes)
        n = self.epoch_length
        span = w * b
        # The last window takes the remainder (W to 2W blocks): no tiny window ends an epoch.
        last = max(1, n // span) - 1
        win = np.minimum(q // span, last)
        r = q - win * span
        n_w = np.where(win == last, n - last * span, span)
        s, k = np.remainder(r, g), r // g
        base, extra = np.divmod(n_w, g)
        count = base + (s < extra)  # positions of stripe s in this window
        start = s * base + np.minimum(s, extra)  # where segment s starts among the window's slots
        # One key per (epoch, window, stripe): each segment's own permutation.
        with np.errstate(over="ignore"):
            mixed = splitmix64(splitmix64(key_epoch.astype(np.uint64) ^ _WINDOW_SALT)
                               + win.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)
                               + s.astype(np.uint64))
        slot = start + _permute_by_size(k, count, self.seed, mixed.view(np.int64))
        # slot -> block of the window's permuted order -> record
        j = win * w + slot // b
        full = n // b
        is_full = j < full
        blocks = np.where(is_full, 0, j)
        if full and is_full.any():
            blocks[is_full] = permute(j[is_full], full, self.seed, key_epoch[is_full])
        return blocks * b + slot % b

    def explain_text(self) -> str:
        """One line saying what this node does with its numbers (`zephon explain` prints it)."""
        return (f"BlockShuffle(seed={self.seed}): blocks of {self.block} records permuted per "
                f"epoch, records permuted within windows of {self.window} blocks "
                f"({_times(self.block, self.window)} records), {self.stripes} stripes "
                f"(lane l reads ~{_ratio(self.window, self.stripes)} blocks of a window)")


def _times(a: Any, b: Any) -> str:
    return str(a * b) if isinstance(a, int) and isinstance(b, int) else "?"


def _ratio(a: Any, b: Any) -> str:
    return f"{a / b:.3g}" if isinstance(a, int) and isinstance(b, int) else "?"


def _permute_by_size(k: np.ndarray, n: np.ndarray, seed: int, epoch: np.ndarray) -> np.ndarray:
    """`permute(k[i], n[i], seed, epoch[i])` for every i: one call per distinct n (a handful)."""
    out = np.empty_like(k)
    sizes = np.unique(n)
    for size in sizes.tolist():
        m = n == size if len(sizes) > 1 else slice(None)
        out[m] = permute(k[m], int(size), seed, epoch[m])
    return out


# --- resolving "auto" --------------------------------------------------------------------------
def resolve_window(node: Node, lanes: int, batch_rows: int) -> Node:
    """Resolves window="auto" (2 × `batch_rows` blocks) and stripes="auto" (`lanes`) below `node`."""
    def fix(n: Node) -> Node:
        if isinstance(n, BlockShuffle) and (n.window == "auto" or n.stripes == "auto"):
            return dataclasses.replace(n, window=2 * batch_rows if n.window == "auto" else n.window,
                                       stripes=lanes if n.stripes == "auto" else n.stripes)
        return n
    return rebuild(node, fix)


def block_shuffles(node: Any) -> list[BlockShuffle]:
    return [n for n in plan_nodes(node) if isinstance(n, BlockShuffle)]


def natural_block(source: Any) -> int | None:
    """A record source's natural block (records per I/O unit), or None if it has none."""
    fn = getattr(source, "natural_block", None)
    return None if fn is None else fn()


def resolve_blocks(plan: N, sources: Mapping[int, Any]) -> N:
    """`plan` with every block="auto" replaced by the natural block of the sources below it (the
    largest when they differ). A source without one is an error naming the fix."""
    def fix(n: Node) -> Node:
        if not isinstance(n, BlockShuffle) or n.block != "auto":
            return n
        got = []
        for leaf in leaf_sources(n):
            src = sources.get(leaf.id)
            b = natural_block(src)
            if b is None:
                raise PlanError(f"block_shuffle(block='auto') needs the natural block of source "
                                f"{leaf.id} ({type(src).__name__}), which has none; give the block "
                                "size in records, e.g. .block_shuffle(seed, block=256).")
            got.append(int(b))
        if len(set(got)) > 1:
            log.info("block_shuffle(block='auto'): the sources' natural blocks differ (%s); "
                     "using the largest", got)
        return dataclasses.replace(n, block=max(got))
    return rebuild(plan, fix)  # type: ignore[return-value]


def follow_blocks(plan: Any, sources: Mapping[int, Any], lanes_owned: int) -> None:
    """Tells the record sources under each block shuffle of `plan` to read whole blocks and keep
    the blocks of about two windows that `lanes_owned` of the plan's lanes need (a source
    without `follow_blocks` reads as before)."""
    total = plan.lanes.count
    for node in block_shuffles(plan):
        if not node.resolved:
            continue
        w, g, b = int(node.window), int(node.stripes), int(node.block)
        share = min(1.0, lanes_owned / total) if g > 1 else 1.0
        # a window's blocks this process needs (+ the two a segment's edges share), two windows
        need = 2 * (int(np.ceil(w * share)) + 2 * max(1, int(np.ceil(g * share)))) + 2
        for leaf in leaf_sources(node):
            follow = getattr(sources.get(leaf.id), "follow_blocks", None)
            if callable(follow):
                follow(b, need)
