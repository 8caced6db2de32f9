"""Text fixtures for LM pipelines: generated corpora, the stdlib as real text, a small BPE.

The machines this project runs on have no network and no model hub, yet tokenize/pack/mix need
text with realistic statistics and a real tokenizer. This module makes both in-process:

- `generate_corpus` (from `zephon.demo.corpus`) writes English-like prose or Python-like code, the same
  on every machine; `python_stdlib_corpus` is real text no one here wrote.
- `train_bpe` trains a byte-level BPE with Hugging Face `tokenizers` in a second or two.
- `write_jsonl` / `write_text_array_record` put texts where `JsonlSource` / `ArrayRecordSource`
  read them back as a text column.

Only numpy and `tokenizers` are needed (array_record only for its writer).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from zephon.errors import DecodeError

from .corpus import STYLES, generate_corpus, python_stdlib_corpus

if TYPE_CHECKING:  # tokenizers is the optional `lm` extra; import it only where it is used
    import tokenizers

log = logging.getLogger(__name__)

__all__ = [
    "BOS_ID",
    "EOS_ID",
    "PAD_ID",
    "SPECIAL_TOKENS",
    "STYLES",
    "Utf8Text",
    "generate_corpus",
    "python_stdlib_corpus",
    "train_bpe",
    "write_jsonl",
    "write_text_array_record",
]

#: Special tokens of `train_bpe`'s default. The trainer gives special tokens the first ids, in
#: order, so with the default `<pad>` is 0, `<bos>` is 1 and `<eos>` is 2. Padding with id 0
#: therefore never collides with a real token.
SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>")
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2

# --------------------------------------------------------------------------------------------
# Tokenizer.


def train_bpe(texts: Iterable[str], vocab_size: int = 4096, *,
              special_tokens: Sequence[str] = SPECIAL_TOKENS, regex: str | None = None) -> tokenizers.Tokenizer:
    """A byte-level BPE trained in-process (no hub here), deterministic for the same input.

    Special tokens get the first ids in the order given: with the default, `<pad>` = 0
    (`PAD_ID`), `<bos>` = 1 (`BOS_ID`), `<eos>` = 2 (`EOS_ID`). No post-processor is set, so
    `encode` returns the text's tokens only; adding BOS/EOS is the pipeline's choice. Byte-level
    means every string encodes (no unknown token) and `decode(encode(s).ids) == s`.

    `regex`: GPT-2's structure (`ByteLevel(use_regex=True)`) when None; else the structure of
    cl100k, o200k, Llama 3 and Qwen2, `Sequence[Split(regex, "isolated"), ByteLevel(use_regex=False)]`
    (their regexes: `zephon.ops.pretoken_regex.REGEXES`).

    Determinism: the trainer has no randomness, but it assigns ids to symbols it meets while
    iterating a hash map; seeding the alphabet with all 256 byte symbols up front (sorted, as the
    trainer does) leaves nothing to assign that way, so ids and merge tie-breaks are the same in
    every process (tested across processes with different hash seeds).
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False) if regex is None else (
        pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(regex), "isolated"),
                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]))
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    log.debug("train_bpe: vocab %d", tokenizer.get_vocab_size())
    return tokenizer


# --------------------------------------------------------------------------------------------
# Writers matching Zephon's sources.


def write_jsonl(path: str | os.PathLike[str], texts: Iterable[str], field: str = "text") -> int:
    """One `{"<field>": text}` object per line; `JsonlSource(path).read(i)[field]` gives the
    texts back as an object array of str. Returns the number of lines written."""
    count = 0
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for text in texts:
            f.write(json.dumps({field: text}, ensure_ascii=False))
            f.write("\n")
            count += 1
    return count


def write_text_array_record(path: str | os.PathLike[str], texts: Iterable[str],
                            field: str = "text") -> int:
    """One raw UTF-8 record per text (no JSON: nothing to parse on the hot path).

    Read it back with `ArrayRecordSource(path, Utf8Text(field))` for a column of str, or with
    `RawBytes(field)` for bytes. `field` is not stored in the file (a raw record has no field
    names); it is accepted so the call mirrors `write_jsonl` and is ignored. Returns the record
    count.
    """
    from zephon.sources.array_record import write_array_record

    del field
    return write_array_record(path, (t.encode("utf-8") for t in texts))


class Utf8Text:
    """A `RecordSpec` for raw UTF-8 records: one column `field` of str (object array).

    Tokenizers take str, so decoding here keeps every text operator free of bytes handling.
    """

    def __init__(self, field: str = "text") -> None:
        self.field = field

    def __repr__(self) -> str:
        return f"Utf8Text(field={self.field!r})"

    def decode(self, records: np.ndarray, locate: Callable[[int], str]) -> dict[str, np.ndarray]:
        out = np.empty(len(records), dtype=object)
        for i, record in enumerate(records):
            try:
                out[i] = record.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DecodeError(f"{locate(i)}: not valid UTF-8 ({e}); {self!r} expects text "
                                  "records as written by write_text_array_record.") from e
        return {self.field: out}
