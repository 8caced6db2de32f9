"""Generated corpora and the stdlib as real text: documents for LM pipelines, made offline.

The machines this project runs on have no network, yet tokenize/pack/mix need text with
realistic statistics. `generate_corpus` writes English-like prose or Python-like code whose
document lengths follow a log-normal body plus a heavy tail (a few percent of documents are
longer than 2048 tokens), so packing, splitting and truncation all get exercised. Every choice is
integer arithmetic on the raw output of a PCG64 bit generator keyed by `SeedSequence` — both are
stable by numpy's policy — so the corpus is the same on every machine and numpy version, not just
"same seed". `python_stdlib_corpus` is real text no one here wrote (the standard library's own
sources). Numpy only; `zephon.demo.textdata` re-exports both next to the tokenizer and the writers.
"""

from __future__ import annotations

import logging
import math
import sysconfig
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

__all__ = ["STYLES", "generate_corpus", "python_stdlib_corpus"]

STYLES = ("prose", "code")

# --------------------------------------------------------------------------------------------
# Deterministic randomness: integer math on raw PCG64 output only.
#
# numpy promises stable streams for its bit generators and SeedSequence, but not for
# Generator methods (their algorithms may change between releases), and float transcendental
# functions may differ in the last ulp between platforms. So every draw below is an integer
# derived from `random_raw()`.


class _Bits:
    """Raw 64-bit draws, turned into integers in [0, n) or picks from integer weight tables."""

    def __init__(self, seed: int, stream: int) -> None:
        seq = np.random.SeedSequence([int(seed) & 0xFFFFFFFF, (int(seed) >> 32) & 0xFFFFFFFF,
                                      stream])
        self._bitgen = np.random.PCG64(seq)

    def raw(self, n: int) -> np.ndarray:
        return np.asarray(self._bitgen.random_raw(int(n)), dtype=np.uint64)

    def below(self, bound: int | np.ndarray, n: int) -> np.ndarray:
        """`n` integers uniform in [0, bound) (bound < 2**32, scalar or per draw): the high 32
        bits times the bound, shifted down — exact and free of modulo bias beyond 2**-32."""
        hi = self.raw(n) >> np.uint64(32)
        return ((hi * np.asarray(bound, dtype=np.uint64)) >> np.uint64(32)).astype(np.int64)

    def pick(self, cdf: np.ndarray, n: int) -> np.ndarray:
        """`n` indices drawn with integer weights given as their cumulative sum."""
        u = self.below(int(cdf[-1]), n)
        return np.searchsorted(cdf, u, side="right")


def _zipf_cdf(n: int, offset: int = 3) -> np.ndarray:
    """Cumulative integer weights ~ 1/(rank + offset): Zipf's law with exponent 1, offset so the
    most frequent word is not absurdly dominant. Total stays below 2**32 for `Bits.below`."""
    weights = (1 << 27) // (np.arange(n, dtype=np.int64) + offset)
    return np.cumsum(weights)


def _octave_table(steps: int = 16, bits: int = 30) -> np.ndarray:
    """round_down(2**(j/steps) * 2**bits) for j in [0, steps), from exact integer square roots,
    so log-normal-ish lengths need no platform-dependent exp()."""
    assert steps & (steps - 1) == 0, "steps must be a power of two"
    one = 1 << bits
    roots: list[int] = []  # 2**(1/2), 2**(1/4), ... as fixed point
    r = math.isqrt(2 << (2 * bits))
    while len(roots) < int(math.log2(steps)):
        roots.append(r)
        r = math.isqrt(r << bits)
    table = []
    for j in range(steps):
        v = one
        for k, root in enumerate(roots):  # bit k of j (from the top) selects 2**(1/2**(k+1))
            if j >> (len(roots) - 1 - k) & 1:
                v = v * root >> bits
        table.append(v)
    return np.array(table, dtype=np.int64)


_OCTAVE_STEPS = 16
_OCTAVES = _octave_table(_OCTAVE_STEPS)
_FIXED_BITS = 30


def _scale_log2(base: int, sixteenths: np.ndarray) -> np.ndarray:
    """base * 2**(sixteenths/16), integer-exact."""
    whole, frac = np.divmod(sixteenths, _OCTAVE_STEPS)
    scaled = np.int64(base) * _OCTAVES[frac]  # < 2**31 * base: fits for base < 2**32
    shift = _FIXED_BITS - whole
    up = np.maximum(-shift, 0)
    down = np.maximum(shift, 0)
    return (scaled << up) >> down


# Document lengths, in nominal tokens (the BPE of `train_bpe` at 2-4k vocab lands within ~15%).
_BODY_MEDIAN = 170        # log-normal-ish body: Irwin-Hall(4) in 1/16 octaves, sd ~0.95 octave
_BODY_HALF_WIDTH = 13     # each of 4 uniforms spans [0, 2*13) sixteenths
_TAIL_PER_MILLE = 35      # 3.5 % of documents come from a heavy tail ...
_TAIL_LOW = 2200          # ... log-uniform between 2200 and ~4000 nominal tokens
_TAIL_OCTAVES_X16 = 14    # 2**(14/16) ~ 1.83
_MIN_TOKENS = 8


def _doc_lengths(bits: _Bits, n_docs: int) -> np.ndarray:
    """Nominal token counts: most documents 50-600 tokens, a few percent longer than 2048."""
    u = bits.below(2 * _BODY_HALF_WIDTH, 4 * n_docs).reshape(n_docs, 4).sum(axis=1)
    body = _scale_log2(_BODY_MEDIAN, u - 4 * _BODY_HALF_WIDTH)
    tail = _scale_log2(_TAIL_LOW, bits.below(_TAIL_OCTAVES_X16 + 1, n_docs))
    is_tail = bits.below(1000, n_docs) < _TAIL_PER_MILLE
    return np.maximum(np.where(is_tail, tail, body), _MIN_TOKENS)


# --------------------------------------------------------------------------------------------
# Vocabulary. Frequent English words first (roughly by frequency), then numbers and invented
# words and names: the tail makes a small BPE split words into pieces, as real text does.

_COMMON = ["the", "of", "and", "to", "a", "in", "is", "that", "for", "it", "as", "was", "with", "be", "by", "on", "not",
           "he", "this", "are", "or", "his", "from", "at", "which", "but", "have", "an", "they", "you", "were", "her",
           "she", "there", "been", "one", "all", "we", "their", "has", "would", "when", "if", "so", "no", "will",
           "more", "can", "its", "out", "into", "who", "them", "than", "some", "other", "time", "only", "new", "these",
           "two", "may", "first", "then", "do", "any", "like", "my", "now", "over", "such", "our", "man", "me", "even",
           "most", "made", "after", "also", "did", "many", "before", "must", "through", "back", "years", "where",
           "much", "your", "way", "well", "down", "should", "because", "each", "just", "those", "people", "how", "too",
           "little", "state", "good", "very", "make", "world", "still", "own", "see", "men", "work", "long", "get",
           "here", "between", "both", "life", "being", "under", "never", "day", "same", "another", "know", "while",
           "last", "might", "us", "great", "old", "year", "off", "come", "since", "against", "go", "came", "right",
           "used", "take", "three", "states", "himself", "few", "house", "use", "during", "without", "again", "place",
           "american", "around", "however", "home", "small", "found", "thought", "went", "say", "part", "once",
           "general", "high", "upon", "school", "every", "does", "got", "united", "left", "number", "course", "war",
           "until", "always", "away", "something", "fact", "though", "water", "less", "public", "put", "think",
           "almost", "hand", "enough", "far", "took", "head", "yet", "government", "system", "better", "set", "told",
           "nothing", "night", "end", "why", "called", "didn't", "eyes", "find", "going", "look", "asked", "later",
           "knew", "point", "next", "program", "city", "business", "give", "group", "toward", "young", "days", "let",
           "room", "president", "side", "social", "given", "present", "several", "order", "national", "possible",
           "rather", "second", "face", "per", "among", "form", "important", "often", "things", "looked", "early",
           "white", "case", "john", "become", "large", "big", "need", "four", "within", "felt", "along", "children",
           "saw", "best", "church", "ever", "least", "power", "development", "light", "thing", "seemed", "family",
           "interest", "want", "members", "mind", "country", "area", "others", "done", "turned", "although", "open",
           "god", "service", "certain", "kind", "problem", "began", "different", "door", "thus", "help", "sense",
           "means", "whole", "matter", "perhaps", "itself", "york", "it's", "times", "law", "human", "line", "above",
           "name", "example", "action", "company", "hands", "local", "show", "whether", "five", "history", "gave",
           "today", "either", "act", "feet", "across", "taken", "past", "quite", "anything", "seen", "having", "death",
           "experience", "body", "word", "half", "really", "field", "week", "words", "already", "information", "tell",
           "together", "college", "shall", "money", "period", "held", "keep", "sure", "free", "real", "probably",
           "seems", "behind", "cannot", "miss", "political", "air", "question", "making", "office", "brought", "whose",
           "special", "major", "heard", "problems", "federal", "became", "study", "ago", "moment", "available", "known",
           "result", "street", "economic", "boy", "position", "reason", "change", "south", "board", "individual", "job",
           "society", "areas", "west", "close", "turn", "love", "community", "true", "court", "force", "full", "seem",
           "am", "policy", "wife", "future", "age", "voice", "center", "woman", "control", "common", "necessary",
           "following", "front", "sometimes", "six", "girl", "clear", "further", "land", "run", "students", "provide",
           "feel", "party", "able", "mother", "music", "education", "university", "child", "effect", "level", "stood",
           "military", "town", "short", "morning", "total", "outside", "rate", "figure", "class", "art", "century",
           "washington", "north", "usually", "leave", "therefore", "evidence", "percent", "black", "strong", "tax",
           "believe", "similar", "plan", "surface", "river", "data", "road", "language", "model", "signal", "energy",
           "network", "memory", "method", "process", "value", "results", "theory", "pressure", "research", "market",
           "training", "storage", "distance", "structure", "material", "function", "between", "ocean", "mountain",
           "forest", "winter", "summer", "garden", "window", "letter", "paper", "story", "question", "answer"]

_SYLLABLES = ["ka", "ri", "to", "na", "me", "lo", "su", "vi", "de", "ra", "mo", "ne", "ta", "li", "ko", "sa", "pe",
              "ru", "mi", "ho", "an", "el", "or", "in", "us", "ter", "ven", "dor", "mal"]


def _invented_words(n: int, capitalize: bool, salt: int) -> list[str]:
    """Pronounceable made-up words (2-4 syllables), enumerated deterministically."""
    bits = _Bits(salt, 7)
    count = 2 + bits.below(3, n)
    syl = bits.below(len(_SYLLABLES), 4 * n).reshape(n, 4)
    words, seen = [], set()
    for c, row in zip(count.tolist(), syl.tolist()):
        w = "".join(_SYLLABLES[s] for s in row[:c])
        w = w.capitalize() if capitalize else w
        if w not in seen:
            seen.add(w)
            words.append(w)
    return words


def _numbers(n: int) -> list[str]:
    years = [str(1900 + (37 * i) % 125) for i in range(n // 2)]
    others = [str((i * 7919) % 1000) if i % 3 else f"{i % 10}.{(i * 13) % 100:02d}"
              for i in range(n - n // 2)]
    return years + others


def _prose_vocab() -> list[str]:
    common = list(dict.fromkeys(_COMMON))  # unique, first occurrence keeps its rank
    tail = _invented_words(1600, False, 1)
    names = _invented_words(500, True, 2)
    nums = _numbers(120)
    # Interleave the tail so numbers, names and invented words share the same rank band.
    mixed: list[str] = []
    for i in range(max(len(tail), len(names), len(nums))):
        for group, every in ((tail, 1), (names, 3), (nums, 12)):
            if i % every == 0 and i // every < len(group):
                mixed.append(group[i // every])
    return common + [w for w in dict.fromkeys(mixed) if w not in set(common)]


# (separator after a word, weight). Sentence ends and within-sentence ones are drawn apart.
_INNER_SEPS = ((" ", 900), (", ", 80), ("; ", 8), (": ", 6))
_END_SEPS = ((". ", 780), ("? ", 50), ("! ", 30), (".\n\n", 140))
_PROSE_TOKENS_PER_WORD_X100 = 122  # calibrated against train_bpe(vocab 4096) on this corpus


def _generate_prose(n_docs: int, seed: int) -> list[str]:
    bits = _Bits(seed, 1)
    vocab = _prose_vocab()
    n_vocab = len(vocab)
    words_per_doc = np.maximum(_doc_lengths(bits, n_docs) * 100 // _PROSE_TOKENS_PER_WORD_X100, 3)
    total = int(words_per_doc.sum())
    ends = np.cumsum(words_per_doc)
    starts = ends - words_per_doc

    word = bits.pick(_zipf_cdf(n_vocab), total)
    # Sentences of 4-24 words over the whole stream; a document's first word starts a sentence
    # and its last one ends it.
    sent_len = 4 + bits.below(21, total // 4 + 2)
    sent_end = np.zeros(total, dtype=bool)
    pos = np.cumsum(sent_len) - 1
    sent_end[pos[pos < total]] = True
    sent_end[ends - 1] = True
    sent_start = np.zeros(total, dtype=bool)
    sent_start[1:] = sent_end[:-1]
    sent_start[starts] = True

    inner = np.cumsum([w for _, w in _INNER_SEPS])
    end = np.cumsum([w for _, w in _END_SEPS])
    sep = np.where(sent_end, len(_INNER_SEPS) + bits.pick(end, total), bits.pick(inner, total))
    seps = [s for s, _ in _INNER_SEPS] + [s for s, _ in _END_SEPS]

    # One table of every (word, capitalised?, separator) piece: a document is then one fancy
    # index and one join, with no per-word Python branching.
    caps = [w[:1].upper() + w[1:] for w in vocab]
    table = np.array([w + s for forms in (vocab, caps) for w in forms for s in seps], dtype=object)
    piece = (sent_start.astype(np.int64) * n_vocab + word) * len(seps) + sep
    pieces = table[piece]
    return ["".join(pieces[a:b].tolist()).rstrip() for a, b in zip(starts.tolist(), ends.tolist())]


_IDENTS = ["self", "x", "y", "i", "j", "n", "k", "data", "result", "value", "values", "items", "item", "key", "keys",
           "name", "names", "config", "path", "size", "count", "index", "offset", "buffer", "state", "options", "args",
           "kwargs", "line", "lines", "text", "token", "tokens", "batch", "batches", "record", "records", "source",
           "sources", "node", "nodes", "parent", "child", "children", "seed", "step", "steps", "row", "rows", "column",
           "columns", "field", "fields", "start", "stop", "end", "length", "total", "shape", "dtype", "array", "arrays",
           "output", "inputs", "outputs", "params", "param", "weights", "weight", "cache", "table", "mapping", "lookup",
           "reader", "writer", "stream", "file", "files", "handle", "client", "server", "request", "response",
           "message", "error", "errors", "logger", "timeout", "retries"]
_CLASSES = ["Reader", "Writer", "Config", "Loader", "Parser", "Buffer", "Cache", "Table", "Node", "Record", "Source",
            "Stream", "Batch", "Plan", "Worker", "Client", "Server", "Request", "Response", "Handler", "Manager",
            "Builder", "Registry", "Schema", "Encoder", "Decoder"]
_FUNCS = ["read", "write", "load", "save", "parse", "build", "make", "get", "set", "update", "reset", "close", "open",
          "run", "start", "stop", "apply", "merge", "split", "join", "encode", "decode", "validate", "check", "compute",
          "fetch", "send", "emit", "flush", "resolve", "convert"]

# Templates: {a} {b} {c} identifiers, {f} a function name, {C} a class name, {n} a number.
# The first field says how the line changes the indentation level after it.
_HEADERS = (
    "def {f}_{a}({b}, {c}):", "def {f}({a}, {b}=None):", "def _{f}_{a}(self, {b}):",
    "class {C}{D}:", "class {C}({D}):", "if {a} is None:", "for {a} in {b}:",
    "for {a}, {b} in enumerate({c}):", "while {a} < {n}:", "with open({a}) as {b}:",
    "if not {a}:", "try:", "elif {a} > {n}:", "else:",
)
_STATEMENTS = (
    "{a} = {b}", "{a} = {b} + {n}", "{a} = {f}_{b}({c})", "{a}.{b} = {c}", "return {a}",
    "return {f}({a}, {b})", "{a}.append({b})", "{a} += {n}", "{a} = [{b} for {b} in {c}]",
    "{a} = {{}}", "{a}[{b}] = {c}", "raise ValueError(f\"bad {a}: {{{a}!r}}\")",
    "logger.debug(\"%s %d\", {a}, {n})", "{a} = self.{b}.get({c}, {n})",
    "# {f} the {a} before the {b} is used", "assert {a} >= 0, {a}", "{a}, {b} = {b}, {a}",
    "yield {a}", "{a} = {C}({b}={c})", "{a} = len({b}) * {n}",
)
_IMPORTS = ("import os", "import sys", "import json", "import numpy as np",
            "from typing import Any", "from pathlib import Path", "import logging",
            "from collections import defaultdict", "import re", "import math")
_CODE_TOKENS_PER_LINE_X100 = 760  # calibrated against train_bpe(vocab 4096) on this corpus


def _positional(template: str) -> str:
    """'{a} = {f}({b})' -> '{0} = {3}({1})': positional str.format is the fast path."""
    for i, name in enumerate("abcfCDn"):
        template = template.replace("{" + name + "}", "{" + str(i) + "}")
    return template


def _generate_code(n_docs: int, seed: int) -> list[str]:
    bits = _Bits(seed, 2)
    lines_per_doc = np.maximum(_doc_lengths(bits, n_docs) * 100 // _CODE_TOKENS_PER_LINE_X100, 2)
    total = int(lines_per_doc.sum())
    idents = _IDENTS + _invented_words(300, False, 3)
    ident = bits.pick(_zipf_cdf(len(idents), offset=2), 3 * total).reshape(3, total)
    a, b, c = ([idents[j] for j in row] for row in ident.tolist())
    f = [_FUNCS[j] for j in bits.pick(_zipf_cdf(len(_FUNCS)), total).tolist()]
    cls = bits.below(len(_CLASSES), 2 * total).reshape(2, total).tolist()
    big, small = ([_CLASSES[j] for j in row] for row in cls)
    num = (bits.raw(total) % np.uint64(1000)).tolist()
    is_header = (bits.below(100, total) < 22).tolist()
    header = bits.below(len(_HEADERS), total).tolist()
    statement = bits.pick(_zipf_cdf(len(_STATEMENTS), offset=4), total).tolist()
    dedent = bits.below(100, total).tolist()
    n_imports = bits.below(5, n_docs).tolist()
    import_pick = bits.below(len(_IMPORTS), 4 * n_docs).reshape(n_docs, 4).tolist()

    headers = [_positional(t) for t in _HEADERS]
    top_headers = headers[:5]  # defs and classes: what may open a block at module level
    statements = [_positional(t) for t in _STATEMENTS]
    # Pass 1, integers only: each line's template and indentation. A header opens a block; a
    # statement may close one (or all), so blocks nest up to three deep and every block has a
    # body.
    template: list[str] = [""] * total
    indent: list[str] = [""] * total
    start = 0
    for n_lines in lines_per_doc.tolist():
        level = 0
        for i in range(start, start + n_lines):
            indent[i] = "    " * level if level else "\n"
            if level == 0 or (is_header[i] and level < 3):
                template[i] = headers[header[i]] if level else top_headers[header[i] % 5]
                level += 1
                continue
            template[i] = statements[statement[i]]
            if dedent[i] < 15:
                level -= 1
            elif dedent[i] < 20:
                level = 0
        start += n_lines
    # Pass 2: format every line at once, then join each document's slice.
    lines = [ind + t.format(a_, b_, c_, f_, big_, small_, n_)
             for ind, t, a_, b_, c_, f_, big_, small_, n_
             in zip(indent, template, a, b, c, f, big, small, num)]
    docs = []
    start = 0
    for d, n_lines in enumerate(lines_per_doc.tolist()):
        head = [f'"""{f[start].capitalize()} {a[start]} for the {b[start]} module."""', ""]
        head += sorted({_IMPORTS[k] for k in import_pick[d][:n_imports[d]]})
        docs.append("\n".join(head + lines[start:start + n_lines]) + "\n")
        start += n_lines
    return docs


def generate_corpus(n_docs: int, *, seed: int, style: str = "prose") -> list[str]:
    """`n_docs` generated documents, identical on every machine for the same arguments.

    "prose" is English-like text (a fixed word list under Zipf's law, with invented words,
    names and numbers in the tail; sentences, commas, paragraphs); "code" is Python-like
    modules (imports, nested defs/classes/loops, statements over a Zipf identifier list). Two
    styles of different character give a mix of corpora with different token statistics.

    Lengths: with a 2-4k vocab BPE trained on the corpus (`train_bpe`), most documents are
    50-600 tokens (log-normal body, median ~170) and ~3.5 % come from a heavy tail of
    ~2200-4000 nominal tokens (2.5-3.5 % of documents end up longer than 2048 tokens), so
    documents longer than any usual `seq_len` are present in corpora of a few hundred
    documents or more. About 30 % of all tokens sit beyond token 512 of their document and
    ~11-13 % beyond 2048: what truncating packers lose.
    """
    if n_docs < 0:
        raise ValueError(f"n_docs must be >= 0, got {n_docs}")
    if style == "prose":
        return _generate_prose(n_docs, seed) if n_docs else []
    if style == "code":
        return _generate_code(n_docs, seed) if n_docs else []
    raise ValueError(f"unknown style {style!r}; choose one of {STYLES}")


# --------------------------------------------------------------------------------------------
# Real text, offline.

_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test",
                        "__pycache__"})


def python_stdlib_corpus(max_files: int | None = None) -> list[str]:
    """The Python standard library's own `.py` files, as text (sorted by relative path).

    Real text that is present on every machine with Python and that nobody here wrote; its
    exact content depends on the Python build, so use it for realism, not for fixed expected
    values. Test directories and installed packages are skipped; bytes that are not UTF-8 are
    dropped.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    paths = sorted(p for p in root.rglob("*.py")
                   if not _SKIP_DIRS.intersection(p.relative_to(root).parts[:-1]))
    if max_files is not None:
        paths = paths[:max_files]
    texts = [p.read_bytes().decode("utf-8", errors="ignore") for p in paths]
    log.debug("python_stdlib_corpus: %d files from %s", len(texts), root)
    return texts
