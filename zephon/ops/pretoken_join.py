"""Many short texts through the pre-token cache with one regex pass, each encoded on its own.

`Chat` tokenizes every piece of a conversation (prompt runs, answer runs) separately, so that the
trained/untrained boundary is a token boundary; a read window holds thousands of such pieces, and
splitting each with its own regex call (plus the added-token search, the cover check and the list
handling around it) costs more than the regex work itself. `encode_joined` splits the window's
pieces *joined* into one string, once, and keeps that split for every piece it provably equals
the piece's own split; only the pieces next to an unsafe boundary are split on their own (the
cache's ordinary path). The ids are the tokenizer's own for each piece either way.

When is the joined split a piece's own split? For the regexes byte-level BPE tokenizers ship
(GPT-2, cl100k / Llama 3, o200k, Qwen2: alternatives of character classes, literals and bounded or
greedy repeats, whose only lookaround is a whole alternative `\\s+(?!\\S)`; `joinable` checks
this on the pattern), a match attempt at position p inside a piece [a, b) of the joined text S
reads only S[p:] and, compared with the piece alone, can only differ where it reads S[b]:

- a class test at b fails on the piece alone (its end); in S it fails too or consumes S[b], and
  then the match ends past b, so b is not a match end of S: that boundary is refused;
- the lookahead `(?!\\S)` at b, after `\\s+` consumed [p, b): on the piece alone it holds; in S
  it fails when S[b] is not a space, and the attempt backtracks to a shorter match. Refusing
  boundaries where S[b-1] and S[b-2] are both spaces (or not ASCII) leaves p = b - 1 only, where
  both give [b-1, b) (S through its last alternative `\\s+`), since b is a match end of S.

So with b a match end of S and no such space run before it, every match of S inside [a, b) is a
match of the piece alone, in the same order (no lookbehind: matches after a never read before
it). A piece is served from the joined split when both its boundaries pass; tests/test_pretoken_join.py
checks ids against the piece-by-piece path on adversarial boundaries, for each regex.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from functools import cache

import numpy as np

from zephon.ops.pretokens import PretokenCache

_LOOKAHEAD_ALTERNATIVE = r"\s+(?!\S)"
#: constructs that could read before a match, past its end, or match nothing (the proof above
#: does not cover them): lookarounds, anchors, word boundaries, back references, possessive and
#: atomic repeats
_OUTSIDE_PROOF = re.compile(r"\(\?(=|!|<|>)|\\[AZzbBGk1-9]|[$^]|\+\+|\*\+|\?\+|\}\+")


@cache
def joinable(pattern: str) -> bool:
    """Whether `pattern` is of the family the module doc proves the joined split exact for."""
    alternatives = _top_level_alternatives(pattern)
    rest = "|".join(a for a in alternatives if a != _LOOKAHEAD_ALTERNATIVE)
    # escapes and classes stand for one character each here (a class's ^ or $ is no anchor)
    flat = re.sub(r"\[(?:\\.|[^\]\\])*\]|\\p\{[^}]*\}|\\[^AZzbBGk1-9]", "a", rest)
    if _LOOKAHEAD_ALTERNATIVE in rest or _OUTSIDE_PROOF.search(flat):
        return False
    try:  # a regex that matches the empty string would put empty pieces at boundaries
        return re.match(flat, "") is None
    except re.error:
        return False


def _top_level_alternatives(pattern: str) -> list[str]:
    out, depth, cls, start, i = [], 0, False, 0, 0
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            i += 2
            continue
        if cls:
            cls = c != "]"
        elif c == "[":
            cls = True
        elif c == "(":
            depth += 1
        elif c == ")":
            depth -= 1
        elif c == "|" and depth == 0:
            out.append(pattern[start:i])
            start = i + 1
        i += 1
    return [*out, pattern[start:]]


#: code point -> an ASCII character that no regex's `\\s` matches (128: any other character)
_SOLID = np.array([chr(c).isascii() and not chr(c).isspace() for c in range(128)] + [False])


def encode_joined(cache: PretokenCache, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """(ids, lengths): the int32 ids of every text, concatenated, and each text's number of ids
    -- equal to concatenating `cache.encode(texts)` (each text encoded on its own)."""
    n = len(texts)
    if n == 0 or not cache.active or not joinable(cache.splitter.pattern):
        return _separately(cache, texts)
    tlen = np.fromiter(map(len, texts), np.int64, n)
    if not tlen.all():  # empty texts have no ids: the rest, then zeros in their places
        nz = np.flatnonzero(tlen)
        flat, part = encode_joined(cache, [texts[i] for i in nz.tolist()])
        lens = np.zeros(n, np.int64)
        lens[nz] = part
        return flat, lens
    joined = "".join(texts)
    pieces = cache.splitter.split(joined)
    if pieces is None or (cache.form is not None and not joined.isascii()):
        return _separately(cache, texts)
    tend = np.cumsum(tlen)
    pend = np.cumsum(np.fromiter(map(len, pieces), np.int64, len(pieces)))
    k = np.searchsorted(pend, tend)  # the piece ending at or across each text's end
    # a boundary (a text's end) is safe when a piece ends there and no run of 2+ spaces does
    codes = np.frombuffer(joined.encode("ascii") if joined.isascii() else joined.encode("utf-32-le"),
                          np.uint8 if joined.isascii() else np.uint32)
    solid = _SOLID[np.minimum(codes, 128)]
    safe = (pend[k] == tend) & (solid[tend - 1] | (tlen < 2) | solid[np.maximum(tend - 2, 0)])
    safe[-1] = True  # the end of the joined text is the end of the last text
    bad = ~safe
    bad[1:] |= ~safe[:-1]  # a text is served when its start (the previous end) and end are safe
    if cache._added is not None:  # texts holding an added token go to the tokenizer, as alone
        for m in cache._added.finditer(joined):
            lo, hi = np.searchsorted(tend, [m.start(), m.end() - 1], side="right")
            bad[lo:hi + 1] = True
    idx, ids, start, length = cache._lookup(pieces)
    lens = length[idx]
    cum = np.cumsum(lens)
    flat = ids[np.repeat(start[idx] - (cum - lens), lens) + np.arange(int(cum[-1]))]
    tok_end = cum[k]
    tok_len = np.diff(tok_end, prepend=0)
    cache.served += int(n - bad.sum())
    if not bad.any():
        return flat.astype(np.int32, copy=False), tok_len
    redo = np.flatnonzero(bad)
    parts = np.split(flat, tok_end[:-1])
    for i, x in zip(redo.tolist(), cache.encode([texts[i] for i in redo.tolist()])):
        parts[i] = x
        tok_len[i] = len(x)
    return np.concatenate(parts).astype(np.int32, copy=False), tok_len


def _separately(cache: PretokenCache, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    ids = cache.encode(texts) if texts else []
    lens = np.fromiter((len(x) for x in ids), np.int64, len(ids))
    flat = np.concatenate(ids).astype(np.int32, copy=False) if ids else np.zeros(0, np.int32)
    return flat, lens
