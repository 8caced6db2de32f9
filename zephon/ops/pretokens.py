"""An exact pre-token cache for byte-level BPE tokenizers (tiktoken's idea).

Online tokenizing is the cost of an LM pipeline, and most of a tokenizer's time goes outside the
BPE merges (the regex, building an `Encoding` with strings and offsets, converting ids to
Python). Yet a byte-level BPE encodes every pre-token (a regex piece: " word", "123", "\\n\\n")
on its own, and text repeats its pieces: so a document's ids are the concatenation of its pieces'
ids, and each distinct piece needs the tokenizer once. This module splits text with the
tokenizer's own regex (run by `re`, `zephon.ops.pretoken_regex`), looks the pieces up in a
bounded cache keyed by the piece's text, asks the tokenizer only for pieces it has not seen (one
call a window; a `tokenizers` BPE's run on tiktoken's engine, `zephon.ops.tiktoken_bpe`) and
gathers the ids with numpy.

Where tiktoken's engine can run the tokenizer (a `tokenizers` byte-level BPE, `TiktokenBPE`),
non-ASCII documents go there whole first (`documents=True`): their pieces repeat less, and its
Rust regex (given the same rewritten pattern as `re`, so the same pieces) and merges, on both
cores, outrun the split, lookups and misses here by ~1.2-1.3x on real non-English text. A
document comes back only with ids proven the tokenizer's (every character covered by a piece,
every token sound), else the cache below takes it. ASCII text (English, code) hits the cache
98 % of the time and was as fast or faster split here.

Served: GPT-2's `ByteLevel(use_regex=True)`, `Sequence[Split(regex, "isolated"),
ByteLevel(use_regex=False)]` (cl100k, o200k, Llama 3, Qwen2 in `tokenizers`), tiktoken encodings,
each with no normalizer, or NFC / NFKC for ASCII documents. It is exact, never approximate: `ineligible` names
why a tokenizer is not served (another model or pre-tokenizer, BPE dropout, truncation or padding
set on it, a regex construct not rewritten), and a document is served only when it can be split
exactly: no added token's text inside, and only characters Python's Unicode tables vouch for
(ASCII always; all scripts where the tables were checked against the tokenizer's on every
assigned code point, `UNICODE_CHECKED`). Every other document goes to the tokenizer. The ids are
the same either way, so the cache is not part of the operator's identity. If a stream's pieces
rarely repeat (more than `MAX_MISS_RATE` missed once warm) and its misses go to `tokenizers`'
BPE, it hands everything to the tokenizer from then on, where that is faster.
"""

from __future__ import annotations

import logging
import re
import threading
import unicodedata
from collections.abc import Callable, Sequence
from typing import Any, Literal

import numpy as np

from zephon.ops.encoders import HFEncoder, TiktokenEncoder, encoder, thread_map
from zephon.ops.pretoken_regex import LIMITS, Splitter, Unsupported, variant_text

log = logging.getLogger(__name__)

#: (backend, Python's Unicode tables, backend major.minor) for which splitting was checked to be
#: the tokenizer's own on every assigned code point (the sweeps in tests/test_pretokens.py).
#: Elsewhere non-ASCII documents go to the tokenizer, which is exact whatever the versions.
UNICODE_CHECKED = {("tokenizers", "14.0.0", "0.23"), ("tiktoken", "14.0.0", "0.14")}
#: Above this fraction of pieces missed, the tokenizer alone is faster (where misses go to the
#: tokenizer's own BPE, not tiktoken's engine). Judged on the second half
#: of the first `WARMUP_PIECES` pieces, once the cache has filled with the stream's common pieces.
MAX_MISS_RATE = 0.25
WARMUP_PIECES = 1 << 17


def ineligible(tokenizer: Any) -> str | None:
    """Why a tokenizer (a `tokenizers.Tokenizer`, its JSON, or a `tiktoken.Encoding`) is not
    served exactly by the cache (None: it is)."""
    if isinstance(tokenizer, str):
        import tokenizers

        tokenizer = tokenizers.Tokenizer.from_str(tokenizer)
    enc = tokenizer if isinstance(tokenizer, (HFEncoder, TiktokenEncoder)) else encoder(tokenizer)
    s = enc.structure()
    if isinstance(s, str):
        return s
    try:
        Splitter(s[0], s[1])  # type: ignore[arg-type]
    except Unsupported as e:
        return f"its regex uses {e}"
    return None


def unicode_checked(kind: str = "tokenizers") -> bool:
    """Whether non-ASCII text is split here (see `UNICODE_CHECKED`)."""
    import importlib

    version = importlib.import_module(kind).__version__.rsplit(".", 1)[0]
    return (kind, unicodedata.unidata_version, version) in UNICODE_CHECKED


class _Index(dict[str, int]):
    """Piece -> its row in the cache's arrays; a piece not in it gets the next row, and is noted
    in `new` (for the caller to encode)."""

    new: list[str]

    def __missing__(self, piece: str) -> int:
        self.new.append(piece)
        row = self[piece] = len(self)
        return row


class PretokenCache:
    """Encodes texts as the tokenizer's own batched encode would, from cached ids of their pieces.

    Per process (it is rebuilt, empty, when pickled) and safe under the threads runner. It never
    holds more than `capacity` pieces: when full it starts over, and a window with more distinct
    pieces than that keeps only `capacity` of them.
    """

    def __init__(self, tokenizer: Any, capacity: int, documents: bool = True) -> None:
        self.enc = tokenizer if isinstance(tokenizer, (HFEncoder, TiktokenEncoder)) else encoder(tokenizer)
        self.capacity, self.documents = capacity, documents
        s = self.enc.structure()
        if isinstance(s, str):
            raise ValueError(f"the pre-token cache cannot serve this tokenizer: {s}")
        pattern, dialect, self.form = s
        self.unicode = unicode_checked(self.enc.kind)
        self.splitter = Splitter(pattern, dialect, self.unicode)  # type: ignore[arg-type]
        added = sorted(self.enc.added, key=len, reverse=True)
        self._added = re.compile("|".join(map(re.escape, added))) if added else None
        self._done = threading.Condition()  # guards the index and arrays; notified on appends
        self._generation = 0
        with self._done:
            self._reset()
        self.pieces = self.misses = self.served = 0  # pieces looked up, missed; documents served
        self.whole = 0  # documents served whole by tiktoken's engine
        self.warm_pieces = self.warm_misses = 0  # the same, counted once the cache has warmed up
        self.active = True
        self._whole: Callable[[str], np.ndarray | None] | Literal[False] | None = None

    def _reset(self) -> None:
        """Empty the cache; calls in flight on the old one look up again (`_generation`)."""
        self._generation += 1
        self._done.notify_all()
        self._index = _Index()
        self._committed = 0  # rows filled: the index may have reserved more, being encoded
        self._ids = np.zeros(0, np.int32)
        self._start = np.zeros(0, np.int64)
        self._len = np.zeros(0, np.int64)

    def __getstate__(self) -> dict[str, Any]:
        return {"enc": self.enc, "capacity": self.capacity, "documents": self.documents}

    def __setstate__(self, d: dict[str, Any]) -> None:
        self.__init__(d["enc"], d["capacity"], d["documents"])  # type: ignore[misc]

    @staticmethod
    def hf(tokenizer: Any, texts: Sequence[str]) -> list[np.ndarray]:
        """int32 ids of each text from the tokenizer's own batched encode (no cache)."""
        return encoder(tokenizer).encode(texts)

    def _splittable(self, text: str) -> bool:
        """Whether the text is the tokenizer's pieces' text only: no added token's text in it,
        and no normal form to apply (ASCII is its own NFC/NFKC; elsewhere Python's tables and
        the tokenizer's differ: the sweep found U+07FD's combining class)."""
        added = self._added
        return (added is None or not added.search(text)) and (self.form is None or text.isascii())

    def _split(self, text: str) -> list[str] | None:
        return self.splitter.split(text) if self._splittable(text) else None

    def _documents(self) -> Callable[[str], np.ndarray | None] | None:
        """Whole texts through tiktoken's engine (`TiktokenBPE.document_encoder`), when the
        tokenizer is a `tokenizers` BPE it can run: its regex (the BMP variant: texts beyond
        it come back unproven) and its merges in Rust, on both cores."""
        if self._whole is None:
            self._whole = False
            bpe = self.enc._tiktoken_bpe() if self.documents and isinstance(self.enc, HFEncoder) else None
            if bpe is not None and self.unicode:  # non-ASCII text, where Python's tables were checked
                s = self.splitter
                try:
                    self._whole = bpe.document_encoder(variant_text(s.pattern, s.dialect, LIMITS[1]))
                except ValueError as e:
                    log.debug("tiktoken's engine cannot run this regex (%s): the cache splits texts", e)
        return self._whole or None

    def encode(self, texts: Sequence[str]) -> list[np.ndarray]:
        """int32 ids of each text, equal to the tokenizer's own batched encode's."""
        out: list[np.ndarray] = [None] * len(texts)  # type: ignore[list-item]
        todo = list(range(len(texts)))
        whole = self._documents()
        if whole is not None:
            # non-ASCII text only: its pieces repeat less (the cache missed 11 % of them on real
            # non-English text, 2 % on English and code), and ASCII text split here was as fast
            # inline and 10 % faster in a one-thread worker (benchmarks/tokenize_real.py);
            # longest first, so that the threads end a window together
            mine = sorted((i for i in todo if not texts[i].isascii() and self._splittable(texts[i])),
                          key=lambda i: -len(texts[i]))
            for i, ids in zip(mine, thread_map(whole, [texts[i] for i in mine])):
                out[i] = ids
            todo = [i for i in todo if out[i] is None]
            self.whole += len(texts) - len(todo)
            self.served += len(texts) - len(todo)
        mine = []
        rest: list[int] = []  # documents for the tokenizer itself (all of them once it stepped aside)
        pieces: list[str] = []
        counts: list[int] = []
        split = self._split if self.active else lambda t: None
        for i in todo:
            t = texts[i]
            p = split(t)
            if p is None:
                rest.append(i)
                continue
            mine.append(i)
            pieces += p
            counts.append(len(p))
        if rest:
            for i, ids in zip(rest, self.enc.encode([texts[i] for i in rest])):
                out[i] = ids
        if not mine:
            return out
        self.served += len(mine)
        idx, ids, start, length = self._lookup(pieces)
        lens = length[idx]
        ends = np.cumsum(lens)
        total = int(ends[-1]) if len(ends) else 0
        flat = ids[np.repeat(start[idx] - (ends - lens), lens) + np.arange(total)]
        bounds = np.concatenate([[0], ends])[np.cumsum(counts)]
        for i, doc in zip(mine, np.split(flat, bounds[:-1])):
            out[i] = doc
        return out

    def _count(self, pieces: int, missing: int) -> None:
        if self.pieces >= WARMUP_PIECES // 2:  # the first half only fills the cache
            self.warm_pieces += pieces
            self.warm_misses += missing
        self.pieces += pieces
        self.misses += missing
        if (self.warm_pieces >= WARMUP_PIECES // 2 and self.warm_misses > MAX_MISS_RATE * self.warm_pieces
                and not self._cheap_misses()):
            self.active = False
            log.info("pre-token cache: %d of %d pieces missed; encoding with the tokenizer alone from now on",
                     self.misses, self.pieces)

    def _cheap_misses(self) -> bool:
        """Misses run on tiktoken's engine: then the cache beats the tokenizer alone even when
        nearly every piece misses (random words: 1.5x `encode_batch` on one core, against 0.3x
        with `tokenizers`' BPE; benchmarks/pretokens.py), so it never steps aside."""
        return isinstance(self.enc, HFEncoder) and self.enc._tiktoken_bpe() is not None

    def _lookup(self, pieces: list[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Each piece's index into arrays (ids, start, length) that hold them all, new ones
        encoded first: one C-level dict lookup a piece, Python only for the misses.

        Under the threads runner the misses are encoded outside the lock (the tokenizer releases
        the GIL): a call reserves rows for its new pieces, encodes them, then appends them in row
        order, waiting for calls that reserved rows before it; a call whose pieces are in rows
        still being encoded waits for those. A failed encode or a start-over (`_generation`)
        sends the calls in flight back to look up again. Arrays are replaced, never changed in
        place, so a caller can read them after the lock is released.
        """
        counted = False  # a call looking up again after a start-over is counted once
        while True:
            with self._done:
                index, generation = self._index, self._generation
                index.new = []
                idx = np.fromiter(map(index.__getitem__, pieces), np.int64, len(pieces))
                missing = index.new
                if not counted:
                    self._count(len(pieces), len(missing))
                    counted = True
                if len(index) > self.capacity:
                    return self._start_over(pieces)
                first = len(index) - len(missing)  # this call's rows: first, first + 1, ...
                if not missing:
                    top = int(idx.max()) + 1 if len(idx) else 0
                    if self._wait(generation, top):
                        return idx, self._ids, self._start, self._len
                    continue
            try:
                flat, lens = self.enc.encode_pieces(missing)
            except BaseException:
                with self._done:  # rows reserved, never filled: nobody may wait for them
                    if generation == self._generation:
                        self._reset()
                raise
            with self._done:
                if not self._wait(generation, first):  # rows before this call's are in
                    continue
                n = len(self._ids)
                self._ids = np.concatenate([self._ids, flat])
                self._start = np.concatenate([self._start, n + np.cumsum(lens) - lens])
                self._len = np.concatenate([self._len, lens])
                self._committed = first + len(missing)
                self._done.notify_all()
                return idx, self._ids, self._start, self._len

    def _wait(self, generation: int, rows: int) -> bool:
        """Wait (lock held) until the first `rows` rows are filled; False if the cache started
        over meanwhile."""
        self._done.wait_for(lambda: generation != self._generation or self._committed >= rows)
        return generation == self._generation

    def _start_over(self, pieces: list[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The cache is full (lock held): start over with as many of this call's pieces as fit,
        holding the rest for this call only. Rare, so it encodes under the lock."""
        self._reset()
        index = self._index
        index.new = []
        idx = np.fromiter(map(index.__getitem__, pieces), np.int64, len(pieces))
        missing = index.new
        try:
            ids, length = self.enc.encode_pieces(missing)
        except BaseException:
            self._reset()
            raise
        start = np.cumsum(length) - length
        keep = min(len(missing), self.capacity)
        for p in missing[keep:]:  # over capacity within one call
            del index[p]
        self._ids = ids[:int(start[keep - 1] + length[keep - 1]) if keep else 0]
        self._start, self._len = start[:keep], length[:keep]
        self._committed = keep
        return idx, ids, start, length
