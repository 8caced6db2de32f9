"""TorchTitan (0.3.0) data loader: a Zephon pipeline behind TorchTitan's `BaseDataLoader`.

TorchTitan's own `ParallelAwareDataloader` saves one pickle per data-parallel rank and refuses a
checkpoint taken at another dp degree. Here a checkpoint holds one entry, the same on every
rank: `{"zephon_state": <Zephon's JSON state, every lane merged>, ...}`. DCP writes a replicated
entry once, and any dp degree dividing the lane count resumes from it with the same global
batches, because Zephon's global batch `k` does not depend on who loads it.

The trainer builds it with `config.dataloader.build(dp_world_size=, dp_rank=, tokenizer=,
seq_len=, local_batch_size=, ...)`; it yields `({"input": ..., "positions": ...}, labels)`,
`local_batch_size` rows at a time, from tokenize → mix by tokens → pack (concat-then-split;
positions restart at every document; a document's last token has label -100, so no target
crosses documents). One Zephon step is one optimizer step: its `global_batch_size` rows are
split over the dp ranks (rank r holds rows `[r·B/D, (r+1)·B/D)`) and each rank's share over
gradient-accumulation micro-batches, so the trainer's global batch is the same at every D.

Run it as `--module zephon.integrations.torchtitan --config zephon_llama3_debugmodel`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torchtitan.components.dataloader import BaseDataLoader
from torchtitan.components.loss import IGNORE_INDEX

from zephon.backends.torch.loader import TorchLoader
from zephon.errors import PlanError, StateError
from zephon.exec.state import merge_states
from zephon.integrations._text import text_pipeline
from zephon.pipeline import How, Where

log = logging.getLogger(__name__)

__all__ = ["ZephonDataLoader", "tokenizer_encoder", "zephon_llama3_debugmodel"]


def tokenizer_encoder(tokenizer: Any, add_bos: bool, add_eos: bool) -> tuple[Any, int | None, int | None, str | None]:
    """(what `Tokenize` takes, bos id, eos id, name) for a TorchTitan tokenizer.

    A `HuggingFaceTokenizer` hands over its `tokenizers.Tokenizer` (batched, identity = a hash of
    its JSON) with its BOS/EOS ids; any other `BaseTokenizer` is called one text at a time through
    its `encode` (identity = its class name: bump nothing, change the name if its vocabulary
    changes)."""
    inner = getattr(tokenizer, "tokenizer", None)
    if inner is not None and type(inner).__module__.startswith("tokenizers"):
        bos = getattr(tokenizer, "bos_id", None) if add_bos else None
        eos = getattr(tokenizer, "eos_id", None) if add_eos else None
        return inner, bos, eos, None
    name = f"torchtitan:{type(tokenizer).__qualname__}"
    return _Encode(tokenizer, add_bos, add_eos), None, None, name


@dataclass(frozen=True)
class _Encode:
    """`str -> ids` through a TorchTitan tokenizer's own `encode` (a named, picklable callable)."""

    tokenizer: Any
    add_bos: bool
    add_eos: bool

    def __call__(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_bos=self.add_bos, add_eos=self.add_eos))


def _gather_merged(state: dict[str, Any]) -> dict[str, Any]:
    """Every rank's lanes in one state, identical on every rank (an all-gather when distributed:
    DCP calls `state_dict()` on every rank together). Ranks that share a dp rank (TP, PP) hold
    the same lanes in the same positions, which `merge_states` accepts."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return merge_states([state])
    states: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(states, state)
    return merge_states(states)


class ZephonDataLoader(BaseDataLoader):
    """TorchTitan's data loader over a Zephon pipeline; see the module doc."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):
        paths: list[str] = field(default_factory=list)
        """JSONL (*.jsonl) or Parquet (*.parquet) files or globs, one mixture component each
        (`dataset_path` is used when this is empty)."""

        text_field: str = "text"
        """The text column of every file."""

        weights: list[float] = field(default_factory=list)
        """Mixture weights by tokens, one per path (empty: equal)."""

        global_batch_size: int = -1
        """Rows per optimizer step, the same at every dp degree: set it to
        `training.global_batch_size` to resume at another dp degree. -1: local_batch_size × dp
        (a resume at another dp then changes the batch and is refused)."""

        lanes: int = -1
        """Zephon lanes (units of state and ownership): must divide the global batch and be a
        multiple of every dp degree you run at. -1: the global batch size."""

        seed: int = 0
        """Shuffle seed (source i shuffles with seed + i)."""

        pack_mode: str = "concat"
        """'concat' (no padding, documents continue in the next row), 'first_fit' or 'best_fit'."""

        add_bos: bool = True
        add_eos: bool = True

        threads: int = 0
        """Tokenize in this many threads (0: in the training process's thread)."""

        infinite: bool = True
        """Repeat the data (each pass reshuffled). False: one pass; the validator sets this."""

    def __init__(self, config: Config, *, dp_world_size: int, dp_rank: int, tokenizer: Any, seq_len: int,
                 local_batch_size: int, **kwargs: Any) -> None:
        paths = list(config.paths) or ([config.dataset_path] if config.dataset_path else [])
        self.config = config
        self.dp_world_size, self.dp_rank = int(dp_world_size), int(dp_rank)
        self.local_batch_size = int(local_batch_size)
        per_rank_default = self.local_batch_size * self.dp_world_size
        self.global_batch_size = config.global_batch_size if config.global_batch_size > 0 else per_rank_default
        share, rest = divmod(self.global_batch_size, self.dp_world_size * self.local_batch_size)
        if rest or share < 1:
            raise PlanError(f"global_batch_size {self.global_batch_size} is not a multiple of "
                            f"local_batch_size × dp = {self.local_batch_size} × {self.dp_world_size}; "
                            "set dataloader.global_batch_size to training.global_batch_size.")
        self.micro_batches = share  # micro-batches of one optimizer step on this rank
        lanes = config.lanes if config.lanes > 0 else self.global_batch_size
        if lanes % self.dp_world_size:
            raise PlanError(f"lanes={lanes} is not a multiple of the dp degree {self.dp_world_size}: "
                            "every rank must own whole lanes (choose lanes divisible by every dp "
                            "degree you will run at).")
        encoder, bos, eos, name = tokenizer_encoder(tokenizer, config.add_bos, config.add_eos)
        pipe = text_pipeline(paths=paths, fields=config.text_field, weights=config.weights,
                             tokenizer=encoder, bos=bos, eos=eos, seq_len=int(seq_len),
                             global_batch=self.global_batch_size, lanes=lanes, seed=config.seed,
                             infinite=config.infinite, pack_mode=config.pack_mode, tokenizer_name=name)
        how = How()
        if config.threads > 0:
            from zephon.runners import threads

            how = How(runner=threads(config.threads))
        self.loader = TorchLoader(pipe.pipeline(), Where(rank=self.dp_rank, world=self.dp_world_size), how)
        self._rows: dict[str, torch.Tensor] | None = None
        self._micro = 0           # micro-batches of the current step already yielded
        self._skip = 0            # after a mid-step restore: micro-batches to skip in the next step
        self._before: dict[str, Any] | None = None  # loader position before the current step

    # -- iteration ---------------------------------------------------------------------------
    def _next_step(self) -> bool:
        self._before = self.loader.loader.position()
        try:
            batch = next(self.loader)
        except StopIteration:
            return False
        mask = batch["loss_mask"].bool()
        self._rows = {"input": batch["tokens"].long(), "positions": batch["positions"].long(),
                      "labels": torch.where(mask, batch["targets"].long(), IGNORE_INDEX)}
        self._micro, self._skip = self._skip, 0
        return True

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        while True:
            if (self._rows is None or self._micro >= self.micro_batches) and not self._next_step():
                return
            assert self._rows is not None
            lo = self._micro * self.local_batch_size
            rows = slice(lo, lo + self.local_batch_size)
            self._micro += 1
            yield ({"input": self._rows["input"][rows], "positions": self._rows["positions"][rows]},
                   self._rows["labels"][rows])

    # -- checkpoint --------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """One replicated entry: the merged Zephon state (JSON text), the same on every rank.

        Between optimizer steps (where TorchTitan checkpoints) it resumes at any dp degree; taken
        inside a step it also records the micro-batches already yielded, which only the same dp
        degree and local batch size can continue."""
        mid = self._rows is not None and 0 < self._micro < self.micro_batches
        if mid:
            assert self._before is not None
            state = self.loader.loader.state_from(self._before)
        else:
            state = self.loader.state_dict()
        merged = _gather_merged(state)
        return {"zephon_state": json.dumps(merged, sort_keys=True), "micro": self._micro if mid else 0,
                "dp_world_size": self.dp_world_size, "local_batch_size": self.local_batch_size}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict or "zephon_state" not in state_dict:
            if state_dict:
                log.warning("dataloader state has no 'zephon_state' (keys %s): starting from step 0",
                            sorted(state_dict))
            return
        text = state_dict["zephon_state"]
        state = json.loads(text) if isinstance(text, (str, bytes)) else text
        micro = int(state_dict.get("micro", 0))
        if micro and (int(state_dict.get("dp_world_size", -1)) != self.dp_world_size
                      or int(state_dict.get("local_batch_size", -1)) != self.local_batch_size):
            raise StateError(f"this checkpoint was taken inside an optimizer step ({micro} micro-batches "
                             f"in) at dp={state_dict.get('dp_world_size')}, local batch "
                             f"{state_dict.get('local_batch_size')}; only that layout can continue it. "
                             "Resume at that layout, or from a checkpoint taken between steps.")
        try:
            self.loader.load_state_dict(state)
        except StateError as e:
            raise StateError(f"{e} (TorchTitan: resuming at another dp degree needs the same "
                             "dataloader.global_batch_size, lanes, seq_len, data and tokenizer)") from e
        self._rows, self._micro, self._skip = None, 0, micro

    def close(self) -> None:
        self.loader.close()


def zephon_llama3_debugmodel() -> Any:
    """TorchTitan's Llama 3 debug model (`llama3_debugmodel`) reading through Zephon.

    Pass your data with `--dataloader.paths a.jsonl,b.jsonl --dataloader.weights 0.7 0.3` and a
    tokenizer directory with `--hf_assets_path`. The global batch is pinned (8 rows, =
    `training.global_batch_size`), so the same checkpoint resumes at dp = 1, 2 or 4 (local
    batch 2, accumulating the rest)."""
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    config = llama3_debugmodel()
    config.training.global_batch_size = 8
    config.training.local_batch_size = 2
    config.dataloader = ZephonDataLoader.Config(global_batch_size=8, lanes=8)
    config.validator.enable = False  # its default reads C4 from the Hugging Face hub
    return config
