"""VLM-packed batches on torch: the dynamic (concatenated) patch form, pinned for the transfer.

The torch emitter hands a `VLMPack` batch over as any other (every field a tensor with the row
axis; `pixel_values [R, P, patch_dim]`). A vision encoder that runs over one flat sequence of
patches takes `packed_patches(batch)`: the same values as `zephon.media.vlm_batch.packed_patches`,
as tensors — `pixel_values [N, patch_dim]` (padding removed), `grid_thw [I, 3]`, `image_row [I]`,
`cu_patches [I + 1]` — with `pin_memory=True` writing them straight into page-locked memory
(where an accelerator runtime provides it) so `.to(device, non_blocking=True)` overlaps the copy.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from zephon.backends.torch.batch import can_pin
from zephon.errors import PlanError

log = logging.getLogger(__name__)

__all__ = ["packed_patches"]


def _tensor(x: Any) -> torch.Tensor:
    return x if isinstance(x, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(x))


def packed_patches(batch: Mapping[str, Any], *, pin_memory: bool = False) -> dict[str, torch.Tensor]:
    """The dynamic form of a VLM-packed torch (or numpy) batch; see the module doc."""
    missing = [k for k in ("pixel_values", "patch_mask", "image_grid") if k not in batch]
    if missing:
        raise PlanError(f"packed_patches needs a VLMPack batch; it lacks {missing}")
    pix, valid, grid = (_tensor(batch[k]) for k in ("pixel_values", "patch_mask", "image_grid"))
    valid = valid != 0
    real = grid.to(torch.int64).prod(dim=2) > 0
    rows = torch.nonzero(real)[:, 0].to(torch.int32)
    g = grid[real].to(torch.int32)
    counts = g.to(torch.int64).prod(dim=1)
    if int(counts.sum()) != int(valid.sum()):
        raise PlanError(f"the batch's image grids count {int(counts.sum())} patches but its "
                        f"patch_mask marks {int(valid.sum())}; it is not a VLMPack batch")
    cu = torch.zeros(len(counts) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(counts, 0).to(torch.int32)
    out = {"pixel_values": pix[valid], "grid_thw": g, "image_row": rows, "cu_patches": cu}
    pin = pin_memory and can_pin()
    if pin_memory and not pin:
        log.warning("pin_memory=True but no accelerator is available here; tensors are not pinned "
                    "(values are unchanged).")
    if pin:
        out = {k: torch.empty(v.shape, dtype=v.dtype, pin_memory=True).copy_(v) for k, v in out.items()}
    return out
