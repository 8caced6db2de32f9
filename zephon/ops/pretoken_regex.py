"""A tokenizer's pre-tokenizer regex, run by Python's `re` with the same result.

Byte-level BPE tokenizers cut text into pieces with a regex before the BPE (GPT-2's in
`ByteLevel(use_regex=True)`; cl100k, o200k, Llama 3 and Qwen2 in a `Split` pre-tokenizer or in
tiktoken's `pat_str`). Those regexes are written for Oniguruma (Hugging Face `tokenizers`) or
fancy-regex (tiktoken) and use Unicode properties (`\\p{L}`, `\\p{N}`, `\\s`) that `re` lacks.
`compile_pattern` rewrites such a regex into `re` syntax with every property spelled out as an
explicit character class built from `unicodedata`:

- Only *vouched* code points are in any class (assigned in Python's tables, not a surrogate, not in
  `DISAGREE`). Negated classes (`[^\\s\\p{L}]`, `\\S`, `.`) are complemented within the vouched
  set, so an unvouched character matches nothing: the pieces then do not cover the text, and
  `Splitter.split` returns None (the document goes to the tokenizer, which is exact whatever its
  tables are). That makes the check free: no separate scan of the text.
- Three variants of each pattern: ASCII-only classes for ASCII text, Basic Multilingual Plane
  classes (which `re` tests in constant time) for most other text, all planes for the rest. A
  text is split by the smallest variant covering it: the result is the same, only faster. Sets
  are boolean numpy masks over the code points, so a process builds a variant in milliseconds
  (ASCII, BMP) to ~0.2 s (all planes), when a text first needs it; texts beyond the BMP (emoji,
  rare CJK) go to the tokenizer until they add up to `FULL_AFTER` characters, since most
  corpora hold few and every worker process would pay the all-planes build.

Exactness of the tables against the tokenizer's own engine is a tested fact, not an assumption:
tests/test_pretokens.py splits every assigned code point in the contexts the regexes care about
with both (`UNICODE_CHECKED` lists the versions it was run for). Constructs whose meaning differs
between the engines or that are not rewritten here (`\\w`, `\\d`, `\\b`, `\\p{Script}`, line
anchors under Oniguruma, …) raise `Unsupported`, naming the construct.
"""

from __future__ import annotations

import functools
import re
import sys
import unicodedata
from collections.abc import Callable, Iterable
from functools import cache
from typing import Literal

import numpy as np

Dialect = Literal["onig", "fancy"]
WHITE_SPACE = frozenset((*range(0x09, 0x0E), 0x20, 0x85, 0xA0, 0x1680, *range(0x2000, 0x200B), 0x2028,
                         0x2029, 0x202F, 0x205F, 0x3000))
#: Code points whose class Python's tables and the tokenizer's engine disagree on (none found so
#: far for the versions in `UNICODE_CHECKED`); they count as unvouched.
DISAGREE: frozenset[int] = frozenset()
#: GPT-2's pre-tokenizer regex (`tokenizers`' ByteLevel(use_regex=True)).
GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
#: The regexes real byte-level BPE tokenizers ship, as written in their tokenizer.json files:
#: cl100k is also Llama 3's.
REGEXES = {
    "gpt2": GPT2,
    "cl100k": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
              r"|\s*[\r\n]+|\s+(?!\S)|\s+",
    "o200k": r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
             r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+"
             r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*"
             r"|\s*[\r\n]+|\s+(?!\S)|\s+",
    "qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
             r"|\s*[\r\n]+|\s+(?!\S)|\s+",
}
_SIMPLE_ESCAPES = {"r": "\r", "n": "\n", "t": "\t", "f": "\f", "v": "\v", "0": "\0"}


class Unsupported(ValueError):
    """The regex uses a construct that is not rewritten (its message names it)."""


#: The three variants' limits: a text is split by the first whose classes cover it.
LIMITS = (0x80, 0x10000, sys.maxunicode + 1)
Mask = np.ndarray  # bool[limit]: a set of code points below the variant's limit
#: Characters of texts beyond the Basic Multilingual Plane a `Splitter` leaves to the tokenizer
#: before building its all-planes variant (about what `tokenizers` encodes in the ~0.2 s the
#: variant takes to build).
FULL_AFTER = 500_000
#: The general categories a property may name (Cn and Cs hold no vouched code point).
_CATEGORIES = frozenset(a + b for a, bs in (("L", "ultmo"), ("M", "nce"), ("N", "dlo"), ("P", "cdseifo"),
                                             ("S", "mcko"), ("Z", "slp"), ("C", "cfo")) for b in bs)


@cache
def _category_codes(limit: int) -> np.ndarray:
    """Each code point's general category below `limit`, as the two ASCII letters in one uint16
    (little-endian: 'L' | 'u' << 8). One C-level pass of `unicodedata` over all of them: a worker
    process builds the tables for a new tokenizer in tens of milliseconds, not a second."""
    cp = np.arange(limit, dtype=np.uint32)
    surrogate = (cp >= 0xD800) & (cp < 0xE000)
    text = np.where(surrogate, 0, cp).astype("<u4").tobytes().decode("utf-32-le")
    codes = np.frombuffer("".join(map(unicodedata.category, text)).encode("ascii"), "<u2").copy()
    codes[surrogate] = _code("Cs")
    codes.flags.writeable = False
    return codes


def _code(category: str) -> int:
    return ord(category[0]) | ord(category[1]) << 8


@cache
def _vouched(limit: int) -> Mask:
    """Code points below `limit` that are assigned in Python's tables, not surrogates, not in
    `DISAGREE`."""
    codes = _category_codes(limit)
    out = (codes != _code("Cn")) & (codes != _code("Cs"))
    out[[c for c in DISAGREE if c < limit]] = False
    out.flags.writeable = False
    return out


def vouched() -> frozenset[int]:
    """Every vouched code point (see `_vouched`)."""
    return frozenset(np.flatnonzero(_vouched(LIMITS[-1])).tolist())


def _property(name: str, limit: int) -> Mask:
    codes = _category_codes(limit)
    if name in _CATEGORIES:
        return (codes == _code(name)) & _vouched(limit)
    if len(name) == 1 and name in {c[0] for c in _CATEGORIES}:
        return ((codes & 0xFF) == ord(name)) & _vouched(limit)
    raise Unsupported(f"\\p{{{name}}} (only general categories such as L, Lu, N, M, P are rewritten)")


def _class_text(mask: Mask) -> str:
    """An `re` character class (without brackets) of the code points in `mask`."""
    edges = np.flatnonzero(np.diff(mask.astype(np.int8), prepend=0, append=0))
    return "".join(_range(int(lo), int(hi) - 1) for lo, hi in zip(edges[::2], edges[1::2]))


def _esc(cp: int) -> str:
    return f"\\x{cp:02x}" if cp < 0x100 else f"\\u{cp:04x}" if cp < 0x10000 else f"\\U{cp:08x}"


def _range(lo: int, hi: int) -> str:
    return _esc(lo) if lo == hi else f"{_esc(lo)}-{_esc(hi)}"


class _Parser:
    """One pass over the pattern: character sets become masks of the code points below `limit`
    (`Mask`), the rest is kept as text. A literal stays a literal even above the limit (`one`)."""

    def __init__(self, pattern: str, dialect: Dialect, limit: int) -> None:
        self.p, self.i, self.dialect, self.limit = pattern, 0, dialect, limit
        self.vouched = _vouched(limit)

    def _set(self, cps: Iterable[int]) -> Mask:
        out = np.zeros(self.limit, bool)
        out[[c for c in cps if c < self.limit]] = True
        return out

    def escape(self, in_class: bool) -> tuple[Mask, int | None] | str:
        """The escape at self.i (after the backslash): (a set, its one code point if it is a
        single character) or literal text."""
        c = self.p[self.i]
        self.i += 1
        if c in "pP":
            m = re.compile(r"\{\^?([A-Za-z_]+)\}").match(self.p, self.i)
            if not m:
                raise Unsupported(f"\\{c} without {{Name}}")
            self.i = m.end()
            s = _property(m.group(1), self.limit)
            return (self.vouched & ~s if (c == "P") != m.group(0).startswith("{^") else s), None
        if c == "s":
            return self._set(WHITE_SPACE) & self.vouched, None
        if c == "S":
            return self.vouched & ~self._set(WHITE_SPACE), None
        if c in _SIMPLE_ESCAPES:
            return self._set([ord(_SIMPLE_ESCAPES[c])]), ord(_SIMPLE_ESCAPES[c])
        if not c.isalnum():
            return (self._set([ord(c)]), ord(c)) if in_class else "\\" + c
        raise Unsupported(f"\\{c}")

    def bracket(self) -> Mask:
        """The set of the bracket expression at self.i (after '[')."""
        negate = self.p.startswith("^", self.i)
        self.i += negate
        items = np.zeros(self.limit, bool)
        first = True
        while True:
            if self.i >= len(self.p):
                raise Unsupported("an unterminated [")
            c = self.p[self.i]
            if c == "]" and not first:
                self.i += 1
                break
            first = False
            if c == "[" or self.p.startswith("&&", self.i):
                raise Unsupported("nested classes or class intersection")
            self.i += 1
            item = self.escape(True) if c == "\\" else (self._set([ord(c)]), ord(c))
            if isinstance(item, str):  # pragma: no cover - escape() returns sets in classes
                raise Unsupported(item)
            mask, single = item
            if single is not None and self.p.startswith("-", self.i) and not self.p.startswith("-]", self.i):
                self.i += 1
                hi = self.p[self.i]
                self.i += 1
                end = self.escape(True) if hi == "\\" else (self._set([ord(hi)]), ord(hi))
                if isinstance(end, str) or end[1] is None:
                    raise Unsupported("a range to a class")
                mask = np.zeros(self.limit, bool)
                mask[single:end[1] + 1] = True
                mask &= self.vouched
            items |= mask
        return self.vouched & ~items if negate else items

    def parse(self) -> list[str | Mask]:
        out: list[str | Mask] = []
        while self.i < len(self.p):
            c = self.p[self.i]
            self.i += 1
            if c == "\\":
                e = self.escape(False)
                out.append(e if isinstance(e, str) else e[0])
            elif c == "[":
                out.append(self.bracket())
            elif c == ".":
                out.append(self.vouched & ~self._set([0x0A]))
            elif c in "^$":
                if self.dialect == "onig":
                    raise Unsupported(f"the anchor {c} (a line anchor under Oniguruma)")
                out.append(r"\A" if c == "^" else r"\Z")
            elif c == "(" and self.p.startswith("?", self.i) and not re.match(
                    r"\?(:|i:|=|!|<=|<!)", self.p[self.i:]):
                raise Unsupported(f"the group ({self.p[self.i:self.i + 3]}")
            else:
                out.append(c)
        return out


@cache
def compile_variant(pattern: str, dialect: Dialect, limit: int) -> re.Pattern[str]:
    """`pattern` as an `re` pattern whose classes hold only code points below `limit` (an empty
    class matches nothing). Raises `Unsupported` naming a construct it does not rewrite exactly.

    The variants differ only in what their classes hold, so one that compiles means all do.
    """
    try:
        return re.compile(variant_text(pattern, dialect, limit))
    except re.error as e:
        raise Unsupported(f"Python's re rejects the rewritten pattern ({e})") from None


@cache
def variant_text(pattern: str, dialect: Dialect, limit: int) -> str:
    """The source of `compile_variant`'s pattern (what tiktoken's engine is given, uncompiled)."""
    parts = _Parser(pattern, dialect, limit).parse()
    return "".join(p if isinstance(p, str) else f"[{_class_text(p)}]" if p.any() else "(?!)" for p in parts)


def compile_pattern(pattern: str, dialect: Dialect = "onig") -> tuple[re.Pattern[str], ...]:
    """`pattern` as `re` patterns with classes limited to ASCII, to the BMP, and to all planes."""
    return tuple(compile_variant(pattern, dialect, limit) for limit in LIMITS)


class Splitter:
    """`split(text)`: the pieces the tokenizer's regex (Split "isolated") cuts `text` into, or
    None when Python's tables cannot vouch for one of its characters (or `unicode` is off and
    the text is not ASCII)."""

    def __init__(self, pattern: str, dialect: Dialect = "onig", unicode: bool = True) -> None:
        self.pattern, self.dialect = pattern, dialect
        # the ASCII variant now (it raises `Unsupported`, and most text is ASCII); the others when
        # a text first needs them (tens of milliseconds each, in every process)
        self.ascii = compile_variant(pattern, dialect, LIMITS[0]).findall
        self.unicode = unicode
        # the all-planes variant takes ~0.2 s to build, in every worker process (the categories
        # of 1.1M code points, a regex of their classes), and few texts need it (emoji, rare
        # CJK): those go to the tokenizer until their characters add up to `full_after`
        self.full_after, self.beyond_bmp = FULL_AFTER, 0

    @functools.cached_property
    def bmp(self) -> Callable[[str], list[str]]:
        return compile_variant(self.pattern, self.dialect, LIMITS[1]).findall

    @functools.cached_property
    def full(self) -> Callable[[str], list[str]]:
        return compile_variant(self.pattern, self.dialect, LIMITS[2]).findall

    def split(self, text: str) -> list[str] | None:
        if text.isascii():
            pieces = self.ascii(text)
            return pieces if sum(map(len, pieces)) == len(text) else self._gaps(text)
        if not self.unicode:
            return None
        pieces = self.bmp(text)
        if sum(map(len, pieces)) == len(text):
            return pieces
        if self.beyond_bmp < self.full_after:  # the tokenizer splits it, until building the
            self.beyond_bmp += len(text)  # all-planes variant pays for itself
            return None
        pieces = self.full(text)
        return pieces if sum(map(len, pieces)) == len(text) else None

    def _gaps(self, text: str) -> list[str]:
        """Split "isolated" keeps what no match covers as pieces of their own (ASCII text: every
        character is vouched, so a gap is the regex's, not a table's)."""
        pat = compile_variant(self.pattern, self.dialect, LIMITS[0])
        out, at = [], 0
        for m in pat.finditer(text):
            if m.start() > at:
                out.append(text[at:m.start()])
            if m.end() > m.start():
                out.append(m.group())
            at = m.end()
        if at < len(text):
            out.append(text[at:])
        return out
