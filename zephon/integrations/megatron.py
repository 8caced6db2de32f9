"""Megatron-LM data: per-rank iterators for `--dataloader-type external`, and a map-style dataset.

Megatron resumes data from one number, `consumed_train_samples`, and lays samples out with its
`single` sampler: from that count the stream is cut into chunks of `micro_batch × dp` samples
and rank r takes samples `[r·micro, (r+1)·micro)` of every chunk. Here global sample `i` is row
`i mod G` of Zephon's global batch `i div G` (G = the global batch size), a pure function of the
plan, so the same count gives the same samples at every dp degree. The plan's lanes hold
`micro_batch` rows of a global batch each (G / micro lanes) and are dealt to ranks
*interleaved*, which puts exactly the single sampler's rows on each rank: lane `c·dp + r` is
chunk c's slice for rank r.

Each micro-batch follows Megatron's batch contract (what `get_batch` reads from the iterator):
`tokens`, `labels` (int64), `loss_mask` (float32, 0 on a document's last token: its label
would be the next document), `position_ids` (int64, restarting at each document like
`--reset-position-ids`), `attention_mask` (bool `[micro, 1, S, S]`, True = masked, causal within
each document, only with `create_attention_mask=True`), and `cu_seqlens` (int32 document
boundaries of the micro-batch flattened to one `micro × S` sequence, THD layout, with
`max_seqlen`) for inter-document masking with `PackedSeqParams(qkv_format="thd")`.

Resuming from the count alone replays the packing of the global batches before it on each rank
(its own lanes only: 1/dp of the work), since Megatron's checkpoint holds no data state. With
`state_dir` (opt-in) the ranks also save their Zephon states by sample count and a resume
replays only from the nearest one (`zephon.integrations.snapshots`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from zephon.errors import PlanError
from zephon.exec.loader import Loader
from zephon.integrations._text import TextPipeline, text_pipeline
from zephon.integrations.snapshots import StateSnapshots
from zephon.pipeline import Where

log = logging.getLogger(__name__)

__all__ = ["MegatronBatches", "ZephonGPTData", "ZephonGPTDataset", "datasets_provider", "megatron_batch"]


def megatron_batch(cols: Mapping[str, np.ndarray], *, create_attention_mask: bool = False,
                   reset_position_ids: bool = True, reset_attention_mask: bool = True) -> dict[str, torch.Tensor]:
    """Packed rows (`zephon.ops.pack.Pack` columns, `[n, S]`) as Megatron's batch dict."""
    tokens = np.asarray(cols["tokens"], np.int64)
    n, s = tokens.shape
    segments = np.asarray(cols["segment_ids"])
    positions = (np.asarray(cols["positions"], np.int64) if reset_position_ids
                 else np.broadcast_to(np.arange(s, dtype=np.int64), (n, s)).copy())
    out = {"tokens": torch.from_numpy(tokens), "labels": torch.from_numpy(np.asarray(cols["targets"], np.int64)),
           "loss_mask": torch.from_numpy(np.asarray(cols["loss_mask"], np.float32)),
           "position_ids": torch.from_numpy(positions)}
    if create_attention_mask:
        causal = np.tril(np.ones((s, s), dtype=bool))
        allowed = causal[None] & (segments[:, :, None] == segments[:, None, :] if reset_attention_mask else True)
        out["attention_mask"] = torch.from_numpy(~allowed[:, None])
    cu = np.asarray(cols["cu_seqlens"], np.int64) + (np.arange(n, dtype=np.int64) * s)[:, None]
    bounds = np.unique(np.concatenate([[0], cu.ravel(), [n * s]]))
    out["cu_seqlens"] = torch.from_numpy(bounds.astype(np.int32))
    out["max_seqlen"] = torch.tensor(int(np.diff(bounds).max()), dtype=torch.int32)
    return out


class ZephonGPTData:
    """Packed, mixed text for Megatron: one plan, any dp degree (see the module doc).

    Args:
      paths: JSONL / Parquet files (or globs), one mixture component each; `weights` by tokens.
      tokenizer: what `zephon.ops.tokenize.Tokenize` takes (a `tokenizers.Tokenizer`, a
        tokenizer.json path, a tiktoken encoding, or a callable with `tokenizer_name`).
      seq_len: tokens per sample (Megatron's `--seq-length`).
      global_batch_size, micro_batch_size: Megatron's; the global one must stay the same across a
        resume at another dp degree (the micro one too: it sets the lanes).
      eod: the end-of-document id appended to every document (Megatron's `tokenizer.eod`).
      create_attention_mask, reset_position_ids, reset_attention_mask: as Megatron's flags.
    """

    def __init__(self, paths: Sequence[str], *, tokenizer: Any, seq_len: int, global_batch_size: int,
                 micro_batch_size: int, weights: Sequence[float] | None = None, text_field: str = "text",
                 eod: int | None = None, bos: int | None = None, seed: int = 0, pack_mode: str = "concat",
                 create_attention_mask: bool = False, reset_position_ids: bool = True,
                 reset_attention_mask: bool = True, tokenizer_name: str | None = None) -> None:
        if micro_batch_size < 1 or global_batch_size % micro_batch_size:
            raise PlanError(f"global_batch_size {global_batch_size} is not a multiple of micro_batch_size "
                            f"{micro_batch_size}; Megatron needs global = micro × dp × accumulation.")
        self.global_batch_size, self.micro_batch_size = int(global_batch_size), int(micro_batch_size)
        self.lanes = self.global_batch_size // self.micro_batch_size
        self.options = {"create_attention_mask": create_attention_mask, "reset_position_ids": reset_position_ids,
                        "reset_attention_mask": reset_attention_mask}
        self.pipeline: TextPipeline = text_pipeline(
            paths=paths, fields=text_field, weights=weights, tokenizer=tokenizer, bos=bos, eos=eod,
            seq_len=int(seq_len), global_batch=self.global_batch_size, lanes=self.lanes, seed=seed,
            infinite=True, pack_mode=pack_mode, tokenizer_name=tokenizer_name, mapping="interleaved")
        self.seq_len = int(seq_len)

    def loader(self, rank: int = 0, world: int = 1) -> Loader:
        return Loader(self.pipeline.pipeline(), Where(rank=rank, world=world))

    def iterator(self, consumed_samples: int, dp_rank: int, dp_size: int, *,
                 state_dir: str | os.PathLike[str] | None = None, save_every: int = 100) -> MegatronBatches:
        """Rank `dp_rank`'s micro-batches from `consumed_samples` on (the single sampler's layout).

        With `state_dir`, the iterator saves this rank's Zephon state there every `save_every`
        global batches and starts from the newest saved state at or before the count, replaying
        only the batches after it (`zephon.integrations.snapshots`); the batches are the same.
        """
        snapshots = (None if state_dir is None else
                     StateSnapshots(state_dir, global_batch_size=self.global_batch_size, every=save_every))
        return MegatronBatches(self, consumed_samples, dp_rank, dp_size, snapshots=snapshots)

    def dataset(self, num_samples: int) -> ZephonGPTDataset:
        """The map-style variant: sample `i` for Megatron's own samplers."""
        return ZephonGPTDataset(self, num_samples)


class MegatronBatches:
    """An iterator of one dp rank's micro-batches (Megatron's `external` data iterator)."""

    def __init__(self, data: ZephonGPTData, consumed_samples: int, dp_rank: int, dp_size: int, *,
                 snapshots: StateSnapshots | None = None) -> None:
        mbs, g = data.micro_batch_size, data.global_batch_size
        if dp_size < 1 or not 0 <= dp_rank < dp_size or g % (mbs * dp_size):
            raise PlanError(f"dp rank {dp_rank} of {dp_size} with micro batch {mbs}: the global batch {g} "
                            "must be a multiple of micro × dp (Megatron's own rule).")
        if consumed_samples < 0 or consumed_samples % (mbs * dp_size):
            raise PlanError(f"consumed_samples={consumed_samples} is not a whole number of micro × dp = "
                            f"{mbs * dp_size} chunks; Megatron only stops between them.")
        self.data, self.dp_rank, self.dp_size = data, dp_rank, dp_size
        self.consumed_samples = int(consumed_samples)
        self.micro_batches = g // (mbs * dp_size)
        step, offset = divmod(self.consumed_samples, g)
        self.loader = data.loader(dp_rank, dp_size)
        self.snapshots = snapshots
        #: the consumed-sample count of the saved state this iterator started from (0: none)
        self.restored_from = snapshots.restore(self.loader, step * g) if snapshots is not None and step else 0
        #: global batches packed again to reach `consumed_samples` (Megatron keeps no data state)
        self.replayed = step - self.loader.step
        for _ in range(self.replayed):  # this rank's lanes only
            next(self.loader)
        self._micro = offset // (mbs * dp_size)
        self._rows: Mapping[str, np.ndarray] | None = None
        if step:
            log.info("zephon megatron: rank %d/%d replayed %d global batches to sample %d (from a saved "
                     "state at sample %d)", dp_rank, dp_size, self.replayed, self.consumed_samples,
                     self.restored_from)

    def __iter__(self) -> MegatronBatches:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        if self._rows is None or self._micro >= self.micro_batches:
            if self._rows is not None:
                self._micro = 0
            if self.snapshots is not None:
                self.snapshots.save(self.loader, self.dp_rank, self.dp_size)
            self._rows = next(self.loader).data
        mbs = self.data.micro_batch_size
        rows = slice(self._micro * mbs, (self._micro + 1) * mbs)  # lane micro·dp + rank: chunk `micro`
        self._micro += 1
        self.consumed_samples += mbs * self.dp_size
        return megatron_batch({k: v[rows] for k, v in self._rows.items()}, **self.data.options)

    def close(self) -> None:
        self.loader.close()


class ZephonGPTDataset(torch.utils.data.Dataset):
    """Map-style: `dataset[i]` is global sample `i` as one unbatched sample dict (GPTDataset's).

    Its `cu_seqlens` are the sample's own document boundaries padded with -1 to `seq_len + 2`
    entries, `cu_seqlens_argmin` the number of valid ones (fixed shapes, so Megatron's
    DataLoader collates them; Megatron-Bridge's `get_packed_seq_params` reads this layout).

    For users who keep Megatron's samplers (`--dataloader-type single`). It cannot know which
    rows a sampler will ask for, so each process computes whole global batches (every lane,
    world = 1) and keeps the current one; indices are expected in increasing order, as the
    single sampler asks for them (a step back restarts from the last positions kept or step 0).
    Use it with `num_workers=0` (each worker would repeat the packing); the iterators above do
    1/dp of the work.
    """

    KEEP = 16  # positions of recent global batches kept for steps back

    def __init__(self, data: ZephonGPTData, num_samples: int) -> None:
        self.data, self.num_samples = data, int(num_samples)
        self._loader: Loader | None = None
        self._step = -1
        self._rows: Mapping[str, np.ndarray] | None = None
        self._positions: dict[int, dict[str, Any]] = {}

    def __len__(self) -> int:
        return self.num_samples

    def _goto(self, step: int) -> None:
        if self._loader is None or step < self._step:
            if self._loader is not None:
                self._loader.close()
            self._loader = self.data.loader()
            back = max((k for k in self._positions if k <= step), default=None)
            if back is not None:
                self._loader.restore(self._loader.state_from(self._positions[back]))
        while self._loader.step <= step:
            self._positions[self._loader.step] = self._loader.position()
            for k in sorted(self._positions)[:-self.KEEP]:
                del self._positions[k]
            self._step, self._rows = self._loader.step, next(self._loader).data

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < self.num_samples:
            raise IndexError(f"sample {index} is outside this dataset's {self.num_samples} samples")
        step, row = divmod(int(index), self.data.global_batch_size)
        if step != self._step:
            self._goto(step)
        assert self._rows is not None
        one = megatron_batch({k: v[row:row + 1] for k, v in self._rows.items()}, **self.data.options)
        out = {k: v[0] for k, v in one.items() if k not in ("cu_seqlens", "max_seqlen")}
        # one row's own document boundaries, padded with -1 to a fixed S + 2 so that a DataLoader's
        # default collate can stack samples with different document counts (Megatron-Bridge's
        # packed-sequence convention: `cu_seqlens_argmin` = the number of valid entries)
        cu = one["cu_seqlens"]
        padded = torch.full((self.data.seq_len + 2,), -1, dtype=torch.int32)
        padded[: len(cu)] = cu
        out["cu_seqlens"], out["cu_seqlens_argmin"] = padded, torch.tensor(len(cu), dtype=torch.int64)
        out["max_seqlen"] = one["max_seqlen"]
        return out


def _megatron_consumed() -> int:
    try:
        from megatron.training import get_args  # Megatron-LM's training package, not megatron-core
    except ImportError as e:
        raise PlanError("consumed samples come from megatron.training.get_args(), which is part of "
                        "Megatron-LM (not the megatron-core wheel); pass consumed_samples= to "
                        "datasets_provider to read it elsewhere.") from e
    return int(get_args().consumed_train_samples)


def datasets_provider(train: ZephonGPTData, valid: ZephonGPTData | None = None, *,
                      consumed_samples: Callable[[], int] | None = None,
                      data_parallel: Callable[[], tuple[int, int]] | None = None,
                      state_dir: str | os.PathLike[str] | None = None, save_every: int = 100,
                      ) -> Callable[[Sequence[int]], tuple[Any, Any, Any]]:
    """A `train_valid_test_datasets_provider` for `--dataloader-type external`.

    Megatron calls it after loading the checkpoint; it returns this rank's train iterator
    starting at `consumed_train_samples` (from `megatron.training.get_args()` unless
    `consumed_samples` is given), a validation iterator from sample 0 (or None) and None for
    test. The dp rank and size come from `megatron.core.parallel_state` (or `data_parallel`).
    `state_dir` (opt-in, shared by all ranks): the train iterator saves its Zephon state there
    every `save_every` global batches and a resume replays only the batches after the newest
    one at or before the count (see `ZephonGPTData.iterator`).
    """

    def provider(train_val_test_num_samples: Sequence[int]) -> tuple[Any, Any, Any]:
        if data_parallel is not None:
            rank, size = data_parallel()
        else:
            from megatron.core import parallel_state

            rank, size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
        consumed = consumed_samples() if consumed_samples is not None else _megatron_consumed()
        return (train.iterator(consumed, rank, size, state_dir=state_dir, save_every=save_every),
                None if valid is None else valid.iterator(0, rank, size), None)

    return provider
