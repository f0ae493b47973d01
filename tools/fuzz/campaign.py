"""Fuzzer of pyinfer's model loading and converter: seeded mutations of valid files, each run in a child
process with time and memory limits, and a table of outcomes per mutation family (issue 14).

    python -m tools.fuzz --cases 2000 --seed 1               # every family, summary table
    python -m tools.fuzz --family tensor_offsets --case 17 --keep /tmp/case  # replay one

Every case is a function of (--seed, family, case number): its mutation draws from a generator seeded by
those, so a failing case is replayed exactly with --family/--case, and --keep saves its input. Outcomes
are defined in `targets`; any of the bad ones (a traceback, a signal, a timeout, a memory blow-up,
a multi-line error, silent non-finite logits, a left-over temporary file) makes the exit status 1.
"""

from __future__ import annotations

import os

# the children must not start thread pools that a fork would leave half-copied
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse
import json
import resource
import select
import shutil
import signal
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from tools.fuzz import gguf_mutations, hf_mutations, targets
from tools.fuzz.image import GGUFImage
from tools.fuzz.seeds import copy_seed, make_seeds

GGUF_FAMILIES = list(gguf_mutations.FAMILIES)
CONVERTER_FAMILIES = [*hf_mutations.FAMILIES, "convert_gguf"]
FAMILIES = GGUF_FAMILIES + CONVERTER_FAMILIES
GGUF_SEEDS = ("llama-bpe", "qwen2-power", "opt-power", "llama-spm", "sparse")
DEFAULT_SHARE = 0.1  # of GGUF cases mutate the real SmolLM2 file when it is available (100 MB)


@dataclass
class Limits:
    timeout_s: float = 20.0
    memory_mb: int = 4096  # address space a case may add to what the forked child starts with


@dataclass
class Case:
    family: str
    index: int
    seed_name: str = ""
    outcome: str = ""
    detail: str = ""
    seconds: float = 0.0


@dataclass
class Report:
    cases: list[Case] = field(default_factory=list)

    @property
    def bad(self) -> list[Case]:
        return [c for c in self.cases if c.outcome in targets.BAD]

    def table(self) -> str:
        """Markdown: cases per family and outcome, then the totals."""
        counts = Counter((c.family, c.outcome) for c in self.cases)
        families = [f for f in FAMILIES if any(c.family == f for c in self.cases)]
        head = ["family", "cases", *targets.OUTCOMES]
        rows = [[f, str(sum(counts[f, o] for o in targets.OUTCOMES)),
                 *(str(counts[f, o]) for o in targets.OUTCOMES)] for f in families]
        totals = Counter(c.outcome for c in self.cases)
        rows.append(["**all**", f"**{len(self.cases)}**", *(f"**{totals[o]}**" for o in targets.OUTCOMES)])
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


# ---------------------------------------------------------------------------------------------------
# cases


def case_rng(seed: int, family: str, index: int) -> np.random.Generator:
    return np.random.default_rng([seed, FAMILIES.index(family), index])


class Seeds:
    """The seed files, made once, and their parsed GGUF images (kept in memory: most mutations are of
    the header)."""

    def __init__(self, folder: str, default_model: str | None):
        self.paths = make_seeds(folder, default_model)
        self._images: dict[str, GGUFImage] = {}

    def image(self, name: str) -> GGUFImage:
        if name not in self._images:
            with open(self.paths[name], "rb") as f:
                self._images[name] = GGUFImage.parse(f.read())
        return self._images[name].copy()

    def gguf_seed(self, rng: np.random.Generator) -> str:
        if "default" in self.paths and rng.random() < DEFAULT_SHARE:
            return "default"
        return GGUF_SEEDS[int(rng.integers(len(GGUF_SEEDS)))]


@dataclass
class Prepared:
    """What the child runs: a GGUF to load, or a converter command line; terminate_after sends SIGTERM."""

    gguf: str | None = None
    argv: list[str] | None = None
    out_dir: str = ""
    terminate_after: float | None = None


def prepare(case: Case, seed: int, seeds: Seeds, workdir: str) -> Prepared:
    """Writes the case's input into workdir."""
    rng = case_rng(seed, case.family, case.index)
    if case.family in GGUF_FAMILIES or case.family == "convert_gguf":
        case.seed_name = seeds.gguf_seed(rng)
        family = case.family if case.family != "convert_gguf" else GGUF_FAMILIES[int(rng.integers(len(GGUF_FAMILIES)))]
        data = gguf_mutations.FAMILIES[family](seeds.image(case.seed_name), rng)
        path = os.path.join(workdir, "model.gguf")
        with open(path, "wb") as f:
            f.write(data)
        if case.family in GGUF_FAMILIES:
            return Prepared(gguf=path)
        out_dir = os.path.join(workdir, "out")
        os.mkdir(out_dir)
        return Prepared(argv=[path, "-o", os.path.join(out_dir, "out.gguf")], out_dir=out_dir)
    mutate, seed_names = hf_mutations.FAMILIES[case.family]
    case.seed_name = seed_names[int(rng.integers(len(seed_names)))]
    out_dir = os.path.join(workdir, "out")
    os.mkdir(out_dir)
    if case.family == "convert_sigterm":  # the seed as it is; SIGTERM within the ~0.2-0.5 s the conversion takes
        argv = mutate(seeds.paths[case.seed_name], out_dir, rng)
        return Prepared(argv=argv, out_dir=out_dir, terminate_after=float(rng.uniform(0.0, 0.6)))
    folder = copy_seed(seeds.paths[case.seed_name], os.path.join(workdir, "checkpoint"))
    return Prepared(argv=mutate(folder, out_dir, rng), out_dir=out_dir)


# ---------------------------------------------------------------------------------------------------
# child processes


def _child(prepared: Prepared, workdir: str, limits: Limits) -> None:
    """Runs in the forked child: limits, output to files, the target, the result as JSON; never returns."""
    code = 0
    try:
        # on top of the parent's address space, which the fork inherits (a test process holding a 2 GB
        # transformers model left a 2 GB absolute limit no room at all)
        with open("/proc/self/statm") as f:
            inherited = int(f.read().split()[0]) * resource.getpagesize()
        memory = inherited + (limits.memory_mb << 20)
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        cpu = int(limits.timeout_s) + 5
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 5))
        for fd, name in ((1, "stdout"), (2, "stderr")):
            out = os.open(os.path.join(workdir, name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.dup2(out, fd)
            os.close(out)
        # new streams on fds 1 and 2: the parent's may be a test runner's capture objects, not these fds
        sys.stdout = open(1, "w", encoding="utf-8", errors="backslashreplace", closefd=False)
        sys.stderr = open(2, "w", encoding="utf-8", errors="backslashreplace", closefd=False)
        if prepared.gguf is not None:
            outcome, detail = targets.load_target(prepared.gguf, workdir)
        else:
            outcome, detail = targets.convert_target(prepared.argv, workdir)
        # written whole or not at all: a SIGTERM the case sends may arrive while it is written
        with open(os.path.join(workdir, "result.part"), "w", encoding="utf-8") as f:
            json.dump({"outcome": outcome, "detail": detail}, f)
        os.replace(os.path.join(workdir, "result.part"), os.path.join(workdir, "result.json"))
    except BaseException:  # a failure of the harness itself: no result file, reported as a traceback
        code = 3
    finally:
        os._exit(code)


def _wait(pid: int, deadline: float, terminate_at: float | None) -> tuple[int | None, bool, bool]:
    """(wait status or None on timeout, whether SIGTERM was sent, whether the child was killed)."""
    pidfd = os.pidfd_open(pid)
    terminated = False
    try:
        while True:
            now = time.monotonic()
            until = min(deadline, terminate_at) if terminate_at is not None and not terminated else deadline
            if select.select([pidfd], [], [], max(0.0, until - now))[0]:
                return os.waitpid(pid, 0)[1], terminated, False
            if terminate_at is not None and not terminated and time.monotonic() >= terminate_at:
                os.kill(pid, signal.SIGTERM)
                terminated = True
            elif time.monotonic() >= deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                return None, terminated, True
    finally:
        os.close(pidfd)


def run_case(case: Case, seed: int, seeds: Seeds, workdir: str, limits: Limits) -> None:
    """Prepares, runs and classifies one case (sets case.outcome, detail, seconds)."""
    prepared = prepare(case, seed, seeds, workdir)
    t0 = time.monotonic()
    pid = os.fork()
    if pid == 0:
        _child(prepared, workdir, limits)
    terminate_at = t0 + prepared.terminate_after if prepared.terminate_after is not None else None
    status, terminated, killed = _wait(pid, t0 + limits.timeout_s, terminate_at)
    case.seconds = time.monotonic() - t0
    result_path = os.path.join(workdir, "result.json")
    if killed:
        case.outcome, case.detail = "timeout", f"killed after {limits.timeout_s:.0f} s"
    elif os.WIFSIGNALED(status) and not (terminated and os.WTERMSIG(status) == signal.SIGTERM):
        sig = os.WTERMSIG(status)
        case.outcome, case.detail = ("timeout" if sig == signal.SIGXCPU else "signal"), signal.Signals(sig).name
    elif os.path.exists(result_path):
        with open(result_path, encoding="utf-8") as f:
            result = json.load(f)
        case.outcome, case.detail = result["outcome"], result["detail"]
    elif terminated:
        case.outcome, case.detail = "error", "killed by SIGTERM outside the write (default action)"
    else:
        case.outcome, case.detail = "traceback", f"child exited {os.waitstatus_to_exitcode(status)} without a result"
    if terminated:
        _check_terminated_outputs(case, prepared)


def _check_terminated_outputs(case: Case, prepared: Prepared) -> None:
    """After a SIGTERM: no temporary file, and an output only if it is complete."""
    from pyinfer.errors import PyInferError
    from pyinfer.formats.gguf_file import GGUFFile

    left = targets.leftovers([prepared.out_dir])
    if left:
        case.outcome, case.detail = "leftover", f"{', '.join(map(os.path.basename, left))} after SIGTERM"
        return
    out = os.path.join(prepared.out_dir, "out.gguf")
    if os.path.exists(out):
        try:
            GGUFFile(out)
        except PyInferError as exc:
            case.outcome, case.detail = "leftover", f"incomplete output after SIGTERM: {exc}"


# ---------------------------------------------------------------------------------------------------
# runs


def plan(families: list[str], n_cases: int) -> list[Case]:
    """n_cases spread evenly over families, in turn."""
    return [Case(families[i % len(families)], i // len(families)) for i in range(n_cases)]


def run(cases: list[Case], seed: int, limits: Limits, workdir: str, default_model: str | None,
        keep: str | None = None, log=None, progress=None) -> Report:
    """Runs cases one after another; the inputs of bad ones (or of a single case) are copied into keep."""
    os.makedirs(workdir, exist_ok=True)
    seeds = Seeds(os.path.join(workdir, "seeds"), default_model)
    report = Report()
    for n, case in enumerate(cases):
        case_dir = tempfile.mkdtemp(prefix=f"{case.family}-{case.index}-", dir=workdir)
        try:
            run_case(case, seed, seeds, case_dir, limits)
            if keep and (case.outcome in targets.BAD or len(cases) == 1):
                shutil.copytree(case_dir, os.path.join(keep, f"{case.family}-{case.index}"), symlinks=True,
                                dirs_exist_ok=True)
        finally:
            shutil.rmtree(case_dir, ignore_errors=True)
        report.cases.append(case)
        if log:
            log.write(json.dumps(case.__dict__) + "\n")
            log.flush()
        if progress:
            progress(n + 1, len(cases), case)
    return report


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tools.fuzz", description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", type=int, default=200, help="cases in all, spread over the families (default 200)")
    p.add_argument("--seed", type=int, default=1, help="the run's seed (default 1)")
    p.add_argument("--family", action="append", choices=FAMILIES, help="only these families (repeatable)")
    p.add_argument("--case", type=int, default=None, help="run only this case number of the one --family given")
    p.add_argument("--timeout", type=float, default=20.0, help="seconds per case (default 20)")
    p.add_argument("--memory-mb", type=int, default=4096, help="address-space limit per case (default 4096)")
    p.add_argument("--default-model", default=None,
                   help="GGUF to mutate besides the tiny seeds (default: the pulled SmolLM2 file, if any)")
    p.add_argument("--no-default-model", action="store_true", help="only the tiny seeds")
    p.add_argument("--workdir", default=None, help="folder for seeds and cases (default: a temporary one)")
    p.add_argument("--keep", default=None, help="copy the inputs of bad cases (or of the one --case) here")
    p.add_argument("--log", default=None, help="append one JSON line per case to this file")
    p.add_argument("--markdown", default=None, help="write the summary table to this file too")
    return p


def _default_model(args) -> str | None:
    if args.no_default_model:
        return None
    if args.default_model:
        return args.default_model
    from pyinfer.hub.pull import SMALLEST_MODEL, model_path

    return str(model_path(SMALLEST_MODEL))


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    families = args.family or FAMILIES
    if args.case is not None:
        if len(families) != 1:
            raise SystemExit("python -m tools.fuzz: --case needs exactly one --family")
        cases = [Case(families[0], args.case)]
    else:
        cases = plan(families, args.cases)
    workdir = args.workdir or tempfile.mkdtemp(prefix="pyinfer-fuzz-")
    limits = Limits(args.timeout, args.memory_mb)
    t0 = time.monotonic()

    def progress(done: int, total: int, case: Case) -> None:
        if case.outcome in targets.BAD or done % 100 == 0 or done == total:
            print(f"[{done}/{total} {time.monotonic() - t0:.0f} s] {case.family} #{case.index} ({case.seed_name}): "
                  f"{case.outcome} {case.detail}", file=sys.stderr, flush=True)

    with open(args.log, "a", encoding="utf-8") if args.log else open(os.devnull, "w") as log:
        report = run(cases, args.seed, limits, workdir, _default_model(args), args.keep, log, progress)
    if not args.workdir:
        shutil.rmtree(workdir, ignore_errors=True)
    table = report.table()
    print(table)
    if args.markdown:
        with open(args.markdown, "w", encoding="utf-8") as f:
            f.write(table + "\n")
    for case in report.bad:
        print(f"BAD {case.family} --case {case.index} ({case.seed_name}): {case.outcome}: {case.detail}")
    return 1 if report.bad else 0

