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
  text is split by the smallest variant covering it: the result is the same, only faster.

Exactness of the tables against the tokenizer's own engine is a tested fact, not an assumption:
tests/test_pretokens.py splits every assigned code point in the contexts the regexes care about
with both (`UNICODE_CHECKED` lists the versions it was run for). Constructs whose meaning differs
between the engines or that are not rewritten here (`\\w`, `\\d`, `\\b`, `\\p{Script}`, line
anchors under Oniguruma, …) raise `Unsupported`, naming the construct.
"""

from __future__ import annotations

import re
import sys
import unicodedata
from functools import cache
from typing import Literal

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


@cache
def _categories() -> dict[str, frozenset[int]]:
    """General category -> its vouched code points (from Python's `unicodedata`)."""
    out: dict[str, set[int]] = {}
    for cp in range(sys.maxunicode + 1):
        cat = unicodedata.category(chr(cp))
        if cat not in ("Cn", "Cs") and cp not in DISAGREE:
            out.setdefault(cat, set()).add(cp)
    return {k: frozenset(v) for k, v in out.items()}


@cache
def vouched() -> frozenset[int]:
    return frozenset().union(*_categories().values())


def _property(name: str) -> frozenset[int]:
    cats = _categories()
    if name in cats or (len(name) == 1 and name in {c[0] for c in cats}):
        return frozenset().union(*(v for k, v in cats.items() if k.startswith(name)))
    raise Unsupported(f"\\p{{{name}}} (only general categories such as L, Lu, N, M, P are rewritten)")


def _class_text(cps: frozenset[int], limit: int) -> str:
    """An `re` character class (without brackets) of the code points below `limit`."""
    out: list[str] = []
    run: list[int] = []
    for cp in sorted(c for c in cps if c < limit):
        if run and cp == run[1] + 1:
            run[1] = cp
            continue
        if run:
            out.append(_range(*run))
        run = [cp, cp]
    if run:
        out.append(_range(*run))
    return "".join(out)


def _esc(cp: int) -> str:
    return f"\\x{cp:02x}" if cp < 0x100 else f"\\u{cp:04x}" if cp < 0x10000 else f"\\U{cp:08x}"


def _range(lo: int, hi: int) -> str:
    return _esc(lo) if lo == hi else f"{_esc(lo)}-{_esc(hi)}"


class _Parser:
    """One pass over the pattern: character sets become `frozenset`s, the rest is kept as text."""

    def __init__(self, pattern: str, dialect: Dialect) -> None:
        self.p, self.i, self.dialect = pattern, 0, dialect

    def escape(self, in_class: bool) -> frozenset[int] | str:
        """The escape at self.i (after the backslash): a set of code points or literal text."""
        c = self.p[self.i]
        self.i += 1
        if c in "pP":
            m = re.compile(r"\{\^?([A-Za-z_]+)\}").match(self.p, self.i)
            if not m:
                raise Unsupported(f"\\{c} without {{Name}}")
            self.i = m.end()
            s = _property(m.group(1))
            return vouched() - s if (c == "P") != m.group(0).startswith("{^") else s
        if c == "s":
            return WHITE_SPACE & vouched()
        if c == "S":
            return vouched() - WHITE_SPACE
        if c in _SIMPLE_ESCAPES:
            return frozenset([ord(_SIMPLE_ESCAPES[c])])
        if not c.isalnum():
            return frozenset([ord(c)]) if in_class else "\\" + c
        raise Unsupported(f"\\{c}")

    def bracket(self) -> frozenset[int]:
        """The set of the bracket expression at self.i (after '[')."""
        negate = self.p.startswith("^", self.i)
        self.i += negate
        items: set[int] = set()
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
            item = self.escape(True) if c == "\\" else frozenset([ord(c)])
            if isinstance(item, str):  # pragma: no cover - escape() returns sets in classes
                raise Unsupported(item)
            if len(item) == 1 and self.p.startswith("-", self.i) and not self.p.startswith("-]", self.i):
                self.i += 1
                hi = self.p[self.i]
                self.i += 1
                end = self.escape(True) if hi == "\\" else frozenset([ord(hi)])
                if isinstance(end, str) or len(end) != 1:
                    raise Unsupported("a range to a class")
                lo, up = next(iter(item)), next(iter(end))
                item = frozenset(range(lo, up + 1)) & vouched()
            items |= item
        s = frozenset(items)
        return vouched() - s if negate else s

    def parse(self) -> list[str | frozenset[int]]:
        out: list[str | frozenset[int]] = []
        while self.i < len(self.p):
            c = self.p[self.i]
            self.i += 1
            if c == "\\":
                out.append(self.escape(False))
            elif c == "[":
                out.append(self.bracket())
            elif c == ".":
                out.append(vouched() - {0x0A})
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
def compile_pattern(pattern: str, dialect: Dialect = "onig") -> tuple[re.Pattern[str], ...]:
    """`pattern` as `re` patterns with classes limited to ASCII, to the BMP, and to all planes.

    Raises `Unsupported` naming a construct it does not rewrite exactly.
    """
    parts = _Parser(pattern, dialect).parse()
    out = []
    for limit in (0x80, 0x10000, sys.maxunicode + 1):
        text = "".join(p if isinstance(p, str) else f"[{_class_text(p, limit)}]" if p and min(p) < limit
                       else "(?!)" for p in parts)
        try:
            out.append(re.compile(text))
        except re.error as e:
            raise Unsupported(f"Python's re rejects the rewritten pattern ({e})") from None
    return tuple(out)


class Splitter:
    """`split(text)`: the pieces the tokenizer's regex (Split "isolated") cuts `text` into, or
    None when Python's tables cannot vouch for one of its characters (or `unicode` is off and
    the text is not ASCII)."""

    def __init__(self, pattern: str, dialect: Dialect = "onig", unicode: bool = True) -> None:
        self.pattern, self.dialect = pattern, dialect
        self.ascii, self.bmp, self.full = (p.findall for p in compile_pattern(pattern, dialect))
        self.unicode = unicode

    def split(self, text: str) -> list[str] | None:
        if text.isascii():
            pieces = self.ascii(text)
            return pieces if sum(map(len, pieces)) == len(text) else self._gaps(text, 0)
        if not self.unicode:
            return None
        pieces = self.bmp(text)
        if sum(map(len, pieces)) == len(text):
            return pieces
        pieces = self.full(text)
        return pieces if sum(map(len, pieces)) == len(text) else None

    def _gaps(self, text: str, variant: int) -> list[str]:
        """Split "isolated" keeps what no match covers as pieces of their own (ASCII text: every
        character is vouched, so a gap is the regex's, not a table's)."""
        pat = compile_pattern(self.pattern, self.dialect)[variant]
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
