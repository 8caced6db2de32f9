"""How the `zephon` program treats a mistake in how it was called: one line, exit 2."""

from __future__ import annotations

import argparse


class UsageError(Exception):
    """A mistake in how the command was called: one line on stderr, exit 2."""


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors point at `--help` (every zephon command uses it)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

