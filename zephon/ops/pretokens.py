"""An exact pre-token cache for GPT-2-style byte-level BPE tokenizers (tiktoken's idea).

Online tokenizing is the cost of an LM pipeline: Hugging Face `tokenizers` spends about 1.4 µs a
token on one core here, most of it outside the BPE merges (the pre-tokenizer's regex, building an
`Encoding` with its strings and offsets, converting ids to Python). Yet a byte-level BPE encodes
every pre-token (a regex piece: " word", "123", "\\n\\n") on its own, and text repeats its words:
so a document's ids are the concatenation of its pieces' ids, and each distinct piece needs the
tokenizer once. This module splits text with the tokenizer's own regex, looks the pieces up in a
bounded cache, asks the tokenizer only for pieces it has not seen (one `encode_batch` a window),
and gathers the ids with numpy.

It is exact, never approximate: it serves only tokenizers whose ids are provably that
concatenation (`ineligible` says why not: a normalizer, another pre-tokenizer, BPE dropout,
truncation or padding set on the tokenizer) and only documents it can split exactly: no added
token's text inside, and either ASCII (where the regex's \\p{L}, \\p{N} and \\s are plain
character sets) or, where the character tables were checked against the tokenizer's regex on
every assigned code point (`UNICODE_CHECKED`), text without unassigned code points. Every other
document goes to `encode_batch` as before. The ids are the same either way, so the
cache is not part of the operator's identity. If a stream's pieces rarely repeat (the cache
misses more than `MAX_MISS_RATE` of them once warm), it hands everything to
`encode_batch` from then on, where that is faster.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import unicodedata
from collections.abc import Sequence
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

_WS = "\\t\\n\\x0b\\x0c\\r "
#: GPT-2's pre-tokenizer regex (`tokenizers`' ByteLevel, use_regex=True) on ASCII text:
#: 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
SPLIT = re.compile(rf"'s|'t|'re|'ve|'m|'ll|'d| ?[A-Za-z]+| ?[0-9]+| ?[^{_WS}A-Za-z0-9]+"
                   rf"|[{_WS}]+(?![^{_WS}])|[{_WS}]+")
#: White_Space code points: the regex engine's \s (not Python's str.isspace, which adds \x1c-\x1f).
WHITE_SPACE = frozenset((*range(0x09, 0x0E), 0x20, 0x85, 0xA0, 0x1680, *range(0x2000, 0x200B), 0x2028,
                         0x2029, 0x202F, 0x205F, 0x3000))
#: (Python's Unicode tables, `tokenizers` major.minor) for which `split()` was checked to split
#: exactly as the tokenizer on every assigned code point (the sweep in tests/test_pretokens.py).
#: Elsewhere non-ASCII documents go to the tokenizer, which is exact whatever the versions.
UNICODE_CHECKED = {("14.0.0", "0.23")}
#: Above this fraction of pieces missed, the tokenizer alone is faster (a miss costs about 3× a
#: token of `encode_batch`, a hit a quarter). Judged on the second half of the first
#: `WARMUP_PIECES` pieces, once the cache has filled with the stream's common pieces.
MAX_MISS_RATE = 0.25
WARMUP_PIECES = 1 << 17


def ineligible(tokenizer_json: str) -> str | None:
    """Why a tokenizer's ids are not its pieces' ids concatenated (None: they are)."""
    cfg = json.loads(tokenizer_json)
    pre = cfg.get("pre_tokenizer") or {}
    model = cfg.get("model") or {}
    if cfg.get("normalizer") is not None:
        return "it has a normalizer"
    if (pre.get("type") != "ByteLevel" or pre.get("add_prefix_space", True)
            or not pre.get("use_regex", True)):
        return "its pre-tokenizer is not ByteLevel(add_prefix_space=False, use_regex=True)"
    if model.get("type") != "BPE" or model.get("dropout") is not None:
        return "its model is not a BPE without dropout"
    if cfg.get("truncation") is not None or cfg.get("padding") is not None:
        return "truncation or padding is set on it"
    return None


class _Classes(dict[int, str]):
    """Code point -> an ASCII character of the same class for the regex: a letter ('a', which is
    in no contraction), a digit, whitespace other than the space ('\\t'), anything else ('!'),
    or U+FFFF for a code point the tables cannot vouch for (unassigned here, or a surrogate).
    Filled as characters are met."""

    def __missing__(self, cp: int) -> str:
        cat = unicodedata.category(chr(cp))
        cls = ("a" if cat[0] == "L" else "0" if cat[0] == "N" else "\t" if cp in WHITE_SPACE
               else "\uffff" if cat in ("Cn", "Cs") else "!")
        self[cp] = cls
        return cls


_CLASSES = _Classes()
_NON_ASCII = re.compile(r"[^\x00-\x7f]+")


def _classify(m: re.Match[str]) -> str:
    return m.group().translate(_CLASSES)


def unicode_checked() -> bool:
    """Whether non-ASCII text is split here (see `UNICODE_CHECKED`)."""
    import tokenizers

    return (unicodedata.unidata_version, tokenizers.__version__.rsplit(".", 1)[0]) in UNICODE_CHECKED


def split(text: str, unicode: bool = True) -> list[str] | None:
    """`text`'s pre-tokens as the tokenizer's regex splits it, or None if not vouched for.

    Non-ASCII text (if `unicode`) is first mapped character for character to ASCII characters of
    the same regex class, split with the ASCII regex, and cut at the same offsets.
    """
    if text.isascii():
        return SPLIT.findall(text)
    if not unicode:
        return None
    classes = _NON_ASCII.sub(_classify, text)
    if not classes.isascii():
        return None
    out, at = [], 0
    for piece in SPLIT.findall(classes):
        out.append(text[at:at + len(piece)])
        at += len(piece)
    return out


class PretokenCache:
    """Encodes texts as `encode_batch` would, from cached ids of their pre-tokens.

    Per process (it is rebuilt, empty, when pickled) and safe under the threads runner. At most
    `capacity` pieces are kept; when full the cache starts over.
    """

    def __init__(self, tokenizer: Any, capacity: int) -> None:
        self.tokenizer = tokenizer
        self.capacity = capacity
        self.added = [t.content for t in tokenizer.get_added_tokens_decoder().values() if t.content]
        self._lock = threading.Lock()
        self._reset()
        self.pieces = self.misses = self.served = 0  # pieces looked up, missed; documents served
        self.warm_pieces = self.warm_misses = 0  # the same, counted once the cache has warmed up
        self.unicode = unicode_checked()
        self.active = True

    def _reset(self) -> None:
        self._index: dict[str, int] = {}
        self._ids = np.zeros(0, np.int32)
        self._start = np.zeros(0, np.int64)
        self._len = np.zeros(0, np.int64)

    def __getstate__(self) -> dict[str, Any]:
        return {"tokenizer": self.tokenizer, "capacity": self.capacity}

    def __setstate__(self, d: dict[str, Any]) -> None:
        self.__init__(d["tokenizer"], d["capacity"])  # type: ignore[misc]

    @staticmethod
    def hf(tokenizer: Any, texts: Sequence[str]) -> list[np.ndarray]:
        """int32 ids of each text from the tokenizer's own batched encode (no cache)."""
        fast = getattr(tokenizer, "encode_batch_fast", None) or tokenizer.encode_batch
        return [np.array(e.ids, np.int32) for e in fast(list(texts), add_special_tokens=False)]

    def _hf(self, texts: Sequence[str]) -> list[np.ndarray]:
        return self.hf(self.tokenizer, texts)

    def encode(self, texts: Sequence[str]) -> list[np.ndarray]:
        """int32 ids of each text, equal to the tokenizer's `encode_batch(texts)` ids."""
        if not self.active:
            return self._hf(texts)
        mine: list[int] = []
        rest: list[int] = []  # documents for the tokenizer itself
        pieces: list[str] = []
        counts: list[int] = []
        for i, t in enumerate(texts):
            if any(a in t for a in self.added) or (p := split(t, self.unicode)) is None:
                rest.append(i)
                continue
            mine.append(i)
            pieces += p
            counts.append(len(p))
        out: list[np.ndarray] = [None] * len(texts)  # type: ignore[list-item]
        if rest:
            for i, ids in zip(rest, self._hf([texts[i] for i in rest])):
                out[i] = ids
        if not mine:
            return out
        self.served += len(mine)
        index, ids, start, length = self._lookup(pieces)
        idx = np.fromiter(map(index.__getitem__, pieces), np.int64, len(pieces))
        lens = length[idx]
        ends = np.cumsum(lens)
        flat = ids[np.repeat(start[idx] - (ends - lens), lens) + np.arange(int(ends[-1]) if len(ends) else 0)]
        bounds = np.concatenate([[0], ends])[np.cumsum(counts)]
        for i, doc in zip(mine, np.split(flat, bounds[:-1])):
            out[i] = doc
        return out

    def _lookup(self, pieces: list[str]) -> tuple[dict[str, int], np.ndarray, np.ndarray, np.ndarray]:
        """The cache's arrays, holding every one of `pieces` (new ones encoded first)."""
        with self._lock:
            missing = list(set(pieces).difference(self._index))
            if self.pieces >= WARMUP_PIECES // 2:  # the first half only fills the cache
                self.warm_pieces += len(pieces)
                self.warm_misses += len(missing)
            self.pieces += len(pieces)
            self.misses += len(missing)
            if (self.warm_pieces >= WARMUP_PIECES // 2
                    and self.warm_misses > MAX_MISS_RATE * self.warm_pieces):
                self.active = False
                log.info("pre-token cache: %d of %d pieces missed; encoding with the tokenizer "
                         "alone from now on", self.misses, self.pieces)
            if missing:
                if len(self._index) + len(missing) > self.capacity:
                    self._reset()
                    missing = list(set(pieces))
                new = self._hf(missing)
                base, n = len(self._index), len(self._ids)
                self._index.update(zip(missing, range(base, base + len(missing))))
                lens = np.fromiter(map(len, new), np.int64, len(new))
                self._ids = np.concatenate([self._ids, *new])
                self._start = np.concatenate([self._start, n + np.cumsum(lens) - lens])
                self._len = np.concatenate([self._len, lens])
            return self._index, self._ids, self._start, self._len
