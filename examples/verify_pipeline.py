"""A user's own pipelines, as `zephon verify` and `zephon.testing` see them.

This module lives outside the zephon package, like your project's data module. Each function
builds a pipeline and returns a `zephon.testing.Pipeline`; nothing runs at import.

    zephon verify examples/verify_pipeline.py:pipeline
    zephon verify examples/verify_pipeline.py:pipeline examples/verify_pipeline.py:packed --steps 30
    zephon explain examples/verify_pipeline.py:packed --step 5 --rows 0:2

`pipeline`: images with a label, a filter and a random augmentation — the augmentation's
generator comes from `RandomMap` (derived from the record, never from a worker or a call count),
so every configuration sees the same pixels. `packed`: short "documents" of token ids, packed
into rows of 64 tokens (the lanes carry the packing state across steps and resumes).
Operators are module-level functions with a declared name and version, so they pickle (for the
processes runner) and their identity goes into checkpoints.
"""

from __future__ import annotations

import numpy as np

import zephon as z
from zephon.ops.pack import Pack
from zephon.sources.memory import ArraySource
from zephon.testing import Pipeline

RECORDS = 2000


def _images() -> dict[str, np.ndarray]:
    data = np.random.default_rng(1234)  # generating the data set once: seeded, fine
    return {"image": data.integers(0, 256, (RECORDS, 8, 8), dtype=np.uint8),
            "label": (np.arange(RECORDS) % 10).astype(np.int32),
            "id": np.arange(RECORDS, dtype=np.int32)}


def not_label_7(record: dict) -> bool:
    return int(record["label"]) != 7


def augment(record: dict, rng: np.random.Generator) -> dict:
    """Random flip and pixel noise from the record's own generator."""
    image = record["image"][:, ::-1] if rng.random() < 0.5 else record["image"]
    noise = rng.integers(-3, 4, image.shape)
    return {**record, "image": np.clip(image.astype(np.int16) + noise, 0, 255).astype(np.uint8)}


def pipeline() -> Pipeline:
    plan = z.Source(RECORDS, name="images").shuffle(2024).repeat().lanes(8).batch(32)
    ops = [z.Filter(not_label_7, name="not_label_7", version=1),
           z.RandomMap(augment, name="augment", version=1)]
    return Pipeline(plan, ArraySource(_images()), ops, seed=7)


def _documents(n: int = 600) -> np.ndarray:
    """`n` documents of 5..120 token ids each (an object array of int32 arrays)."""
    data = np.random.default_rng(99)
    docs = np.empty(n, object)
    for i in range(n):
        docs[i] = data.integers(3, 1000, data.integers(5, 121), dtype=np.int32)
    return docs


def packed() -> Pipeline:
    plan = z.Source(600, name="docs").shuffle(5).repeat().lanes(8).batch(16)
    return Pipeline(plan, ArraySource({"tokens": _documents()}), [Pack(64, "concat")])
