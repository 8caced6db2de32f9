"""Lane execution: the `Loader` (numpy emitter) over one `Engine` holding one core — random access
(`steps`) or the lane engine (`lanes`) — with the end (`end`) and resume (`resume`) as components.
Terms: docs/glossary.md."""

from zephon.exec.loader import Loader, LocalBatch, merge_states
from zephon.exec.state import LaneState

__all__ = ["LaneState", "Loader", "LocalBatch", "merge_states"]
