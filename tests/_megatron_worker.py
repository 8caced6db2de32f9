"""One rank of a gloo group with megatron-core's parallel state, reading Zephon's iterators.

Run by tests/test_integration_megatron.py under torchrun: `python -m torch.distributed.run
--nproc_per_node D tests/_megatron_worker.py OUT DATA CONSUMED STEPS [STATE_DIR]`. Each rank builds its
train iterator through `datasets_provider` (dp rank and size from
`parallel_state.get_data_parallel_rank/world_size()` after `initialize_model_parallel`), takes
STEPS global batches of micro-batches and saves them to OUT/rank{r}.pt.

The iterator goes through Megatron's own `build_pretraining_data_loader(dataset,
consumed_samples, "external", ...)` (Megatron-Bridge 0.3.1's copy of Megatron's samplers module,
loaded by tests/_megatron_samplers.py) and is wrapped in megatron-core's `RerunDataIterator`,
as Megatron-LM's `build_train_valid_test_data_iterators` does for `--dataloader-type external`;
the batches are what the trainer's `next(data_iterator)` returns.
"""

from __future__ import annotations

import sys
from pathlib import Path

import _megatron_samplers
import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.rerun_state_machine import RerunDataIterator
from tokenizers import Tokenizer

from zephon.integrations.megatron import ZephonGPTData, datasets_provider

GLOBAL, MICRO, SEQ, EOD = 8, 2, 32, 2


def main() -> None:
    out, data_dir, consumed, steps = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    state_dir = sys.argv[5] if len(sys.argv) > 5 else None  # saved states every global batch
    dist.init_process_group("gloo")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    data = ZephonGPTData([str(data_dir / "prose.jsonl"), str(data_dir / "code.jsonl")], weights=[0.7, 0.3],
                         tokenizer=Tokenizer.from_file(str(data_dir / "tok" / "tokenizer.json")), seq_len=SEQ,
                         global_batch_size=GLOBAL, micro_batch_size=MICRO, eod=EOD, create_attention_mask=True)
    provider = datasets_provider(data, consumed_samples=lambda: consumed, state_dir=state_dir, save_every=1)
    train_ds, valid_ds, test_ds = provider([10**6, 0, 0])
    assert valid_ds is None and test_ds is None
    dp, rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    samplers = _megatron_samplers.load()
    loader = samplers.build_pretraining_data_loader(
        train_ds, consumed, "external", MICRO, num_workers=0, data_sharding=False,
        data_parallel_rank=rank, data_parallel_size=dp, global_batch_size=GLOBAL)
    assert samplers.build_pretraining_data_loader(
        valid_ds, 0, "external", MICRO, num_workers=0, data_sharding=False) is None
    train = RerunDataIterator(loader)
    micro = GLOBAL // (MICRO * dp)
    batches = [next(train) for _ in range(steps * micro)]
    torch.save({"dp": dp, "rank": rank, "consumed_after": loader.consumed_samples,
                "external_is_provider_output": loader is train_ds, "batches": batches,
                "replayed": train_ds.replayed, "restored_from": train_ds.restored_from},
               out / f"rank{dist.get_rank()}.pt")
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
