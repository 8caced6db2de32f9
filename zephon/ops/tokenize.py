"""Online tokenization as a row operator: text in, int32 token ids out, batched.

A read window's texts are encoded together, on whichever runner computes the window: through the
exact pre-token cache (`zephon.ops.pretokens`: each distinct piece of text goes to the tokenizer
once) where a `tokenizers` tokenizer allows it, else with one batched call of the tokenizer
itself (HF `tokenizers`' `encode_batch` or tiktoken's `encode_ordinary_batch`,
`zephon.ops.encoders`). The ids are the same either way. The tokenizer is part of the operator's
identity (a hash of its JSON; a tiktoken encoding's name and a hash of its ranks), so a checkpoint
taken with one tokenizer is refused under another.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from dataclasses import field as dc_field
from typing import Any, Literal

import numpy as np

from zephon.errors import DecodeError, PlanError
from zephon.ops.base import Transform, fn_name
from zephon.ops.encoders import HFEncoder, TiktokenEncoder, encoder
from zephon.ops.pretokens import PretokenCache, ineligible
from zephon.plan import Refs
from zephon.sources.base import Columns
from zephon.sources.columns import objects

log = logging.getLogger(__name__)


@dataclass(frozen=True, eq=False)
class Tokenize(Transform):
    """Encodes column `field` (str or UTF-8 bytes) into int32 ids in column `output`.

    Args:
      tokenizer: a `tokenizers.Tokenizer`, the path of a `tokenizer.json`, a `tiktoken.Encoding`
        (`encode_ordinary`: special tokens' text is plain text; a tiktoken BPE file loads with
        `zephon.ops.encoders.load_tiktoken_file`), or any callable `str -> sequence of ints`
        (then give `name=` and bump `version=` when it changes).
      field: the text column; output: the token column (object array of int32 arrays).
      bos, eos: ids added at the start / end of every document (None: not added).
      max_tokens: longest document kept whole; longer ones are `split` into pieces of at most
        `max_tokens` (no token lost; each piece its own row) or `truncate`d (the number cut goes
        to column `truncated`). None: no limit (packing splits long documents itself).
      keep_text: keep the text column next to the tokens.
      cache: pieces kept by the exact pre-token cache (`zephon.ops.pretokens`), which encodes
        regex-split byte-level BPE `tokenizers` (GPT-2, cl100k, o200k, Llama 3, Qwen2 structures)
        faster than their batched encode with the same ids (non-ASCII documents whole on
        tiktoken's engine where it is installed, `zephon.ops.tiktoken_bpe`); 0 turns both off. Tokenizers it
        cannot serve exactly are used as they are (`pretokens.ineligible` says why), and so are
        tiktoken encodings, whose own batched encode is faster than the cache.
    """

    tokenizer: Any
    field: str = "text"
    output: str = "tokens"
    bos: int | None = None
    eos: int | None = None
    max_tokens: int | None = None
    overflow: Literal["split", "truncate"] = "split"
    keep_text: bool = False
    cache: int = 1 << 18
    name: str | None = None
    version: int = 1
    params: Mapping[str, Any] = dc_field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.overflow not in ("split", "truncate"):
            raise PlanError(f"Tokenize.overflow must be 'split' or 'truncate', got {self.overflow!r}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise PlanError(f"Tokenize.max_tokens must be a positive integer or None, got {self.max_tokens!r}")
        if isinstance(self.cache, bool) or not isinstance(self.cache, int) or self.cache < 0:
            raise PlanError(f"Tokenize.cache must be a number of pieces >= 0 (0: off), got {self.cache!r}")
        object.__setattr__(self, "_cache", None)
        plain = (callable(self.tokenizer) and not hasattr(self.tokenizer, "encode_batch")
                 and not type(self.tokenizer).__module__.startswith("tiktoken"))
        object.__setattr__(self, "_enc", None if plain else encoder(self.tokenizer))

    # the tokenizer travels to worker processes inside its encoder (HF: as its JSON)
    def __getstate__(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        if d.get("_enc") is not None:
            d["tokenizer"] = None
        d["_cache"] = None  # per process: rebuilt (empty) where the operator runs
        return d

    def __setstate__(self, d: dict[str, Any]) -> None:
        self.__dict__.update(d)

    def _encoder(self) -> HFEncoder | TiktokenEncoder | None:
        return self._enc  # type: ignore[attr-defined]

    def _pretokens(self) -> PretokenCache | None:
        """The pre-token cache, if it is on and can serve this tokenizer exactly."""
        enc = self._encoder()
        if self._cache is None and self.cache and enc is not None:  # type: ignore[attr-defined]
            # tiktoken's own batched encode (its Rust regex and BPE) outruns the cache, warm or
            # cold, on real text (benchmarks/tokenize_real.py): it is used as it is
            why = "tiktoken encodes faster than the cache" if enc.kind == "tiktoken" else ineligible(enc)
            if why is not None:
                log.debug("Tokenize: no pre-token cache for this tokenizer: %s", why)
            object.__setattr__(self, "_cache", False if why else PretokenCache(enc, self.cache))
        return self._cache or None  # type: ignore[attr-defined]

    @property
    def expands(self) -> bool:  # type: ignore[override]
        return self.max_tokens is not None and self.overflow == "split"

    @property
    def one_to_one(self) -> bool:  # type: ignore[override]
        return not self.expands

    @property
    def op_name(self) -> str:
        if self.name:
            return self.name
        return "Tokenize" if self._encoder() is not None else f"Tokenize({fn_name(self.tokenizer)})"

    def config(self) -> dict[str, Any]:
        cfg: dict[str, Any] = {"field": self.field, "output": self.output, "bos": self.bos,
                               "eos": self.eos, "max_tokens": self.max_tokens,
                               "overflow": self.overflow, "keep_text": self.keep_text, **self.params}
        if (enc := self._encoder()) is not None:
            cfg.update(enc.identity())
        return cfg

    def _texts(self, cols: Columns, refs: Refs) -> list[str]:
        if self.field not in cols:
            raise PlanError(f"Tokenize reads text column {self.field!r}, but the rows have "
                            f"{sorted(cols)}; set Tokenize(field=...).")
        out: list[str] = []
        for i, t in enumerate(cols[self.field]):
            if isinstance(t, (bytes, bytearray, np.bytes_)):
                try:
                    t = bytes(t).decode("utf-8")
                except UnicodeDecodeError as e:
                    raise DecodeError(f"record {int(refs.record[i])} of source {int(refs.source[i])}: "
                                      f"field {self.field!r} is not UTF-8 ({e}); fix the record or "
                                      "decode it with a Map before Tokenize.") from None
            elif not isinstance(t, str):
                raise DecodeError(f"record {int(refs.record[i])} of source {int(refs.source[i])}: "
                                  f"field {self.field!r} is {type(t).__name__}, not text.")
            out.append(t)
        return out

    def encode(self, texts: Sequence[str]) -> list[np.ndarray]:
        """Token ids of each text (with BOS/EOS), as int32 arrays."""
        cache = self._pretokens()
        if cache is not None:
            ids = cache.encode(texts)
        elif (enc := self._encoder()) is not None:
            ids = enc.encode(texts)
        else:
            ids = [np.array(list(self.tokenizer(t)), dtype=np.int32) for t in texts]
        head = [self.bos] if self.bos is not None else []
        tail = [self.eos] if self.eos is not None else []
        if not head and not tail:
            return ids
        return [np.concatenate([np.array(head, np.int32), x, np.array(tail, np.int32)]) for x in ids]

    def apply(self, cols: Columns, refs: Refs, seed: int) -> tuple[Columns, np.ndarray | None]:
        texts = self._texts(cols, refs)
        try:
            toks = self.encode(texts)
        except (TypeError, ValueError) as e:  # e.g. a lone surrogate ("\ud800"): not encodable text
            for i, text in enumerate(texts):
                try:
                    text.encode("utf-8")
                except UnicodeEncodeError as u:
                    raise DecodeError(f"record {int(refs.record[i])} of source {int(refs.source[i])}: "
                                      f"field {self.field!r} holds a lone surrogate "
                                      f"({text[max(0, u.start - 10):u.end + 10]!r}), which is not text a "
                                      "tokenizer can encode; fix the record, or replace it with a Map "
                                      "(text.encode('utf-8', 'replace').decode()).") from e
            raise
        rest = {k: v for k, v in cols.items() if k != self.field or self.keep_text}
        m = self.max_tokens
        if m is None or not any(len(t) > m for t in toks):
            out = {**rest, self.output: objects(toks)}
            if m is not None and self.overflow == "truncate":
                out["truncated"] = np.zeros(len(toks), np.int32)
            return out, None
        if self.overflow == "truncate":
            cut = np.array([max(0, len(t) - m) for t in toks], np.int32)
            return {**rest, self.output: objects([t[:m] for t in toks]), "truncated": cut}, None
        pieces: list[np.ndarray] = []
        rows: list[int] = []
        for i, t in enumerate(toks):
            for s in range(0, max(len(t), 1), m):
                pieces.append(t[s:s + m])
                rows.append(i)
        idx = np.asarray(rows, np.int64)
        return {**{k: v[idx] for k, v in rest.items()}, self.output: objects(pieces)}, idx
