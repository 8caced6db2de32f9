"""Torch batches: this process's numpy rows as tensors, without copying, and their micro-batches.

`to_tensor` hands numpy rows to torch *without copying* (`torch.from_numpy`), so the torch path
costs what the numpy reference costs. Copies happen only where they are unavoidable and asked
for (`Emitter`): a dtype cast (`dtypes=`, e.g. bfloat16, which numpy lacks), pinning
(`pin_memory=True`) and a device transfer (`device=`).

Fields torch cannot hold (bytes, strings, ragged lists: numpy object arrays, and datetimes) are
passed through unchanged as numpy arrays; asking to cast one raises `PlanError`.

Batches are `TorchBatch`es (dicts) with `micro_batches(n)` for gradient accumulation: `n` equal,
consecutive blocks of this rank's rows (views; a `DTensor` is cut in its local shard), whose
concatenation is the batch, so changing `n` — also at a resume — changes nothing loaded.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from zephon.errors import PlanError
from zephon.exec.batch import check_micro_count
from zephon.exec.loader import LocalBatch

log = logging.getLogger(__name__)

# numpy dtypes torch.from_numpy accepts; anything else is passed through as numpy.
_TENSOR_DTYPES = frozenset(np.dtype(d) for d in (
    np.bool_, np.uint8, np.int8, np.uint16, np.int16, np.uint32, np.int32, np.uint64, np.int64,
    np.float16, np.float32, np.float64, np.complex64, np.complex128))


class TorchBatch(dict):
    """`{field: Tensor}` (numpy arrays for fields torch cannot hold) with `micro_batches(n)`."""

    #: (worker, stage seconds, bytes read, workers) of the process that built it (telemetry)
    telemetry: tuple[int, dict[str, float], int, int] | None = None

    def micro_batches(self, n: int) -> list[TorchBatch]:
        """`n` micro-batches (see `micro_batches`)."""
        return micro_batches(self, n)


def _rows_of(v: Any) -> int:
    from torch.distributed.tensor import DTensor

    return int(v.to_local().shape[0] if isinstance(v, DTensor) else v.shape[0])


def _cut_rows(v: Any, start: int, stop: int) -> Any:
    from torch.distributed.tensor import DTensor

    if isinstance(v, DTensor):  # cut the local shard: each rank's i-th block, no communication
        local = v.to_local()[start:stop]
        rows = v.shape[0] * (stop - start) // max(1, _rows_of(v))
        shape = torch.Size((rows, *v.shape[1:]))
        stride = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
        return DTensor.from_local(local, v.device_mesh, v.placements, run_check=False, shape=shape,
                                  stride=stride)
    return v[start:stop]


def micro_batches(batch: Mapping[str, Any], n: int) -> list[TorchBatch]:
    """`n` micro-batches of this rank's rows: equal, consecutive blocks (views, no copy).

    Micro-batch `i` holds rows `[i*R/n, (i+1)*R/n)` of the `R` rows this rank holds (of each
    `DTensor`'s local shard), so `torch.cat` of the micro-batches is the batch for every `n`.
    """
    rows = {_rows_of(v) for v in batch.values()}
    if len(rows) > 1:
        raise PlanError(f"the batch's fields have different row counts {sorted(rows)}; micro-batches "
                        "cut every field at the same rows.")
    n = check_micro_count(n, rows.pop() if rows else 0)
    m = (_rows_of(next(iter(batch.values()))) // n) if batch else 0
    return [TorchBatch({k: _cut_rows(v, i * m, (i + 1) * m) for k, v in batch.items()}) for i in range(n)]


def torch_dtype(dtype: Any) -> torch.dtype:
    """A `torch.dtype` from a dtype or its name ("bfloat16"), so configs can stay JSON."""
    if isinstance(dtype, torch.dtype):
        return dtype
    found = getattr(torch, dtype, None) if isinstance(dtype, str) else None
    if not isinstance(found, torch.dtype):
        raise PlanError(f"{dtype!r} is not a torch dtype; use e.g. torch.bfloat16 or 'bfloat16'.")
    return found


def to_tensor(array: np.ndarray) -> torch.Tensor | np.ndarray:
    """A tensor sharing memory with `array`, or `array` itself if torch cannot hold its dtype.

    Copies only when torch could not safely share the memory: a read-only array (torch would
    warn and writes would be undefined), a non-contiguous one, or a non-native byte order.
    """
    arr = np.asarray(array)
    if not arr.dtype.isnative:
        arr = arr.astype(arr.dtype.newbyteorder("="))
    if arr.dtype not in _TENSOR_DTYPES:
        return arr
    if not (arr.flags.c_contiguous and arr.flags.writeable):
        arr = np.array(arr, order="C", copy=True)
    return torch.from_numpy(arr)


def _no_cast(np_dtype: np.dtype, dtype: Any) -> PlanError:
    return PlanError(f"a field of dtype {np_dtype} (bytes, text or ragged values) cannot become a "
                     f"torch tensor, so it cannot be cast to {dtype}; it is passed through as a "
                     "numpy array. Drop it from dtypes, or map it to fixed-size numbers (tokenize, "
                     "pad) in a transform first.")


@functools.lru_cache(maxsize=1)
def can_pin() -> bool:
    """Whether page-locked memory exists here (it needs an accelerator runtime): every torch
    emitter asks before pinning, and warns instead of failing where it does not."""
    try:
        torch.empty(1).pin_memory()
    except RuntimeError:
        return False
    return True


@dataclass(frozen=True)
class Emitter:
    """Turns a `LocalBatch` into `{field: Tensor}`: zero-copy, then cast, pin, transfer.

    `dtypes` maps field -> torch dtype (a cast, e.g. float32 -> bfloat16 rounds to nearest even).
    `pin_memory` is ignored with a warning where no accelerator exists, as DataLoader does.
    A transfer is non-blocking when the source is pinned; to the CPU it is a no-op (no copy).
    """

    dtypes: Mapping[str, Any] = field(default_factory=dict)
    pin_memory: bool = False
    device: torch.device | None = None

    @staticmethod
    def make(dtypes: Mapping[str, Any] | None = None, pin_memory: bool = False,
             device: str | torch.device | None = None) -> Emitter:
        casts = {str(k): torch_dtype(v) for k, v in (dtypes or {}).items()}
        pin = bool(pin_memory) and can_pin()
        if pin_memory and not pin:
            log.warning("pin_memory=True but no accelerator is available here; tensors are not "
                        "pinned (values are unchanged).")
        return Emitter(casts, pin, None if device is None else torch.device(device))

    def __call__(self, batch: LocalBatch) -> TorchBatch:
        unknown = sorted(set(self.dtypes) - set(batch.data))
        if unknown:
            raise PlanError(f"dtypes names fields {unknown} that the batch lacks; its fields are "
                            f"{sorted(batch.data)}.")
        return TorchBatch({k: self._one(v, self.dtypes.get(k)) for k, v in batch.data.items()})

    def _one(self, array: np.ndarray, dtype: torch.dtype | None) -> torch.Tensor | np.ndarray:
        t = to_tensor(array)
        if not isinstance(t, torch.Tensor):
            if dtype is not None:
                raise _no_cast(t.dtype, dtype)
            return t
        if self.pin_memory:  # cast straight into pinned memory: one copy, not two
            t = torch.empty(t.shape, dtype=t.dtype if dtype is None else dtype, pin_memory=True).copy_(t)
        elif dtype is not None:
            t = t.to(dtype)
        if self.device is not None:
            t = t.to(self.device, non_blocking=self.pin_memory)
        return t


def emit(batch: LocalBatch, *, dtypes: Mapping[str, Any] | None = None, pin_memory: bool = False,
         device: str | torch.device | None = None) -> TorchBatch:
    """This process's rows of a global batch as tensors (see `Emitter`)."""
    return Emitter.make(dtypes, pin_memory, device)(batch)
