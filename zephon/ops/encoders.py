"""The tokenizers `Tokenize` runs: Hugging Face `tokenizers` and tiktoken, behind one interface.

An `Encoder` answers what `Tokenize` and its pre-token cache (`zephon.ops.pretokens`) need:

- `encode(texts)`: the tokenizer's own batched encode (the reference every id is equal to):
  `Tokenizer.encode_batch(texts, add_special_tokens=False)`, tiktoken's `encode_ordinary_batch`
  (special tokens' text is ordinary text, as in any corpus).
- `encode_pieces(pieces)`: each piece encoded as one pre-token, without the regex: the BPE
  applied to its bytes (what the tokenizer does to each piece its regex cuts), as (the ids of
  all pieces concatenated, each piece's number of ids).
- `structure()`: (regex, its dialect, normalization form or None) when the tokenizer's ids are
  its pieces' ids concatenated, else the reason why not.
- `identity()`: what makes ids differ (a hash of the tokenizer's JSON; for tiktoken the encoding's
  name and a hash of its ranks, regex and special tokens), for the operator's config.

Both pickle small enough to travel to worker processes (the JSON; tiktoken's own pickling).
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import logging
import os
import re
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

import numpy as np

from zephon.errors import PlanError
from zephon.ops.pretoken_regex import GPT2
from zephon.ops.tiktoken_bpe import TiktokenBPE
from zephon.runners.base import native_threads

log = logging.getLogger(__name__)

Structure = tuple[str, str, str | None]  # (regex, dialect, normalization form)


@functools.lru_cache(maxsize=16)
def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


#: Missed pieces encoded in one sequence (the chunks go to the tokenizer's threads).
PIECES_PER_SEQUENCE = 4096
#: Fewest missed pieces worth a thread of tiktoken's engine.
MIN_PIECES_PER_THREAD = 1024


@functools.lru_cache(maxsize=4)
def _thread_pool(threads: int) -> ThreadPoolExecutor:
    """One pool a process and size (tiktoken releases the GIL while it encodes)."""
    return ThreadPoolExecutor(threads, thread_name_prefix="zephon-tiktoken")


def thread_map(fn: Callable[[Any], Any], items: Sequence[Any]) -> list[Any]:
    """`fn` over `items` on this process's share of the cores (`fn` releases the GIL: tiktoken)."""
    n = min(native_threads(), len(items))
    return list(_thread_pool(n).map(fn, items)) if n > 1 else list(map(fn, items))


def _flat(lists: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
    """(all ids concatenated, each list's length): no array per piece."""
    lens = np.fromiter(map(len, lists), np.int64, len(lists))
    return np.fromiter(itertools.chain.from_iterable(lists), np.int32, int(lens.sum())), lens


class HFEncoder:
    """A Hugging Face `tokenizers.Tokenizer` (a `tokenizer.json`)."""

    kind = "tokenizers"

    def __init__(self, tokenizer: Any, text: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.json = tokenizer.to_str() if text is None else text  # `text`: the JSON it was made from
        self._pieces: Any = None
        self._bpe: TiktokenBPE | Literal[False] | None = None
        self._structure: Structure | str | None = None
        self.added = [t.content for t in tokenizer.get_added_tokens_decoder().values() if t.content]

    def __getstate__(self) -> dict[str, Any]:
        return {"json": self.json}

    def __setstate__(self, d: dict[str, Any]) -> None:
        import tokenizers

        self.__init__(tokenizers.Tokenizer.from_str(d["json"]), d["json"])  # type: ignore[misc]

    def identity(self) -> dict[str, Any]:
        return {"tokenizer_sha256": _sha256(self.json.encode())}

    def encode(self, texts: Sequence[str]) -> list[np.ndarray]:
        fast = getattr(self.tokenizer, "encode_batch_fast", None) or self.tokenizer.encode_batch
        return [np.array(e.ids, np.int32) for e in fast(list(texts), add_special_tokens=False)]

    def encode_pieces(self, pieces: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        bpe = self._tiktoken_bpe()
        if bpe is None or not pieces:
            return self._hf_pieces(pieces)
        # tiktoken's engine releases the GIL: a chunk a thread
        threads = max(1, min(native_threads(), len(pieces) // MIN_PIECES_PER_THREAD))
        n = -(-len(pieces) // threads)
        runs = thread_map(functools.partial(self._engine_pieces, bpe),
                          [pieces[i:i + n] for i in range(0, len(pieces), n)])
        return np.concatenate([r[0] for r in runs]), np.concatenate([r[1] for r in runs])

    def _engine_pieces(self, bpe: TiktokenBPE, pieces: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        run = bpe.encode(pieces)
        if run is None:
            return self._hf_pieces(pieces)
        flat, lens, unproven = run
        if len(unproven):  # pieces whose ids tiktoken's run does not prove HF's: HF's own
            ids = np.split(flat, np.cumsum(lens)[:-1])
            hf_flat, hf_lens = self._hf_pieces([pieces[i] for i in unproven])
            for i, x in zip(unproven, np.split(hf_flat, np.cumsum(hf_lens)[:-1])):
                ids[i] = x
            flat, lens = np.concatenate(ids), lens.copy()
            lens[unproven] = hf_lens
        return flat, lens

    def _tiktoken_bpe(self) -> TiktokenBPE | None:
        """The model run by tiktoken's engine (`zephon.ops.tiktoken_bpe`), if it can be."""
        if self._bpe is None:
            model = json.loads(self.json).get("model") or {}
            why = TiktokenBPE.eligible(model)
            try:
                self._bpe = False if why else TiktokenBPE(model)
            except ValueError as e:
                why, self._bpe = str(e), False
            if why:
                log.debug("missed pieces go to the tokenizer's own BPE, not tiktoken's engine: %s", why)
        return self._bpe or None

    def _hf_pieces(self, pieces: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        if self._pieces is None:  # the same model with a byte-level pre-tokenizer that does not split
            import tokenizers

            cfg = json.loads(self.json)
            cfg["normalizer"] = None
            cfg["pre_tokenizer"] = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
                                    "use_regex": False}
            self._pieces = tokenizers.Tokenizer.from_str(json.dumps(cfg))
        # chunks of pieces as pre-tokenized sequences: one Encoding a chunk instead of one a
        # piece (most of the cost of a piece in its own sequence); the BPE never merges across
        # the words of a pre-tokenized input, and each id's word gives the pieces' lengths
        chunk = PIECES_PER_SEQUENCE
        groups = [list(pieces[i:i + chunk]) for i in range(0, len(pieces), chunk)]
        encs = self._pieces.encode_batch(groups, is_pretokenized=True, add_special_tokens=False)
        flat, words = _flat([e.ids for e in encs]), _flat([e.word_ids for e in encs])[0]
        offsets = np.repeat(np.arange(len(groups), dtype=np.int64) * chunk, flat[1])
        return flat[0], np.bincount(words + offsets, minlength=len(pieces)).astype(np.int64)

    def structure(self) -> Structure | str:
        if self._structure is None:  # asked for by `ineligible` and the cache: parse the JSON once
            self._structure = self._parse_structure()
        return self._structure

    def _parse_structure(self) -> Structure | str:
        cfg = json.loads(self.json)
        model = cfg.get("model") or {}
        if model.get("type") != "BPE" or model.get("dropout") is not None:
            return "its model is not a BPE without dropout"
        if cfg.get("truncation") is not None or cfg.get("padding") is not None:
            return "truncation or padding is set on it"
        norm = cfg.get("normalizer")
        if norm is not None and norm.get("type") not in ("NFC", "NFKC"):
            return f"its normalizer is {norm.get('type')} (only NFC and NFKC are served)"
        form = None if norm is None else norm["type"]
        pre = cfg.get("pre_tokenizer") or {}
        if pre.get("type") == "ByteLevel" and not pre.get("add_prefix_space", True) and pre.get("use_regex", True):
            return GPT2, "onig", form
        steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else []
        if (len(steps) == 2 and steps[0].get("type") == "Split" and "Regex" in (steps[0].get("pattern") or {})
                and steps[0].get("behavior") == "Isolated" and not steps[0].get("invert")
                and steps[1].get("type") == "ByteLevel" and not steps[1].get("add_prefix_space", True)
                and not steps[1].get("use_regex", True)):
            return steps[0]["pattern"]["Regex"], "onig", form
        return ("its pre-tokenizer is neither ByteLevel(add_prefix_space=False, use_regex=True) nor "
                "Sequence[Split(Regex, 'isolated'), ByteLevel(add_prefix_space=False, use_regex=False)]")


class TiktokenEncoder:
    """A `tiktoken.Encoding`; special tokens' text is encoded as ordinary text."""

    kind = "tiktoken"

    def __init__(self, encoding: Any) -> None:
        self.encoding = encoding
        self.added: list[str] = []  # encode_ordinary: no text is special
        self._identity: dict[str, Any] | None = None

    def identity(self) -> dict[str, Any]:
        if self._identity is None:
            enc = self.encoding
            ranks = b"".join(rank.to_bytes(4, "little") + len(token).to_bytes(2, "little") + token
                             for token, rank in sorted(enc._mergeable_ranks.items(), key=lambda kv: kv[1]))
            rest = json.dumps([enc._pat_str, sorted(enc._special_tokens.items())]).encode()
            self._identity = {"tiktoken": enc.name, "tiktoken_sha256": _sha256(ranks + rest)}
        return self._identity

    def encode(self, texts: Sequence[str]) -> list[np.ndarray]:
        """`encode_ordinary_batch`'s ids, as arrays straight from tiktoken's buffer: its lists of
        Python ints (and a thread pool made per call) cost 2-3x the encoding itself."""
        return thread_map(self._encode_one, texts)

    def _encode_one(self, text: str) -> np.ndarray:
        # encode() with no special token allowed nor checked is encode_ordinary (tiktoken's
        # docstring); lone surrogates are replaced as encode_ordinary does
        enc = self.encoding
        try:
            ids = enc.encode_to_numpy(text, allowed_special=set(), disallowed_special=())
        except UnicodeEncodeError:
            text = text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
            ids = enc.encode_to_numpy(text, allowed_special=set(), disallowed_special=())
        return ids.astype(np.int32)

    def encode_pieces(self, pieces: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        return _flat(list(map(self.encoding._encode_single_piece, pieces)))

    def structure(self) -> Structure | str:
        return self.encoding._pat_str, "fancy", None


def load_tiktoken_file(path: str, pat_str: str, special_tokens: dict[str, int] | None = None,
                       name: str | None = None) -> Any:
    """A `tiktoken.Encoding` from a tiktoken-format BPE file (`base64-token rank` lines).

    The file has no regex: pass the one the ranks were trained with (`pat_str`), e.g.
    `tiktoken.get_encoding("cl100k_base")._pat_str` for cl100k's.
    """
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe

    path = os.fspath(path)
    if not os.path.exists(path):
        raise PlanError(f"no tiktoken BPE file at {path}")
    try:
        ranks = load_tiktoken_bpe(path)
    except Exception as e:
        raise PlanError(f"{path} is not a tiktoken BPE file (lines of `base64-token rank`): {e}") from e
    return tiktoken.Encoding(name or os.path.basename(path).split(".")[0], pat_str=pat_str,
                             mergeable_ranks=ranks, special_tokens=special_tokens or {})


def encoder(spec: Any) -> HFEncoder | TiktokenEncoder:
    """The encoder for `Tokenize(tokenizer=spec)`: a `tokenizers.Tokenizer`, a `tiktoken.Encoding`,
    or the path of a `tokenizer.json`."""
    if type(spec).__module__.startswith("tiktoken"):
        return TiktokenEncoder(spec)
    try:
        import tokenizers
    except ImportError as e:  # pragma: no cover - the [lm] extra
        raise PlanError("Tokenize needs Hugging Face `tokenizers`: pip install 'zephon-loader[lm]'") from e
    if isinstance(spec, tokenizers.Tokenizer):
        return HFEncoder(spec)
    path = os.fspath(spec)
    if not os.path.exists(path):
        raise PlanError(f"no tokenizer file at {path}; pass the path of a tokenizer.json, a tokenizers.Tokenizer "
                        "or a tiktoken.Encoding (there is no model hub here: train one with "
                        "zephon.demo.textdata.train_bpe and save it).")
    if re.search(r"\.tiktoken$|\.bpe$", path):
        raise PlanError(f"{path} looks like a tiktoken BPE file, which has no regex: load it with "
                        "zephon.ops.encoders.load_tiktoken_file(path, pat_str=...) and pass the Encoding.")
    try:
        return HFEncoder(tokenizers.Tokenizer.from_file(path))
    except Exception as e:
        raise PlanError(f"{path} is not a tokenizers JSON file ({e}); save one with "
                        "Tokenizer.save(path).") from e
