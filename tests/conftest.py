"""Shared test set-up: 8 fake CPU devices for jax, set before anything imports jax."""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# No test forks a process that may have imported JAX: its threads make os.fork() a deadlock risk
# (JAX warns "os.fork() was called ..."). Processes started through multiprocessing's default
# context — torch DataLoader workers among them — come from a fork server instead: a fresh
# interpreter that never imports JAX, preloading numpy, torch and zephon once so that each
# worker starts about as fast as a fork. (Tests that fork on purpose do it in a subprocess.)
import multiprocessing

multiprocessing.set_start_method("forkserver", force=True)
multiprocessing.set_forkserver_preload(["numpy", "torch", "zephon", "zephon.runners"])
