"""The steady soak's flatness verdict (benchmarks/soak_steady.py) is a check that can fail."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
soak_steady = pytest.importorskip("soak_steady")


def _rows(t, rss, fds=None):
    fds = np.full(len(t), 40.0) if fds is None else fds
    return [{"fds": f, "memfds": f - 20, "memfd_maps": 10.0, "rss_mb": r, "workers_rss_mb": 130.0,
             "anon_mb": r - 20, "workers_anon_mb": 110.0} for f, r in zip(fds, rss)]


def test_flat_series_with_a_warm_up_ramp_and_noise_pass():
    t = np.arange(600.0)
    rng = np.random.default_rng(0)
    rss = np.minimum(140 + t / 5, 160) + rng.normal(0, 0.7, len(t))  # ramps for 100 s, then noise
    _, flat = soak_steady.verdict(t, _rows(t, rss), 0.25, 0.05)
    assert all(flat.values()), flat


def test_a_leak_after_warm_up_fails():
    t = np.arange(600.0)
    rss = 160 + 2.0 * t / 60  # 2 MB a minute
    fds = 40 + np.floor(t / 120)  # one descriptor every two minutes
    fit, flat = soak_steady.verdict(t, _rows(t, rss, fds), 0.25, 0.05)
    assert not flat["rss_mb"] and not flat["anon_mb"] and not flat["fds"] and not flat["memfds"]
    assert flat["memfd_maps"] and flat["workers_rss_mb"] and flat["workers_anon_mb"]
    assert fit["rss_mb"]["slope_per_min"] == pytest.approx(2.0)
