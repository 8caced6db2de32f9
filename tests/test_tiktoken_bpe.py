"""Missed pieces run by tiktoken's engine get Hugging Face's ids, or go to Hugging Face.

tiktoken merges any adjacent pair whose bytes are a token; HF only the pairs its merges list. The
tests build vocabularies where the two differ, and random ones, and check that every piece's ids
are HF's: the soundness check must catch each unlisted merge, not just the common case.
"""

import json
import random
import sys

import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from zephon.demo import realtext
from zephon.demo.textdata import train_bpe
from zephon.ops.encoders import HFEncoder
from zephon.ops.pretoken_regex import REGEXES
from zephon.ops.pretokens import PretokenCache
from zephon.ops.tiktoken_bpe import TiktokenBPE, byte_symbols

pytest.importorskip("tiktoken")
SYMBOL = {b: c for c, b in byte_symbols().items()}


def byte_level(merges, ignore_merges=False, extra=()):
    """A byte-level BPE over all 256 bytes with these merges (pairs of byte strings) and `extra`
    vocabulary tokens no merge makes."""
    def sym(t: bytes) -> str:
        return "".join(SYMBOL[b] for b in t)

    vocab = {SYMBOL[b]: b for b in range(256)}
    for a, b in merges:
        vocab.setdefault(sym(a + b), len(vocab))
    for t in extra:
        vocab.setdefault(sym(t), len(vocab))
    tok = Tokenizer(models.BPE(vocab, [(sym(a), sym(b)) for a, b in merges], ignore_merges=ignore_merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    return tok


def hf_ids(enc, pieces):
    flat, lens = enc._hf_pieces(pieces)
    return [x.tolist() for x in np.split(flat, np.cumsum(lens)[:-1])]


def engine_ids(enc, pieces):
    flat, lens = enc.encode_pieces(pieces)
    assert flat.dtype == np.int32
    return [x.tolist() for x in np.split(flat, np.cumsum(lens)[:-1])]


def test_an_unlisted_split_is_caught():
    # "bc" merges first, so HF leaves "a" + "bc" ("abc" is listed as "ab" + "c" only);
    # tiktoken sees the bytes "abc" are a token and merges them
    enc = HFEncoder(byte_level([(b"b", b"c"), (b"a", b"b"), (b"ab", b"c")]))
    pieces = ["abc", "xabcx", "ab", "abcabc", "c"]
    bpe = enc._tiktoken_bpe()
    assert bpe is not None
    raw = bpe.encoding.encode_ordinary("abc")
    assert bpe.ids[raw].tolist() != hf_ids(enc, ["abc"])[0]  # the engines do differ here
    assert engine_ids(enc, pieces) == hf_ids(enc, pieces)
    assert (bpe._sound == -1).sum() >= 1


def test_ignore_merges_takes_a_whole_token_as_it_is():
    # "abc" is in the vocabulary, but no merge makes it: HF with ignore_merges returns it whole
    # for the piece "abc", and merges "xabc" as usual
    merges = [(b"b", b"c"), (b"a", b"b")]
    for ignore in (False, True):
        enc = HFEncoder(byte_level(merges, ignore_merges=ignore, extra=[b"abc", b"cab"]))
        pieces = ["abc", "xabc", "cab", "abcab", "bcab"]
        assert engine_ids(enc, pieces) == hf_ids(enc, pieces)
        whole = engine_ids(enc, ["abc"])[0]
        assert (len(whole) == 1) == ignore
        if ignore:  # taken from tiktoken, not redone by HF
            assert len(enc._tiktoken_bpe().encode(["abc", "cab"])[2]) == 0


@pytest.mark.parametrize("ignore", [False, True])
def test_random_vocabularies_give_hf_ids(ignore):
    """Random merges over a few bytes make many tokens with several splits: the case where the
    engines can part ways."""
    rng = random.Random(7 + ignore)
    for trial in range(30):
        alphabet = [bytes([c]) for c in b"abcd"]
        tokens, merges = list(alphabet), []
        while len(merges) < 40:
            a, b = rng.choice(tokens), rng.choice(tokens)
            if a + b not in tokens and len(a + b) <= 8:
                merges.append((a, b))
                tokens.append(a + b)
        extra = [bytes(rng.choice(b"abcd") for _ in range(rng.randrange(2, 6))) for _ in range(10)]
        enc = HFEncoder(byte_level(merges, ignore_merges=ignore, extra=extra))
        pieces = list(dict.fromkeys("".join(rng.choice("abcd") for _ in range(rng.randrange(1, 14)))
                                    for _ in range(400)))
        assert engine_ids(enc, pieces) == hf_ids(enc, pieces), f"trial {trial}"


@pytest.mark.parametrize("regex", [None, "cl100k"])
def test_trained_tokenizers_on_real_text_need_no_fallback(regex):
    text = realtext.english(60_000) + realtext.non_english(120_000, doc_chars=1500)
    tok = train_bpe(text[::2], vocab_size=1500, regex=regex and REGEXES[regex])
    enc = HFEncoder(tok)
    split = PretokenCache(tok, 1 << 17).splitter.split
    pieces = list(dict.fromkeys(p for t in text for p in (split(t) or [])))
    assert engine_ids(enc, pieces) == hf_ids(enc, pieces)
    bpe = enc._tiktoken_bpe()
    assert bpe is not None and (bpe._sound == 1).sum() > 500 and not (bpe._sound == -1).any()


def test_pieces_it_cannot_join_go_to_hf():
    enc = HFEncoder(byte_level([(b"a", b"b")]))
    pieces = ["ab", "a\x00b", "\x00", "abab"]
    assert enc._tiktoken_bpe().encode(pieces) is None  # the separator is inside a piece
    assert engine_ids(enc, pieces) == hf_ids(enc, pieces)


def test_without_tiktoken_misses_go_to_hf(monkeypatch):
    monkeypatch.setitem(sys.modules, "tiktoken", None)  # `import tiktoken` raises ImportError
    enc = HFEncoder(byte_level([(b"a", b"b")]))
    assert "not installed" in TiktokenBPE.eligible(json.loads(enc.json)["model"])
    assert enc._tiktoken_bpe() is None
    assert engine_ids(enc, ["ab", "ba"]) == hf_ids(enc, ["ab", "ba"])


def test_what_it_cannot_serve_is_named():
    assert "dropout" in TiktokenBPE.eligible({"type": "BPE", "dropout": 0.1})
    assert "prefix" in TiktokenBPE.eligible({"type": "BPE", "continuing_subword_prefix": "##"})
    assert "256" in TiktokenBPE.eligible({"type": "BPE", "vocab": {"a": 0}})
    tok = Tokenizer(models.BPE({"a": 0, "b": 1, "ab": 2}, [("a", "b")]))
    enc = HFEncoder(tok)
    assert enc._tiktoken_bpe() is None
    assert engine_ids(enc, ["ab", "ba"]) == hf_ids(enc, ["ab", "ba"])
