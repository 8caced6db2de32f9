"""A window sent from a worker process carries a column of token arrays as one array and its
lengths; what arrives is the same column (values, dtypes, order), and packed chat batches are the
same under processes(2) as inline."""

from __future__ import annotations

import pickle

import numpy as np

from zephon import Loader, Source
from zephon.demo.chatdata import chat_texts, generate_chats
from zephon.demo.textdata import train_bpe
from zephon.exec.windows import Window, _Ragged
from zephon.ops.chat import Chat
from zephon.ops.pack import Pack
from zephon.plan import Refs
from zephon.runners import processes
from zephon.sources.columns import objects
from zephon.sources.memory import ArraySource


def test_columns_survive_the_trip_exactly():
    e = np.zeros(0, np.int64)
    cols = {"tokens": objects([np.arange(3, dtype=np.int32), np.zeros(0, np.int32), np.arange(5, dtype=np.int32)]),
            "mask": objects([np.ones(3, np.uint8), np.zeros(0, np.uint8), np.ones(5, np.uint8)]),
            "text": objects(["a", "b", "c"]), "x": np.arange(3),
            "mixed": objects([np.arange(2), np.arange(2, dtype=np.int32), np.arange(1)]),
            "nested": objects([np.zeros((2, 2)), np.zeros((1, 2)), np.zeros((0, 2))])}
    assert _Ragged.of(cols["tokens"]) is not None and _Ragged.of(cols["mixed"]) is None
    assert _Ragged.of(cols["nested"]) is None and _Ragged.of(cols["text"]) is None
    got = pickle.loads(pickle.dumps(Window(0, 0, cols, e, e, Refs(e, e, e), e, e), protocol=5)).cols
    assert sorted(got) == sorted(cols)
    for k, col in cols.items():
        assert got[k].dtype == col.dtype and got[k].shape == col.shape
        for a, b in zip(col, got[k]):
            if isinstance(a, np.ndarray):
                assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)
            else:
                assert a == b


def test_packed_chat_batches_equal_under_processes():
    chats = generate_chats(300, seed=1)
    tok = train_bpe(chat_texts(chats) + ["<|user|>\n<|assistant|>\n<|system|>\n<|end|>\n"] * 20, vocab_size=400)

    def batches(runner):
        source = ArraySource({"messages": objects([c["messages"] for c in chats])})
        loader = Loader(Source(300).repeat().lanes(4).batch(8), source,
                        [Chat(tok), Pack(128, "best_fit", max_open_bins=4)], runner=runner)
        try:
            return [next(loader).data for _ in range(12)]
        finally:
            loader.close()

    for a, b in zip(batches(None), batches(processes(2))):
        assert sorted(a) == sorted(b) and all(np.array_equal(a[k], b[k]) for k in a)
