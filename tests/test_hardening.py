"""Issue 23: inputs a hostile user tried — positions past 2**62, huge mix counters and steps, a
flipped bit in a state file, overlapping merges — are refused with a Zephon error, never wrapped
round or resumed silently. Every test runs under a deadline (a hang fails, it does not stall)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from _corpus import corpora_fixture, objects
from _helpers import deadline

import zephon as z
from zephon import Filter, Loader, Mix, PlanError, Source, StateError, load_state, merge_states, save_state
from zephon.checkpoint import STATE_VERSION
from zephon.sources.memory import ArraySource


@pytest.fixture(autouse=True)
def _time_limit():
    with deadline(60):
        yield


corpora = corpora_fixture(prose=120, code=80, train=(60, 40), vocab_size=600)


def _shuffled(lanes=8, batch=8):
    return Source(1000).shuffle(1).repeat().lanes(lanes).batch(batch)


def _src(n=1000):
    return ArraySource({"x": np.arange(n, dtype=np.int64)})


# --- 1. positions never wrap round -------------------------------------------------------------
def test_random_access_refuses_steps_whose_positions_wrap():
    plan = _shuffled()
    l = Loader(plan, _src())
    assert plan.max_step == 2**62 // 8 - 1
    last = l.batch(plan.max_step).data["x"]  # the last addressable step still works
    assert last.shape == (8,)
    for step in (2**61, 2**62, 2**63, 2**64):
        with pytest.raises(PlanError, match="beyond the last step"):
            l.batch(step)
        with pytest.raises(PlanError, match="beyond the last step"):
            Loader(plan, _src(), start_step=step)
        with pytest.raises(PlanError, match="beyond the last step"):
            plan.refs(step)
    with pytest.raises(PlanError, match="2\\*\\*62"):
        plan.lanes.resolve([2**63])  # no raw OverflowError from numpy


def test_restore_refuses_steps_and_cursors_past_the_bound():
    plan = _shuffled()
    state = Loader(plan, _src()).state()
    for step in (2**61, 2**63, 2**70):
        s = json.loads(json.dumps(state))
        s["step"] = step
        s["lanes"] = {k: {"cursor": [step], "skip": [0]} for k in s["lanes"]}
        with pytest.raises(StateError, match="beyond the last step"):
            Loader(plan, _src()).restore(s)


def test_filter_pipeline_refuses_cursors_that_would_wrap():
    plan = _shuffled()
    keep = Filter(lambda r: r["x"] % 2 == 0, name="even", version=1)
    l = Loader(plan, _src(), [keep])
    next(l)
    state = l.state()
    state["lanes"] = {k: {**v, "cursor": [2**61]} for k, v in state["lanes"].items()}
    with pytest.raises(StateError, match="invalid 'cursor'.*below"):
        Loader(plan, _src(), [keep]).restore(state)


# --- 2. token-mix counters count in integers ---------------------------------------------------
def _token_mix():
    plan = Mix([Source(64, id=0).repeat(), Source(64, id=1).repeat()], [1, 1], by="tokens").lanes(2).batch(16)
    one_token = ArraySource({"tokens": np.zeros((64, 1), np.int32)})
    return plan, [one_token, one_token]


def test_token_mix_counters_past_2_53_are_refused_and_the_schedule_counts_in_integers():
    from types import SimpleNamespace

    from zephon.exec.schedule import TokenSchedule

    plan, srcs = _token_mix()
    l = Loader(plan, srcs)
    next(l)
    state = l.state()
    for lane in state["lanes"].values():
        lane["mix"] = [2**53 + c for c in lane["mix"]]
    with pytest.raises(StateError, match=r"lane 0 .*branch 0 .*2\*\*53"):  # issue 39: no run gets there
        Loader(plan, srcs).restore(state)
    # the deficit itself stays exact past 2**53: float64 counters (2**53 + 1 == 2**53) would tie
    # every time and take all 16 rows from source 0
    row = SimpleNamespace(cols={"tokens": [np.zeros(1, np.int32)]})
    _, branches = TokenSchedule.of(plan.lanes.child).candidates(lambda b, n: [(row, 0)] * n, 16,
                                                                [2**53, 2**53], 0)
    assert np.bincount(branches, minlength=2).tolist() == [8, 8]


def test_token_mix_counter_without_a_read_input_is_refused():
    plan, srcs = _token_mix()
    state = Loader(plan, srcs).state()
    state["lanes"]["0"]["mix"] = [5, 0]
    with pytest.raises(StateError, match="has not read an input"):
        Loader(plan, srcs).restore(state)


def _mixed_packed(corpora, by="tokens", stop="first", max_tokens=None):
    """The soak's pipeline, small: prose and code mixed 0.7/0.3 in 4 lanes, per-source Tokenize
    with EOS (every record counts at least one token), Pack(64)."""
    from zephon.demo.textdata import EOS_ID
    from zephon.ops.pack import Pack
    from zephon.ops.tokenize import Tokenize

    prose, code, tok = corpora
    kids = [Source(len(prose), id=0).shuffle(1), Source(len(code), id=1).shuffle(2)]
    if stop == "first":
        kids = [k.repeat() for k in kids]
    plan = Mix(kids, [0.7, 0.3], by=by, stop=stop).lanes(4).batch(8)
    srcs = [ArraySource({"text": objects(prose)}), ArraySource({"body": objects(code)})]
    kw = {"transforms": [Pack(64, "concat", drop=("truncated",) if max_tokens else ())],
          "per_source": {0: [Tokenize(tok, eos=EOS_ID, max_tokens=max_tokens, overflow="truncate")],
                         1: [Tokenize(tok, field="body", eos=EOS_ID, max_tokens=max_tokens, overflow="truncate")]}}
    return lambda rank=0, world=1: Loader(plan, srcs, rank=rank, world=world, **kw)


def _advanced(make, steps):
    l = make()
    for _ in range(steps):
        next(l)
    return l.state()


def test_token_mix_counters_that_cannot_agree_with_the_cursors_are_refused(corpora):
    make = _mixed_packed(corpora)
    state = _advanced(make, 6)
    assert all(min(lane["cursor"]) > 0 for lane in state["lanes"].values())
    state["lanes"]["1"]["mix"] = [0, 0]  # read inputs of both sources, counted no token
    with pytest.raises(StateError, match=r"lane 1 .*counts 0 tokens of source branch 0 \('mix'\).*at least"):
        make().restore(state)
    state = _advanced(make, 6)
    lane = state["lanes"]["2"]
    lane["mix"] = [lane["mix"][0], lane["cursor"][1] - 1]  # fewer tokens than inputs read
    with pytest.raises(StateError, match="branch 1"):
        make().restore(state)
    # read whole by samples, every record counts exactly one
    make = _mixed_packed(corpora, by="samples", stop="all")
    state = _advanced(make, 3)
    assert [lane["mix"] for lane in state["lanes"].values()] == [lane["cursor"] for lane in state["lanes"].values()]
    state["lanes"]["0"]["mix"][1] += 1
    with pytest.raises(StateError, match="exactly"):
        make().restore(state)
    # documents truncated to 8 tokens: a counter cannot exceed 8 per input read
    make = _mixed_packed(corpora, max_tokens=8)
    state = _advanced(make, 3)
    state["lanes"]["3"]["mix"] = [2**53, 2**53]
    with pytest.raises(StateError, match="at most"):
        make().restore(state)


@pytest.mark.parametrize("by,stop,max_tokens", [("tokens", "first", None), ("samples", "all", None),
                                                ("tokens", "first", 8)])
def test_genuine_mixed_packed_states_round_trip_at_every_degree(corpora, tmp_path, by, stop, max_tokens):
    from zephon.fingerprints import run_fingerprints

    make = _mixed_packed(corpora, by, stop, max_tokens)
    ref = run_fingerprints([make()], 14)
    for step, saved_d, restored_d in ((1, 1, 4), (4, 2, 1), (9, 4, 2)):
        ranks = [make(r, saved_d) for r in range(saved_d)]
        for l in ranks:
            for _ in range(step):
                next(l)
        path = tmp_path / f"{by}-{step}.json"
        save_state(path, merge_states([l.state() for l in ranks]))
        resumed = [make(r, restored_d) for r in range(restored_d)]
        for l in resumed:
            l.restore(load_state(path))
        assert run_fingerprints(resumed, 14 - step) == ref[step:], (by, step, saved_d, restored_d)


# --- 3. the step of a count-changing pipeline is bounded ---------------------------------------
def test_step_of_a_count_changing_pipeline_is_bounded(tmp_path):
    plan, srcs = _token_mix()
    l = Loader(plan, srcs)
    next(l)
    state = l.state()
    state["step"] = 2**70
    with pytest.raises(StateError, match="beyond the last step"):
        Loader(plan, srcs).restore(state)
    save_state(tmp_path / "s.json", state)  # saving is not checking; restoring the file is refused
    with pytest.raises(StateError, match="beyond the last step"):
        Loader(plan, srcs).restore(load_state(tmp_path / "s.json"))


# --- 4. a state file carries a checksum --------------------------------------------------------
def test_every_single_bit_flip_of_a_state_file_is_refused(tmp_path):
    plan = _shuffled()
    keep = Filter(lambda r: r["x"] % 3 != 0, name="thirds", version=1)
    l = Loader(plan, _src(), [keep])
    for _ in range(3):
        next(l)
    path = tmp_path / "s.json"
    save_state(path, l.state())
    data = path.read_bytes()
    assert load_state(path)["zephon_state"] == STATE_VERSION == 3
    accepted = []
    for i in range(len(data)):
        for bit in (0, 1, 5):  # digit +-1/2 ('11' -> '10'), case of a key; bit 7 breaks UTF-8 anyway
            flipped = bytearray(data)
            flipped[i] ^= 1 << bit
            one = tmp_path / f"{i}.{bit}.json"  # a new file each: rewriting one is slower
            one.write_bytes(bytes(flipped))
            try:
                load_state(one)
            except z.ZephonError:
                continue
            accepted.append((i, bit, bytes(flipped[max(0, i - 10):i + 10])))
    assert accepted == []  # before checksums, cursor [11] -> [10] (bit 0 of '1') resumed elsewhere


def test_a_hand_edit_is_refused_until_resigned(tmp_path, capsys):
    from zephon.cli import main

    plan = _shuffled()
    l = Loader(plan, _src())
    next(l)
    path = tmp_path / "s.json"
    save_state(path, l.state())
    doc = json.loads(path.read_text())
    doc["step"] = 5
    doc["lanes"] = {k: {"cursor": [5], "skip": [0]} for k in doc["lanes"]}
    path.write_text(json.dumps(doc, indent=2))
    with pytest.raises(StateError, match="fails its checksum.*zephon state resign"):
        load_state(path)
    assert main(["state", "resign", str(path)]) == 0
    r = Loader(plan, _src())
    r.restore(load_state(path))
    assert r.step == 5
    del doc["checksum"]
    path.write_text(json.dumps(doc))
    with pytest.raises(StateError, match="has no 'checksum'"):
        load_state(path)
    doc["zephon_state"] = 2  # a state from before checksums: resigning upgrades it
    path.write_text(json.dumps(doc))
    with pytest.raises(StateError, match="format 2.*resign"):
        Loader(plan, _src()).restore(load_state(path))
    z.resign_state(path)
    assert load_state(path)["zephon_state"] == STATE_VERSION


def test_reindenting_a_state_file_keeps_it_valid(tmp_path):
    path = tmp_path / "s.json"
    save_state(path, Loader(_shuffled(), _src()).state())
    path.write_text(json.dumps(json.loads(path.read_text()), indent=4))
    assert load_state(path)["step"] == 0


# --- 9. merge_states refuses overlapping lanes that differ -------------------------------------
def test_merge_refuses_overlaps_that_differ_and_accepts_equal_ones():
    plan = _shuffled()
    keep = Filter(lambda r: r["x"] % 3 != 0, name="thirds", version=1)
    a, b = (Loader(plan, _src(), [keep], rank=r, world=2) for r in range(2))
    next(a), next(b)
    sa, sb = a.state(), b.state()
    whole = merge_states([sa, sb])
    assert merge_states([sb, sa])["lanes"] == whole["lanes"]
    assert merge_states([sa, whole])["lanes"] == whole["lanes"]  # equal overlaps are fine
    forged = json.loads(json.dumps(sb))
    forged["lanes"]["0"] = {**sa["lanes"]["0"], "cursor": [sa["lanes"]["0"]["cursor"][0] + 1]}
    with pytest.raises(StateError, match="lane 0 appears in two states"):
        merge_states([sa, forged])
    with pytest.raises(StateError, match="lane 0 appears in two states"):
        merge_states([forged, sa])


# --- 5. no raw exceptions from load_state or a plan file ---------------------------------------
@pytest.mark.parametrize("text, what", [("[" * 10**6, "nested too deeply"), ('{"step": ' + "9" * 5001 + "}",
                                                                           "number it cannot hold")])
def test_load_state_of_deep_nesting_or_a_huge_number_is_a_state_error(tmp_path, text, what):
    path = tmp_path / "s.json"
    path.write_text(text)
    with pytest.raises(StateError, match=what):
        load_state(path)
    with pytest.raises(PlanError, match=what):
        z.Node.from_json(text)


def _jsonl(tmp_path, name, rows):
    path = tmp_path / name
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def test_jsonl_deep_nesting_and_lone_surrogates_are_decode_errors_naming_the_line(tmp_path):
    from zephon.sources.jsonl import JsonlSource

    deep = _jsonl(tmp_path, "deep.jsonl", [{"v": 1}, '{"v": ' + "[" * 10**5 + "]" * 10**5 + "}"])
    with pytest.raises(z.DecodeError, match=r"deep.jsonl: line 2 \(record 1\): not valid JSON \(nested too deeply"):
        JsonlSource(deep, schema={"v": "any"}).read(np.array([1]))
    bad = _jsonl(tmp_path, "bad.jsonl", [{"t": "ok"}, '{"t": "bad \\ud800 text"}'])
    src = JsonlSource(bad)
    assert src.read(np.array([0]))["t"].tolist() == ["ok"]
    with pytest.raises(z.DecodeError, match=r"bad.jsonl: line 2 \(record 1\): field 't' holds a lone surrogate"):
        src.read(np.array([1]))
    pair = _jsonl(tmp_path, "pair.jsonl", ['{"t": "smile \\ud83d\\ude00"}'])  # a whole pair is text
    assert JsonlSource(pair).read(np.array([0]))["t"].tolist() == ["smile \U0001F600"]


def test_tokenize_names_the_record_with_a_lone_surrogate():
    from tokenizers import Tokenizer, models, pre_tokenizers

    from zephon.ops.tokenize import Tokenize
    from zephon.sources.columns import objects

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "bad": 1, "text": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    src = ArraySource({"text": objects(["bad text"] * 7 + ["bad \ud800 text"])})
    with pytest.raises(z.DecodeError, match="record 7 of source 0: field 'text' holds a lone surrogate"):
        next(Loader(Source(8).lanes(1).batch(8), src, [Tokenize(tok)]))


def test_parquet_text_that_is_not_utf8_is_a_decode_error_naming_row_and_column(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from zephon.sources.parquet import ParquetSource

    offsets = np.array([0, 5, 10, 15], np.int32)
    text = pa.Array.from_buffers(pa.string(), 3, [None, pa.py_buffer(offsets.tobytes()),
                                                  pa.py_buffer(b"hello\xffelloworld")])
    path = str(tmp_path / "t.parquet")
    pq.write_table(pa.table({"text": text, "n": [1, 2, 3]}), path)  # no page checksums
    src = ParquetSource(path, verify_checksums=False)
    with pytest.raises(z.DecodeError, match=r"t.parquet: record 1 \(row 1 of row group 0\): column 'text'"):
        src.read(np.arange(3))


# --- 6. the schema decides a column's dtype, whatever lines a read touches ---------------------
def test_jsonl_list_column_keeps_its_dtype_or_the_read_is_refused(tmp_path):
    from zephon.sources.jsonl import JsonlSource

    big = _jsonl(tmp_path, "big.jsonl", [{"v": [i, i + 1] if i != 150 else [1, 2**64]} for i in range(200)])
    src = JsonlSource(big)
    first = src.read(np.arange(10))["v"]
    assert first.dtype == np.int64 and first.shape == (10, 2)
    with pytest.raises(z.DecodeError, match=r"big.jsonl: line 151 \(record 150\): field 'v' holds a number beyond"):
        src.read(np.arange(145, 155))
    grows = _jsonl(tmp_path, "grows.jsonl", [{"v": [i] * (4 if i < 150 else 5)} for i in range(200)])
    src = JsonlSource(grows)
    assert src.read(np.arange(8))["v"].shape == (8, 4)
    with pytest.raises(z.DecodeError, match=r"line 151 \(record 150\): field 'v' has 5 elements.*ragged=\['v'\]"):
        src.read(np.arange(146, 154))
    ragged = JsonlSource(grows, ragged=["v"]).read(np.arange(146, 154))["v"]
    assert ragged.dtype == object and ragged.shape == (8,)


# --- 10. no silent fallbacks, no late errors ---------------------------------------------------
def test_torch_loader_under_torchrun_env_without_init_process_group_is_refused(monkeypatch):
    tb = pytest.importorskip("zephon.backends.torch")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(PlanError, match="torchrun.*init_process_group"):
        tb.TorchLoader(_shuffled(), _src())
    assert tb.TorchLoader(_shuffled(), _src(), rank=1, world=2).rank == 1  # explicit is fine
    monkeypatch.setenv("WORLD_SIZE", "1")
    tb.TorchLoader(_shuffled(), _src())


def test_a_lambda_on_processes_is_refused_when_the_loader_is_built():
    from zephon.runners import processes

    runner = processes(2)
    try:
        with pytest.raises(PlanError, match="operator evens cannot be pickled for processes"):
            Loader(_shuffled(), _src(), [Filter(lambda r: r["x"] % 2 == 0, name="evens")], runner=runner)
        assert runner.pids == []  # refused before any worker started
    finally:
        runner.close()


class _GetItem:
    def __len__(self):
        return 1000

    def __getitem__(self, i):
        return {"x": i}


def test_a_getitem_source_is_refused_at_construction_saying_how():
    with pytest.raises(PlanError, match="__len__ and __getitem__.*GrainSource"):
        Loader(_shuffled(), _GetItem())


def test_a_loader_shared_by_two_threads_says_it_is_not_shareable():
    import threading

    inside, release = threading.Event(), threading.Event()

    def slow(r):
        inside.set()
        release.wait(20)
        return r

    l = Loader(_shuffled(), _src(), [z.Map(slow, name="slow")])
    first = threading.Thread(target=lambda: next(l))
    first.start()
    try:
        assert inside.wait(20)
        with pytest.raises(PlanError, match="not shareable between threads"):
            next(l)
    finally:
        release.set()
        first.join(20)
    assert l.step == 1 and next(l).step == 1  # the loader still works for its one thread


# --- 11. messages that name the problem ------------------------------------------------------
def test_rank_0_state_into_rank_1_says_whose_lanes_it_holds():
    plan = _shuffled()
    keep = Filter(lambda r: r["x"] % 3 != 0, name="thirds")
    a = Loader(plan, _src(), [keep], rank=0, world=2)
    next(a)
    with pytest.raises(StateError, match=r"rank 1 of 2\) owns; it holds lanes 0\.\.3 — another rank's"):
        Loader(plan, _src(), [keep], rank=1, world=2).restore(a.state())


def test_a_map_returning_a_non_dict_is_named():
    l = Loader(_shuffled(), _src(), [z.Map(lambda r: r["x"], name="bad_map")])
    with pytest.raises(z.DecodeError, match="bad_map's output for record .* of source 0 .* is a int64"):
        next(l)


def test_a_changed_eos_under_per_source_names_the_field():
    from zephon.ops.base import identity_diff

    def chain(eos, sha):
        tok = {"name": "Tokenize", "version": 1, "config": {"field": "text", "eos": eos, "bos": None,
                                                          "tokenizer_sha256": sha, "x": "y" * 500}}
        return [{"name": "PerSource", "version": 1, "config": {"0": [tok], "1": [tok]}}]

    diffs = identity_diff(chain(1, "a" * 16), chain(2, "b" * 16))
    assert diffs == ["operator 0 (PerSource): config 0[0].config.eos 1 != 2",
                     f"operator 0 (PerSource): config 0[0].config.tokenizer_sha256 '{'a' * 16}' != '{'b' * 16}'",
                     "operator 0 (PerSource): config 1[0].config.eos 1 != 2",
                     f"operator 0 (PerSource): config 1[0].config.tokenizer_sha256 '{'a' * 16}' != '{'b' * 16}'"]


def test_verify_with_torch_and_matplotlib_missing_reports_na_and_writes_the_json(monkeypatch, tmp_path, capsys):
    import sys

    from zephon.cli import main

    for name in [m for m in sys.modules if m == "zephon.backends.torch" or m.startswith("zephon.backends.torch.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch -> ModuleNotFoundError
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    plan = tmp_path / "plan.json"
    plan.write_text(_shuffled().canonical_json())
    rc = main(["verify", str(plan), "--steps", "2", "--backends", "numpy,torch", "--degrees", "1,2",
               "--runners", "none", "--workers", "0", "--micro", "2", "--processes", "0",
               "--report", str(tmp_path / "r"), "--no-progress"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "n/a: torch is not installed: pip install 'zephon-loader[torch]'" in out
    assert "ModuleNotFoundError" not in out and "ALL IDENTICAL" in out
    assert "no PNG: the heat map needs matplotlib, pip install 'zephon-loader[plots]'" in out
    assert json.loads((tmp_path / "r.json").read_text())["ok"] is True


def test_verify_default_resume_configurations_fit_a_short_run():
    from zephon.testing.configs import default_resume, matrix

    for steps in (2, 3, 4, 7):
        for cfg in default_resume(steps):
            stops = [s.until for s in cfg.segments if s.until is not None]
            assert stops == sorted(set(stops)) and all(0 < x < steps for x in stops), (steps, cfg)
        assert matrix(steps=steps)  # --steps 2 used to raise building its own matrix


def test_explain_from_state_runs_from_the_saved_step(monkeypatch, tmp_path, capsys):
    from pathlib import Path

    from zephon.cli import main
    from zephon.exec import loader as loader_mod
    from zephon.testing import Builder

    target = f"{Path(__file__).resolve().parent.parent / 'examples' / 'verify_pipeline.py'}:pipeline"
    l = Builder(target)(1, 0).loader()
    for _ in range(30):
        next(l)
    save_state(tmp_path / "s.json", l.state())
    calls = []
    real = loader_mod.Loader._next
    monkeypatch.setattr(loader_mod.Loader, "_next", lambda self: calls.append(1) or real(self))
    assert main(["explain", target, "--step", "35", "--from-state", str(tmp_path / "s.json")]) == 0
    from_state, n_from_state = capsys.readouterr().out, len(calls)
    calls.clear()
    assert main(["explain", target, "--step", "35"]) == 0
    assert capsys.readouterr().out == from_state and (n_from_state, len(calls)) == (6, 36)
    assert main(["explain", target, "--step", "20", "--from-state", str(tmp_path / "s.json")]) == 2
    assert "is at step 30, after --step 20" in capsys.readouterr().err


# --- 7. bounded descriptors --------------------------------------------------------------------
def _fds() -> int:
    import os

    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not __import__("os").path.isdir("/proc/self/fd"), reason="counts /proc/self/fd")
def test_jsonl_and_parquet_keep_at_most_max_open_files(tmp_path):
    from zephon.sources import write_parquet
    from zephon.sources.jsonl import JsonlSource
    from zephon.sources.parquet import ParquetSource

    jpaths = [_jsonl(tmp_path, f"{i:04d}.jsonl", [{"v": i, "w": j} for j in range(3)]) for i in range(150)]
    ppaths = []
    for i in range(60):
        ppaths.append(str(tmp_path / f"{i:04d}.parquet"))
        write_parquet(ppaths[-1], {"v": np.full(3, i, np.int64)}, 3)
    before = _fds()
    j = JsonlSource(jpaths, max_open_files=16)
    got = j.read(np.arange(450))
    assert got["v"].tolist() == [i for i in range(150) for _ in range(3)]
    assert _fds() - before <= 16
    p = ParquetSource(ppaths, decode_threads=4, cache_row_groups=0, max_open_files=16)
    assert p.read(np.arange(180)[::-1])["v"].tolist() == [i for i in range(60) for _ in range(3)][::-1]
    assert _fds() - before <= 16 + 16 + 8  # JSONL's, Parquet's, the decode threads' own (pipes, ...)
    j._close_fds()


def test_too_many_open_files_is_named_emfile(tmp_path):
    import resource

    from zephon.sources.jsonl import JsonlSource
    from zephon.sources.parquet import ParquetSource

    paths = [_jsonl(tmp_path, f"{i:03d}.jsonl", [{"v": i}]) for i in range(40)]
    src = JsonlSource(paths, max_open_files=40)
    from zephon.sources import write_parquet

    ppath = str(tmp_path / "one.parquet")
    write_parquet(ppath, {"v": np.arange(3)}, 3)
    psrc = ParquetSource(ppath, decode_threads=1)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (_fds() + 10, hard))
    try:
        with pytest.raises(z.SourceError, match=r"too many open files \(EMFILE\).*ulimit -n is"):
            src.read(np.arange(40))
        with pytest.raises(z.SourceError, match=r"too many open files \(EMFILE\)"):
            psrc.read(np.arange(3))
    finally:
        src._close_fds()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


# --- 12. reads after a fork are safe; process-starting tests kill their group ------------------
FORK_WHILE_READING = """
import os, signal, sys, threading
import numpy as np
from zephon.errors import SourceError
from zephon.sources import ArrayRecordSource, FixedFields
src = ArrayRecordSource(sys.argv[1], spec=FixedFields({"label": ("int64", ())}))
idx = np.arange(200)[::-1].copy()
stop = threading.Event()
def busy():  # the parent keeps the reader's thread pool working while it forks
    while not stop.is_set():
        src.read(idx)
t = threading.Thread(target=busy)
t.start()
failed = 0
for _ in range(int(sys.argv[2])):
    pid = os.fork()
    if pid == 0:
        signal.alarm(20)  # a blocked child dies of SIGALRM instead of hanging
        try:
            src.read(idx)
            os._exit(1)  # read after the fork: could have blocked forever (1 in 30 did)
        except SourceError as e:
            os._exit(0 if "forkserver" in str(e) else 2)
    _, status = os.waitpid(pid, 0)
    failed += os.waitstatus_to_exitcode(status) != 0
stop.set()
t.join()
print(failed)
"""


def test_a_child_forked_while_another_thread_reads_array_record_refuses_never_blocks(tmp_path):
    import sys

    from _helpers import run_group

    from zephon.sources.array_record import write_array_record

    path = tmp_path / "f.array_record"
    write_array_record(path, [np.int64(i).tobytes() for i in range(200)])
    out = run_group([sys.executable, "-c", FORK_WHILE_READING, str(path), "12"], capture_output=True,
                    text=True, timeout=100)
    assert out.returncode == 0 and out.stdout.strip() == "0", out.stderr[-2000:]


# --- 8. a flat soak: shared memory held by pending windows stays bounded -----------------------
def _docs(n, seed, lo, hi):
    from zephon.sources.columns import objects

    rng = np.random.default_rng(seed)
    return ArraySource({"tokens": objects([rng.integers(1, 1000, rng.integers(lo, hi), dtype=np.int32)
                                           for _ in range(n)])})


@pytest.mark.multiprocess
def test_windows_pending_for_slow_lanes_leave_shared_memory(monkeypatch):
    """Lanes of a token mix drift apart, so windows wait for the slowest lane; their arrays were
    views of processes()' shared-memory slots, which then could not be reused: the soak's
    memfds and mappings rose for as long as it ran. Waiting windows are now copied out."""
    from zephon.exec import lanes as lanes_mod
    from zephon.fingerprints import run_fingerprints
    from zephon.ops.pack import Pack
    from zephon.runners import processes

    plan = Mix([Source(400, id=0).shuffle(1).repeat(), Source(300, id=1).shuffle(2).repeat()],
               [0.7, 0.3], by="tokens").lanes(8).batch(16)
    srcs = [_docs(400, 0, 1200, 4000), _docs(300, 1, 1100, 2000)]  # tokens arrays > 4 KB: in slots

    def run(shared_windows, runner=None):
        monkeypatch.setattr(lanes_mod, "_SHARED_WINDOWS", shared_windows)
        l = Loader(plan, srcs, [Pack(1024, "concat")], runner=runner, read_ahead=8)
        most, got = 0, []
        try:
            for _ in range(400):
                got.append(next(l))
                most = max(most, len(runner._pool._slots)) if runner is not None else 0
            return run_fingerprints([iter(got)], 400), most
        finally:
            l.close()

    ref, _ = run(3)
    got, most = run(0, processes(2, depth=2))  # every window that waits is copied out
    assert got == ref  # copies change no data
    assert most <= 6  # in flight (2) + windows being read; without the copies: 11 here


def test_rows_kept_for_drifting_lanes_stay_bounded():
    """The lanes of a token mix drift apart like a random walk (here by ~150 inputs in 2,400
    steps). When every window read the same inputs of every lane, windows waited for the slowest
    lane while the fastest made the engine fetch more: the rows kept grew with the drift (the
    10-minute soak's consumer RSS rose ~1 MB/min). Each lane is now fed from its own frontier."""
    from zephon.fingerprints import run_fingerprints
    from zephon.ops.pack import Pack

    plan = Mix([Source(500, id=0).shuffle(1).repeat(), Source(500, id=1).shuffle(2).repeat()],
               [0.5, 0.5], by="tokens").lanes(8).batch(8)
    srcs = [_docs(500, 0, 1, 400), _docs(500, 1, 1, 40)]
    l = Loader(plan, srcs, [Pack(64, "concat")], read_ahead=64)
    got, kept, spread = [], [], 0
    for _ in range(2400):
        got.append(next(l))
        eng = l.engine.lane_engine
        kept.append(sum(int(w.bounds[-1]) for p in eng.windows.pending for w in p))
        cur = np.array([st.cursor for st in eng.states])
        spread = max(spread, int((cur.max(0) - cur.min(0)).max()))
    bound = 8 * 8 * eng.windows.task.size  # a few windows' worth per lane, whatever the drift
    assert spread > 2 * bound // 8  # the lanes drifted further than what a lane may keep
    assert max(kept) <= bound, (max(kept), bound)  # lock-step windows: 1,344 by step 1,500
    # which window reads which input changes no data: larger windows give the same stream
    ref = Loader(plan, srcs, [Pack(64, "concat")], read_ahead=4096)
    assert run_fingerprints([iter(got[:600])], 600) == run_fingerprints([ref], 600)
