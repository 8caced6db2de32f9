"""The pre-token cache gives exactly the tokenizer's ids, or steps aside.

Exactness is the whole contract: a document's ids from the cache must equal `encode_batch`'s
for every text, including the regex's edge cases (contractions, whitespace runs before a word,
control characters the regex does not call whitespace); documents and tokenizers it cannot
serve exactly go to the tokenizer, and the tests check that the cache really served the rest.
"""

import pickle
import random
import threading

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
    batch = ["plain text here", "café au lait", "ends with <eos>", "<pad> starts", "naïve",
             "tab\tand\x85nel", "again plain", "\u3000wide space"]
    cache = PretokenCache(tok, 1 << 17)
    assert_same(cache.encode(batch), reference(tok, batch))
    assert cache.served == 2  # only the two plain ASCII texts without an added token


@pytest.mark.parametrize("capacity", [1, 7, 64])
def test_small_capacity_starts_over_and_stays_exact(tok, texts, capacity):
    cache = PretokenCache(tok, capacity)
    for i in range(0, 120, 10):
        batch = texts[i:i + 10]
        assert_same(cache.encode(batch), reference(tok, batch))
        unique = len({p for t in batch for p in pretokens.SPLIT.findall(t)})
        assert len(cache._index) <= max(capacity, unique)


def test_steps_aside_when_pieces_do_not_repeat(tok, monkeypatch):
    monkeypatch.setattr(pretokens, "WARMUP_PIECES", 100)
    rng = random.Random(1)
    batch = [" ".join("".join(rng.choice("qxzjkvw") for _ in range(9)) for _ in range(30))
             for _ in range(20)]
    cache = PretokenCache(tok, 1 << 17)
    assert_same(cache.encode(batch), reference(tok, batch))
    assert not cache.active
    served = cache.served
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
    with pytest.raises(ValueError, match="cache"):
        Tokenize(tok, cache=-1)


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
