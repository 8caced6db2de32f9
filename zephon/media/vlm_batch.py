"""The dynamic (concatenated) form of a VLM-packed batch, for numpy and torch consumers.

The loader always yields `VLMPack`'s static form: every field has the batch's row axis
(`pixel_values [R, P, patch_dim]` with `patch_mask`, `image_grid [R, M, 3]`, `image_offsets`),
which is what keeps vision-language batches inside Zephon's guarantees with no special case —
lane digests, rank ownership (contiguous row blocks), micro-batches (row views), JAX's batch
sharding and torch's transfer all work per row, and a row's patches travel with its tokens
(so a rank holds exactly the patches of its rows). A JAX step under `jit` consumes that form
as is.

A vision encoder that runs over one flat sequence of patches (TorchTitan's and Hugging Face's
Qwen2-VL-style `pixel_values [N_patches, patch_dim]` + `grid_thw`) takes `packed_patches(batch)`:
the valid patches of the rows, concatenated in row order (no padding), each image's grid, the
row it belongs to and cumulative patch offsets. It is a pure function of the batch, computed
where it is consumed; `zephon.backends.torch.vlm.packed_patches` is the same on torch tensors
(pinned when asked).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from zephon.errors import PlanError

__all__ = ["packed_patches"]

_NEEDS = ("pixel_values", "patch_mask", "image_grid")


def packed_patches(batch: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """The dynamic form of a VLM-packed batch (numpy arrays):

    - `pixel_values` `[N, patch_dim]`: every row's real patches, rows in order;
    - `grid_thw` `[I, 3]` int32: each image's (t, h, w) in patches, in the same order;
    - `image_row` `[I]` int32: the batch row holding each image;
    - `cu_patches` `[I + 1]` int32: where each image's patches start in `pixel_values`.

    The other fields (tokens, masks...) are unchanged and not repeated here."""
    missing = [k for k in _NEEDS if k not in batch]
    if missing:
        raise PlanError(f"packed_patches needs a VLMPack batch; it lacks {missing}")
    pix = np.asarray(batch["pixel_values"])
    valid = np.asarray(batch["patch_mask"]) != 0
    grid = np.asarray(batch["image_grid"])
    real = grid.prod(axis=2) > 0                # [R, M]
    rows, _ = np.nonzero(real)
    g = grid[real].astype(np.int32)
    counts = g.astype(np.int64).prod(axis=1)
    if int(counts.sum()) != int(valid.sum()):
        raise PlanError(f"the batch's image grids count {int(counts.sum())} patches but its "
                        f"patch_mask marks {int(valid.sum())}; it is not a VLMPack batch")
    return {"pixel_values": pix[valid], "grid_thw": g, "image_row": rows.astype(np.int32),
            "cu_patches": np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)}
