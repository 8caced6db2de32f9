"""The report of a configuration matrix: per configuration its result against the reference
(`RunResult`), per pipeline the table, the summary line and the JSON document (`Report`), and a
PNG heat map of configurations x steps (`write_heatmap`). What `zephon verify` and
`zephon.testing` print and write."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from zephon.fingerprints import Divergence


@dataclass
class RunResult:
    """One configuration's outcome against the reference."""

    name: str
    status: str                      # "identical" | "differs" | "error" | "n/a"
    steps: int = 0
    fingerprints: list[str] | None = None
    matches: list[bool] | None = None
    divergence: Divergence | None = None
    note: str = ""
    seconds: float = 0.0
    detail: str = ""                 # e.g. where an error was raised (JSON report only)

    @property
    def ok(self) -> bool:
        return self.status in ("identical", "n/a")

    def verdict(self) -> str:
        if self.status == "identical":
            return "identical" + (f" ({self.note})" if self.note else "")
        if self.status == "n/a":
            return f"n/a: {self.note}"
        if self.status == "error":
            first = self.note.splitlines()[0] if self.note else ""
            return f"ERROR: {first[:300]}{'...' if len(first) > 300 else ''}"
        d = self.divergence
        return f"DIFFERS at {d.where()}" if d else "DIFFERS"

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "status": self.status, "steps": self.steps,
                "seconds": round(self.seconds, 2), "note": self.note, "detail": self.detail,
                "last_fingerprint": self.fingerprints[-1] if self.fingerprints else None,
                "fingerprints": self.fingerprints,
                "matches": self.matches,
                "divergence": None if self.divergence is None else self.divergence.to_json()}


@dataclass
class Report:
    """The matrix of one pipeline: the reference run and every configuration's result."""

    pipeline: str
    steps: int
    results: list[RunResult]
    plan_fingerprint: str = ""
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.results)

    def summary(self) -> str:
        """`N configurations, M steps, all identical`, or what differs first."""
        ran = [r for r in self.results if r.status != "n/a"]
        na = len(self.results) - len(ran)
        tail = f" ({na} not applicable)" if na else ""
        head = f"{self.pipeline}: {len(ran)} configurations, {self.steps} steps"
        bad = [r for r in ran if not r.ok]
        if not bad:
            return f"{head}, all identical{tail}"
        differ = sum(r.status == "differs" for r in bad)
        errors = len(bad) - differ
        counts = ", ".join(x for x in (f"{differ} differ{'s' if differ == 1 else ''}" if differ else "",
                                       f"{errors} failed" if errors else "") if x)
        first = bad[0]
        what = (f"at {first.divergence.where()}" if first.divergence else
                f"with {first.note.splitlines()[0][:160]}" if first.note else "")
        return f"{head}: {counts} — first: {first.name!r} {what}{tail}"

    def table(self) -> str:
        width = max([len(r.name) for r in self.results] + [13])
        lines = [f"{'configuration':<{width}}  {'steps':>5}  {'last fingerprint':<16}  {'time':>6}  result"]
        for r in self.results:
            fp = (r.fingerprints[-1][:16] if r.fingerprints else "-")
            lines.append(f"{r.name:<{width}}  {r.steps:>5}  {fp:<16}  {r.seconds:>5.1f}s  {r.verdict()}")
            if r.divergence is not None:
                lines += ["      " + l for l in str(r.divergence).splitlines()]
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        import zephon

        return {"zephon_verify": 1, "zephon_version": zephon.__version__, "pipeline": self.pipeline,
                "plan_fingerprint": self.plan_fingerprint, "steps": self.steps,
                "seconds": round(self.seconds, 1), "ok": self.ok, "summary": self.summary(),
                "configurations": [r.to_json() for r in self.results]}


def write_heatmap(reports: Sequence[Report], path: str) -> None:
    """A PNG: one row per configuration, one block of columns (its steps) per pipeline; green
    where a step is identical to the reference, red where it differs, orange for a configuration
    that failed, grey where it does not apply, white past the last step of a configuration that
    runs fewer steps (the cross-product's)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap

    names: list[str] = []
    for rep in reports:
        names += [r.name for r in rep.results if r.name not in names]
    gap = 2
    widths = [max(rep.steps, 1) for rep in reports]
    grid = np.full((max(len(names), 1), sum(widths) + gap * (len(reports) - 1)), 4, np.int8)  # white
    col = 0
    for rep, w in zip(reports, widths):
        for res in rep.results:
            i = names.index(res.name)
            line = np.full(w, {"n/a": 3, "error": 2}.get(res.status, 4), np.int8)  # white past its steps
            if res.matches:
                line[:len(res.matches)] = np.where(res.matches, 0, 1)
            grid[i, col:col + w] = line
        col += w + gap
    fig_w = min(18.0, max(8.0, 3.5 + 0.05 * grid.shape[1]))
    fig, ax = plt.subplots(figsize=(fig_w, 1.4 + 0.2 * len(names)))
    ax.imshow(grid, aspect="auto", interpolation="nearest", vmin=0, vmax=4,
              cmap=ListedColormap(["#3a9d4a", "#d62728", "#ff9f1c", "#c8c8c8", "#ffffff"]))
    ax.set_yticks(range(len(names)))
    ax.set_yticklabels(names, fontsize=7)
    starts = np.cumsum([0] + [w + gap for w in widths[:-1]])
    ax.set_xticks([a + w / 2 - 0.5 for a, w in zip(starts, widths)])
    ax.set_xticklabels([f"{rep.pipeline}\n(steps 0..{rep.steps - 1})" for rep in reports], fontsize=8)
    ok = all(r.ok for r in reports)
    ax.set_title("zephon verify vs the reference (numpy, D=1): " + ("all identical" if ok else
                 "red = step differs, orange = failed") + ("; grey = n/a" if (grid == 3).any() else ""),
                 fontsize=9, loc="left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
