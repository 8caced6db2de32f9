"""Lane execution: the random-access path (`steps`), the lane engine (`lanes`) and the loader."""

from zephon.exec.loader import Loader, LocalBatch, merge_states
from zephon.exec.state import LaneState

__all__ = ["LaneState", "Loader", "LocalBatch", "merge_states"]
