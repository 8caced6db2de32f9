"""Soak: several epochs of the packed LM pipeline under worker kills and elastic stop/resume.

`make soak` (a few minutes) or `python benchmarks/soak.py [--epochs 6] [--seed 0]`.

The pipeline: two generated JSONL corpora (prose and code) mixed by tokens 0.7/0.3 inside each
of 8 lanes, tokenized per source with an in-process BPE, packed concat-then-split into rows of
256 tokens, global batch 16, every rank on `zephon.runners.processes(2)`.

1. **Reference.** One uninterrupted loader (D=1, inline runner) runs until every lane of both
   sources has finished `--epochs` epochs; its step fingerprints are the reference stream.
2. **Chaos.** The same number of steps, but at random steps the job (D `Loader`s with rank/world,
   D in {1, 2, 4}) saves a merged checkpoint (`merge_states` + `save_state`), and sometimes stops
   and resumes from it at another D (`load_state` + `restore`); at other random moments a timer
   SIGKILLs one worker process of one rank: the loader must raise `WorkerError`, and the job
   resumes from the last saved checkpoint with new runners (at a random D), recomputing the
   steps since. Every step's fingerprint (`zephon.fingerprints`) must equal the reference's, also for
   recomputed steps.
3. **Exact tokens.** Every packed row is checked against the documents it names
   (`LocalBatch.segments`: source, record, epoch, start, stop): its tokens are exactly those
   document tokens, rows are full (concat packs no padding), no token of any (source, record,
   epoch) appears twice, every document's pieces form a prefix of it, and in every epoch that all
   lanes finished every document of the corpus appears whole, exactly once.
4. **Resources.** A thread samples, every 0.25 s: RSS of the consumer and of the workers, open
   file descriptors, memfd descriptors and mappings, `/dev/shm` entries, live worker processes.
   After the run every worker ever started must be gone and nothing left in `/dev/shm`.

Writes benchmarks/results/soak.json and soak.png (RSS and FDs over time, kills and resumes
marked). Exits 1 if any check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict

import numpy as np
import psutil
from tqdm import tqdm

import zephon
from zephon import How, Loader, Mix, Pipeline, Source, Where, WorkerError, load_state, merge_states, save_state
from zephon.demo.textdata import EOS_ID, generate_corpus, train_bpe, write_jsonl
from zephon.fingerprints import first_mismatch, lane_digests, step_fingerprint
from zephon.ops.pack import Pack
from zephon.ops.tokenize import Tokenize
from zephon.runners import processes
from zephon.sources import JsonlSource

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results")

LANES, BATCH, SEQ = 8, 16, 256
WEIGHTS = (0.7, 0.3)
DEGREES = (1, 2, 4)
SAVE_EVERY = (10, 50)   # steps between merged checkpoints; 60% of those taken while no kill is pending
                        # also stop and resume at another D
KILL_EVERY = (20, 80)   # steps between worker SIGKILLs (counted from the last resume)


# ---------------------------------------------------------------- data and pipeline

class Job:
    """Corpora on disk, the tokenizer, the plan and a loader factory."""

    def __init__(self, tmp: str, prose_docs: int, code_docs: int) -> None:
        prose = generate_corpus(prose_docs, seed=11)
        code = generate_corpus(code_docs, seed=12, style="code")
        self.paths = [os.path.join(tmp, "prose.jsonl"), os.path.join(tmp, "code.jsonl")]
        write_jsonl(self.paths[0], prose)
        write_jsonl(self.paths[1], code, field="body")
        tok = train_bpe(prose[: prose_docs // 2] + code[: code_docs // 2], vocab_size=2000)
        self.tokenizer = os.path.join(tmp, "tokenizer.json")
        tok.save(self.tokenizer)
        # what every document must come back as: its ids and EOS
        self.docs = [[np.array(e.ids + [EOS_ID], np.int32)
                      for e in tok.encode_batch(texts, add_special_tokens=False)]
                     for texts in (prose, code)]
        self.sizes = [len(prose), len(code)]
        self.plan = Mix([Source(len(prose), id=0, name="prose").shuffle(1).repeat(),
                         Source(len(code), id=1, name="code").shuffle(2).repeat()],
                        list(WEIGHTS), by="tokens").lanes(LANES).batch(BATCH)

    def loader(self, rank: int = 0, world: int = 1, runner=None) -> Loader:
        return Loader(Pipeline(self.plan, [JsonlSource(self.paths[0]), JsonlSource(self.paths[1])],
                               [Pack(SEQ, "concat")],
                               per_source={0: [Tokenize(self.tokenizer, eos=EOS_ID)],
                                           1: [Tokenize(self.tokenizer, field="body", eos=EOS_ID)]}),
                      Where(rank=rank, world=world), How(runner=runner))

    def complete_epochs(self, state: dict) -> list[int]:
        """Per source, the epochs every lane has emitted entirely: lane l's inputs of source s
        before index `first_open` (its cursor, or the first input its packer still holds) are
        done, i.e. stream positions < first_open·L + l."""
        out = []
        for s, n in enumerate(self.sizes):
            done = []
            for lane, st in state["lanes"].items():
                first_open = min([h[1] for h in st.get("held", []) if h[0] == s] + [st["cursor"][s]])
                done.append((first_open * LANES + int(lane)) // n)
            out.append(min(done))
        return out


# ---------------------------------------------------------------- resource sampling

def _memfd_fds(pid: int | str = "self") -> int:
    n = 0
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                n += os.readlink(f"/proc/{pid}/fd/{fd}").startswith("/memfd:")
            except OSError:
                pass
    except OSError:
        pass
    return n


def _mappings(pid: int | str = "self") -> tuple[int, int]:
    """(memfd mappings, /dev/shm mappings) in a process's address space."""
    try:
        with open(f"/proc/{pid}/maps") as f:
            text = f.read()
    except OSError:
        return 0, 0
    return text.count("/memfd:"), text.count("/dev/shm/")


def _fd_targets() -> dict[str, str]:
    out = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            out[fd] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            pass
    return out


def _shm_names(pid: int | str = "self") -> set[str]:
    """Names under /dev/shm that a process maps."""
    try:
        with open(f"/proc/{pid}/maps") as f:
            return {line.split("/dev/shm/", 1)[1].split()[0] for line in f if "/dev/shm/" in line}
    except OSError:
        return set()


class Sampler(threading.Thread):
    def __init__(self, interval: float = 0.5) -> None:
        super().__init__(daemon=True, name="soak-sampler")
        self.interval = interval
        self.t0 = time.monotonic()
        self.samples: list[dict] = []
        self.events: list[dict] = []
        self.phase = "setup"
        self.step = 0
        self.worker_pids = list  # the live loaders' workers (set by the chaos run)
        self._halt = threading.Event()
        self.me = psutil.Process()
        self.shm_prefix = f"zephon-{os.getpid()}-"
        self.shm_mapped: set[str] = set()  # /dev/shm names any of our processes ever mapped

    def now(self) -> float:
        return round(time.monotonic() - self.t0, 3)

    def event(self, kind: str, **kw) -> None:
        self.events.append({"t": self.now(), "kind": kind, "step": self.step, **kw})

    def sample(self) -> dict:
        rss_children, worker_maps = 0, 0
        children = self.me.children(recursive=True)  # forkserver and every worker, leaked or not
        for c in children:
            try:
                rss_children += c.memory_info().rss
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                pass
        alive = 0
        for pid in self.worker_pids():
            if _alive(pid):
                alive += 1
                worker_maps += _mappings(pid)[0]
        memfd_maps, shm_maps = _mappings()
        for pid in ["self"] + [c.pid for c in children]:
            self.shm_mapped |= _shm_names(pid)
        try:
            shm = os.listdir("/dev/shm")
        except OSError:
            shm = []
        s = {"t": self.now(), "phase": self.phase, "step": self.step,
             "rss_mb": round(self.me.memory_info().rss / 2**20, 2),
             "children_rss_mb": round(rss_children / 2**20, 2),
             "fds": len(os.listdir("/proc/self/fd")),
             "memfd_fds": _memfd_fds(),
             "memfd_maps": memfd_maps, "worker_memfd_maps": worker_maps, "shm_maps": shm_maps,
             "dev_shm_ours": sum(n.startswith(self.shm_prefix) for n in shm),
             "dev_shm_all": len(shm),
             "workers_alive": alive,
             "children": len(children)}
        self.samples.append(s)
        return s

    def run(self) -> None:
        while not self._halt.wait(self.interval):
            try:
                self.sample()
            except Exception as e:
                self.events.append({"t": self.now(), "kind": "sampler-error", "error": repr(e)})

    def stop(self) -> None:
        self._halt.set()
        self.join()


# ---------------------------------------------------------------- token accounting

class Tokens:
    """Per step, the pieces its rows hold; checks each row against the documents."""

    def __init__(self, job: Job) -> None:
        self.job = job
        self.by_step: dict[int, list[tuple[int, int, int, int, int]]] = {}
        self.rows_checked = 0
        self.recomputed_steps = 0

    def record(self, step: int, batches: list) -> None:
        pieces = []
        for b in batches:
            tokens = b.data["tokens"]
            for j, row in enumerate(b.segments):
                at = 0
                for s, r, e, a, z in row:
                    want = self.job.docs[s][r][a:z]
                    if z - a != len(want) or not np.array_equal(tokens[j, at:at + z - a], want):
                        raise AssertionError(f"step {step} row {j}: tokens of source {s} record {r} "
                                             f"[{a}, {z}) differ from the document")
                    at += z - a
                    pieces.append((s, r, e, a, z))
                if at != SEQ:
                    raise AssertionError(f"step {step} row {j}: {at} tokens, expected a full row of {SEQ}")
                self.rows_checked += 1
        old = self.by_step.get(step)
        if old is not None:
            self.recomputed_steps += 1
            if old != pieces:
                raise AssertionError(f"step {step} recomputed after a resume holds other pieces")
        self.by_step[step] = pieces

    def check(self, complete: list[int]) -> dict:
        docs = defaultdict(list)
        for step in sorted(self.by_step):
            for s, r, e, a, z in self.by_step[step]:
                docs[(s, r, e)].append((a, z))
        problems: list[str] = []
        for (s, r, e), parts in docs.items():
            parts.sort()
            n = len(self.job.docs[s][r])
            at = 0
            for a, z in parts:
                if a != at:
                    problems.append(f"source {s} record {r} epoch {e}: piece [{a}, {z}) after {at} "
                                    f"({'overlap: a token twice' if a < at else 'gap'})")
                    break
                at = z
            if at > n:
                problems.append(f"source {s} record {r} epoch {e}: {at} tokens of {n}")
        per_epoch = []
        for s, n_docs in enumerate(self.job.sizes):
            total = sum(len(d) for d in self.job.docs[s])
            for e in range(complete[s]):
                whole = sum(1 for r in range(n_docs)
                            if sum(z - a for a, z in docs.get((s, r, e), [])) == len(self.job.docs[s][r]))
                got = sum(z - a for r in range(n_docs) for a, z in docs.get((s, r, e), []))
                per_epoch.append({"source": s, "epoch": e, "documents": n_docs,
                                  "documents_whole": whole, "tokens_expected": total,
                                  "tokens_seen": got, "exact": whole == n_docs and got == total})
                if not per_epoch[-1]["exact"]:
                    problems.append(f"source {s} epoch {e}: {whole}/{n_docs} documents whole, "
                                    f"{got}/{total} tokens")
        return {"pieces": sum(len(p) for p in self.by_step.values()), "documents_seen": len(docs),
                "rows_checked": self.rows_checked, "recomputed_steps": self.recomputed_steps,
                "complete_epochs": complete, "epochs": per_epoch,
                "problems": problems[:20], "n_problems": len(problems)}


# ---------------------------------------------------------------- the runs

def fingerprint(batches) -> str:
    digests = {}
    for b in batches:
        digests.update(lane_digests(b))
    return step_fingerprint(digests)


def reference(job: Job, epochs: int, margin: int, sampler: Sampler) -> tuple[list[str], Tokens, int]:
    """Fingerprints of the uninterrupted stream: up to the step where every lane finished
    `epochs` epochs of both sources (`steps`), then `margin` more (where a kill fired near the
    end may still surface)."""
    sampler.phase = "reference"
    loader = job.loader()
    fps: list[str] = []
    tokens = Tokens(job)
    steps = None
    bar = tqdm(desc=f"reference (D=1, inline) to {epochs} epochs", unit="step", mininterval=1.0)
    while steps is None or len(fps) < steps + margin:
        b = next(loader)
        tokens.record(len(fps), [b])
        fps.append(fingerprint([b]))
        sampler.step = len(fps)
        bar.update()
        if steps is None and len(fps) % 10 == 0:
            state = loader.state()
            done = job.complete_epochs(state)
            bar.set_postfix(epochs=done)
            if min(done) >= epochs:
                steps = len(fps)
                tokens.final_state = state
    bar.close()
    loader.close()
    return fps, tokens, steps


class Chaos:
    def __init__(self, job: Job, ref: list[str], steps: int, sampler: Sampler, rng: random.Random,
                 ckpt: str) -> None:
        self.job, self.ref, self.steps, self.sampler, self.rng, self.ckpt = job, ref, steps, sampler, rng, ckpt
        self.tokens = Tokens(job)
        self.fps: dict[int, str] = {}
        self.mismatches: list[dict] = []
        self.loaders: list[Loader] = []
        self.degree = 1
        self.all_workers: set[int] = set()
        self.shm_seen: set[str] = set()
        self.stats = {"kills": 0, "worker_errors": 0, "resumes_after_kill": 0, "elastic_resumes": 0,
                      "checkpoints": 0, "steps_run": 0, "steps_recomputed": 0, "steps_past_end": 0,
                      "kill_to_error_s": [], "kill_to_error_steps": [], "degrees": [],
                      "undetected_kills": 0, "restore_s": [], "first_batch_s": []}

    # --- loaders ---------------------------------------------------------------------------
    def open(self, degree: int, state: dict | None) -> None:
        t = time.monotonic()
        self.loaders = [self.job.loader(r, degree, processes(2)) for r in range(degree)]
        if state is not None:
            for l in self.loaders:
                l.restore(state)
        self.degree = degree
        self.opened = time.monotonic()
        self.stats["degrees"].append(degree)
        self.stats["restore_s"].append(round(self.opened - t, 4))

    def close(self) -> None:
        for l in self.loaders:
            l.close()
        self.loaders = []

    def refresh_workers(self) -> None:
        self.all_workers.update(p for l in self.loaders for p in l.runner.pids)

    def worker_pids(self) -> list[int]:
        """The live loaders' workers (read by the sampler thread, also while a step computes)."""
        try:
            pids = [p for l in list(self.loaders) for p in l.runner.pids]
        except Exception:
            return []
        self.all_workers.update(pids)
        return pids

    def checkpoint(self, step: int) -> None:
        merged = merge_states([l.state() for l in self.loaders])
        assert merged["step"] == step, (merged["step"], step)
        save_state(self.ckpt, merged)
        self.saved_step = step
        self.stats["checkpoints"] += 1
        self.sampler.event("checkpoint", degree=self.degree)

    def resume(self, why: str) -> int:
        state = load_state(self.ckpt)
        degree = self.rng.choice([d for d in DEGREES if d != self.degree] if why == "elastic" else DEGREES)
        self.close()
        self.open(degree, state)
        self.sampler.event(f"resume-{why}", degree=degree, at=state["step"])
        return state["step"]

    # --- kills -------------------------------------------------------------------------------
    def arm_kill(self) -> dict:
        """A timer that SIGKILLs one random worker of one random rank a moment from now."""
        shot: dict = {}
        rank = self.rng.randrange(self.degree)
        which = self.rng.randrange(2)
        delay = self.rng.uniform(0.0, 0.3)
        loaders = self.loaders

        def fire() -> None:
            pids = loaders[rank].runner.pids
            if len(pids) > which:
                try:
                    os.kill(pids[which], signal.SIGKILL)
                except ProcessLookupError:
                    return
                shot.update(pid=pids[which], rank=rank, t=time.monotonic(), steps=0)
                self.sampler.event("kill", pid=pids[which], rank=rank, degree=self.degree)

        timer = threading.Timer(delay, fire)
        timer.daemon = True
        timer.start()
        shot["timer"] = timer
        return shot

    # --- the loop ----------------------------------------------------------------------------
    def run(self) -> None:
        self.sampler.phase = "chaos"
        self.open(self.rng.choice(DEGREES), None)
        self.checkpoint(0)
        step = 0
        bar = tqdm(total=self.steps, desc="chaos (kills, resumes at D in 1/2/4, processes(2))",
                   unit="step", mininterval=1.0)
        next_save = self.rng.randint(*SAVE_EVERY)
        next_kill = self.rng.randint(*KILL_EVERY)
        shot: dict | None = None
        while step < self.steps or shot is not None:
            if step >= len(self.ref):
                self.stats["undetected_kills"] += 1
                self.sampler.event("kill-undetected", pid=shot.get("pid") if shot else None)
                break
            if shot is None and step == next_kill and step < self.steps:
                shot = self.arm_kill()
            try:
                batches = [next(l) for l in self.loaders]
            except WorkerError as e:
                self.stats["worker_errors"] += 1
                if shot and "t" in shot:
                    self.stats["kills"] += 1
                    self.stats["kill_to_error_s"].append(round(time.monotonic() - shot["t"], 4))
                    self.stats["kill_to_error_steps"].append(shot["steps"])
                    if str(shot["pid"]) not in str(e):
                        self.mismatches.append({"step": step, "why": f"WorkerError names another pid: {e}"})
                self.sampler.event("worker-error", message=str(e)[:300])
                lost = step - self.saved_step
                if shot is not None:
                    shot["timer"].cancel()
                shot = None
                step = self.resume("after-kill")
                self.stats["resumes_after_kill"] += 1
                self.stats["steps_recomputed"] += lost
                next_kill = step + self.rng.randint(*KILL_EVERY)
                next_save = step + self.rng.randint(*SAVE_EVERY)
                bar.n = min(step, self.steps)
                bar.refresh()
                continue
            if self.stats["degrees"] and len(self.stats["first_batch_s"]) < len(self.stats["degrees"]):
                self.stats["first_batch_s"].append(round(time.monotonic() - self.opened, 3))
            self.refresh_workers()
            self.tokens.record(step, batches)
            fp = fingerprint(batches)
            if step in self.fps and self.fps[step] != fp:
                self.mismatches.append({"step": step, "why": "recomputed step differs"})
            self.fps[step] = fp
            if fp != self.ref[step]:
                self.mismatches.append({"step": step, "degree": self.degree, "why": "differs from reference"})
            step += 1
            self.stats["steps_run"] += 1
            self.stats["steps_past_end"] += step > self.steps
            self.sampler.step = step
            bar.n = min(step, self.steps)
            bar.refresh()
            if shot is not None:
                if "t" in shot:
                    shot["steps"] += 1
                elif not shot["timer"].is_alive():
                    shot = None  # the timer found no worker to kill (none started yet)
                    next_kill = step + self.rng.randint(5, 30)
            if step >= next_save and step < self.steps:
                self.checkpoint(step)  # also while a killed worker has not surfaced yet
                next_save = step + self.rng.randint(*SAVE_EVERY)
                if shot is None and self.rng.random() < 0.6:  # stop, resume at another degree
                    step = self.resume("elastic")
                    self.stats["elastic_resumes"] += 1
            if shot is None and next_kill < step:
                next_kill = step + self.rng.randint(*KILL_EVERY)
        bar.close()
        # where the run stops, every lane must stand where the reference's did at that step
        self.final_state = merge_states([l.state() for l in self.loaders])
        self.close()


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
    except Exception:
        return ""


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = result["samples"]
    t = np.array([x["t"] for x in s])
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(11, 7), sharex=True)
    ax1.plot(t, [x["rss_mb"] for x in s], label="consumer RSS")
    ax1.plot(t, [x["children_rss_mb"] for x in s], label="child processes' RSS (forkserver + workers, sum)",
             alpha=0.7)
    ax1.set_ylabel("MB")
    ax2.plot(t, [x["fds"] for x in s], label="open FDs (consumer)")
    ax2.plot(t, [x["memfd_maps"] for x in s], label="memfd mappings (consumer)")
    ax2.plot(t, [x["dev_shm_ours"] for x in s], label="/dev/shm segments (ours)")
    ax2.plot(t, [x["children"] for x in s], label="child processes", alpha=0.7)
    ax2.set_ylabel("count")
    ax2.set_xlabel("seconds")
    for ax in (ax1, ax2):
        for e in result["events"]:
            if e["kind"] == "kill":
                ax.axvline(e["t"], color="red", lw=0.8, alpha=0.7)
            elif e["kind"].startswith("resume"):
                ax.axvline(e["t"], color="gray", lw=0.6, ls="--", alpha=0.5)
        ref = [x["t"] for x in s if x["phase"] == "reference"]
        if ref:
            ax.axvspan(min(ref), max(ref), color="green", alpha=0.06)
        ax.legend(loc="upper left", fontsize=8)
    st = result["chaos"]
    ax1.set_title(f"Zephon soak: packed LM pipeline, {result['steps']} steps ({st['steps_run']} run); "
                  f"{st['kills']} worker SIGKILLs (red), {st['elastic_resumes'] + st['resumes_after_kill']} "
                  f"resumes at D in {sorted(set(st['degrees']))} (gray); green: uninterrupted reference",
                  fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def summarise(samples: list[dict], key: str, phase: str | None = None) -> dict:
    xs = [x[key] for x in samples if phase is None or x["phase"] == phase]
    if not xs:
        return {}
    q = max(1, len(xs) // 4)
    return {"min": min(xs), "max": max(xs), "first_quarter_median": float(np.median(xs[:q])),
            "last_quarter_median": float(np.median(xs[-q:]))}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--epochs", type=int, default=4, help="epochs every lane of both sources finishes")
    ap.add_argument("--margin", type=int, default=400,
                    help="reference steps past the end, where a kill fired near the end may surface")
    ap.add_argument("--prose-docs", type=int, default=1200)
    ap.add_argument("--code-docs", type=int, default=600)
    ap.add_argument("--seed", type=int, default=0, help="seeds where kills and resumes happen")
    ap.add_argument("--out", default=os.path.join(RESULTS, "soak.json"))
    args = ap.parse_args()
    rng = random.Random(args.seed)
    started = time.time()
    head, dirty = _git("rev-parse", "HEAD"), _git("status", "--porcelain", "zephon")
    sampler = Sampler()
    sampler.start()
    shm_before = set(os.listdir("/dev/shm"))
    with tempfile.TemporaryDirectory(prefix="zephon-soak-") as tmp:
        sampler.phase = "setup"
        job = Job(tmp, args.prose_docs, args.code_docs)
        ref, ref_tokens, steps = reference(job, args.epochs, args.margin, sampler)
        chaos = Chaos(job, ref, steps, sampler, rng, os.path.join(tmp, "ckpt", "loader.json"))
        sampler.worker_pids = chaos.worker_pids
        os.makedirs(os.path.dirname(chaos.ckpt))
        fds_before = _fd_targets()
        chaos.run()
        sampler.phase = "after"
        time.sleep(1.0)  # workers exit within milliseconds of close(); let the sampler see it
        fds_after = _fd_targets()
        fds_new = sorted(t for fd, t in fds_after.items() if fds_before.get(fd) != t)
        # closed loaders sit in reference cycles until the cyclic GC runs; their sources'
        # descriptors go with them
        import gc

        gc.collect()
        fds_gc = _fd_targets()
        fds_new_gc = sorted(t for fd, t in fds_gc.items() if fds_before.get(fd) != t)
    sampler.stop()
    final = sampler.sample()
    leftover = [p for p in chaos.all_workers if _alive(p)]
    # other jobs on the machine create and remove /dev/shm entries: ours are the ones named
    # zephon-<our pid>-... or mapped by one of our processes at some sample
    shm_new = sorted(n for n in set(os.listdir("/dev/shm")) - shm_before
                     if n.startswith(sampler.shm_prefix) or n in sampler.shm_mapped)
    complete = job.complete_epochs(ref_tokens.final_state)
    chaos.tokens.by_step = {k: v for k, v in chaos.tokens.by_step.items() if k < steps}
    ref_tokens.by_step = {k: v for k, v in ref_tokens.by_step.items() if k < steps}
    token_check = chaos.tokens.check(complete)
    ref_check = ref_tokens.check(complete)
    ordered = [chaos.fps.get(i, "") for i in range(max(chaos.fps) + 1)]
    mismatch = first_mismatch(ref[:len(ordered)], ordered)
    chaos_samples = [x for x in sampler.samples if x["phase"] == "chaos"]
    result = {
        "what": "soak: packed LM pipeline (2 JSONL corpora mixed 0.7/0.3 by tokens, Tokenize, "
                "Pack concat 256) on processes(2) per rank, worker SIGKILLs, elastic stop/resume",
        "config": {"lanes": LANES, "batch": BATCH, "seq_len": SEQ, "weights": WEIGHTS,
                   "degrees": DEGREES, "epochs": args.epochs, "prose_docs": args.prose_docs,
                   "code_docs": args.code_docs, "seed": args.seed,
                   "corpus_tokens": [int(sum(len(d) for d in docs)) for docs in job.docs]},
        "env": {"python": platform.python_version(), "zephon": zephon.__version__,
                "cpus": os.cpu_count(), "loadavg_end": os.getloadavg(), "git_head": head,
                "zephon_dirty_at_start": dirty.splitlines(),
                "zephon_dirty_at_end": _git("status", "--porcelain", "zephon").splitlines()},
        "seconds": round(time.time() - started, 1),
        "steps": steps,
        "chaos": chaos.stats,
        "stream_equals_reference": not chaos.mismatches and mismatch is None,
        "first_mismatch_step": mismatch,
        "mismatches": chaos.mismatches[:20],
        "tokens": token_check,
        "reference_tokens_problems": ref_check["n_problems"],
        "final_step": chaos.final_state["step"],
        "final_lanes_equal_reference": (chaos.final_state["step"] == steps
                                        and chaos.final_state["lanes"] == ref_tokens.final_state["lanes"]),
        "resources": {key: summarise(chaos_samples, key) for key in
                      ("rss_mb", "children_rss_mb", "fds", "memfd_fds", "memfd_maps", "dev_shm_ours",
                       "children", "workers_alive")},
        "after_close": {"sample": final, "workers_left": leftover, "dev_shm_new": shm_new,
                        "fds_before_chaos": len(fds_before), "fds_after_close": len(fds_after),
                        "fds_new_after_close": fds_new, "fds_after_gc_collect": len(fds_gc),
                        "fds_new_after_gc_collect": fds_new_gc},
        "events": sampler.events,
        "samples": sampler.samples,
    }
    failures = []
    if not result["stream_equals_reference"]:
        failures.append(f"stream differs from the reference (first at step {mismatch}; {chaos.mismatches[:3]})")
    if token_check["n_problems"] or ref_check["n_problems"]:
        failures.append(f"token check: {token_check['problems'][:3]}")
    if min(complete) < args.epochs:
        failures.append(f"only {complete} epochs complete")
    if chaos.stats["kills"] == 0 or chaos.stats["undetected_kills"]:
        failures.append(f"kills {chaos.stats['kills']}, undetected {chaos.stats['undetected_kills']}")
    if chaos.stats["worker_errors"] != chaos.stats["kills"]:
        failures.append(f"{chaos.stats['worker_errors']} WorkerErrors for {chaos.stats['kills']} kills")
    if not result["final_lanes_equal_reference"]:
        failures.append("the final lane states differ from the reference's")
    if any(t.startswith(("/memfd:", "socket:")) or t.endswith(".jsonl") for t in fds_new_gc):
        failures.append(f"descriptors left open after close and gc.collect(): {fds_new_gc}")
    if leftover or shm_new or final["memfd_maps"] or final["memfd_fds"]:
        failures.append(f"leaks after close: workers {leftover}, /dev/shm {shm_new}, "
                        f"memfd maps {final['memfd_maps']}, memfd fds {final['memfd_fds']}")
    result["failures"] = failures
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    plot(result, os.path.splitext(args.out)[0] + ".png")
    r = result["resources"]
    print(f"soak: {steps} steps, {chaos.stats['steps_run']} run ({chaos.stats['steps_recomputed']} "
          f"recomputed), {result['seconds']} s")
    print(f"  kills {chaos.stats['kills']} (WorkerError after {chaos.stats['kill_to_error_s']} s), "
          f"resumes {chaos.stats['resumes_after_kill']} after kills + {chaos.stats['elastic_resumes']} "
          f"elastic, checkpoints {chaos.stats['checkpoints']}, degrees {sorted(set(chaos.stats['degrees']))}")
    print(f"  stream equals reference: {result['stream_equals_reference']}; tokens: "
          f"{token_check['rows_checked']} rows checked, complete epochs {complete}, "
          f"{sum(e['exact'] for e in token_check['epochs'])}/{len(token_check['epochs'])} source-epochs exact")
    print(f"  consumer RSS {r['rss_mb'].get('min')}-{r['rss_mb'].get('max')} MB, child processes "
          f"{r['children_rss_mb'].get('min')}-{r['children_rss_mb'].get('max')} MB, FDs "
          f"{r['fds'].get('min')}-{r['fds'].get('max')}, memfd maps {r['memfd_maps'].get('min')}-"
          f"{r['memfd_maps'].get('max')}, /dev/shm {r['dev_shm_ours'].get('max')}")
    print(f"  after close: workers left {leftover}, /dev/shm new {shm_new}, memfd maps "
          f"{final['memfd_maps']}, fds {len(fds_before)} before the chaos run -> {len(fds_after)} "
          f"after close ({sum(t.endswith('.jsonl') for t in fds_new)} JSONL files of closed loaders "
          f"awaiting the cyclic GC) -> {len(fds_gc)} after gc.collect() (new: {fds_new_gc})")
    for f in failures:
        print(f"FAIL: {f}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
