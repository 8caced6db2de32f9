"""The PyTorch emitter: global batches as `torch.Tensor`s, a DataLoader dataset, resumable state.

Each process materialises only the rows of the lanes it owns and hands them to torch without
copying (`batch`); which rows those are is decided by the plan's lanes, never by torch
(`placement`: rank and degree from `torch.distributed` or a `DeviceMesh`), so the concatenation
over ranks is the numpy reference's global batch for every degree dividing the lane count.

Three ways to iterate, from simplest to most torch-shaped:

- `TorchLoader` (`loader`): an iterator of `{field: Tensor}` with `state_dict()` /
  `load_state_dict()`. Parallelism comes from a Zephon runner; optional `DTensor` output over a
  device mesh.
- `ZephonIterableDataset` (`dataset`): an `IterableDataset` for `DataLoader(batch_size=None)`.
  With `num_workers=W > 1` and a one-to-one pipeline, worker `w` computes steps `start+w,
  start+w+W, ...`; DataLoader fetches from workers round-robin and returns results in order, so
  the sequence is unchanged.
- `ZephonDataLoader` (`dataloader`): that DataLoader with the StatefulDataLoader convention: it
  counts the batches it *handed to the training loop* (not those prefetched by workers), so its
  `state_dict()` resumes exactly after the last batch the model saw. Its workers also run
  pipelines that change the number of records (filters, packing): each takes a block of the
  rank's lanes, and the loader joins their rows of every step and merges their lanes' positions.

Batches are `TorchBatch`es (dicts) with `micro_batches(n)` for gradient accumulation. State
(`state`): `state_dict()` is Zephon's state document itself — plain dicts, lists, strings and
numbers — so `torch.save` / `torch.load(weights_only=True)` need no pickle and every emitter
restores every other's.

One concept a module: `batch` (tensors, casts, pinning, micro-batches), `placement` (rank and
degree, DTensors), `state`, `loader`, `dataset`, `dataloader`. Import from here.
"""

from zephon.backends.torch.batch import Emitter, TorchBatch, emit, micro_batches, to_tensor, torch_dtype
from zephon.backends.torch.dataloader import ZephonDataLoader, join_parts
from zephon.backends.torch.dataset import WorkerPart, ZephonIterableDataset
from zephon.backends.torch.loader import Sources, TorchLoader
from zephon.backends.torch.placement import MeshDims, data_parallel, mesh_data_parallel, to_dtensors
from zephon.backends.torch.state import seek_position, state_document

__all__ = [
    "Emitter", "MeshDims", "Sources", "TorchBatch", "TorchLoader", "WorkerPart", "ZephonDataLoader",
    "ZephonIterableDataset", "data_parallel", "emit", "join_parts", "mesh_data_parallel",
    "micro_batches", "seek_position", "state_document", "to_dtensors", "to_tensor", "torch_dtype",
]
