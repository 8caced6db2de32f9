"""Batch sizes at run time: a resume at another global batch size, micro-batches of a schedule.

Every lane is an independent sequential stream and its state is positions, so nothing a lane
holds depends on the batch size: a state saved under one size (or schedule) can continue under
another. It is refused unless the user asks for it (`restore(state, allow_batch_change=True)`),
because the batches from then on are not the ones the saved plan would have made; when asked,
every lane continues exactly where it stopped and step k takes this plan's `B(k)/L` outputs of
every lane. A random-access run then keeps a constant `lane_shift` (saved lane position minus
the plan's `lane_offset(step)`) and stays O(1) per step.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from zephon.errors import PlanError, StateError, check_positive_int
from zephon.exec.batch import check_micro_count
from zephon.plan import Batching, Node

log = logging.getLogger(__name__)


def check_micro_schedule(plan: Batching, n: Any, shards: int) -> int:
    """`n` if it splits the rows each of `shards` equal blocks holds at every batch size of the
    plan's schedule; otherwise a PlanError naming the first step and size it does not split."""
    n = check_positive_int(n, "micro_batches")
    for step, size in plan.sizes.stretches():
        if size % shards or (size // shards) % n:
            check_micro_count(n, size // shards if size % shards == 0 else size,
                              f"the {size}-row batches from step {step} ({shards} blocks of rows)")
    return n


def batch_change(saved: Any, plan: Batching, allowed: bool) -> Batching | None:
    """The state's plan if it differs from `plan` in its batch size or schedule only (None if
    it differs otherwise) — and, when it does, a StateError naming the sizes unless `allowed`."""
    mine = plan.to_json()
    if not isinstance(saved, Mapping) or saved.get("type") != "Batch":
        return None
    strip = ("size", "schedule")
    if {k: v for k, v in saved.items() if k not in strip} != {k: v for k, v in mine.items() if k not in strip}:
        return None
    try:
        old = Node.from_json(dict(saved))
    except PlanError:
        return None
    if not isinstance(old, Batching) or (old.size, old.schedule) == (plan.size, plan.schedule):
        return None
    if not allowed:
        raise StateError(f"this checkpoint was written with global batch {_describe_sizes(old)} "
                         f"and this plan has {_describe_sizes(plan)}; the rest of the plan is the "
                         "same. To continue every lane exactly where it stopped with this plan's "
                         "batch sizes, restore with allow_batch_change=True; otherwise build the "
                         "plan with the sizes that wrote the state.")
    log.info("resuming at another global batch size: %s -> %s", _describe_sizes(old), _describe_sizes(plan))
    return old


def lane_shift_of(position: Mapping[str, Any]) -> int:
    """A position's `lane_shift` (0 if absent), checked."""
    shift = position.get("lane_shift", 0)
    if isinstance(shift, bool) or not isinstance(shift, int):
        raise StateError(f"the state's 'lane_shift' {shift!r} is not an integer; the state was edited.")
    return shift


def _describe_sizes(plan: Any) -> str:
    if not plan.schedule:
        return f"size {plan.size}"
    return "sizes " + ", ".join(f"{b} from step {k}" for k, b in plan.sizes.stretches())


__all__ = ["batch_change", "check_micro_schedule", "lane_shift_of"]
