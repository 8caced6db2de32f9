"""Zephon: an elastically deterministic data loader.

The sequence of global batches is a pure function of the plan and the step. It does not change
with the number of devices, hosts, workers, the micro-batch size, the backend, or a stop/resume.

The distribution is `zephon-loader`; `zephon` on the package index is another project that also
imports as `zephon`. Both cannot share an environment (one overwrites the other's files), so an
import that finds the other one installed says so once.
"""

from typing import Any

from zephon._distribution import warn_if_shadowed
from zephon.checkpoint import load_state, resign_state, save_state
from zephon.errors import (
    DecodeError,
    PlanError,
    SourceError,
    StateError,
    WorkerError,
    ZephonError,
    deprecated_attribute,
)
from zephon.exec.loader import Loader, LocalBatch, merge_states
from zephon.exec.state import LaneState
from zephon.ops.base import DEPRECATED as _OPS_DEPRECATED
from zephon.ops.base import Accumulator, AccumulatorStep, Operator, Transform
from zephon.ops.filter import Filter, FlatMap
from zephon.ops.map import Map, RandomMap
from zephon.pipeline import How, Pipeline, Where
from zephon.plan import DEPRECATED as _PLAN_DEPRECATED
from zephon.plan import Batching, BlockShuffle, Lanes, Mix, Node, Plan, Refs, Repeat, Shuffle, Slice, Source
from zephon.telemetry import Stats, Telemetry

__all__ = [
    "Accumulator", "AccumulatorStep", "Batching", "BlockShuffle", "DecodeError", "Filter", "FlatMap", "How",
    "LaneState", "Lanes", "Loader", "LocalBatch", "Map", "Mix", "Node", "Operator", "Pipeline", "Plan", "PlanError",
    "RandomMap", "Refs", "Repeat", "Shuffle", "Slice", "Source", "SourceError", "StateError", "Stats",
    "Telemetry", "Transform", "Where", "WorkerError", "ZephonError", "load_state", "merge_states", "resign_state",
    "save_state",
]
__version__ = "0.3.0"

warn_if_shadowed()

# Renamed in 0.4, kept for one version with a DeprecationWarning naming the new name:
# Batch -> Batching (the plan's root node), Take/Skip -> .take(n)/.skip(n), Step -> AccumulatorStep.
_DEPRECATED: dict[str, tuple[Any, str]] = {**_PLAN_DEPRECATED, **_OPS_DEPRECATED}


def __getattr__(name: str) -> Any:
    return deprecated_attribute(__name__, name, _DEPRECATED)
