"""`zephon.compat.grain.experimental`: Grain's experimental datasets under their Grain names
(the packers here; the iterator-level ones in `iterdata`).

`grain.experimental.X(ds, ...)` becomes `zg.experimental.X(ds, ...)` with the same arguments;
each is a `Dataset` whose last step is `Dataset.pack` (see `packing`). Arguments Zephon's
packing cannot honour are refused with the reason.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import grain
import numpy as np

from zephon.errors import PlanError

from .dataset import Dataset
from .iterdata import (
    FlatMapIterDataset,
    FlatMapMapDataset,
    FlatMapTransform,
    InterleaveIterDataset,
    ParquetIterDataset,
    PerformanceConfig,
    ThreadPrefetchIterDataset,
    WindowShuffleIterDataset,
    device_put,
    pick_performance_config,
)


def _bos_handling_none(bos_handling: Any) -> bool:
    return bos_handling is None or bos_handling == grain.experimental.BOSHandling.DO_NOTHING


def _check_parent(parent: Any, cls: str) -> None:
    if not isinstance(parent, Dataset):
        raise PlanError(f"{cls} packs a zephon.compat.grain Dataset, got {type(parent).__name__}; "
                        "build the pipeline with zg.Dataset (a real Grain dataset takes "
                        f"grain.experimental.{cls}).")


def _refuse(what: str, value: Any, why: str) -> None:
    raise PlanError(f"{what}={value!r} is not supported by Zephon's packing: {why}")


def _fit_args(length_struct: Any, num_packing_bins: int, seed: int, shuffle_bins: bool,
              shuffle_bins_group_by_feature: str | None, meta_features: Sequence[str],
              pack_alignment_struct: Any, padding_struct: Any,
              max_sequences_per_bin: int | None) -> dict[str, Any]:
    if isinstance(num_packing_bins, bool) or not isinstance(num_packing_bins, (int, np.integer)) \
            or num_packing_bins < 1:
        raise PlanError(f"num_packing_bins must be a positive integer, got {num_packing_bins!r}")
    if meta_features:
        _refuse("meta_features", meta_features, "it packs token features only; drop or pack the "
                "other features before the packing step.")
    if pack_alignment_struct is not None:
        _refuse("pack_alignment_struct", pack_alignment_struct, "segments start right after "
                "one another.")
    if shuffle_bins_group_by_feature is not None:
        _refuse("shuffle_bins_group_by_feature", shuffle_bins_group_by_feature, "rows are emitted "
                "in the order they close (deterministic per lane); there is no bin shuffle.")
    return {"length_struct": length_struct, "num_packing_bins": int(num_packing_bins), "seed": seed,
            "shuffle_bins": shuffle_bins, "shuffle_bins_group_by_feature": None, "meta_features": (),
            "pack_alignment_struct": None, "padding_struct": padding_struct,
            "max_sequences_per_bin": max_sequences_per_bin}


class ConcatThenSplitIterDataset(Dataset):
    """`grain.experimental.ConcatThenSplitIterDataset` on Zephon: concat-then-split packing.

    Same arguments as Grain's; runs `zephon.ops.pack.Pack(seq_len, "concat")` in every lane
    (documents laid end to end and cut every seq_len tokens; a document crossing a row boundary
    continues in the lane's next row — across steps and resumes; no token lost, no padding).
    With `lanes(1)` the rows are Grain's rows (`names="grain"` gives Grain's fields too); with
    L lanes each lane packs its own share of the stream. `names`: see `Dataset.pack`.
    Unsupported (refused): meta features, `split_full_length_features=False`, BOS replacement
    (add BOS with `Tokenize(bos=...)` instead: replacing a token loses it).
    """

    def __init__(self, parent: Dataset, *, length_struct: Mapping[str, int],
                 meta_features: Sequence[str] = (), split_full_length_features: bool = True,
                 bos_handling: Any = None, bos_features: Sequence[str] = (),
                 bos_token_id: int | None = None, names: str = "maxtext") -> None:
        _check_parent(parent, "ConcatThenSplitIterDataset")
        if meta_features:
            _refuse("meta_features", meta_features, "it packs token features only; drop or pack "
                    "the other features before the packing step.")
        if not split_full_length_features:
            _refuse("split_full_length_features", False, "full-length documents are packed in "
                    "stream order like any other (Grain passes them ahead of the buffer).")
        if not _bos_handling_none(bos_handling) or bos_features or bos_token_id is not None:
            _refuse("bos_handling", bos_handling, "replacing each piece's first token with BOS "
                    "drops that token; add BOS to every document with Tokenize(bos=...).")
        kwargs = {"length_struct": length_struct, "meta_features": (),
                  "split_full_length_features": True}
        ds = parent.pack(length_struct, "concat", names=names,
                         _grain=("ConcatThenSplitIterDataset", kwargs))
        super().__init__(ds._op, ds._config)


class FirstFitPackIterDataset(Dataset):
    """`grain.experimental.FirstFitPackIterDataset` on Zephon: first-fit packing.

    Same arguments as Grain's; runs `Pack(seq_len, "first_fit", max_open_bins=num_packing_bins,
    max_segments=max_sequences_per_bin)` in every lane. Zephon keeps up to `num_packing_bins`
    rows open and emits the oldest when a document fits none (Grain emits all its bins then),
    and splits documents longer than seq_len (Grain raises on them), so rows differ from Grain's
    while padding is comparable. `seed`/`shuffle_bins` only reorder Grain's emitted bins: Zephon
    emits rows in the order they close. `names`: see `Dataset.pack`.
    """

    _mode = "first_fit"
    _grain_name = "FirstFitPackIterDataset"

    def __init__(self, parent: Dataset, *, length_struct: Any, num_packing_bins: int,
                 seed: int = 0, shuffle_bins: bool = True,
                 shuffle_bins_group_by_feature: str | None = None, meta_features: Sequence[str] = (),
                 pack_alignment_struct: Any = None, padding_struct: Any = None,
                 max_sequences_per_bin: int | None = None, names: str = "maxtext") -> None:
        _check_parent(parent, self._grain_name)
        kwargs = _fit_args(length_struct, num_packing_bins, seed, shuffle_bins,
                           shuffle_bins_group_by_feature, meta_features, pack_alignment_struct,
                           padding_struct, max_sequences_per_bin)
        ds = parent.pack(length_struct, self._mode, num_packing_bins=int(num_packing_bins),
                         padding_struct=padding_struct, max_sequences_per_bin=max_sequences_per_bin,
                         names=names, _grain=(self._grain_name, kwargs))
        super().__init__(ds._op, ds._config)


class BestFitPackIterDataset(FirstFitPackIterDataset):
    """`grain.experimental.BestFitPackIterDataset` on Zephon: best-fit packing (each document
    goes to the open row it fills tightest); otherwise as `FirstFitPackIterDataset`."""

    _mode = "best_fit"
    _grain_name = "BestFitPackIterDataset"


BOSHandling = grain.experimental.BOSHandling

__all__ = ["BOSHandling", "BestFitPackIterDataset", "ConcatThenSplitIterDataset",
           "FirstFitPackIterDataset", "FlatMapIterDataset", "FlatMapMapDataset", "FlatMapTransform",
           "InterleaveIterDataset", "ParquetIterDataset", "PerformanceConfig",
           "ThreadPrefetchIterDataset", "WindowShuffleIterDataset", "device_put",
           "pick_performance_config"]
