"""Warnings for Grain code that runs with a Zephon guarantee off (said once per cause)."""

from __future__ import annotations

import threading
import warnings


class GrainCompatWarning(UserWarning):
    """Grain code ran as on Grain, but a Zephon guarantee does not hold for it (the message says
    which, and how to keep it)."""


_seen: set[str] = set()
_lock = threading.Lock()


def warn_once(key: str, message: str) -> None:
    """Warns `message` the first time `key` is seen in this process."""
    with _lock:
        if key in _seen:
            return
        _seen.add(key)
    warnings.warn(message, GrainCompatWarning, stacklevel=3)
