"""Zephon: an elastically deterministic data loader.

The sequence of global batches is a pure function of the plan and the step. It does not change
with the number of devices, hosts, workers, the micro-batch size, the backend, or a stop/resume.
"""

from zephon.errors import DecodeError, PlanError, SourceError, StateError, WorkerError, ZephonError
from zephon.loader import LaneState, Loader, LocalBatch, load_state, merge_states, save_state
from zephon.plan import Batch, Lanes, Mix, Node, Plan, Refs, Repeat, Shuffle, Skip, Slice, Source, Take
from zephon.transforms import Filter, Map, RandomMap, Transform

__all__ = [
    "Batch", "DecodeError", "Filter", "LaneState", "Lanes", "Loader", "LocalBatch", "Map", "Mix",
    "Node", "Plan", "PlanError", "RandomMap", "Refs", "Repeat", "Shuffle", "Skip", "Slice", "Source",
    "SourceError", "StateError", "Take", "Transform", "WorkerError", "ZephonError", "load_state",
    "merge_states", "save_state",
]
__version__ = "0.1.0"
