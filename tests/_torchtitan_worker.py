"""One rank of the real TorchTitan 0.3.0 trainer on CPU (gloo), reading through Zephon's loader.

Run by tests/test_integration_torchtitan.py under torchrun: `python -m torch.distributed.run
--nproc_per_node D tests/_torchtitan_worker.py OUT_DIR DATA_DIR --module ... --config ... [args]`.
It records every batch the trainer takes from the data loader (`Trainer.batch_generator`) to
OUT_DIR/batches_rank{r}.pt, so the test compares what the trainer actually consumed.

The test-only CPU shim (TorchTitan 0.3.0 targets GPUs; nothing here changes the data path):
- `torchtitan.tools.utils.device_type` falls back to "cuda" without an accelerator: set to "cpu"
  before the rest of TorchTitan imports it.
- FSDP2's gradient reduce-scatter averages, which gloo cannot: `force_sum_reduction_for_comms`
  (TorchTitan divides by the global token count itself: gradient_divide_factor = 1).
- `torch.distributed.set_timeout` (called after the first step) is not in torch 2.13: a no-op.
- FlexAttention has no CPU backward: every layer's inner attention becomes SDPA (causal).
- `--parallelism.spmd_backend partial_dtensor` (passed by the test).
"""

from __future__ import annotations

import os
import sys
import types

import torch
import torch.distributed as dist
import torchtitan.tools.utils as tt_utils


def _cpu_module() -> types.SimpleNamespace:
    """torch.cpu plus the few CUDA-module calls TorchTitan makes (names, memory statistics)."""
    return types.SimpleNamespace(
        set_device=torch.cpu.set_device, current_device=lambda: 0,  # an index: barrier(device_ids=)
        device_count=torch.cpu.device_count, synchronize=torch.cpu.synchronize,
        get_device_name=lambda device=None: "cpu", empty_cache=lambda: None,
        get_device_properties=lambda device=None: types.SimpleNamespace(total_memory=1 << 34, name="cpu"),
        memory_stats=lambda device=None: {}, reset_peak_memory_stats=lambda device=None: None)


tt_utils.device_type, tt_utils.device_module = "cpu", _cpu_module()  # before anything imports them

if not hasattr(dist, "set_timeout"):
    dist.set_timeout = lambda timeout, group=None: None  # type: ignore[attr-defined]

import torchtitan.distributed.fsdp as tt_fsdp  # noqa: E402
from torch.distributed.fsdp import FSDPModule  # noqa: E402

_disable_division = tt_fsdp.disable_fsdp_gradient_division


def _sum_reduction(model: torch.nn.Module) -> None:
    _disable_division(model)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)


tt_fsdp.disable_fsdp_gradient_division = _sum_reduction

from torchtitan.config import ConfigManager  # noqa: E402
from torchtitan.models.common.attention import ScaledDotProductAttention  # noqa: E402
from torchtitan.tools.logging import init_logger  # noqa: E402
from torchtitan.trainer import Trainer  # noqa: E402

RECORD: list[dict[str, torch.Tensor]] = []
_batch_generator = Trainer.batch_generator


def _recording(self, data_iterable):  # type: ignore[no-untyped-def]
    for input_dict, labels in _batch_generator(self, data_iterable):
        RECORD.append({"step": torch.tensor(self.step), "input": input_dict["input"].clone(),
                       "positions": input_dict["positions"].clone(), "labels": labels.clone()})
        yield input_dict, labels


Trainer.batch_generator = _recording  # type: ignore[method-assign]


def main() -> None:
    out_dir, args = sys.argv[1], sys.argv[2:]
    init_logger()
    config = ConfigManager().parse_args(args)
    for layer in config.model_spec.model.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    trainer = config.build()
    try:
        trainer.train()
    finally:
        trainer.close()
    rank = dist.get_rank()
    torch.save(RECORD, os.path.join(out_dir, f"batches_rank{rank}.pt"))
    torch.save({"dp": trainer.dataloader.dp_world_size, "micro": trainer.dataloader.micro_batches},
               os.path.join(out_dir, f"layout_rank{rank}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
