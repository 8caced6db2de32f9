"""Walking a plan tree: every node, the leaf sources, and a rebuild with a function applied."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

from zephon.plan.node import Node
from zephon.plan.source import Source

__all__ = ["leaf_sources", "plan_nodes", "rebuild"]


def leaf_sources(node: Node) -> list[Any]:
    """The `Source` leaves below `node`, depth first (a mix's children in order)."""
    if isinstance(node, Source):
        return [node]
    kids = getattr(node, "children", None) or ((node.child,) if hasattr(node, "child") else ())
    return [s for c in kids for s in leaf_sources(c)]


def plan_nodes(node: Any) -> Iterator[Any]:
    """Every node of a plan, depth first."""
    yield node
    kids = getattr(node, "children", None) or ((node.child,) if hasattr(node, "child") else ())
    for c in kids:
        yield from plan_nodes(c)


def rebuild(node: Node, fn: Callable[[Node], Node]) -> Node:
    """`node` with `fn` applied bottom-up to every node (unchanged subtrees are kept as they are)."""
    changes: dict[str, Any] = {}
    if dataclasses.is_dataclass(node):
        for f in dataclasses.fields(node):
            v = getattr(node, f.name)
            if isinstance(v, Node):
                nv = rebuild(v, fn)
                if nv is not v:
                    changes[f.name] = nv
            elif isinstance(v, tuple) and v and all(isinstance(c, Node) for c in v):
                kids = tuple(rebuild(c, fn) for c in v)
                if any(a is not b for a, b in zip(kids, v)):
                    changes[f.name] = kids
    new = dataclasses.replace(node, **changes) if changes else node  # type: ignore[type-var]
    return fn(new)
