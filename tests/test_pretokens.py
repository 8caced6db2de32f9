"""The pre-token cache gives exactly the tokenizer's ids, or steps aside.

Exactness is the whole contract: a document's ids from the cache must equal `encode_batch`'s
for every text, including the regex's edge cases (contractions, whitespace runs before a word,
control characters the regex does not call whitespace); documents and tokenizers it cannot
serve exactly go to the tokenizer, and the tests check that the cache really served the rest.
"""

import pickle
import random
import threading
import unicodedata

import numpy as np
import pytest
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

from zephon import Loader, Source
from zephon.ops import pretokens
from zephon.ops.pack import Pack
from zephon.ops.pretokens import PretokenCache, ineligible
from zephon.ops.tokenize import Tokenize
from zephon.sources.memory import ArraySource
from zephon.textdata import generate_corpus, train_bpe

TRICKY = ["'s", "'t", "'re", "'ve", "'m", "'ll", "'d", "'S", "'LL", "  ", "   x", "\n\n", " \n ",
          "\t", "\r\n", "123", " 45", "a1b2", "!!", " ?", " .", "\x1c", "\x1f", "\x0b", "\x0c",
          "\x00", "\x7f", "don't", "  'll", " 'd", "x  ", " ", ""]


@pytest.fixture(scope="module")
def texts():
    return generate_corpus(300, seed=3, style="prose") + generate_corpus(100, seed=4, style="code")


@pytest.fixture(scope="module")
def tok(texts):
    return train_bpe(texts, vocab_size=700)


def reference(tok, texts):
    return [e.ids for e in tok.encode_batch(list(texts), add_special_tokens=False)]


def random_ascii(n, seed):
    rng = random.Random(seed)
    alphabet = [chr(i) for i in range(128)]
    return ["".join(rng.choice(alphabet) if rng.random() < 0.5 else rng.choice(TRICKY)
                    for _ in range(rng.randrange(0, 50))) for _ in range(n)]


def assert_same(got, want):
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.dtype == np.int32
        assert g.tolist() == w, f"text {i}"


def test_exact_on_corpus_and_adversarial_ascii(tok, texts):
    cache = PretokenCache(tok, 1 << 17)
    for batch in (texts, random_ascii(2000, 0), TRICKY):
        assert_same(cache.encode(batch), reference(tok, batch))
    assert cache.served == len(texts) + 2000 + len(TRICKY)  # all ASCII, no special token in them
    assert cache.misses < cache.pieces


def test_texts_it_cannot_split_go_to_the_tokenizer(tok):
    unassigned = "\u0378"  # no character (yet) in Python's tables: the tokenizer's may differ
    batch = ["plain text here", "ends with <eos>", "<pad> starts", f"odd {unassigned} one",
             "again plain"]
    cache = PretokenCache(tok, 1 << 17)
    assert_same(cache.encode(batch), reference(tok, batch))
    assert cache.served == 2  # only the two texts without an added token or unknown code point


UNICODE = pretokens.unicode_checked()
SCRIPTS = ["café", "naïve", "Ünïcödé", "日本語のテキスト", "русский текст", "١٢٣ عربي", "Ⅻ ½ ²",
           "\u3000wide", "nel\x85x", "nb\xa0sp", "emoji 🙂🚀", "’quotes” — dash", "\u2028sep",
           "'s 'T ’ll", "  \u2003 x", "ǅ ʰ ゝ 〇", "\u0301combining", "१२३ देवनागरी"]


def multilingual(n, seed):
    rng = random.Random(seed)
    return ["".join(rng.choice(SCRIPTS + TRICKY) for _ in range(rng.randrange(1, 30))) for _ in range(n)]


@pytest.mark.skipif(not UNICODE, reason="Unicode tables unchecked for these versions (ASCII only)")
def test_non_ascii_text_is_served_exactly(texts):
    # trained on the same scripts, so the BPE merges across their bytes: a wrong split would
    # change the ids (with an English-only BPE every split of them gives the same byte tokens)
    tok = train_bpe(texts[:100] + multilingual(400, 4), vocab_size=1200)
    batch = multilingual(1500, 5)
    cache = PretokenCache(tok, 1 << 17)
    assert_same(cache.encode(batch), reference(tok, batch))
    assert cache.served == len(batch)


def _byte_chars():
    """GPT-2's byte -> printable character table (what ByteLevel's pieces are written in)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = [b for b in range(256) if b not in keep]
    return {b: chr(c) for b, c in zip(keep + extra, keep + [256 + i for i in range(len(extra))])}


BYTE_CHARS = _byte_chars()


def assert_splits_like_the_tokenizer(tok, codepoints):
    """Each code point next to a letter, a digit, punctuation, spaces, itself and a contraction:
    the pieces (not the ids, which an English BPE cannot tell apart here) must be the tokenizer's."""
    pre = tok.pre_tokenizer
    checked = 0
    for c in map(chr, codepoints):
        text = f"a{c}a 1{c}1 !{c}! {c}{c} x{c} {c}\t{c}'s{c} '{c}x x'{c}"
        pieces = pretokens.split(text)
        if pieces is None:  # unassigned in Python's tables, or a surrogate: left to the tokenizer
            assert unicodedata.category(c) in ("Cn", "Cs"), f"U+{ord(c):04X}"
            continue
        ours = ["".join(BYTE_CHARS[b] for b in p.encode()) for p in pieces]
        assert ours == [p for p, _ in pre.pre_tokenize_str(text)], f"U+{ord(c):04X}"
        checked += 1
    assert checked > len(codepoints) // 10


@pytest.mark.skipif(not UNICODE, reason="Unicode tables unchecked for these versions (ASCII only)")
def test_code_points_of_common_scripts_split_like_the_tokenizer(tok):
    rng = random.Random(7)
    assert_splits_like_the_tokenizer(tok, [*range(0x80, 0x3100), *rng.sample(range(0x3100, 0x110000), 20000)])


@pytest.mark.slow
def test_every_assigned_code_point_splits_like_the_tokenizer(tok):
    """What `UNICODE_CHECKED` rests on: run it to add a (Unicode, tokenizers) pair there."""
    assert_splits_like_the_tokenizer(tok, range(0x80, 0x110000))


@pytest.mark.parametrize("capacity", [1, 7, 64])
def test_small_capacity_starts_over_and_stays_exact(tok, texts, capacity):
    cache = PretokenCache(tok, capacity)
    for i in range(0, 120, 10):
        batch = texts[i:i + 10]
        assert_same(cache.encode(batch), reference(tok, batch))
        unique = len({p for t in batch for p in pretokens.SPLIT.findall(t)})
        assert len(cache._index) <= max(capacity, unique)


def test_steps_aside_when_pieces_do_not_repeat(tok, texts, monkeypatch):
    monkeypatch.setattr(pretokens, "WARMUP_PIECES", 2000)
    rng = random.Random(1)

    def unique_words(n):
        return [" ".join("".join(rng.choice("qxzjkvw") for _ in range(9)) for _ in range(30))
                for _ in range(n)]

    repeating = PretokenCache(tok, 1 << 17)  # prose repeats its words: it keeps serving
    for i in range(0, 300, 20):
        assert_same(repeating.encode(texts[i:i + 20]), reference(tok, texts[i:i + 20]))
    assert repeating.active and repeating.warm_pieces >= 1000 and repeating.served == 300
    cache = PretokenCache(tok, 1 << 17)
    for _ in range(4):  # 600 new pieces a call: the first 1000 fill it, the next 1000 judge it
        batch = unique_words(20)
        assert_same(cache.encode(batch), reference(tok, batch))
    assert not cache.active
    served = cache.served
    batch = unique_words(20)
    assert_same(cache.encode(batch), reference(tok, batch))
    assert cache.served == served


def _tokenizer(**changes):
    t = Tokenizer(models.BPE(dropout=changes.get("dropout")))
    t.pre_tokenizer = changes.get("pre", pre_tokenizers.ByteLevel(add_prefix_space=False))
    if "normalizer" in changes:
        t.normalizer = changes["normalizer"]
    if changes.get("truncation"):
        t.enable_truncation(8)
    return t


@pytest.mark.parametrize("changes, why", [
    ({}, None),
    ({"normalizer": normalizers.Lowercase()}, "normalizer"),
    ({"pre": pre_tokenizers.ByteLevel(add_prefix_space=True)}, "pre-tokenizer"),
    ({"pre": pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)}, "pre-tokenizer"),
    ({"pre": pre_tokenizers.Whitespace()}, "pre-tokenizer"),
    ({"dropout": 0.1}, "dropout"),
    ({"truncation": True}, "truncation"),
])
def test_ineligible_tokenizers_are_named(changes, why):
    reason = ineligible(_tokenizer(**changes).to_str())
    assert reason is None if why is None else why in reason


def test_tokenize_uses_it_only_when_exact(tok, texts):
    lower = Tokenizer.from_str(tok.to_str())
    lower.normalizer = normalizers.Lowercase()
    for t, served in ((tok, True), (lower, False)):
        op = Tokenize(t)
        assert_same(op.encode(texts[:50]), reference(t, texts[:50]))
        assert (op._pretokens() is not None) == served
    assert Tokenize(tok, cache=0)._pretokens() is None
    for bad in (-1, True, 1.5):
        with pytest.raises(ValueError, match="cache"):
            Tokenize(tok, cache=bad)


def test_pickled_without_its_contents(tok, texts):
    op = Tokenize(tok)
    op.encode(texts[:20])
    assert op._pretokens().pieces > 0
    clone = pickle.loads(pickle.dumps(op))
    assert clone._cache is None
    assert_same(clone.encode(texts[:20]), reference(tok, texts[:20]))
    cache = pickle.loads(pickle.dumps(op._pretokens()))
    assert cache.pieces == 0 and not cache._index


def test_threads_share_one_cache_exactly(tok, texts):
    cache = PretokenCache(tok, 1 << 17)
    batches = [texts[i::4] for i in range(4)] + [random_ascii(300, s) for s in range(4)]
    results: dict[int, list] = {}

    def work(i):
        results[i] = cache.encode(batches[i])

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(batches))]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    for i, batch in enumerate(batches):
        assert_same(results[i], reference(tok, batch))


def test_same_packed_stream_and_same_checkpoint_with_or_without_it(tok, texts):
    col = np.empty(len(texts), object)
    col[:] = texts
    plan = Source(len(texts)).shuffle(2).repeat().lanes(4).batch(8)

    def loader(cache, state=None):
        out = Loader(plan, ArraySource({"text": col}), [Tokenize(tok, eos=2, cache=cache), Pack(64)])
        if state is not None:
            out.restore(state)
        return out

    on, off = iter(loader(1 << 17)), iter(loader(0))
    for _ in range(12):
        a, b = next(on), next(off)
        assert np.array_equal(a.data["tokens"], b.data["tokens"])
    resumed = iter(loader(0, state=on.state()))
    for _ in range(5):
        assert np.array_equal(next(resumed).data["tokens"], next(on).data["tokens"])
