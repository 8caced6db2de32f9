"""How every front door in `zephon.backends` reads its arguments: `(pipeline, where=, how=)`.

`JaxLoader`, `TorchLoader` and `ZephonIterableDataset` restate none of the loader's
parameters: they take the same `zephon.Pipeline` (what is read) and the two option groups
`zephon.Where` (rank and world, or a mesh) and `zephon.How` (runner, read-ahead, telemetry,
prefetch), derive what their placement decides (a JAX process's row block from the mesh, a
torch rank from `torch.distributed`) and hand the groups on to `zephon.Loader` with
`dataclasses.replace`. `zephon.pipeline.read_call` (shared with `zephon.Loader`) reads a
door's arguments, the deprecated old form included; `refuse` says which fields of a group a
door has no use for, and why.
"""

from __future__ import annotations

from zephon.errors import PlanError
from zephon.pipeline import How, Where

__all__ = ["refuse"]


def refuse(entry: str, group: Where | How, names: tuple[str, ...], why: str) -> None:
    """A PlanError if any of `names` is set (not None) in `group`: fields this door cannot honour."""
    given = [n for n in names if getattr(group, n) is not None]
    if given:
        raise PlanError(f"{entry} got {type(group).__name__}({', '.join(f'{n}=...' for n in given)}): {why}")
