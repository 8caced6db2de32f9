"""`encode_joined` (one regex pass over a window's pieces) gives each piece the ids it gets on
its own, at boundaries where BPE pre-tokens could cross; and `Chat` gives the ids and masks of
tokenizing every rendered piece separately."""

from __future__ import annotations

import numpy as np
import pytest

from zephon.demo.chatdata import chat_texts, generate_chats
from zephon.demo.textdata import train_bpe
from zephon.ops.chat import Chat, ChatTemplate
from zephon.ops.pretoken_join import encode_joined, joinable
from zephon.ops.pretoken_regex import REGEXES
from zephon.ops.pretokens import PretokenCache
from zephon.plan import Refs
from zephon.sources.columns import objects

#: fragments that make pre-tokens cross piece boundaries: space runs, newlines, contractions,
#: digit runs (cl100k's \p{N}{1,3}), letters, punctuation, non-ASCII letters and spaces, an
#: added token's text
FRAGMENTS = (" ", "  ", "\n", "\n\n", "\t", " \n", "'", "s", "'s", "re", "ll", "a", "Hi", "word",
             "1", "23", "456", ".", "<|", "|>", ",", "é", "日本", "\xa0", "\u2003", "<eos>", "")
CHATS = generate_chats(60, seed=3)


def pieces(rng: np.random.Generator, n: int) -> list[str]:
    return ["".join(rng.choice(FRAGMENTS, size=int(rng.integers(0, 5)))) for _ in range(n)]


@pytest.fixture(scope="module", params=sorted(REGEXES))
def tok(request):
    name = request.param
    corpus = chat_texts(CHATS) + pieces(np.random.default_rng(0), 300)
    return train_bpe(corpus, vocab_size=500, regex=None if name == "gpt2" else REGEXES[name])


def reference(tok, texts):
    ids = [np.asarray(e.ids, np.int32) for e in tok.encode_batch(texts, add_special_tokens=False)]
    return np.concatenate(ids) if ids else np.zeros(0, np.int32), np.array([len(x) for x in ids])


def test_each_piece_gets_its_own_ids(tok):
    cache = PretokenCache(tok, 1 << 12)
    assert joinable(cache.splitter.pattern)
    rng = np.random.default_rng(1)
    for _ in range(150):
        texts = pieces(rng, int(rng.integers(1, 25)))
        ids, lens = encode_joined(cache, texts)
        want_ids, want_lens = reference(tok, texts)
        assert lens.tolist() == want_lens.tolist(), texts
        assert np.array_equal(ids, want_ids), texts
    assert cache.served > 0  # the joined split served pieces, not only the fallback


def test_the_boundaries_the_proof_refuses_are_real(tok):
    """Joined, "hi\\n\\n" + "x" splits "\\n", "\\n" (a lookahead sees the x); alone "\\n\\n":
    a boundary where pieces end in a space run is not taken from the joined split."""
    cache = PretokenCache(tok, 1 << 12)
    texts = ["hi\n\n", "x", "a", " b"]
    joined = cache.splitter.split("".join(texts))
    alone = [p for t in texts for p in cache.splitter.split(t)]
    assert joined != alone
    ids, lens = encode_joined(cache, texts)
    want_ids, want_lens = reference(tok, texts)
    assert lens.tolist() == want_lens.tolist() and np.array_equal(ids, want_ids)


def test_only_patterns_of_the_proven_family_are_joined():
    assert all(joinable(p) for p in REGEXES.values())
    # tiktoken's own cl100k pat_str: possessive repeats and an anchor are outside the proof
    assert not joinable(r"'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+|\s++$|\s+(?!\S)|\s")
    assert not joinable(r"(?<=a)b|\s+")
    assert not joinable(r"a\s+(?!\S)|\s+")
    assert not joinable(r"a*|\s+")  # matches nothing


def chat_reference(tok, template, train, convs):
    """Render, then every piece through the tokenizer on its own: the definition of Chat."""
    out = []
    for c in convs:
        ps = template.render(c, frozenset(train))
        ids = [tok.encode(t, add_special_tokens=False).ids for t, _ in ps]
        out.append((np.array([i for x in ids for i in x], np.int32),
                    np.array([on for x, (_, on) in zip(ids, ps) for _ in x], np.uint8)))
    return out


@pytest.mark.parametrize("template", [ChatTemplate(), ChatTemplate(turn="{role}: {content}\n"),
                                      ChatTemplate(turn="<|{role}|>{content}", start="\n"),
                                      ChatTemplate(turn="{content}")])
def test_chat_ids_and_masks_equal_piece_by_piece(tok, template):
    rng = np.random.default_rng(2)
    convs = [c["messages"] for c in CHATS[:30]]
    for _ in range(30):  # adversarial contents: spaces and newlines at the ends, empty answers
        msgs = [{"role": r, "content": "".join(rng.choice(FRAGMENTS, size=int(rng.integers(0, 4))))}
                for r in ("system", "user", "assistant", "user", "assistant")[int(rng.integers(0, 2)):]]
        msgs[-1]["content"] += "ok"
        convs.append(msgs)
    op = Chat(tok, template=template, train=("assistant",) if template.turn != "{content}" else ("user", "assistant"))
    refs = Refs(np.zeros(len(convs), np.int64), np.arange(len(convs)), np.zeros(len(convs), np.int64))
    out, _ = op.apply({"messages": objects(convs)}, refs, 0)
    for (want_t, want_m), t, m in zip(chat_reference(tok, template, op.train, convs), out["tokens"], out["loss_mask"]):
        assert np.array_equal(t, want_t) and np.array_equal(m, want_m)


def test_turn_templates_render_as_joined_pieces():
    """`ChatTemplate.render` (the fast path) equals its definition: start, then per message
    header (untrained), content and tail (trained for trained roles), empty text dropped and
    neighbours with the same flag joined."""
    from zephon.ops.chat import _joined

    rng = np.random.default_rng(4)
    for turn, start in (("<|{role}|>\n{content}<|end|>\n", ""), ("{content}", ""), ("{role}:{content}", "S"),
                        ("{content}\n", "<s>"), ("[{role}]{content}", "")):
        tpl = ChatTemplate(turn=turn, start=start)
        head, tail = turn.split("{content}")
        for _ in range(200):
            roles = rng.choice(["system", "user", "assistant", ""], size=int(rng.integers(0, 6)))
            msgs = [{"role": str(r), "content": str(rng.choice(["", "x", " y\n"]))} for r in roles]
            train = frozenset(rng.choice(["user", "assistant", ""], size=2).tolist())
            want = _joined([(start, False)] + [p for m in msgs for p in (
                (head.replace("{role}", m["role"]), False), (m["content"], m["role"] in train),
                (tail.replace("{role}", m["role"]), m["role"] in train))])
            assert tpl.render(msgs, train) == want, (turn, msgs, train)
