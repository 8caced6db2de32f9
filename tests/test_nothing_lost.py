"""Issue 39: nothing lost without a word — the default end of a finite count-changing plan, the
drop warning and count, restored mix counters, and closes that never wait forever."""

from __future__ import annotations

import copy
import logging
import threading
import time

import numpy as np
import pytest

import zephon as z
import zephon.runners.closing
from zephon import Filter, Loader, Mix, Source
from zephon.demo.textdata import EOS_ID, generate_corpus, train_bpe
from zephon.errors import StateError
from zephon.ops.pack import Pack
from zephon.ops.tokenize import Tokenize
from zephon.sources.memory import ArraySource
from zephon.testing.gather import ThreadGather


# --- 1. the end of a finite count-changing plan -------------------------------------------------
@pytest.fixture(scope="module")
def seventy():
    """70 source documents of ~8,600 tokens (the issue's 70 files: 629,889 tokens)."""
    corpus = generate_corpus(70 * 19, seed=7)
    docs = [" ".join(corpus[i * 19:(i + 1) * 19]) for i in range(70)]
    tok = train_bpe(corpus[:300], vocab_size=1000)
    total = sum(len(e.ids) + 1 for e in tok.encode_batch(docs))
    return ArraySource({"text": np.array(docs, dtype=object)}), tok, total


def _emitted(loader):
    tokens = steps = 0
    for b in loader:
        steps += 1
        tokens += int((b.data["segment_ids"] > 0).sum())
    return steps, tokens


def test_the_issue_repro_by_default_emits_every_token(seventy, caplog):
    src, tok, total = seventy
    plan = z.Source(70).shuffle(0).lanes(32).batch(32)  # as a new user writes it: no remainder
    ops = [Tokenize(tok, eos=EOS_ID), Pack(2048, "concat")]
    assert total > 500_000
    with caplog.at_level(logging.WARNING, logger="zephon"):
        loader = Loader(plan, src, ops)
        assert loader.plan.remainder == "pad"  # "auto": a count-changing finite plan pads
        steps, tokens = _emitted(loader)
    assert tokens == total and steps > 5  # pad semantics: every token exactly once
    assert loader.unemitted is None and loader.stats().unemitted is None
    assert not [r for r in caplog.records if "unemitted" in r.getMessage()]
    # a one-to-one plan keeps dropping (less than one batch, as drop_last), and its states keep
    # the fingerprint they had before "auto"
    one = Loader(z.Source(70).lanes(32).batch(32), src)
    assert one.plan.remainder == "drop"
    assert one.state()["plan_fingerprint"] == z.Source(70).lanes(32).batch(32, remainder="drop").fingerprint()


def test_an_explicit_drop_says_what_it_leaves_before_the_first_step(seventy, caplog):
    src, tok, total = seventy
    plan = z.Source(70).shuffle(0).lanes(32).batch(32, remainder="drop")
    with caplog.at_level(logging.WARNING, logger="zephon"):
        loader = Loader(plan, src, [Tokenize(tok, eos=EOS_ID), Pack(2048, "concat")])
        n = len(loader)  # the count: before step 0
        said = [r.getMessage() for r in caplog.records if "unemitted" in r.getMessage()]
        assert len(said) == 1
        u = loader.unemitted
        steps, tokens = _emitted(loader)
    assert steps == n
    assert u is not None and u.rows > u.batch_rows == 32 and u.undealt == 70 % 32
    assert u.tokens == u.total_tokens - tokens and u.total_tokens < total  # the undealt documents aside
    assert f"{u.tokens:,} of {u.total_tokens:,} tokens" in said[0] and "remainder='pad'" in said[0]
    assert f"{100 * u.share:.1f}%" in said[0] and u.share > 0.3
    assert loader.stats().unemitted == u and loader.stats().to_json()["unemitted"]["tokens"] == u.tokens
    assert len([r for r in caplog.records if "unemitted" in r.getMessage()]) == 1  # once


def test_drop_at_d1_without_a_count_says_it_at_the_end(seventy, caplog):
    src, tok, _ = seventy
    plan = z.Source(70).shuffle(0).lanes(32).batch(32, remainder="drop")
    ops = lambda: [Tokenize(tok, eos=EOS_ID), Pack(2048, "concat")]
    counted = Loader(plan, src, ops())
    len(counted)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="zephon"):
        lazy = Loader(plan, src, ops())
        _emitted(lazy)
    assert lazy.unemitted == counted.unemitted  # the same numbers, learnt at the end
    assert len([r for r in caplog.records if "unemitted" in r.getMessage()]) == 1


def test_ranks_agree_on_what_drop_leaves(seventy):
    src, tok, _ = seventy
    plan = z.Source(70).shuffle(0).lanes(32).batch(32, remainder="drop")
    ops = lambda: [Tokenize(tok, eos=EOS_ID), Pack(2048, "concat")]
    one = Loader(plan, src, ops())
    len(one)
    gather = ThreadGather(4)
    got = [None] * 4

    def rank(r):
        ld = Loader(plan, src, ops(), rank=r, world=4, all_gather=gather.for_rank(r))
        ld.settle_end()
        got[r] = ld.unemitted

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == [one.unemitted] * 4


def test_torch_emitters_report_what_drop_leaves(caplog):
    tb = pytest.importorskip("zephon.backends.torch")
    src = ArraySource({"x": np.arange(1000, dtype=np.int64)})
    uneven = Filter(uneven_lanes, name="uneven")
    plan = Source(1000).lanes(8).batch(16, remainder="drop")
    with caplog.at_level(logging.WARNING, logger="zephon"):
        loader = tb.TorchLoader(plan, src, [uneven])
        assert len(loader) == 25
        assert loader.stats().unemitted.rows == 525
        dl = tb.ZephonDataLoader(tb.ZephonIterableDataset(plan, src, [uneven]), num_workers=2, timeout=120)
        assert len(list(dl)) == 25 and dl.stats().unemitted.rows == 525
    assert sum("525 of 925 records" in r.getMessage() for r in caplog.records) == 2  # once per loader


def test_drop_within_one_batch_stays_quiet(caplog):
    src = ArraySource({"x": np.arange(100, dtype=np.int64)})
    keep = Filter(lambda r: int(r["x"]) != 5, name="not_five")
    with caplog.at_level(logging.WARNING, logger="zephon"):
        loader = Loader(Source(100).lanes(4).batch(8, remainder="drop"), src, [keep])
        list(loader)
    assert loader.unemitted is not None and loader.unemitted.rows <= 8
    assert not [r for r in caplog.records if "unemitted" in r.getMessage()]


def uneven_lanes(r):  # lane 0 of 8 (x % 8 == 0) keeps only x < 400: it runs dry first
    return int(r["x"]) % 8 != 0 or int(r["x"]) < 400


# --- 2. restored mix counters -------------------------------------------------------------------
@pytest.fixture(scope="module")
def mixed():
    prose = generate_corpus(120, seed=3)
    code = [f"def f{i}(x):\n    return x * {i}\n" for i in range(120)]
    tok = train_bpe(prose[:60] + code[:60], vocab_size=400)
    plan = Mix([Source(120, id=0).shuffle(1).repeat(), Source(120, id=1).shuffle(2).repeat()],
               [0.7, 0.3], by="tokens").lanes(4).batch(8)
    srcs = [ArraySource({"text": np.array(prose, dtype=object)}),
            ArraySource({"body": np.array(code, dtype=object)})]
    kw = {"transforms": [Pack(64, "concat")],
          "per_source": {0: [Tokenize(tok, eos=EOS_ID)], 1: [Tokenize(tok, field="body", eos=EOS_ID)]}}
    return lambda: Loader(plan, srcs, **kw)


@pytest.mark.parametrize("counter", [2**61, 2**53])
def test_mix_counters_at_or_past_2_53_are_refused(mixed, counter):
    l = mixed()
    for _ in range(4):
        next(l)
    state = l.state()
    mixed().restore(copy.deepcopy(state))  # as saved: restores
    state["lanes"]["2"]["mix"][1] = counter  # no tokenizer bound here (no truncation)
    with pytest.raises(StateError, match=rf"lane 2 .*counts {counter} tokens of source branch 1 .*2\*\*53"):
        mixed().restore(state)


def test_a_filtered_branch_bounds_its_counter_by_the_inputs_consumed():
    plan = Mix([Source(64, id=0), Source(64, id=1)], [1, 1], by="samples", stop="all").lanes(2).batch(4)
    src = ArraySource({"x": np.arange(64, dtype=np.int64)})
    odd = Filter(lambda r: int(r["x"]) % 2 == 1, name="odd")
    make = lambda: Loader(plan, [src, src], per_source={0: [odd]})
    l = make()
    for _ in range(3):
        next(l)
    state = l.state()
    make().restore(copy.deepcopy(state))
    lane = state["lanes"]["1"]
    lane["mix"][0] = lane["cursor"][0] + 3  # more records than inputs read, through a filter
    with pytest.raises(StateError, match=r"lane 1 .*branch 0 .*at most"):
        make().restore(state)


# --- 3. closes are bounded ----------------------------------------------------------------------
class Blocking:
    """A record source whose reads past `free` records block until `release` is set."""

    def __init__(self, n=64, free=8):
        self.n, self.free = n, free
        self.release = threading.Event()
        self.blocked = threading.Event()

    def __len__(self):
        return self.n

    def read(self, indices):
        idx = np.asarray(indices, np.int64)
        if idx.size and idx.max() >= self.free:
            self.blocked.set()
            self.release.wait()
        return {"x": idx.copy()}

    def __getitem__(self, i):  # the Grain-style access of the compat layer
        if i >= self.free:
            self.blocked.set()
            self.release.wait()
        return int(i)


@pytest.fixture
def quick_bound(monkeypatch):
    monkeypatch.setattr(zephon.runners.closing, "STOP_TIMEOUT_S", 0.5)


def _closes_within_the_bound(close, source, caplog):
    assert source.blocked.wait(10), "the producer never reached the blocking read"
    t = time.perf_counter()
    with caplog.at_level(logging.WARNING, logger="zephon"):
        close()
    took = time.perf_counter() - t
    source.release.set()  # let the abandoned thread finish
    assert took < 3, f"close waited {took:.1f} s"
    assert any("did not stop" in r.getMessage() and "abandoned" in r.getMessage() for r in caplog.records)


def test_threads_runner_close_is_bounded(quick_bound, caplog):
    src = Blocking()
    loader = Loader(Source(64).lanes(2).batch(4), src, runner=z.runners.threads(2), read_ahead=4)
    next(loader), next(loader)  # the first step is inline; from the second the pool reads ahead
    _closes_within_the_bound(loader.close, src, caplog)


def test_torch_loader_close_is_bounded(quick_bound, caplog):
    tb = pytest.importorskip("zephon.backends.torch")
    src = Blocking()
    loader = tb.TorchLoader(Source(64).lanes(2).batch(4), src, runner=z.runners.threads(2), read_ahead=4)
    it = iter(loader)
    next(it), next(it)
    _closes_within_the_bound(loader.close, src, caplog)


def test_grain_prefetch_iterator_close_is_bounded(quick_bound, caplog):
    zg = pytest.importorskip("zephon.compat.grain")
    X = pytest.importorskip("zephon.compat.grain.experimental")
    src = Blocking()
    ds = zg.Dataset.source(src).to_iter_dataset()
    it = iter(X.ThreadPrefetchIterDataset(ds, prefetch_buffer_size=2))
    assert next(it) == 0
    _closes_within_the_bound(it.close, src, caplog)


def test_jax_prefetch_close_is_bounded(quick_bound, caplog):
    jax = pytest.importorskip("jax")
    jb = pytest.importorskip("zephon.backends.jax")
    from jax.sharding import Mesh

    src = Blocking()
    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    loader = jb.JaxLoader(Source(64).lanes(2).batch(4), src, mesh=mesh, read_ahead=4)
    next(iter(loader))
    _closes_within_the_bound(loader.close, src, caplog)


_EXIT_WITHOUT_CLOSE = """
import gc, logging, sys, threading, time
import numpy as np
sys.path.insert(0, sys.argv[1])
from test_nothing_lost import Blocking
import zephon as z
import zephon.compat.grain as zg
from zephon.compat.grain import experimental as X

logging.basicConfig(level=logging.WARNING, format="%(message)s")
# a Grain-compatible prefetch iterator dropped mid-read: its __del__ closes it
src = Blocking()
it = iter(X.ThreadPrefetchIterDataset(zg.Dataset.source(src).to_iter_dataset(), prefetch_buffer_size=2))
next(it)
assert src.blocked.wait(10)
t = time.perf_counter()
del it
gc.collect()
print(f"del {time.perf_counter() - t:.2f}", flush=True)
# a threads() runner left open, a read blocked in its pool: the interpreter's exit must not wait
src = Blocking()
loader = z.Loader(z.Source(64).lanes(2).batch(4), src, runner=z.runners.threads(2), read_ahead=4)
next(loader), next(loader)
assert src.blocked.wait(10)
print("exiting", flush=True)
"""


def test_del_and_interpreter_exit_never_wait_for_a_blocked_producer():
    import os
    import sys

    from _helpers import run_group

    here = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "ZEPHON_STOP_TIMEOUT_S": "0.5"}
    t = time.perf_counter()
    done = run_group([sys.executable, "-c", _EXIT_WITHOUT_CLOSE, here], timeout=120, capture_output=True,
                     text=True, env=env)
    took = time.perf_counter() - t
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.split()
    assert lines[0] == "del" and float(lines[1]) < 3 and lines[-1] == "exiting"
    assert took < 60, f"the interpreter took {took:.0f} s to exit"
