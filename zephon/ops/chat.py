"""Chat conversations as a row operator: `{"messages": [{"role", "content"}, ...]}` -> token ids
and the mask of the tokens to train on (the assistant's answers by default).

A `ChatTemplate` renders a conversation into text pieces, each trained or not; `Chat` tokenizes
the pieces of a whole read window together (the same encoder as `Tokenize`; with its exact
pre-token cache, one regex pass over the window's pieces joined, kept where it provably equals
each piece's own split: `zephon.ops.pretoken_join`) and concatenates them per conversation, so
every token's mask comes from the piece it belongs to — exact by construction, no character
offsets needed. Adjacent pieces
with the same mask are joined before tokenizing, so the only token boundaries a template adds are
where training starts or stops (as nanochat and most SFT trainers tokenize prompt and answer).

Two kinds of template:

- `ChatTemplate(turn=..., start=...)`: every message is `turn` with `{role}` and `{content}`
  filled in; in a trained role's message, `{content}` and the rest of `turn` after it (the end
  marker: the model learns to stop) are trained, the header before it is not.
- `ChatTemplate.jinja(source)` / `ChatTemplate.from_tokenizer_config(path)`: a Hugging Face chat
  template (the `chat_template` of a local `tokenizer_config.json`; there is no model hub here),
  rendered with jinja2 as `transformers` does (sandboxed, `trim_blocks`, `lstrip_blocks`), whose
  `{% generation %}...{% endgeneration %}` blocks mark the trained text — what
  `apply_chat_template(..., return_assistant_tokens_mask=True)` uses. `transformers` itself is
  not required (a heavy import for one function); the same template source gives the same text.

A template that marks no trained token is refused when the operator is built (a template without
generation markers would otherwise train on everything, or on nothing); a conversation with no
trained token is an error naming the record (or dropped, `empty="drop"`), never an all-ones or
all-zeros mask. The template is part of the operator's identity.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from dataclasses import field as dc_field
from typing import Any, Literal

import numpy as np

from zephon.errors import DecodeError, PlanError
from zephon.ops.base import Transform
from zephon.ops.pretoken_join import encode_joined
from zephon.ops.tokenize import Tokenize
from zephon.plan import Refs
from zephon.sources.base import Columns
from zephon.sources.columns import objects

Piece = tuple[str, bool]  # (text, trained)
_OPEN, _CLOSE = "\ue000", "\ue001"  # private-use sentinels around generation blocks


def _generation_extension() -> type:
    from jinja2 import nodes
    from jinja2.ext import Extension

    class Generation(Extension):
        """`{% generation %}...{% endgeneration %}`: the block's text is trained."""

        tags = {"generation"}  # noqa: RUF012 - jinja2's Extension declares it an instance set

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_mark", []), [], [], body).set_lineno(lineno)

        def _mark(self, caller: Any) -> str:
            return _OPEN + caller() + _CLOSE

    return Generation


def _raise(message: str) -> None:
    raise DecodeError(f"the chat template refused a conversation: {message}")


@dataclass(frozen=True, eq=False)
class ChatTemplate:
    """How a conversation becomes text, and which text is trained (see the module doc).

    Args:
      turn: one message's text, with `{content}` once and optionally `{role}`.
      start: text once before the first message.
      source: a jinja chat template (use `ChatTemplate.jinja`); then `turn`/`start` are unused.
      bos_token, eos_token: the strings a jinja template may use (`{{ bos_token }}`).
    """

    turn: str = "<|{role}|>\n{content}<|end|>\n"
    start: str = ""
    source: str | None = None
    bos_token: str = ""
    eos_token: str = ""

    def __post_init__(self) -> None:
        if self.source is None and (not isinstance(self.turn, str) or self.turn.count("{content}") != 1):
            raise PlanError(f"ChatTemplate.turn must contain '{{content}}' exactly once, got {self.turn!r}")
        object.__setattr__(self, "_compiled", None)
        object.__setattr__(self, "_parts", {})

    @staticmethod
    def jinja(source: str, *, bos_token: str = "", eos_token: str = "") -> ChatTemplate:
        """A Hugging Face chat template; its `{% generation %}` blocks are the trained text."""
        if not isinstance(source, str) or not source.strip():
            raise PlanError("ChatTemplate.jinja needs the template's source text")
        return ChatTemplate(source=source, bos_token=bos_token, eos_token=eos_token)

    @staticmethod
    def from_tokenizer_config(path: str | os.PathLike[str], name: str = "default") -> ChatTemplate:
        """The `chat_template` of a local `tokenizer_config.json` (or of the directory holding it)."""
        p = os.fspath(path)
        if os.path.isdir(p):
            p = os.path.join(p, "tokenizer_config.json")
        try:
            with open(p, encoding="utf-8") as f:
                cfg = json.load(f)
        except (OSError, ValueError) as e:
            raise PlanError(f"cannot read a tokenizer_config.json at {p}: {e}") from None
        tpl = cfg.get("chat_template")
        if isinstance(tpl, list):  # named templates: [{"name": ..., "template": ...}]
            tpl = {t.get("name"): t.get("template") for t in tpl if isinstance(t, Mapping)}.get(name)
        if not isinstance(tpl, str):
            raise PlanError(f"{p} has no chat_template{'' if name == 'default' else f' named {name!r}'}; "
                            "give the template with ChatTemplate.jinja(source) or ChatTemplate(turn=...).")

        def token(k: str) -> str:
            v = cfg.get(k) or ""
            return str(v.get("content", "")) if isinstance(v, Mapping) else str(v)

        return ChatTemplate.jinja(tpl, bos_token=token("bos_token"), eos_token=token("eos_token"))

    def identity(self) -> dict[str, Any]:
        if self.source is None:
            return {"turn": self.turn, "start": self.start}
        return {"jinja_sha256": hashlib.sha256(self.source.encode()).hexdigest()[:16],
                "bos_token": self.bos_token, "eos_token": self.eos_token}

    def __getstate__(self) -> dict[str, Any]:  # the compiled jinja template stays in its process
        return {**self.__dict__, "_compiled": None, "_parts": {}}

    def __setstate__(self, d: dict[str, Any]) -> None:
        self.__dict__.update(d)

    def render(self, messages: Sequence[Mapping[str, str]], train: frozenset[str]) -> list[Piece]:
        """The conversation as (text, trained) pieces, adjacent ones with the same flag joined."""
        if self.source is not None:
            return _joined(self._jinja(messages))
        out: list[Piece] = []
        run, flag = [self.start], False  # the current run of text with one flag
        parts = self._parts  # type: ignore[attr-defined]
        for m in messages:
            role = m["role"]
            head, tail = parts.get(role) or self._role(role)
            on = role in train
            if head and flag:  # the header is never trained
                out.append(("".join(run), True))
                run, flag = [], False
            run.append(head)
            if on != flag and (m["content"] or tail):
                out.append(("".join(run), flag))
                run, flag = [], on
            run += (m["content"], tail)
        out.append(("".join(run), flag))
        return [p for p in out if p[0]]

    def _role(self, role: str) -> tuple[str, str]:
        """(header, tail) of a message of `role`: `turn` around `{content}`, the role filled in."""
        head, tail = self.turn.split("{content}")
        parts = (head.replace("{role}", role), tail.replace("{role}", role))
        self._parts[role] = parts  # type: ignore[attr-defined]
        return parts

    def _jinja(self, messages: Sequence[Mapping[str, str]]) -> list[Piece]:
        if self._compiled is None:  # type: ignore[attr-defined]
            try:
                from jinja2.exceptions import TemplateError
                from jinja2.sandbox import ImmutableSandboxedEnvironment
            except ImportError as e:  # pragma: no cover - the [lm] extra
                raise PlanError("a jinja chat template needs jinja2: pip install 'zephon-loader[lm]'") from e
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[
                _generation_extension(), "jinja2.ext.loopcontrols"])
            env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
            env.globals["raise_exception"] = _raise
            try:
                object.__setattr__(self, "_compiled", env.from_string(self.source or ""))
            except TemplateError as e:
                raise PlanError(f"the chat template does not compile: {e}") from None
        text = self._compiled.render(messages=list(messages), add_generation_prompt=False,  # type: ignore[attr-defined]
                                     bos_token=self.bos_token, eos_token=self.eos_token)
        marks = [c for c in text if c in (_OPEN, _CLOSE)]
        if marks != [_OPEN, _CLOSE] * (len(marks) // 2):
            raise PlanError("the chat template nests or leaves open a {% generation %} block; mark "
                            "each trained span once.")
        # markers alternate, opening first: odd parts are inside generation blocks
        return [(part, i % 2 == 1) for i, part in enumerate(re.split("[\ue000\ue001]", text))]


def _joined(pieces: Iterable[Piece]) -> list[Piece]:
    """Adjacent pieces with the same flag joined, empty ones dropped."""
    out: list[Piece] = []
    run: list[str] = []
    flag = False
    for text, on in pieces:
        if not text:
            continue
        if run and on != flag:
            out.append(("".join(run), flag))
            run = []
        run.append(text)
        flag = on
    if run:
        out.append(("".join(run), flag))
    return out


#: what `Chat` checks a template with when it is built: a trained role must get trained tokens
_PROBE = ({"role": "system", "content": "You are helpful."}, {"role": "user", "content": "Hi?"},
          {"role": "assistant", "content": "Hello."})


@dataclass(frozen=True, eq=False)
class Chat(Transform):
    """Renders column `field` (a list of `{"role", "content"}` messages) with `template`,
    tokenizes it, and writes the ids to `output` and the trained-token mask (uint8) to `mask`.

    Args:
      tokenizer: as `Tokenize` (a `tokenizers.Tokenizer`, a `tokenizer.json` path, or a callable
        `str -> ids` with `name=`/`version=`).
      template: a `ChatTemplate` (default: `<|role|>` headers and `<|end|>` after each message).
      train: the roles whose messages are trained (`ChatTemplate(turn=...)` templates; a jinja
        template marks its trained text itself).
      bos: an id put before every conversation (not trained); None: none.
      empty: a conversation with no trained token is an 'error' (naming the record) or 'drop'ped.
      cache: the pre-token cache size, as `Tokenize(cache=...)`.
    """

    tokenizer: Any
    template: ChatTemplate = dc_field(default_factory=ChatTemplate)
    train: tuple[str, ...] = ("assistant",)
    field: str = "messages"
    output: str = "tokens"
    mask: str = "loss_mask"
    bos: int | None = None
    empty: Literal["error", "drop"] = "error"
    cache: int = 1 << 17
    name: str | None = None
    version: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.template, ChatTemplate):
            raise PlanError(f"Chat.template must be a ChatTemplate, got {type(self.template).__name__}")
        if isinstance(self.train, str) or not self.train or not all(isinstance(r, str) for r in self.train):
            raise PlanError(f"Chat.train must be a non-empty tuple of role names, got {self.train!r}")
        object.__setattr__(self, "train", tuple(self.train))
        if self.template.source is not None and self.train != ("assistant",):
            raise PlanError("a jinja chat template marks its trained text itself ({% generation %} "
                            "blocks); train= applies to ChatTemplate(turn=...) templates.")
        if self.empty not in ("error", "drop"):
            raise PlanError(f"Chat.empty must be 'error' or 'drop', got {self.empty!r}")
        if len({self.field, self.output, self.mask}) != 3:
            raise PlanError("Chat's field, output and mask columns must have three different names")
        object.__setattr__(self, "_tok", Tokenize(self.tokenizer, output=self.output, cache=self.cache,
                                                  name=self.name))
        probe = list(_PROBE) + [{"role": r, "content": "Yes."} for r in self.train if r != "assistant"]
        if not any(on for _, on in self.template.render(probe, frozenset(self.train))):
            raise PlanError("the chat template marks no trained token in a conversation with "
                            f"{[m['role'] for m in probe]} turns: a jinja template needs "
                            "{% generation %}...{% endgeneration %} around the answers (as for "
                            "apply_chat_template's return_assistant_tokens_mask); training on all "
                            "tokens instead would train on the prompts.")

    @property
    def one_to_one(self) -> bool:  # type: ignore[override]
        return self.empty == "error"

    @property
    def op_name(self) -> str:
        return self.name or "Chat"

    def config(self) -> dict[str, Any]:
        return {"template": self.template.identity(), "train": list(self.train), "field": self.field,
                "output": self.output, "mask": self.mask, "bos": self.bos, "empty": self.empty,
                "tokenizer": self._tok.identity()}  # type: ignore[attr-defined]

    def _messages(self, conv: Any, refs: Refs, i: int) -> list[Mapping[str, str]]:
        def bad(why: str) -> DecodeError:
            return DecodeError(f"record {int(refs.record[i])} of source {int(refs.source[i])}: field "
                               f"{self.field!r} {why}; a conversation is a list of "
                               "{'role': str, 'content': str} messages.")

        if isinstance(conv, (str, bytes)):
            try:
                conv = json.loads(conv)
            except ValueError:
                raise bad("is text that is not JSON") from None
        if not isinstance(conv, (list, tuple, np.ndarray)):
            raise bad(f"is {type(conv).__name__}")
        for m in conv:
            try:
                ok = type(m["role"]) is str and type(m["content"]) is str
            except (TypeError, KeyError, IndexError):
                ok = False
            if not ok and not (isinstance(m, Mapping) and isinstance(m.get("role"), str)
                               and isinstance(m.get("content"), str)):
                raise bad(f"holds {m!r}")
            if self.template.source is not None and (_OPEN in m["content"] or _CLOSE in m["content"]):
                raise bad("holds the private-use characters U+E000/U+E001 that mark trained text")
        return list(conv)

    def _encode(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """(ids, lengths): every piece's ids, concatenated, and each piece's count of ids; each
        piece encoded on its own (one regex pass over the window where the pre-token cache serves
        the tokenizer: `zephon.ops.pretoken_join`)."""
        cache = self._tok._pretokens()  # type: ignore[attr-defined]
        if cache is not None:
            return encode_joined(cache, texts)
        ids = self._tok.encode(texts) if texts else []  # type: ignore[attr-defined]
        lens = np.fromiter((len(x) for x in ids), np.int64, len(ids))
        return (np.concatenate(ids).astype(np.int32, copy=False) if ids else np.zeros(0, np.int32)), lens

    def apply(self, cols: Columns, refs: Refs, seed: int) -> tuple[Columns, np.ndarray | None]:
        if self.field not in cols:
            raise PlanError(f"Chat reads conversations from column {self.field!r}, but the rows have "
                            f"{sorted(cols)}; set Chat(field=...).")
        train = frozenset(self.train)
        texts: list[str] = []
        flags: list[bool] = []
        per: list[int] = []
        render = self.template.render
        for i, conv in enumerate(cols[self.field]):
            pieces = render(self._messages(conv, refs, i), train)
            texts += [t for t, _ in pieces]
            flags += [on for _, on in pieces]
            per.append(len(pieces))
        flat, lens = self._encode(texts)
        flat_mask = np.repeat(np.asarray(flags, np.uint8), lens)
        # token offsets where each conversation ends (no pieces: where the last one ended)
        ends = np.concatenate([[0], np.cumsum(lens)])[np.cumsum(per, dtype=np.int64)]
        toks = np.split(flat, ends[:-1]) if per else []
        masks = np.split(flat_mask, ends[:-1]) if per else []
        if self.bos is not None:
            toks = [np.concatenate([np.array([self.bos], np.int32), t]) for t in toks]
            masks = [np.concatenate([np.zeros(1, np.uint8), m]) for m in masks]
            trained = np.fromiter((int(m[1:].sum()) for m in masks), np.int64, len(masks))
        else:  # trained tokens after each conversation's first
            cum = np.concatenate([[0], np.cumsum(flat_mask, dtype=np.int64)])
            starts = np.concatenate([[0], ends[:-1]])
            trained = cum[ends] - cum[np.minimum(starts + 1, ends)]
        rest = {k: v for k, v in cols.items() if k != self.field}
        out = {**rest, self.output: objects(toks), self.mask: objects(masks)}
        if not trained.all():
            if self.empty == "drop":
                keep = trained > 0
                return {k: v[keep] for k, v in out.items()}, keep
            i = int(np.flatnonzero(trained == 0)[0])
            raise DecodeError(f"record {int(refs.record[i])} of source {int(refs.source[i])}: the "
                              f"conversation has no trained token (roles {list(self.train)} give "
                              "none after the first token); fix or filter it, or Chat(empty='drop').")
        return out, None
