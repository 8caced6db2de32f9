"""The chat operator (render, tokenize, trained-token mask), Mix(by="trained_tokens") and the
per-domain accounting fields of `Loader(domains=True)`."""

from __future__ import annotations

import json

import numpy as np
import pytest

from zephon import DecodeError, Loader, Mix, PlanError, Source
from zephon.demo.chatdata import chat_texts, generate_chats
from zephon.demo.textdata import train_bpe
from zephon.ops.chat import Chat, ChatTemplate
from zephon.ops.pack import Pack
from zephon.plan import Refs
from zephon.sources.columns import objects
from zephon.sources.memory import ArraySource

CHATS = generate_chats(120, seed=5)
MARKERS = "<|user|>\n<|assistant|>\n<|system|>\n<|end|>\n"


@pytest.fixture(scope="module")
def tok():
    return train_bpe(chat_texts(CHATS) + [MARKERS] * 20, vocab_size=400)


def apply(op, convs):
    refs = Refs(np.zeros(len(convs), np.int64), np.arange(len(convs)), np.zeros(len(convs), np.int64))
    return op.apply({"messages": objects(convs)}, refs, 0)


def test_the_mask_marks_the_answers_and_their_end_markers_only(tok):
    convs = [c["messages"] for c in CHATS[:40]]
    out, rows = apply(Chat(tok), convs)
    assert rows is None and out["loss_mask"][0].dtype == np.uint8
    for msgs, t, m in zip(convs, out["tokens"], out["loss_mask"]):
        assert len(t) == len(m)
        answers = "".join(x["content"] + "<|end|>\n" for x in msgs if x["role"] == "assistant")
        prompt = "".join(f"<|{x['role']}|>\n" + (x["content"] + "<|end|>\n" if x["role"] != "assistant" else "")
                         for x in msgs)
        assert tok.decode(t[m == 1].tolist()) == answers
        assert tok.decode(t[m == 0].tolist()) == prompt
    # roles are configurable: train the user's turns instead
    out, _ = apply(Chat(tok, train=("user",)), convs[:5])
    for msgs, t, m in zip(convs, out["tokens"], out["loss_mask"]):
        users = "".join(x["content"] + "<|end|>\n" for x in msgs if x["role"] == "user")
        assert tok.decode(t[m == 1].tolist()) == users


def test_json_text_conversations_and_bos(tok):
    convs = [c["messages"] for c in CHATS[:5]]
    a, _ = apply(Chat(tok), convs)
    b, _ = apply(Chat(tok, bos=1), [json.dumps(c) for c in convs])
    for x, y, mx, my in zip(a["tokens"], b["tokens"], a["loss_mask"], b["loss_mask"]):
        assert y[0] == 1 and my[0] == 0
        assert np.array_equal(x, y[1:]) and np.array_equal(mx, my[1:])


HF_STYLE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{% if m['role'] == 'assistant' %}"
            "{% generation %}{{ m['content'] }}<|end|>{% endgeneration %}\n{% else %}{{ m['content'] }}"
            "<|end|>\n{% endif %}{% endfor %}")


def test_a_jinja_template_marks_its_generation_blocks(tok, tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": HF_STYLE,
                                                                 "eos_token": {"content": "<eos>"}}))
    tpl = ChatTemplate.from_tokenizer_config(tmp_path)
    assert tpl.eos_token == "<eos>"
    convs = [c["messages"] for c in CHATS[:10]]
    out, _ = apply(Chat(tok, template=tpl), convs)
    for msgs, t, m in zip(convs, out["tokens"], out["loss_mask"]):
        assert tok.decode(t[m == 1].tolist()) == "".join(
            x["content"] + "<|end|>" for x in msgs if x["role"] == "assistant")


def test_a_template_that_marks_no_trained_token_is_refused(tok):
    with pytest.raises(PlanError, match="marks no trained token"):
        Chat(tok, template=ChatTemplate.jinja("{% for m in messages %}{{ m['content'] }}\n{% endfor %}"))
    with pytest.raises(PlanError, match="nests or leaves open"):
        Chat(tok, template=ChatTemplate.jinja("{% generation %}{% generation %}x{% endgeneration %}"
                                              "{% endgeneration %}"))
    with pytest.raises(PlanError, match="contain '{content}' exactly once"):
        ChatTemplate(turn="<|{role}|>")
    with pytest.raises(PlanError, match="train= applies to ChatTemplate"):
        Chat(tok, template=ChatTemplate.jinja(HF_STYLE), train=("user",))


def test_a_conversation_with_nothing_to_train_is_an_error_or_dropped(tok):
    convs = [CHATS[0]["messages"], [{"role": "user", "content": "hello?"}], CHATS[1]["messages"]]
    with pytest.raises(DecodeError, match="record 1 of source 0: the conversation has no trained token"):
        apply(Chat(tok), convs)
    out, keep = apply(Chat(tok, empty="drop"), convs)
    assert keep.tolist() == [True, False, True] and len(out["tokens"]) == 2
    with pytest.raises(DecodeError, match="record 0 of source 0: field 'messages' holds"):
        apply(Chat(tok), [[{"role": "user"}]])


def test_the_template_and_roles_are_part_of_the_identity(tok):
    base = Chat(tok).identity()
    assert Chat(tok, template=ChatTemplate(turn="[{role}] {content}\n")).identity() != base
    assert Chat(tok, train=("assistant", "user")).identity() != base
    assert Chat(tok, template=ChatTemplate.jinja(HF_STYLE)).identity() != base
    assert Chat(tok).identity() == base


# --- mixing by trained tokens ------------------------------------------------------------------
def two_domains(tok, by, lanes=4, batch=8, n=100):
    short = generate_chats(n, seed=1, kinds=("add", "spell"))
    long = generate_chats(n, seed=2, kinds=("count",))
    srcs = [ArraySource({"messages": objects([c["messages"] for c in s])}) for s in (short, long)]
    plan = Mix([Source(n, id=0).shuffle(1).repeat(), Source(n, id=1).shuffle(2).repeat()], [0.5, 0.5],
               by=by).lanes(lanes).batch(batch)
    return Loader(plan, srcs, [Chat(tok), Pack(64, "best_fit")], domains=True)


def trained_per_lane(batches, lanes=4):
    """Per lane, the packed loss_mask-1 tokens of each source (from the accounting field)."""
    out = np.zeros((lanes, 2), np.int64)
    for b in batches:
        per = b.rows_per_lane
        t = b.data["trained_by_source"]
        for k, lane in enumerate(b.lanes):
            out[lane] += t[k * per:(k + 1) * per].sum(0)
    return out


def test_a_mix_by_trained_tokens_holds_every_lane_to_its_weights(tok):
    """1:1 in trained tokens in every lane, within one document's trained tokens, though one
    domain's answers are ~20x longer; a mix by all tokens is far from 1:1 in trained tokens."""
    loader = two_domains(tok, "trained_tokens")
    docs = [loader.sources[s].read(np.arange(100))["messages"] for s in (0, 1)]
    one_doc = max(int(m[1:].sum()) for d in docs for m in apply(Chat(tok), list(d))[0]["loss_mask"])
    batches = []
    for _ in range(4):
        batches += [next(loader) for _ in range(5)]
        for lane, v in loader.state()["lanes"].items():
            mix = np.array(v["mix"])
            assert abs(mix[0] - mix[1]) <= one_doc, (lane, mix, one_doc)
    got = trained_per_lane(batches)  # what the loss saw, from the packed rows
    assert np.all(np.abs(got[:, 0] - got[:, 1]) <= 2 * one_doc), (got, one_doc)
    by_tokens = two_domains(tok, "tokens")
    seen = trained_per_lane([next(by_tokens) for _ in range(20)])
    assert np.all(seen[:, 1] > 3 * seen[:, 0]), seen  # the long answers dominate


def test_mix_by_trained_tokens_needs_the_mask(tok):
    plan = Mix([Source(8, id=0).repeat(), Source(8, id=1).repeat()], [1, 1], by="trained_tokens").lanes(2).batch(2)
    docs = ArraySource({"tokens": objects([np.arange(5, dtype=np.int32)] * 8)})
    with pytest.raises(PlanError, match="counts the non-zero tokens of column 'loss_mask'"):
        next(Loader(plan, [docs, docs], [Pack(8)]))
    assert "mask_field" not in Mix([Source(8)], [1]).to_json()
    assert Mix.from_json(plan.lanes.child.to_json()) == plan.lanes.child


# --- accounting --------------------------------------------------------------------------------
def test_domain_fields_count_each_sources_tokens_and_trained_tokens(tok):
    b = next(two_domains(tok, "trained_tokens"))
    d = b.data
    assert d["source_id"].shape == d["tokens"].shape and d["trained_by_source"].shape == (8, 2)
    assert np.array_equal(d["source_id"] == -1, d["segment_ids"] == 0)
    for r, row in enumerate(b.segments):
        for k, (src, *_rest) in enumerate(row):
            on = d["segment_ids"][r] == k + 1
            assert np.all(d["source_id"][r][on] == src)
        for s in range(2):
            assert d["tokens_by_source"][r, s] == (d["source_id"][r] == s).sum()
            assert d["trained_by_source"][r, s] == d["loss_mask"][r][d["source_id"][r] == s].sum()
    plain = Loader(Source(10, id=3).repeat().lanes(2).batch(4), {3: ArraySource({"x": np.arange(10)})}, domains=True)
    assert next(plain).data["source_id"].tolist() == [3, 3, 3, 3]


def test_jax_and_torch_loaders_carry_accounting_and_provenance(tok):
    import jax
    from jax.sharding import Mesh

    from zephon.backends.jax import JaxLoader
    from zephon.backends.torch import TorchLoader

    ref = two_domains(tok, "trained_tokens")
    want = [next(ref) for _ in range(2)]
    loader = two_domains(tok, "trained_tokens")
    mesh = Mesh(np.array(jax.devices()[:4]), ("data",))
    jl = JaxLoader(loader.plan, loader.sources, loader.transforms, mesh=mesh, domains=True, prefetch=1)
    tl = TorchLoader(loader.plan, loader.sources, loader.transforms, domains=True, rank=0, world=1)
    with jl, tl:
        for w in want:
            j, t = next(jl), next(tl)
            for k in ("source_id", "tokens_by_source", "trained_by_source", "loss_mask"):
                assert np.array_equal(np.asarray(j[k]), w.data[k]) and np.array_equal(t[k].numpy(), w.data[k])
            assert jl.explain() == w.explain() == tl.explain()
            assert tl.provenance.segments == w.segments
