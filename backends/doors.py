"""How every front door in `zephon.backends` reads its arguments: `(pipeline, where=, how=)`.

`JaxLoader`, `TorchLoader` and `ZephonIterableDataset` restate none of the loader's
parameters: they take the same `zephon.Pipeline` (what is read) and the two option groups
`zephon.Where` (rank and world, or a mesh) and `zephon.How` (runner, read-ahead, telemetry,
prefetch), derive what their placement decides (a JAX process's row block from the mesh, a
torch rank from `torch.distributed`) and hand the groups on to `zephon.Loader` with
`dataclasses.replace`. `read_call` accepts the old form `Door(plan, sources, transforms,
**options)` for one more version, with a `DeprecationWarning` naming the new one; `refuse`
says which fields of a group a door has no use for, and why.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from zephon.errors import PlanError
from zephon.pipeline import How, Pipeline, Where, split_old_form

__all__ = ["Call", "no_rest", "read_call", "refuse"]

_GROUPS = (("zephon.Where", frozenset(f.name for f in fields(Where))),
           ("zephon.How", frozenset(f.name for f in fields(How))),
           ("zephon.Pipeline", frozenset(("seed", "per_source", "sources", "plan", "transforms"))))


@dataclass(frozen=True)
class Call:
    """A front door's arguments, read: the pipeline, its two option groups, and the door's own
    keyword arguments the old form passed among the loader's (`rest`)."""

    pipeline: Pipeline
    where: Where
    how: How
    rest: dict[str, Any]


def read_call(entry: str, pipeline: Any, where: Any, how: Any, old_form: dict[str, Any], *,
              renames: Mapping[str, str] | None = None) -> Call:
    """`entry(pipeline, where, how)`, or the deprecated `entry(plan, sources, transforms,
    **options)` (also with `plan=`, `sources=`, `transforms=` as keywords) split into the groups
    by `zephon.pipeline.split_old_form`, which warns naming the new form at the caller's line."""
    if not isinstance(pipeline, Pipeline):
        if pipeline is None and "plan" in old_form:
            pipeline = old_form.pop("plan")
        if where is None and "sources" in old_form:
            where = old_form.pop("sources")
        transforms = old_form.pop("transforms", how)
        if pipeline is None:
            raise PlanError(f"{entry} needs a zephon.Pipeline(plan, sources, ops): what it reads.")
        # the warning names the line that called the door: split_old_form <- here <- door <- caller
        pipe, w, h, rest = split_old_form(entry, pipeline, where, transforms, old_form, renames=renames,
                                          stacklevel=4)
        return Call(pipe, w, h, rest)
    if old_form:
        hints = []
        for key in sorted(old_form):
            key = (renames or {}).get(key, key)
            group = next((g for g, keys in _GROUPS if key in keys), None)
            hints.append(f"{key} goes in {group}" if group else f"{key} is not an option of {entry}")
        raise TypeError(f"{entry}(pipeline, where=, how=) got unexpected keyword arguments "
                        f"{sorted(old_form)}: {'; '.join(hints)}.")
    where = Where() if where is None else where
    how = How() if how is None else how
    for what, v, cls in (("where", where, Where), ("how", how, How)):
        if not isinstance(v, cls):
            raise PlanError(f"{entry}({what}=...) takes a zephon.{cls.__name__}, got {type(v).__name__}")
    return Call(pipeline, where, how, {})


def refuse(entry: str, group: Where | How, names: tuple[str, ...], why: str) -> None:
    """A PlanError if any of `names` is set (not None) in `group`: fields this door cannot honour."""
    given = [n for n in names if getattr(group, n) is not None]
    if given:
        raise PlanError(f"{entry} got {type(group).__name__}({', '.join(f'{n}=...' for n in given)}): {why}")


def no_rest(entry: str, rest: Mapping[str, Any]) -> None:
    """A TypeError naming old-form keyword arguments that belong to no group and not to the door."""
    if rest:
        raise TypeError(f"{entry}() got unexpected keyword arguments {sorted(rest)}")
