"""`plan_diff`: what differs between two plans' JSON, for refusing a foreign checkpoint."""

from __future__ import annotations

from typing import Any

__all__ = ["plan_diff"]


def plan_diff(a: dict[str, Any] | Any, b: dict[str, Any] | Any, path: str = "plan") -> list[str]:
    """Human-readable differences between two plans' JSON, for refusing a foreign checkpoint."""
    if isinstance(a, dict) and isinstance(b, dict):
        out: list[str] = []
        for k in sorted(set(a) | set(b)):
            if k not in a or k not in b:
                out.append(f"{path}.{k}: {a.get(k, '<absent>')!r} != {b.get(k, '<absent>')!r}")
            else:
                out += plan_diff(a[k], b[k], f"{path}.{k}")
        return out
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in plan_diff(x, y, f"{path}[{i}]")]
    return [] if a == b else [f"{path}: {a!r} != {b!r}"]
