"""Torch's `state_dict()`: Zephon's state document itself.

`state_dict()` is the dict `Loader.state()` returns, of plain dicts, lists, strings and numbers,
so `torch.save` / `torch.load(weights_only=True)` need no pickle, every emitter restores it
(`Loader.restore`, `JaxLoader.restore`, ...) and `load_state_dict` restores theirs. Each rank's
`lanes` are its own, the rest is identical on every rank: `zephon.merge_states` of every rank's
state resumes at any other degree, and so does a `torch.distributed.checkpoint` loaded with a
fresh loader's `state_dict()` as the template (each rank asks for the lanes it now owns). States
are built only when asked for: loaders keep cheap positions, so a pipeline of lambdas iterates
with workers and is refused only by `state_dict()`.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from zephon.exec.loader import Loader


def state_document(state: Mapping[str, Any], loader: Loader) -> dict[str, Any]:
    """An independent copy of `loader`'s state document (plain dicts, lists, str, int, ...).

    With an accumulator (packing) every lane names its `held` inputs and `carry`, empty or not
    (the core writes both): a `torch.distributed.checkpoint` load fills only the keys of its
    template (a fresh loader's state), so a carry whose structure the template lacks is a loud
    "missing key", never a dropped carry (see the README).
    """
    return copy.deepcopy(dict(state))


def seek_position(loader: Loader, position: Mapping[str, Any]) -> None:
    """Puts `loader` at a `position()` taken in this job (see `Loader.seek_position`)."""
    loader.seek_position(position)
