"""Prove Zephon's guarantee on your own pipeline: one-call assertions and the configuration matrix.

You write a *factory*: a function that builds your pipeline and returns a `Pipeline` (or
`(plan, sources[, transforms])`, a dict of `Pipeline`'s fields, or a `zephon.compat.grain.Dataset`).
It may take `world=` (and `rank=`) if your code reads the data-parallel degree: then a pipeline
that changes with the degree is caught too. A factory given as `"module:function"` or
`"path/to/file.py:function"` is imported by name, which multi-process runs need.

Then, in a test::

    from zephon import testing as zt

    def test_my_pipeline_is_deterministic():
        zt.assert_elastic(my_factory)                      # D = 1, 2, 4, 8 give the same batches
        zt.assert_runners_agree(my_factory)                # threads / processes change nothing
        zt.assert_emitters_agree(my_factory)               # numpy, JAX, torch, the Grain API
        zt.assert_resumes(my_factory)                      # stop, save, resume at another D
        zt.assert_micro_batches(my_factory, counts=(2, 4)) # gradient accumulation views

or with the pytest plugin (`@pytest.mark.zephon_pipeline(factory)` and the `zephon_verify`
fixture), or from the shell: `zephon verify module:factory`.

Every check runs configurations of your pipeline and compares each global step, lane by lane,
with the reference — the numpy emitter at D=1 — by digests of every row. A failure raises
`DeterminismError` naming the first step, lane, row and field that differ, with `explain` of
that row (its source, record, epoch — or the document pieces of a packed row).

A configuration is written like `numpy D=2 runner=threads:2`, `jax mesh=2x4 micro=2`,
`torch D=4 workers=2`, `grain D=2`, `jax procs=2 mesh=2x4` (two local processes under
`jax.distributed`), `torch procs=2` (gloo), and with stops: `numpy D=2 @10 -> torch D=8`
(10 steps at D=2, the state saved through that emitter's API, JSON round-tripped, merged over
ranks and restored by the next). See `Config.parse`.

This package is numpy-only at import; it imports JAX, torch and Grain only for the
configurations that use them. One concept a module:

- `pipeline`: the pipeline under test (`Pipeline`, `IndexSource`, `load_plan`, `load_factory`, `Builder`);
- `configs`: configurations (`Segment`, `Config`, `matrix`, `default_resume`);
- `sessions`: one emitter (numpy, Grain, torch, JAX) over every rank of a segment;
- `processes`: segments in several local processes (`python -m zephon.testing worker`);
- `runs`: running configurations, the first divergence from the reference, `verify`;
- `asserts`: the one-call assertions.
"""

from __future__ import annotations

from zephon.fingerprints import Divergence
from zephon.testing.asserts import (
    DeterminismError,
    assert_deterministic,
    assert_elastic,
    assert_emitters_agree,
    assert_micro_batches,
    assert_resumes,
    assert_runners_agree,
)
from zephon.testing.configs import BACKENDS, REFERENCE, Config, Segment, default_resume, matrix
from zephon.testing.pipeline import (
    Builder,
    Factory,
    FactoryError,
    IndexSource,
    Pipeline,
    factory_spec,
    load_factory,
    load_plan,
)
from zephon.testing.report import Report, RunResult
from zephon.testing.runs import Run, divergence, run_config, verify
from zephon.testing.sessions import StepOut

__all__ = [
    "BACKENDS", "REFERENCE", "Builder", "Config", "DeterminismError", "Divergence", "Factory", "FactoryError",
    "IndexSource", "Pipeline", "Report", "Run", "RunResult", "Segment", "StepOut", "assert_deterministic",
    "assert_elastic", "assert_emitters_agree", "assert_micro_batches", "assert_resumes", "assert_runners_agree",
    "default_resume", "divergence", "factory_spec", "load_factory", "load_plan", "matrix", "run_config", "verify",
]
