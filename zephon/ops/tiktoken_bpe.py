"""A Hugging Face byte-level BPE's merges, run by tiktoken's engine, each result proven equal.

The pre-token cache sends every piece it has not seen to the tokenizer's BPE, and on text whose
words rarely repeat (most non-English text) those misses are most of the work: Hugging Face's
BPE costs ~3 us a piece, tiktoken's ~0.5 us on two threads. The two engines differ in one rule:
HF merges the adjacent pair of *tokens* listed earliest among its merges, tiktoken the adjacent
pair whose *concatenated bytes* rank lowest. Rank each merge's result by its merge's position,
and each pair HF may merge is a pair tiktoken may merge, at the same or a lower rank. So the two
runs are the same, merge for merge, as long as tiktoken only merges listed pairs at their
listed rank; it may otherwise merge a pair HF does not list (an unlisted split of a token).

Whether it did is a property of each output token by itself: tiktoken's merges inside the bytes
of one output token are its run on those bytes alone (pairs inside the span are ranked without
looking outside it, and no merge crosses the span's edge). So a token is *sound* when tiktoken's
run on its own bytes ends in that token by listed merges only (checked in Python, once, the
first time a token comes out), and a piece whose tokens are all sound has HF's ids. The others
go to HF itself (none, in the tokenizers trained here and in cl100k_base). `document_encoder`
runs whole texts the same way, split by tiktoken with the tokenizer's regex as rewritten for `re`.

Served: `BPE` models over the 256 byte-level symbols (ByteLevel pre-tokenizers), without dropout,
subword prefix or suffix, with or without `ignore_merges` (which tiktoken always does: a piece
that is one token is that token).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

SEP = "\x00"  # joins a call's pieces: tiktoken's regex below cuts there, and it is never merged


@functools.cache
def byte_symbols() -> dict[str, int]:
    """HF's byte-level alphabet: the character standing for each byte (GPT-2's table)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = [b for b in range(256) if b not in keep]
    return {chr(c): b for b, c in zip(keep + extra, keep + [256 + i for i in range(len(extra))])}


class TiktokenBPE:
    """One HF byte-level BPE model (its JSON's `model`) as a `tiktoken.Encoding` plus the ids map."""

    def __init__(self, model: dict[str, Any]) -> None:
        import tiktoken

        sym = byte_symbols()
        # each symbol to the character of its byte, any other character past Latin-1
        table = {c: chr(sym[chr(c)]) if chr(c) in sym else "\uffff" for c in range(512)}

        def to_bytes(token: str) -> bytes | None:
            try:
                return token.translate(table).encode("latin-1")
            except UnicodeEncodeError:  # not byte-level text: no byte-level word can produce it
                return None

        vocab: dict[str, int] = model["vocab"]
        ranks = {bytes([b]): b for b in range(256)}
        listed: dict[tuple[bytes, bytes], int] = {}  # a listed pair -> its rank (HF: the last listing)
        for i, m in enumerate(model["merges"]):
            a, b = map(to_bytes, m.split(" ") if isinstance(m, str) else m)
            if a is None or b is None:
                continue
            ranks.setdefault(a + b, 256 + i)
            listed[a, b] = 256 + i
        if model.get("ignore_merges"):  # a piece that is one token is that token, merged or not
            top = 256 + len(model["merges"])
            for token in vocab:
                t = to_bytes(token)
                if t is not None and t not in ranks:
                    ranks[t] = top
                    top += 1
        ids = np.full(max(ranks.values()) + 1, -1, np.int64)
        symbol_of = {b: c for c, b in sym.items()}  # a byte's character to its symbol
        for t, r in ranks.items():
            ids[r] = vocab.get(t.decode("latin-1").translate(symbol_of), -1)
        if (ids < 0).any():
            raise ValueError("a merge's result is not in the vocabulary")
        self.ids = ids.astype(np.int32)
        self.whole_words = bool(model.get("ignore_merges"))
        self.ranks, self.listed = ranks, listed
        self._bytes = {r: t for t, r in ranks.items()}
        self._sound = np.zeros(len(ids), np.int8)  # 0 not yet checked, 1 sound, -1 not
        self.encoding = tiktoken.Encoding(f"hf-bpe-{len(ranks)}", pat_str=f"[^{SEP}]+|{SEP}",
                                          mergeable_ranks=ranks, special_tokens={})

    @staticmethod
    def eligible(model: dict[str, Any]) -> str | None:
        """Why the model cannot run here (None: it can)."""
        if model.get("type") != "BPE" or model.get("dropout") is not None:
            return "not a BPE without dropout"
        if model.get("continuing_subword_prefix") or model.get("end_of_word_suffix"):
            return "it has a subword prefix or suffix"
        if not set(byte_symbols()) <= set(model.get("vocab", {})):
            return "its vocabulary lacks some of the 256 byte-level symbols"
        try:
            import tiktoken  # noqa: F401
        except ImportError:
            return "tiktoken is not installed"
        return None

    def _run_is_listed(self, rank: int) -> bool:
        """tiktoken's run on the token's own bytes ends in it, by listed merges only."""
        ranks, listed = self.ranks, self.listed
        parts = [bytes([b]) for b in self._bytes[rank]]
        while len(parts) > 1:
            best, at = None, -1
            for i in range(len(parts) - 1):
                r = ranks.get(parts[i] + parts[i + 1])
                if r is not None and (best is None or r < best):  # the leftmost lowest, as tiktoken
                    best, at = r, i
            if best is None or listed.get((parts[at], parts[at + 1])) != best:
                return False
            parts[at:at + 2] = [parts[at] + parts[at + 1]]
        return True

    def _soundness(self, ranks: np.ndarray) -> np.ndarray:
        """Each token's soundness (1 sound, -1 not), checking the tokens seen for the first time."""
        sound = self._sound
        out = sound[ranks]
        if out.all():
            return out
        for r in np.unique(ranks[out == 0]).tolist():
            sound[r] = 1 if self._run_is_listed(r) else -1
        return sound[ranks]

    def document_encoder(self, pattern: str) -> Callable[[str], np.ndarray | None]:
        """Whole texts split by `pattern` and merged, both by tiktoken (in Rust, without the
        GIL): the function gives a text's HF ids, or None where they are not proven HF's.

        `pattern` is a `zephon.ops.pretoken_regex` variant: its classes hold only the code points
        Python's tables vouch for (checked against the tokenizer's), so its pieces are the
        tokenizer's where they cover the text (tests/test_pretoken_regex.py compares them with
        `re`'s, piece for piece). tiktoken drops what no piece covers, so a text whose tokens'
        bytes fall short of its own is not proven (an unvouched character); nor is one with a
        token that is not sound (`ignore_merges` cannot tell a whole piece here), nor text
        tiktoken cannot take (a lone surrogate). Raises ValueError if tiktoken rejects `pattern`.
        """
        import tiktoken

        enc = tiktoken.Encoding(f"hf-bpe-{len(self.ranks)}-documents", pat_str=pattern,
                                mergeable_ranks=self.ranks, special_tokens={})
        nbytes = np.zeros(len(self.ids), np.int64)
        for t, r in self.ranks.items():
            nbytes[r] = len(t)
        ids = self.ids

        def encode(text: str) -> np.ndarray | None:
            try:
                ranks = enc.encode_to_numpy(text, disallowed_special=())
            except Exception:
                return None
            size = len(text) if text.isascii() else len(text.encode("utf-8"))
            if int(nbytes[ranks].sum()) != size or self._soundness(ranks).min(initial=1) < 0:
                return None
            return ids[ranks]

        return encode

    def encode(self, pieces: Sequence[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """(HF ids of all pieces concatenated, each piece's number of ids, the pieces whose ids
        are not proven HF's), or None when the pieces cannot be joined (one holds `SEP`, or is
        not encodable text): then HF must encode them all."""
        joined = SEP.join(pieces) + SEP
        if joined.count(SEP) != len(pieces):
            return None
        try:
            out = self.encoding.encode_to_numpy(joined, disallowed_special=())
        except Exception:  # e.g. a lone surrogate: HF's own encode names the problem
            return None
        seps = np.flatnonzero(out == 0)  # rank 0 is the byte 0: only the separators
        lens = np.diff(seps, prepend=-1) - 1
        ranks = np.delete(out, seps)
        bad = self._soundness(ranks) < 0
        if self.whole_words:  # HF too returns a piece that is one token as that token
            bad &= np.repeat(lens != 1, lens)
        if bad.any():
            owner = np.repeat(np.arange(len(pieces)), lens)
            unproven = np.unique(owner[bad])
        else:
            unproven = np.zeros(0, np.int64)
        return self.ids[ranks], lens.astype(np.int64), unproven
