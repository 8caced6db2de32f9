"""Chat conversations generated in-process, for fine-tuning examples, tests and benchmarks.

There is no network or dataset hub here, so `generate_chats` makes `{"messages": [...]}`
conversations with realistic shape: an optional system prompt, one to three user/assistant
exchanges, questions whose answers are checkable (arithmetic, counting, spelling) and answers
whose lengths vary from a few tokens to a few hundred (so packing must split some). The same
`(n, seed)` gives the same conversations on every machine.
"""

from __future__ import annotations

import numpy as np

Message = dict[str, str]

_SYSTEM = ("You are a helpful assistant.", "Answer briefly and exactly.",
           "You are a careful math tutor. Show the result.")
_WORDS = ("river", "lantern", "orbit", "meadow", "quartz", "harbor", "violet", "signal", "pepper",
          "glacier", "compass", "thunder", "saddle", "ember", "falcon", "marble")


#: the kinds of question: short answers (arithmetic, spelling) and long ones (counting)
KINDS = ("add", "multiply", "spell", "count")


def _exchange(rng: np.random.Generator, kinds: tuple[int, ...]) -> tuple[str, str]:
    kind = kinds[int(rng.integers(0, len(kinds)))]
    if kind == 0:
        a, b = (int(x) for x in rng.integers(0, 1000, 2))
        return f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}."
    if kind == 1:
        a, b = (int(x) for x in rng.integers(2, 60, 2))
        return f"Multiply {a} by {b}.", f"{a} times {b} equals {a * b}."
    if kind == 2:
        w = _WORDS[int(rng.integers(0, len(_WORDS)))]
        return f"Spell the word {w!r} letter by letter.", " ".join(w.upper()) + "."
    start = int(rng.integers(0, 50))
    stop = start + int(rng.integers(3, 120))  # long answers: packing splits some of them
    return (f"Count from {start} to {stop}, separated by commas.",
            ", ".join(str(i) for i in range(start, stop + 1)) + ".")


def generate_chats(n: int, seed: int = 0, kinds: tuple[str, ...] = KINDS) -> list[dict[str, list[Message]]]:
    """`n` conversations `{"messages": [{"role", "content"}, ...]}`, deterministic in `seed`;
    `kinds` (of `KINDS`) picks the questions asked, e.g. two domains with short and long answers."""
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown or not kinds:
        raise ValueError(f"kinds must be a non-empty subset of {KINDS}, got {kinds!r}")
    ids = tuple(KINDS.index(k) for k in kinds)
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        msgs: list[Message] = []
        if rng.random() < 0.5:
            msgs.append({"role": "system", "content": _SYSTEM[int(rng.integers(0, len(_SYSTEM)))]})
        for _ in range(int(rng.integers(1, 4))):
            q, a = _exchange(rng, ids)
            msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        out.append({"messages": msgs})
    return out


def chat_texts(chats: list[dict[str, list[Message]]]) -> list[str]:
    """Every message's text, e.g. to train a tokenizer on (`zephon.demo.textdata.train_bpe`)."""
    return [m["content"] for c in chats for m in c["messages"]]


__all__ = ["KINDS", "chat_texts", "generate_chats"]
