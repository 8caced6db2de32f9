"""pytest plugin: the `zephon_verify` fixture and the `zephon_pipeline` marker.

Registered through the `pytest11` entry point when Zephon is installed, so a test of your own
pipeline is a few lines::

    import pytest
    from my_project.data import pipeline

    @pytest.mark.zephon_pipeline(factory=pipeline, steps=30)
    def test_data_is_deterministic(zephon_verify):
        zephon_verify.elastic()          # D = 1, 2, 4, 8
        zephon_verify.resume()           # stop, save, resume at another D (and emitter)

Pass the factory as `factory=` (or as "module:function"): pytest takes a marker's lone
positional function argument for the function being decorated. Without the marker, hand the
factory to the fixture: `zephon_verify(pipeline).emitters()`.
Each check raises `zephon.testing.DeterminismError` (an AssertionError) naming the first step,
lane, row and field that differ and what that row holds. `--zephon-steps N` sets every check's
step count (e.g. longer in nightly CI). The JAX checks use several meshes: give JAX 8 CPU
devices by setting `XLA_FLAGS=--xla_force_host_platform_device_count=8` before it is imported
(e.g. at the top of `conftest.py`); with fewer devices those meshes are reported as n/a.

This module imports nothing heavy: Zephon is imported when a check runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest


def pytest_addoption(parser: Any) -> None:
    group = parser.getgroup("zephon", "Zephon determinism checks (zephon_verify fixture)")
    group.addoption("--zephon-steps", type=int, default=None, metavar="N",
                    help="global steps every zephon_verify check runs (default: the marker's or 20)")


def pytest_configure(config: Any) -> None:
    config.addinivalue_line(
        "markers", "zephon_pipeline(factory=..., steps=20): the pipeline factory (a callable, "
        "'module:function' or 'path/file.py:function') the zephon_verify fixture checks")


class ZephonVerify:
    """The checks of `zephon.testing`, bound to one pipeline factory and step count."""

    def __init__(self, factory: Any = None, steps: int = 20, forced_steps: int | None = None) -> None:
        self.factory = factory
        self.steps = steps
        self.forced_steps = forced_steps

    def __call__(self, factory: Any, steps: int | None = None) -> ZephonVerify:
        """The same checks for another factory."""
        return ZephonVerify(factory, self.steps if steps is None else steps, self.forced_steps)

    def _args(self, steps: int | None) -> tuple[Any, int]:
        if self.factory is None:
            raise pytest.UsageError("zephon_verify has no pipeline: mark the test with "
                                    "@pytest.mark.zephon_pipeline(factory) or call zephon_verify(factory)")
        return self.factory, self.forced_steps or steps or self.steps

    def elastic(self, degrees: Sequence[int] = (1, 2, 4, 8), steps: int | None = None) -> Any:
        """Same global batches at every data-parallel degree (that divides the lanes)."""
        __tracebackhide__ = True
        from zephon.testing import assert_elastic

        f, n = self._args(steps)
        return assert_elastic(f, degrees, n)

    def runners(self, runners: Sequence[str] = ("threads:2", "processes:2"), world: int = 2,
                steps: int | None = None) -> Any:
        """Runners and worker counts change nothing."""
        __tracebackhide__ = True
        from zephon.testing import assert_runners_agree

        f, n = self._args(steps)
        return assert_runners_agree(f, runners, world, n)

    def emitters(self, backends: Sequence[str] = ("jax", "torch", "grain"), steps: int | None = None,
                 **options: Any) -> Any:
        """numpy, JAX (several meshes), torch and the Grain-compatible iterator agree."""
        __tracebackhide__ = True
        from zephon.testing import assert_emitters_agree

        f, n = self._args(steps)
        return assert_emitters_agree(f, backends, n, **options)

    def resume(self, stops: Sequence[int] | None = None,
               degrees: Sequence[tuple[int, int]] = ((2, 8), (8, 1), (1, 4)),
               backends: Sequence[str] = ("numpy",), steps: int | None = None) -> Any:
        """Stop, save (JSON), merge ranks, resume at another degree (and emitter): same batches."""
        __tracebackhide__ = True
        from zephon.testing import assert_resumes

        f, n = self._args(steps)
        return assert_resumes(f, stops, degrees, backends, n)

    def micro_batches(self, counts: Sequence[int] = (2, 4),
                      backends: Sequence[str] = ("numpy", "jax", "torch"), steps: int | None = None) -> Any:
        """Micro-batches concatenate to the batch on every emitter; changing n at resume is free."""
        __tracebackhide__ = True
        from zephon.testing import assert_micro_batches

        f, n = self._args(steps)
        return assert_micro_batches(f, counts, backends, steps=n)

    def all(self, steps: int | None = None, **options: Any) -> Any:
        """The whole default matrix (see `zephon.testing.matrix` for the options)."""
        __tracebackhide__ = True
        from zephon.testing import assert_deterministic

        f, n = self._args(steps)
        return assert_deterministic(f, n, **options)

    def configs(self, *configs: str, steps: int | None = None) -> Any:
        """Exactly these configurations, e.g. `"numpy D=2 @5 -> jax mesh=2x4 micro=2"`."""
        __tracebackhide__ = True
        from zephon.testing import verify
        from zephon.testing.asserts import raise_if_failed

        f, n = self._args(steps)
        return raise_if_failed(verify(f, configs, n), "configurations differ")


@pytest.fixture
def zephon_verify(request: Any) -> ZephonVerify:
    """Determinism checks of the pipeline named by `@pytest.mark.zephon_pipeline(factory)`."""
    marker = request.node.get_closest_marker("zephon_pipeline")
    factory, steps = None, 20
    if marker is not None:
        if marker.args:
            factory = marker.args[0]
        factory = marker.kwargs.get("factory", factory)
        steps = int(marker.kwargs.get("steps", steps))
    return ZephonVerify(factory, steps, request.config.getoption("zephon_steps"))
