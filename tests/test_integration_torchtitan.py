"""zephon.integrations.torchtitan against the real TorchTitan 0.3.0 (CPU, gloo).

The trainer tests run TorchTitan's own `Trainer` (Llama 3 debug model, FSDP2 at dp = 2) under
torchrun through tests/_torchtitan_worker.py (its CPU shim is described there), checkpoint with
DCP, and resume at another dp degree; the batches the trainer consumed are compared exactly.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest

pytest.importorskip("torchtitan")

import torch
from _helpers import run_group, text_corpus

from zephon.errors import PlanError, StateError
from zephon.exec.state import merge_states
from zephon.testing.object_servers import free_port

WORKER = Path(__file__).with_name("_torchtitan_worker.py")
SEQ, GLOBAL = 64, 4


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Two JSONL files (prose, code) and a BPE tokenizer directory TorchTitan can load."""
    d = text_corpus(tmp_path_factory.mktemp("tt_data"))
    (d / "tok" / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<bos>", "eos_token": "<eos>"}))
    return d


def _train(corpus: Path, out: Path, nproc: int, local_batch: int, steps: int = 4) -> list[list[dict]]:
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", str(nproc),
           "--master_addr", "127.0.0.1", "--master_port", str(free_port()), str(WORKER), str(out),
           "--module", "zephon.integrations.torchtitan", "--config", "zephon_llama3_debugmodel",
           "--hf_assets_path", str(corpus / "tok"),
           "--dataloader.paths", f"{corpus / 'prose.jsonl'},{corpus / 'code.jsonl'}",
           "--dataloader.weights", "0.7", "0.3", "--dataloader.global_batch_size", str(GLOBAL),
           "--dataloader.lanes", "4", "--training.seq_len", str(SEQ),
           "--training.local_batch_size", str(local_batch), "--training.global_batch_size", str(GLOBAL),
           "--training.steps", str(steps), "--checkpoint.enable", "--checkpoint.interval", "2",
           "--dump_folder", str(out / "dump"), "--parallelism.spmd_backend", "partial_dtensor"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    res = run_group(cmd, timeout=300, capture_output=True, text=True, env=env)
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
    return [torch.load(out / f"batches_rank{r}.pt") for r in range(nproc)]


def _global(records: list[list[dict]], step: int | slice, key: str) -> torch.Tensor:
    """The trainer's global batch of `step`: rank 0's micro-batches, then rank 1's, ..."""
    steps = range(1, 100) if step == slice(None) else [step]
    return torch.cat([b[key] for rank in records for b in rank if int(b["step"]) in steps])


@pytest.fixture(scope="module")
def dp2_run(corpus, tmp_path_factory):
    """The uninterrupted run: 4 steps at dp = 2 (FSDP2), checkpoints at steps 2 and 4."""
    out = tmp_path_factory.mktemp("tt_dp2")
    return out, _train(corpus, out, nproc=2, local_batch=2)


def _resume(corpus: Path, dp2_out: Path, out: Path, nproc: int, local_batch: int) -> list[list[dict]]:
    (out / "dump" / "checkpoint").mkdir(parents=True)
    shutil.copytree(dp2_out / "dump" / "checkpoint" / "step-2", out / "dump" / "checkpoint" / "step-2")
    return _train(corpus, out, nproc=nproc, local_batch=local_batch)


def test_trainer_at_dp2_consumes_zephon_global_batches(dp2_run):
    out, records = dp2_run
    assert [[int(b["step"]) for b in r] for r in records] == [[1, 2, 3, 4]] * 2  # accumulation 1
    for step in range(1, 5):
        inputs, labels = _global(records, step, "input"), _global(records, step, "labels")
        positions = _global(records, step, "positions")
        assert inputs.shape == labels.shape == positions.shape == (GLOBAL, SEQ)
        assert inputs.dtype == labels.dtype == positions.dtype == torch.int64
        # labels are the next input within a document and -100 where a document ends
        same_doc = positions[:, 1:] == positions[:, :-1] + 1
        assert torch.equal(labels[:, :-1][same_doc], inputs[:, 1:][same_doc])
    labels, positions = _global(records, slice(None), "labels"), _global(records, slice(None), "positions")
    assert (labels == -100).any() and ((positions == 0).sum(1) > 1).any()  # packed, reset per document
    assert not torch.equal(_global(records, 1, "input"), _global(records, 2, "input"))
    # DCP holds the data loader as one replicated entry (not one pickle per dp rank)
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(str(out / "dump" / "checkpoint" / "step-2")).read_metadata()
    assert sorted(k for k in meta.state_dict_metadata if k.startswith("dataloader")) == [
        "dataloader.dp_world_size", "dataloader.local_batch_size", "dataloader.micro", "dataloader.zephon_state"]
    written = [i.fqn for i in meta.storage_data if i.fqn.startswith("dataloader.zephon_state")]
    assert written == ["dataloader.zephon_state"]  # saved by both ranks, written once


@pytest.mark.parametrize("nproc,local_batch", [(1, 2), (4, 1)], ids=["dp1", "dp4"])
def test_trainer_resumes_a_dp2_checkpoint_at_another_dp_with_the_same_batches(corpus, dp2_run, tmp_path,
                                                                              nproc, local_batch):
    """Saved at dp = 2, resumed from step 2 at dp = 1 (gradient accumulation 2) or dp = 4."""
    dp2_out, uninterrupted = dp2_run
    resumed = _resume(corpus, dp2_out, tmp_path, nproc, local_batch)
    accumulation = GLOBAL // (nproc * local_batch)
    assert [[int(b["step"]) for b in r] for r in resumed] == [[3] * accumulation + [4] * accumulation] * nproc
    assert not torch.equal(_global(resumed, 3, "input"), _global(uninterrupted, 1, "input"))  # not a restart
    for step in (3, 4):
        for key in ("input", "positions", "labels"):
            assert torch.equal(_global(resumed, step, key), _global(uninterrupted, step, key)), (step, key)


class _Rows(torch.utils.data.IterableDataset):
    def __iter__(self):
        yield from range(100)


def test_torchtitans_own_loader_refuses_the_dp_change_that_zephons_accepts():
    from torchtitan.components.dataloader import ParallelAwareDataloader

    saved = ParallelAwareDataloader(_Rows(), dp_rank=0, dp_world_size=2, batch_size=2)
    it = iter(saved)
    next(it), next(it)
    state = saved.state_dict()
    assert state["world_size"] == 2 and "dp_rank_0" in state  # one pickle per dp rank
    resumed = ParallelAwareDataloader(_Rows(), dp_rank=0, dp_world_size=1, batch_size=4)
    with pytest.raises(AssertionError, match="dp_degree is inconsistent.*resharding is not supported"):
        resumed.load_state_dict(state)


# -- the loader alone (no trainer): layouts, states, errors ------------------------------------------
@pytest.fixture(scope="module")
def tokenizer(corpus):
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    return HuggingFaceTokenizer.Config().build(tokenizer_path=str(corpus / "tok"))


def _config(corpus: Path, **kw):
    from zephon.integrations.torchtitan import ZephonDataLoader

    base = {"paths": [str(corpus / "prose.jsonl"), str(corpus / "code.jsonl")], "weights": [0.7, 0.3],
            "global_batch_size": 8, "lanes": 8}
    return ZephonDataLoader.Config(**{**base, **kw})


def _loaders(corpus, tokenizer, dp: int, local: int, **kw):
    cfg = _config(corpus, **kw)
    return [cfg.build(dp_world_size=dp, dp_rank=r, tokenizer=tokenizer, seq_len=SEQ, local_batch_size=local)
            for r in range(dp)]


def _steps(loaders, steps: int) -> list[torch.Tensor]:
    """Global batches (rows of every rank, every micro-batch) of `steps` optimizer steps."""
    its = [iter(x) for x in loaders]
    out = []
    for _ in range(steps):
        out.append(torch.cat([next(it)[0]["input"] for it in its for _ in range(loaders[0].micro_batches)]))
    return out


def _merged_state(loaders) -> dict:
    """What every rank's `state_dict()` holds under torch.distributed (here: merged by hand)."""
    parts = [x.state_dict() for x in loaders]
    merged = merge_states([json.loads(p["zephon_state"]) for p in parts])
    return {**parts[0], "zephon_state": json.dumps(merged)}


def test_global_batches_are_the_same_at_every_dp_and_after_a_resume_at_another_dp(corpus, tokenizer):
    ref = _steps(_loaders(corpus, tokenizer, 1, 8), 5)
    assert all(b.shape == (8, SEQ) for b in ref)
    for dp, local in ((2, 2), (4, 1), (8, 1)):
        assert all(torch.equal(a, b) for a, b in zip(_steps(_loaders(corpus, tokenizer, dp, local), 5), ref))
    saved = _loaders(corpus, tokenizer, 2, 4)
    _steps(saved, 2)
    state = _merged_state(saved)
    assert state["micro"] == 0
    for dp, local in ((1, 4), (4, 2)):
        resumed = _loaders(corpus, tokenizer, dp, local)
        for x in resumed:
            x.load_state_dict(state)
        assert all(torch.equal(a, b) for a, b in zip(_steps(resumed, 3), ref[2:]))


def test_a_state_taken_inside_a_step_continues_at_the_same_layout_only(corpus, tokenizer):
    ref = _steps(_loaders(corpus, tokenizer, 1, 2), 2)
    (loader,) = _loaders(corpus, tokenizer, 1, 2)
    it = iter(loader)
    first = [next(it)[0]["input"] for _ in range(5)]  # step 0 whole, one micro-batch of step 1
    state = loader.state_dict()
    assert state["micro"] == 1
    (same,) = _loaders(corpus, tokenizer, 1, 2)
    same.load_state_dict(state)
    rest = [x[0]["input"] for _, x in zip(range(3), iter(same))]
    assert torch.equal(torch.cat(first + rest), torch.cat(ref))
    (other,) = _loaders(corpus, tokenizer, 1, 4)
    with pytest.raises(StateError, match="inside an optimizer step"):
        other.load_state_dict(state)


def test_a_changed_global_batch_is_refused_naming_the_setting(corpus, tokenizer):
    saved = _loaders(corpus, tokenizer, 1, 8)
    _steps(saved, 1)
    state = _merged_state(saved)
    (other,) = _loaders(corpus, tokenizer, 1, 4, global_batch_size=4, lanes=4)
    with pytest.raises(StateError, match="global_batch_size"):
        other.load_state_dict(state)


def test_bad_layouts_are_refused_with_the_fix(corpus, tokenizer):
    with pytest.raises(PlanError, match="not a multiple of local_batch_size"):
        _loaders(corpus, tokenizer, 2, 3)
    with pytest.raises(PlanError, match="lanes=2 is not a multiple of the dp degree 4"):
        _loaders(corpus, tokenizer, 4, 2, lanes=2)
    with pytest.raises(PlanError, match="cannot tell the format"):
        _loaders(corpus, tokenizer, 1, 8, paths=[str(corpus / "tok" / "tokenizer_config.txt")], weights=[])


def test_the_config_function_parses_from_torchtitans_command_line(corpus):
    from torchtitan.config import ConfigManager

    from zephon.integrations.torchtitan import ZephonDataLoader

    cfg = ConfigManager().parse_args(["--module", "zephon.integrations.torchtitan", "--config",
                                      "zephon_llama3_debugmodel", "--dataloader.paths", "a.jsonl,b.jsonl",
                                      "--dataloader.weights", "0.7", "0.3"])
    assert isinstance(cfg.dataloader, ZephonDataLoader.Config)
    assert cfg.dataloader.paths == ["a.jsonl", "b.jsonl"] and cfg.dataloader.weights == [0.7, 0.3]
    assert cfg.dataloader.global_batch_size == cfg.training.global_batch_size == 8


def test_tokenizing_in_threads_changes_nothing(corpus, tokenizer):
    ref = _steps(_loaders(corpus, tokenizer, 2, 2), 3)
    assert all(torch.equal(a, b) for a, b in zip(_steps(_loaders(corpus, tokenizer, 2, 2, threads=2), 3), ref))
