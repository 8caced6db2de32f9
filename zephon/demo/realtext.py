"""Real text that every machine running Zephon has, for benchmarks and exactness tests.

Generated prose flatters a tokenizer cache (few distinct words, all ASCII). Real text is what
users tokenize, and the only real text a machine without network is sure to have is what its
software ships:

- English: the Python standard library's own sources (`zephon.demo.corpus.python_stdlib_corpus`):
  code, docstrings and comments.
- Non-English: the human translations the system ships as gettext catalogs
  (`/usr/share/locale/<lang>/LC_MESSAGES/*.mo`: every message of coreutils, apt, glib, …
  in dozens of languages and scripts), then the non-ASCII test data of the standard library
  (`test/cjkencodings`: Chinese, Japanese, Korean prose; every line of its files with non-ASCII
  characters). A machine without catalogs still gets the standard library's part.

Both are deterministic for a given machine image (sorted paths), not across images: use them for
realism and for comparing with the tokenizer itself, never for fixed expected values.
"""

from __future__ import annotations

import gettext
import logging
import os
import sysconfig
from pathlib import Path

from .corpus import python_stdlib_corpus

log = logging.getLogger(__name__)

LOCALE_DIR = Path("/usr/share/locale")
#: Locales whose catalogs are (mostly) English, skipped for the non-English corpus.
_ENGLISH = ("en", "en_GB", "en_AU", "en_CA", "en@quot", "en@boldquot", "en@shaw", "en@arabic",
            "en@cyrillic", "en@greek", "en@hebrew", "en_NZ", "en_US", "en_ZA")


def english(max_chars: int | None = None) -> list[str]:
    """The standard library's `.py` files (one document each), up to `max_chars` characters."""
    return _cap(python_stdlib_corpus(), max_chars)


def _cap(docs: list[str], max_chars: int | None) -> list[str]:
    if max_chars is None:
        return docs
    out, total = [], 0
    for d in docs:
        if total >= max_chars:
            break
        out.append(d)
        total += len(d)
    return out


def _catalog_docs(doc_chars: int, max_chars: int | None) -> list[list[str]]:
    """Per non-English language, its catalogs' translations in documents of ~`doc_chars` chars
    (about `max_chars` in all: each language gets its share)."""
    out: list[list[str]] = []
    if not LOCALE_DIR.is_dir():
        return out
    langs = [lang for lang in sorted(os.listdir(LOCALE_DIR))
             if lang not in _ENGLISH and (LOCALE_DIR / lang / "LC_MESSAGES").is_dir()]
    share = None if max_chars is None else max_chars // max(len(langs), 1) + doc_chars
    for lang in langs:
        docs: list[str] = []
        out.append(docs)
        for mo in sorted((LOCALE_DIR / lang / "LC_MESSAGES").glob("*.mo")):
            if share is not None and len(docs) * doc_chars >= share:
                break
            try:
                with open(mo, "rb") as f:
                    catalog = gettext.GNUTranslations(f)._catalog  # type: ignore[attr-defined]
            except (OSError, LookupError, UnicodeError, ValueError, SyntaxError) as e:
                log.debug("realtext: skipping %s (%s)", mo, e)
                continue
            texts = [v for k, v in catalog.items() if k and isinstance(v, str) and not v.isascii()]
            doc: list[str] = []
            size = 0
            for t in texts:
                doc.append(t)
                size += len(t) + 1
                if size >= doc_chars:
                    docs.append("\n".join(doc))
                    doc, size = [], 0
            if doc:
                docs.append("\n".join(doc))
    return out


def _stdlib_non_ascii() -> list[str]:
    """The standard library's CJK test prose and its files' non-ASCII lines, one doc per file."""
    root = Path(sysconfig.get_paths()["stdlib"])
    docs: list[str] = []
    for p in sorted(root.rglob("*")):
        if "site-packages" in p.parts or not p.is_file() or p.suffix not in (".py", ".txt", ".xml", ""):
            continue
        try:
            text = p.read_bytes().decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        lines = [line for line in text.splitlines() if not line.isascii()]
        if lines:
            docs.append("\n".join(lines))
    return docs


def non_english(max_chars: int | None = None, doc_chars: int = 4000) -> list[str]:
    """Translations in many scripts (see the module), up to `max_chars` characters.

    Documents are taken round-robin over languages, so that any prefix mixes scripts.
    """
    langs = [_stdlib_non_ascii(), *_catalog_docs(doc_chars, max_chars)]
    docs = [d for i in range(max(map(len, langs))) for lang in langs if i < len(lang) for d in [lang[i]]]
    log.debug("realtext.non_english: %d documents in %d groups", len(docs), len(langs))
    return _cap(docs, max_chars)
