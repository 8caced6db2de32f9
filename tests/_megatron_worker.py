"""One rank of a gloo group with megatron-core's parallel state, reading Zephon's iterators.

Run by tests/test_integration_megatron.py under torchrun: `python -m torch.distributed.run
--nproc_per_node D tests/_megatron_worker.py OUT DATA CONSUMED STEPS`. Each rank builds its
train iterator through `datasets_provider` (dp rank and size from
`parallel_state.get_data_parallel_rank/world_size()` after `initialize_model_parallel`), takes
STEPS global batches of micro-batches and saves them to OUT/rank{r}.pt.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from tokenizers import Tokenizer

from zephon.integrations.megatron import ZephonGPTData, datasets_provider

GLOBAL, MICRO, SEQ, EOD = 8, 2, 32, 2


def main() -> None:
    out, data_dir, consumed, steps = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    dist.init_process_group("gloo")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    data = ZephonGPTData([str(data_dir / "prose.jsonl"), str(data_dir / "code.jsonl")], weights=[0.7, 0.3],
                         tokenizer=Tokenizer.from_file(str(data_dir / "tok" / "tokenizer.json")), seq_len=SEQ,
                         global_batch_size=GLOBAL, micro_batch_size=MICRO, eod=EOD, create_attention_mask=True)
    provider = datasets_provider(data, consumed_samples=lambda: consumed)
    train, valid, test = provider([10**6, 0, 0])
    assert valid is None and test is None
    dp, rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    micro = GLOBAL // (MICRO * dp)
    batches = [next(train) for _ in range(steps * micro)]
    torch.save({"dp": dp, "rank": rank, "consumed_after": train.consumed_samples, "batches": batches},
               out / f"rank{dist.get_rank()}.pt")
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
