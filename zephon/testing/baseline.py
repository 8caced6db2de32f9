"""Comparing a run of the matrix with a saved one (`zephon verify --baseline PATH.json`): every
configuration of this run whose pipeline and name are in the saved report must give, step by
step, the fingerprints it gave then. The reference comparison proves the configurations agree
with each other today; the baseline proves they still load what they loaded before a change
(a refactor that changed every configuration alike would pass the first and fail this one)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from zephon.errors import ZephonError
from zephon.testing.report import Report


class BaselineError(ZephonError, ValueError):
    """The baseline file cannot be read as a `zephon verify --report` JSON document."""


@dataclass(frozen=True)
class Mismatch:
    """A configuration whose fingerprints differ from the baseline's, from `step` on."""

    pipeline: str
    config: str
    step: int
    got: str | None          # this run's fingerprint at `step` (None: this run ended before it)
    saved: str | None        # the baseline's (None: the baseline ended before it)

    def __str__(self) -> str:
        if self.got is None or self.saved is None:
            who = "this run" if self.got is None else "the baseline"
            return (f"{self.pipeline}: {self.config!r} differs from the baseline at step {self.step}: "
                    f"{who} ended there")
        return (f"{self.pipeline}: {self.config!r} differs from the baseline at step {self.step}: "
                f"fingerprint {self.got[:16]}, the baseline's {self.saved[:16]}")


@dataclass
class BaselineResult:
    """What the comparison found."""

    path: str
    configurations: int = 0          # compared (in both, with fingerprints)
    steps: int = 0                   # steps compared, summed over them
    mismatches: list[Mismatch] = field(default_factory=list)
    new: int = 0                     # configurations of this run the baseline does not have
    missing: int = 0                 # configurations of the baseline this run did not run

    @property
    def ok(self) -> bool:
        return not self.mismatches

    def summary(self) -> str:
        head = (f"baseline {self.path}: {self.configurations} configurations, {self.steps} steps "
                "compared with it")
        tail = ", ".join(x for x in (f"{self.new} configurations of this run not in it" if self.new else "",
                                     f"{self.missing} of its configurations not run" if self.missing else "")
                         if x)
        tail = f" ({tail})" if tail else ""
        if self.ok:
            return f"{head}: all equal{tail}"
        return (f"{head}: {len(self.mismatches)} differ{'s' if len(self.mismatches) == 1 else ''} — "
                f"first: {self.mismatches[0]}{tail}")


def load_baseline(path: str) -> dict[str, dict[str, Any]]:
    """{pipeline: {"steps": N, "configurations": {name: fingerprints}}} from a report written by
    `zephon verify --report PATH` (PATH.json)."""
    p = Path(path)
    if not p.is_file():
        raise BaselineError(f"--baseline {path}: no such file; give the PATH.json that "
                            "`zephon verify --report PATH` wrote")
    try:
        doc = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BaselineError(f"--baseline {path} is not JSON ({e}); give the PATH.json that "
                            "`zephon verify --report PATH` wrote") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("pipelines"), list):
        raise BaselineError(f"--baseline {path} is not a `zephon verify --report` document (no "
                            "'pipelines' list); give the PATH.json it wrote")
    out: dict[str, dict[str, Any]] = {}
    for rep in doc["pipelines"]:
        try:
            confs = {c["name"]: c.get("fingerprints") for c in rep["configurations"]}
            out[str(rep["pipeline"])] = {"steps": int(rep.get("steps", 0)), "configurations": confs,
                                         "requested": doc.get("steps")}
        except (KeyError, TypeError, ValueError) as e:
            raise BaselineError(f"--baseline {path}: a pipeline's entry lacks {e}; give the PATH.json "
                                "that `zephon verify --report PATH` wrote") from None
    return out


def compare_baseline(reports: Sequence[Report], saved: Mapping[str, Mapping[str, Any]], path: str,
                     requested: int | None = None) -> BaselineResult:
    """Every configuration of `reports` that ran and is in `saved` (same pipeline, same name)
    compared step by step over the steps both ran (a run with fewer `--steps` compares its
    steps). A finite pipeline whose reference now ends at another step, in a run that asked both
    for more steps than either ran, differs too."""
    res = BaselineResult(path)
    for rep in reports:
        base = saved.get(rep.pipeline)
        confs: Mapping[str, Any] = base["configurations"] if base else {}
        ran = set()
        for r in rep.results:
            ran.add(r.name)
            old = confs.get(r.name)
            if not r.fingerprints or not old:
                res.new += r.name not in confs and bool(r.fingerprints)
                continue
            n = min(len(old), len(r.fingerprints))
            res.configurations += 1
            res.steps += n
            bad = next((s for s in range(n) if old[s] != r.fingerprints[s]), None)
            if bad is not None:
                res.mismatches.append(Mismatch(rep.pipeline, r.name, bad, r.fingerprints[bad], old[bad]))
            elif (r.name.endswith("(reference)") and len(old) != len(r.fingerprints) and base is not None
                  and requested and base.get("requested") and min(requested, base["requested"]) > n):
                longer = len(old) > len(r.fingerprints)
                res.mismatches.append(Mismatch(rep.pipeline, r.name, n, None if longer else r.fingerprints[n],
                                               old[n] if longer else None))
        res.missing += sum(1 for k, v in confs.items() if k not in ran and v)
    return res
