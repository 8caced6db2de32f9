"""The LM tests' corpus: generated prose and code documents and a BPE trained on part of them."""

from __future__ import annotations

from typing import Any

import pytest

from zephon.demo.textdata import generate_corpus, train_bpe
from zephon.sources.columns import objects  # noqa: F401 - the tests wrap documents with it


def corpora_fixture(prose: int, code: int, train: tuple[int, int], vocab_size: int) -> Any:
    """A module-scoped `corpora` fixture: (prose docs, code docs, a BPE trained on the first
    `train` of each)."""

    @pytest.fixture(scope="module")
    def corpora() -> tuple[list[str], list[str], Any]:
        p = generate_corpus(prose, seed=1)
        c = generate_corpus(code, seed=2, style="code")
        return p, c, train_bpe(p[:train[0]] + c[:train[1]], vocab_size=vocab_size)

    return corpora
