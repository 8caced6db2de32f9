"""Thin adapters from a Zephon pipeline to the data protocols of trainers (TorchTitan, Megatron-LM).

Each is an optional extra, imported only by its own module, so the core keeps its numpy-only
imports. Their state is Zephon's JSON state, the same on every rank, so a run resumes at another
data-parallel size.
"""
