"""Lane execution: the random-access path (`steps`), the lane engine (`lanes`) and the loader."""

from zephon.exec.state import LaneState
from zephon.exec.loader import Loader, LocalBatch, merge_states

__all__ = ["LaneState", "Loader", "LocalBatch", "merge_states"]
