"""Grain compatibility: Grain's sources, transforms, API shape, record order and checkpoints.

A Grain user switches by changing the import and keeps the pipeline:

    ds = grain.MapDataset.source(src).shuffle(seed=7).repeat().map(f).batch(32)        # Grain
    ds = zephon.compat.grain.Dataset.source(src).shuffle(seed=7).repeat().map(f).batch(32)

`iter(ds)` yields numpy batches with Grain's structure, and in the default `order="grain"`
they are Grain's batches bit for bit: the plan computes Grain's own shuffle, mix and sampler
order (`order`, `cipher`), `MapWithIndex` sees Grain's index and `RandomMap` draws
from Grain's own per-index generator. Zephon's lanes, data-parallel ranks, runners and
checkpoints come on top, and none of them changes the batches. `Dataset.to_grain()` builds the
equivalent real Grain pipeline and `grain_fingerprints` digests its batches exactly like
`zephon.fingerprints` digests Zephon's, so Grain is one more column of the verify matrix.

Records. A Grain source returns Python objects; they travel as one object column (`RECORD`)
through the Grain transforms, which therefore see exactly what Grain would hand them, and are
stacked into columns once at the end: dict keys (nested with "/") or tuple positions become
field names, a bare value becomes `VALUE`; numbers and arrays stack as Grain's `np.stack` does,
while bytes and str stay object arrays — exact, and the same whatever the data-parallel degree
(Grain's fixed-width S/U arrays would depend on which rows are stacked together).

LM pipelines. `map()` also takes Zephon lane operators — `Tokenize`, `zephon.Map`/`Filter`/
`FlatMap`, a `zephon.ops.pack.Pack` — and Grain's packing datasets keep their names and
arguments under `experimental` (`zg.experimental.ConcatThenSplitIterDataset(ds, length_struct=
{"tokens": 2048})`, `FirstFitPackIterDataset`, `BestFitPackIterDataset(..., num_packing_bins=8)`):
they compile to `Pack(seq_len, mode)` running in every lane of Zephon's lane engine, with
MaxText's field names by default (`names="grain"`: Grain's packer layout). `Dataset.mix(...,
by="tokens")` balances realised tokens inside every lane. Such pipelines batch, shard, resume
from the one Zephon JSON state (at another data-parallel degree after `merge_states`) and feed
`to_jax`/`to_torch`/`to_torch_dataset` like any other. Packing is Zephon's: it loses no token
(documents longer than seq_len are split, never dropped), so rows equal Grain's only for
concat-then-split at `lanes(1)`. A finite stream (no `repeat()`) ends at its last full global
batch: the partly filled rows still open then are not emitted (Grain pads and emits them).

Plans holding Grain nodes load with `Node.from_json` only after `import zephon.compat.grain`.

One concept a module: `records` (Grain records <-> columns), `sources`, `transforms`,
`packing` (Grain's packer arguments -> `Pack`), `dataset` (the `Dataset` facade), `compile`
(pipeline graph -> plan, and back to real Grain), `iterator` (`Iterator`, `merge_states`),
`dataloader` (`DataLoader` + `IndexSampler`), `verify` (`grain_fingerprints`, `concat_shards`),
`order` (Grain's record order as plan nodes), `cipher` (Grain's index_shuffle, vectorised) and
`experimental` (Grain's packing datasets).
"""

from __future__ import annotations

from . import experimental
from .cipher import index_shuffle
from .compile import READ_AHEAD
from .dataloader import DataLoader
from .dataset import Dataset
from .experimental import BestFitPackIterDataset, ConcatThenSplitIterDataset, FirstFitPackIterDataset
from .iterator import CollatingLoader, Iterator, merge_states
from .iterdata import IterDataset
from .order import (
    GRAIN_INFINITE,
    ContiguousBatches,
    GrainIndex,
    GrainLoaderOrder,
    GrainMix,
    GrainSampler,
    GrainShuffle,
    even_split,
    grain_index_column,
    grain_proportions,
    mix_selection,
)
from .packing import GrainPackNames, PackInput
from .records import (
    RECORD,
    RNG,
    VALUE,
    collate,
    flatten_record,
    grain_batch_columns,
    records_of,
    records_to_columns,
    stack_leaves,
    unflatten_columns,
)
from .sources import GrainSource, RecordsOf
from .transforms import (
    Branches,
    Collate,
    GrainFilter,
    GrainMap,
    GrainMapWithIndex,
    GrainRandomMap,
    LaneOp,
    grain_map_rng,
    with_collate,
)
from .verify import concat_shards, grain_fingerprints
from .warn import GrainCompatWarning

__all__ = [
    "GRAIN_INFINITE",
    "READ_AHEAD",
    "RECORD",
    "RNG",
    "VALUE",
    "BestFitPackIterDataset",
    "Branches",
    "Collate",
    "CollatingLoader",
    "ConcatThenSplitIterDataset",
    "ContiguousBatches",
    "DataLoader",
    "Dataset",
    "FirstFitPackIterDataset",
    "GrainCompatWarning",
    "GrainFilter",
    "GrainIndex",
    "GrainLoaderOrder",
    "GrainMap",
    "GrainMapWithIndex",
    "GrainMix",
    "GrainPackNames",
    "GrainRandomMap",
    "GrainSampler",
    "GrainShuffle",
    "GrainSource",
    "IterDataset",
    "Iterator",
    "LaneOp",
    "PackInput",
    "RecordsOf",
    "collate",
    "concat_shards",
    "even_split",
    "experimental",
    "flatten_record",
    "grain_batch_columns",
    "grain_fingerprints",
    "grain_index_column",
    "grain_map_rng",
    "grain_proportions",
    "index_shuffle",
    "merge_states",
    "mix_selection",
    "records_of",
    "records_to_columns",
    "stack_leaves",
    "unflatten_columns",
    "with_collate",
]
