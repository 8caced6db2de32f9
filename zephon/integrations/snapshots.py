"""Per-rank Zephon states saved by consumed-sample count, so a resume from a count replays little.

Trainers such as Megatron-LM keep no data state: their checkpoint holds one number, the samples
consumed. Zephon can rebuild its position from that number alone by replaying the packing of
every global batch before it, which costs time in proportion to the count. With a snapshot
directory each rank also saves its loader's JSON state every `every` global batches, keyed by
the consumed-sample count at that step; a resume restores the newest snapshot at or before the
count that covers the lanes it owns and replays only the batches after it. The batches are the
same either way (a snapshot is the state an uninterrupted run has at that step), so snapshots
are a cache: a missing, partial or unreadable one only means a longer replay, and any of them
may be deleted.

Layout: `{dir}/samples-{count:015d}/rank-{r:05d}-of-{dp:05d}.json`, written with
`zephon.checkpoint.save_state` (atomic, checksummed; an `s3://` or `gs://` directory is written
with one PUT per file). A resume at another dp degree merges the files of one count
(`merge_states`) and takes its own lanes from the union.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping
from typing import Any

from zephon.checkpoint import load_state, save_state
from zephon.errors import PlanError, StateError
from zephon.exec.loader import Loader
from zephon.exec.state import merge_states
from zephon.storage.url import is_remote, local_path

log = logging.getLogger(__name__)

__all__ = ["StateSnapshots"]

_DIR = re.compile(r"^samples-(\d+)$")
_FILE = re.compile(r"^rank-(\d+)-of-(\d+)\.json$")


class StateSnapshots:
    """One rank's snapshot directory: `save` every `every` global batches, `restore` the nearest.

    Args:
      directory: a local directory (created if missing) or an `s3://` / `gs://` prefix, shared by
        every rank (and by every run of the same data: snapshots of another plan are refused).
      global_batch_size: samples per global batch (the count of step k is k × this).
      every: save when the loader is about to produce global batch k with k % every == 0.
    """

    def __init__(self, directory: str | os.PathLike[str], *, global_batch_size: int, every: int = 100) -> None:
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise PlanError(f"snapshot every={every!r}: expected a positive number of global batches "
                            "between saved states (e.g. 100).")
        self.directory = local_path(directory).rstrip("/")
        self.remote = is_remote(self.directory)
        self.global_batch_size, self.every = int(global_batch_size), every
        if not self.remote:
            os.makedirs(self.directory, exist_ok=True)

    def _name(self, count: int) -> str:
        return f"{self.directory}/samples-{count:015d}"

    def save(self, loader: Loader, rank: int, world: int) -> str | None:
        """Saves the loader's state if its next step is a snapshot step; returns the file written."""
        step = loader.step
        if step == 0 or step % self.every:
            return None
        where = self._name(step * self.global_batch_size)
        if not self.remote:
            os.makedirs(where, exist_ok=True)
        path = f"{where}/rank-{rank:05d}-of-{world:05d}.json"
        save_state(path, loader.state())
        return path

    def _listing(self) -> dict[int, list[str]]:
        """count → the state files under it (local folders are listed when examined: see `_files`)."""
        out: dict[int, list[str]] = {}
        if self.remote:
            from zephon.storage import list_objects

            for url, _ in list_objects(self.directory + "/"):
                parts = url[len(self.directory) + 1:].split("/")
                m = _DIR.match(parts[0]) if len(parts) == 2 else None
                if m and _FILE.match(parts[1]):
                    out.setdefault(int(m.group(1)), []).append(url)
            return out
        for name in os.listdir(self.directory):
            m = _DIR.match(name)
            if m and os.path.isdir(os.path.join(self.directory, name)):
                out[int(m.group(1))] = []
        return out

    def _files(self, listing: dict[int, list[str]], count: int) -> list[str]:
        if self.remote:
            return listing[count]
        d = self._name(count)
        try:
            return [f"{d}/{f}" for f in sorted(os.listdir(d)) if _FILE.match(f)]
        except FileNotFoundError:  # deleted meanwhile
            return []

    @staticmethod
    def _holding(loader: Loader, files: list[str]) -> list[str]:
        """The files (by their rank-r-of-dp names) that together hold the lanes `loader` owns:
        a rank reads dp_old / dp_new files, not all of them. Fewer degrees first."""
        mine = {int(lane) for lane in loader.owned}
        named = []
        for f in files:
            m = _FILE.match(f.rsplit("/", 1)[-1])
            assert m is not None
            rank, world = int(m.group(1)), int(m.group(2))
            try:
                theirs = {int(lane) for lane in loader.plan.lanes.owned(rank, world)}
            except PlanError:  # a degree this plan cannot have: not this data's file
                continue
            if theirs & mine:
                named.append((world, rank, f, theirs))
        pick: list[str] = []
        covered: set[int] = set()
        for _, _, f, theirs in sorted(named):
            if not theirs <= covered:
                pick.append(f)
                covered |= theirs
        return pick

    def _merged(self, files: list[str]) -> dict[str, Any] | None:
        states = []
        for f in files:
            try:
                states.append(load_state(f))
            except (StateError, OSError) as e:  # a cache entry: skip it, replay a little more
                log.warning("zephon snapshots: skipping %s (%s)", f, e)
        if not states:
            return None
        try:
            return merge_states(states)
        except StateError as e:
            log.warning("zephon snapshots: the states under %s do not merge (%s); skipping them",
                        os.path.dirname(files[0]), e)
            return None

    def restore(self, loader: Loader, count: int) -> int:
        """Restores `loader` (at step 0) from the newest snapshot at or before `count` samples that
        holds every lane it owns; returns that snapshot's count (0 when none fits: replay all)."""
        owned = {str(int(lane)) for lane in loader.owned}
        listing = self._listing()
        for saved in sorted((c for c in listing if c <= count), reverse=True):
            if saved % self.global_batch_size:
                continue
            state = self._merged(self._holding(loader, self._files(listing, saved)))
            if state is None:
                continue
            lanes = state.get("lanes")
            if not isinstance(lanes, Mapping) or not owned <= set(lanes):
                continue  # other ranks' files only (a partial save): an older snapshot may cover us
            if state.get("step") != saved // self.global_batch_size:
                raise StateError(f"the snapshot {self._name(saved)} holds step {state.get('step')}, not "
                                 f"{saved // self.global_batch_size} = {saved} samples / global batch "
                                 f"{self.global_batch_size}: it was written with another global batch "
                                 "size. Use a separate snapshot directory per configuration.")
            try:
                loader.restore(state)
            except StateError as e:
                raise StateError(f"the snapshot {self._name(saved)} was written by other data ({e}). "
                                 "Use a separate snapshot directory per data configuration, or empty "
                                 "this one (snapshots only save replay time).") from e
            return saved
        return 0
