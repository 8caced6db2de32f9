"""Megatron's own data samplers, loaded from the installed Megatron-Bridge wheel by file path.

megatron-core's wheel has no `megatron.training`, so Megatron-LM's
`build_pretraining_data_loader` and `MegatronPretrainingSampler` are not importable from it.
Megatron-Bridge ships Megatron's copy of both in `megatron/bridge/data/samplers.py`, a
self-contained module (it imports random, typing, numpy, torch only). Its package's
`megatron/bridge/__init__.py` imports transformers and the model bridges, which are not
installed (the Makefile installs Megatron-Bridge with --no-deps), so the module is loaded from
its file without executing that package `__init__`.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

RELATIVE = Path("bridge") / "data" / "samplers.py"
NAME = "zephon_tests_megatron_samplers"


def samplers_path() -> Path | None:
    """The installed `megatron/bridge/data/samplers.py`, or None when Megatron-Bridge is absent."""
    spec = importlib.util.find_spec("megatron")  # a namespace package: megatron-core's + Bridge's dirs
    for location in (spec.submodule_search_locations or []) if spec is not None else []:
        candidate = Path(location) / RELATIVE
        if candidate.is_file():
            return candidate
    return None


def load() -> ModuleType:
    """Megatron's samplers module (cached in sys.modules under a private name)."""
    if NAME in sys.modules:
        return sys.modules[NAME]
    path = samplers_path()
    if path is None:
        raise ImportError("megatron/bridge/data/samplers.py not found: install Megatron-Bridge's samplers "
                          "with `pip install --no-deps megatron-bridge==0.3.1` (the Makefile does)")
    spec = importlib.util.spec_from_file_location(NAME, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[NAME] = module
    spec.loader.exec_module(module)
    return module
