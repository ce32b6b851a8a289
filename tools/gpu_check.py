"""GPU acceptance check: the short form of every README GPU command, on the GPUs this host has.

Each command of tools/gpu_commands.py whose GPU count is met runs as its own process group
under its own time limit, with the repository on PYTHONPATH and NVLink multicast off (NCCL NVLS,
torch symmetric memory, NVSHMEM), logging to its own folder under a fresh ``--out/<time>/``.
After each command a record (exit code, seconds, headline figure) is appended to
``gpu_check.jsonl`` there; the end prints one table. A time limit is a command's kill switch,
well above its usual time; a command is skipped, not started, when its GPUs are missing, an
optional module is absent or the command it reads from did not pass. With ``--budget-s`` a
command is not run when less than half its limit is left of the budget: such a check has not
checked everything, so it does not pass. The several-GPU commands run first, one at a
time; then the one-GPU commands run in lanes, ``--per-gpu`` of them on each GPU
(``CUDA_VISIBLE_DEVICES`` set to it, a data cache and an equal share of the CPUs of its own), a command waiting for the one it
reads from and an ``exclusive`` one for a GPU of its own. Commands sharing a GPU slow each other:
their figures say that the command runs, the reports' figures come from full runs alone. ``--with-tests`` then runs the GPU tests, under
a limit of their own. A last record, ``total``, holds the whole run's seconds and counts.
Exit code 1 if any command failed, timed out or was not run for the budget.

    python3 tools/gpu_check.py                      # everything this host can run
    python3 tools/gpu_check.py --only gpt2 vit --budget-s 120
    python3 tools/gpu_check.py --list
"""

from __future__ import annotations

import argparse
import contextlib
import fnmatch
import importlib.util
import math
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

import torch
from gpu_commands import COMMANDS, ROOT, GpuCommand, Headline

sys.path.insert(0, str(ROOT))  # effdl from this checkout, installed or not
from effdl.cli import format_table
from effdl.results import RunLog, read_records

MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                 "NVSHMEM_DISABLE_NVLS": "1"}  # fmt: skip
TESTS = 'python3 -m pytest -m "gpu or multigpu" -q --durations=30'  # multigpu ones skip on one GPU
TESTS_LIMIT_S = 540  # DESIGN.md: 6 minutes of GPU tests on one H100; the multi-GPU ones beside
SHARE_MIN_GIB = 64  # two short forms fit beside each other on a GPU this large
BUDGET_NOTE = "over budget"
KILL_GRACE_S = 10  # between SIGTERM and SIGKILL of a command's process group
TAIL_LINES = 15  # of a failed command's output, printed


@dataclass
class Outcome:
    """How one command ended."""

    name: str
    status: str  # ok | failed | timeout | skipped (not for this host) | not-run (budget)
    exit_code: int | None = None
    seconds: float = 0.0
    headline: float | None = None
    unit: str = ""
    note: str = ""


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--out", type=Path, default=Path("runs/acceptance"), help="logs go to OUT/<time>/"
    )
    p.add_argument("--only", nargs="+", metavar="SUBSTRING",
                   help="the commands whose name or README line has one of these")  # fmt: skip
    p.add_argument("--list", action="store_true", help="print the commands and exit")
    p.add_argument("--budget-s", type=float, default=math.inf,
                   help="leave out a command once less than half its limit is left of this many seconds (the check then fails)")  # fmt: skip
    p.add_argument("--per-gpu", type=int, default=None,
                   help=f"commands sharing a GPU at once (default: 2 on GPUs of {SHARE_MIN_GIB} GiB or more, else 1)")  # fmt: skip
    p.add_argument("--with-tests", action="store_true",
                   help=f"then `{TESTS}` (limit {TESTS_LIMIT_S} s, outside the budget)")  # fmt: skip
    return p.parse_args(argv)


def selected(only: Sequence[str] | None) -> list[GpuCommand]:
    if only is None:
        return list(COMMANDS)
    return [c for c in COMMANDS if any(o in c.name or o in c.command for o in only)]


def print_list(commands: Sequence[GpuCommand]) -> None:
    width = max(len(c.name) for c in commands)
    print(f"{'name':{width}}  gpus  limit_s  short form")
    for c in commands:
        print(f"{c.name:{width}}  {c.min_gpus:4}  {c.limit_s:7}  {c.check}")
    for gpus in (1, 2):
        total = sum(c.limit_s for c in commands if c.min_gpus <= gpus)
        print(f"sum of limits with {gpus} GPU{'s' if gpus > 1 else ''}: {total} s")


def argv_of(line: str, folders: dict[str, Path]) -> list[str]:
    """A short form's argv: placeholders filled, python3/torchrun run by this Python."""
    words = shlex.split(line.format(**{k: str(v) for k, v in folders.items()}))
    if words[0] in ("python", "python3"):
        return [sys.executable, *words[1:]]
    if words[0] == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", *words[1:]]
    raise ValueError(f"{line!r}: expected python3 or torchrun")


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {**os.environ, **MULTICAST_OFF, **(extra or {})}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return env


def descendants(pid: int) -> list[int]:
    """Every process below ``pid``, from /proc (Linux)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue  # the process ended meanwhile
        children.setdefault(ppid, []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def kill(pid: int, sig: int, group: bool = False) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):  # gone already
        (os.killpg if group else os.kill)(pid, sig)


def run_process(
    argv: list[str],
    limit_s: float,
    log: Path,
    env: dict[str, str] | None = None,
    cpus: set[int] | None = None,
) -> tuple[int | None, float]:
    """Run ``argv`` in a process group of its own, output to ``log``, on ``cpus`` (all when
    None: its threads and workers start after the pin and inherit it); (exit code or None on
    timeout, seconds). On a timeout the group gets SIGTERM, then it and every process the
    command started (torchrun puts its ranks in sessions of their own) SIGKILL; after any end,
    what is left of the group (loader workers) goes too."""
    start = time.monotonic()
    with log.open("w", encoding="utf-8") as f:
        proc = subprocess.Popen(argv, cwd=ROOT, env=child_env(env), stdout=f,
                                stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        if cpus:
            os.sched_setaffinity(proc.pid, cpus)
        try:
            code = proc.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            tree = descendants(proc.pid)
            kill(proc.pid, signal.SIGTERM, group=True)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=KILL_GRACE_S)
            for pid in tree:
                kill(pid, signal.SIGKILL)
            code = None
        kill(proc.pid, signal.SIGKILL, group=True)
        proc.wait()
    return code, time.monotonic() - start


def read_headline(folder: Path, headline: Headline) -> float | None:
    """``headline.metric`` of the last matching record in the run logs under ``folder``."""
    value = None
    for path in sorted(folder.glob("**/*.jsonl")):
        for rec in read_records(path):
            v = rec["metrics"].get(headline.metric)
            if fnmatch.fnmatchcase(rec["variant"], headline.variant) and _is_number(v):
                value = v * headline.scale
    return value


def _is_number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def skip_reason(c: GpuCommand, gpus: int, left_s: float, done: dict[str, Outcome]) -> str:
    """Why ``c`` does not start (empty when it does); see ``BUDGET_NOTE`` for the budget."""
    if c.min_gpus > gpus:
        return f"needs {c.min_gpus} GPUs"
    missing = [m for m in c.requires if importlib.util.find_spec(m) is None]
    if missing:
        return f"no module {', '.join(missing)}"
    if c.after is not None and (c.after not in done or done[c.after].status != "ok"):
        return f"needs {c.after} to pass first"
    if c.limit_s / 2 > left_s:
        return f"{BUDGET_NOTE}: half its limit, {c.limit_s / 2:.0f} s, > {left_s:.0f} s left"
    return ""


def run_command(
    c: GpuCommand,
    run_dir: Path,
    cache: Path,
    env: dict[str, str] | None = None,
    cpus: set[int] | None = None,
) -> Outcome:
    out = run_dir / c.name
    argv = argv_of(c.check, {"out": out, "run": run_dir, "cache": cache})
    code, seconds = run_process(argv, c.limit_s, run_dir / f"{c.name}.log", env, cpus)
    status = "timeout" if code is None else "ok" if code == 0 else "failed"
    outcome = Outcome(c.name, status, code, seconds)
    if c.headline is not None and out.is_dir():
        outcome.headline, outcome.unit = read_headline(out, c.headline), c.headline.unit
    return outcome


def run_tests(run_dir: Path) -> Outcome:
    times = {"EFFDL_TEST_TIMES": str((run_dir / "gpu_tests.jsonl").resolve())}  # each test's time
    code, seconds = run_process(
        argv_of(TESTS, {}), TESTS_LIMIT_S, run_dir / "pytest-gpu.log", times
    )
    status = "timeout" if code is None else "ok" if code == 0 else "failed"
    return Outcome("pytest-gpu", status, code, seconds)


def record(log: RunLog, outcome: Outcome, config: dict) -> None:
    metrics = {"status": outcome.status, "exit_code": outcome.exit_code,
               "seconds": outcome.seconds, "headline": outcome.headline,
               "headline_unit": outcome.unit, "note": outcome.note}  # fmt: skip
    log.log(outcome.name, config, metrics)


def report(outcome: Outcome, run_dir: Path) -> None:
    """One line per finished command; the tail of its output when it did not pass."""
    figure = "" if outcome.headline is None else f", {outcome.headline:.4g} {outcome.unit}"
    note = f" ({outcome.note})" if outcome.note else ""
    print(f"  [{outcome.name}] {outcome.status}{note}: {outcome.seconds:.1f} s{figure}", flush=True)
    output = run_dir / f"{outcome.name}.log"
    if outcome.status in ("failed", "timeout") and output.exists():
        lines = output.read_text(encoding="utf-8", errors="replace").splitlines()
        for line in lines[-TAIL_LINES:]:
            print(f"    | {line}", flush=True)


def table_row(o: Outcome) -> dict:
    figure = "" if o.headline is None else f"{o.headline:.4g} {o.unit}"
    return {"command": o.name, "status": o.status,
            "exit": "" if o.exit_code is None else str(o.exit_code),
            "seconds": f"{o.seconds:.1f}", "headline": figure, "note": o.note}  # fmt: skip


def command_config(c: GpuCommand) -> dict:
    return {"command": c.check, "readme_command": c.command, "limit_s": c.limit_s}


def start_or_skip(c: GpuCommand, gpus: int, left_s: float, done: dict) -> Outcome | None:
    """A skipped outcome, or None after announcing that ``c`` starts."""
    reason = skip_reason(c, gpus, left_s, done)
    status = "not-run" if reason.startswith(BUDGET_NOTE) else "skipped"
    print(f"[{c.name}] {f'{status}: {reason}' if reason else c.check}", flush=True)
    return Outcome(c.name, status, note=reason) if reason else None


def lane_devices(gpus: int) -> list[str]:
    """The device each lane sees as its only one: the visible devices, in order."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    names = [d.strip() for d in visible.split(",")] if visible else [str(i) for i in range(gpus)]
    return names[:gpus]


def lane_cpus(lanes: int) -> list[set[int]]:
    """This process's CPUs cut into ``lanes`` equal shares: commands running side by side each
    size their thread pools and loader workers to their own share instead of all oversubscribing
    the host."""
    cpus = sorted(os.sched_getaffinity(0))
    share = max(1, len(cpus) // lanes)
    return [set(cpus[i * share : (i + 1) * share] or cpus) for i in range(lanes)]


def default_per_gpu(gpus: int) -> int:
    """2 when every GPU holds two short forms at once, else 1."""
    smallest = min(torch.cuda.get_device_properties(i).total_memory for i in range(gpus))
    return 2 if smallest >= SHARE_MIN_GIB * 2**30 else 1


def free_device(c: GpuCommand, free: dict[str, list[int]], per_gpu: int) -> str | None:
    """A device with a free lane for ``c`` (all its lanes when ``c`` is exclusive), emptiest first."""
    need = per_gpu if c.exclusive else 1
    fits = [d for d, lanes in free.items() if len(lanes) >= need]
    return max(fits, key=lambda d: len(free[d])) if fits else None


def run_in_lanes(commands: list[GpuCommand], gpus: int, args: argparse.Namespace,
                 start: float, run_dir: Path, log: RunLog, done: dict) -> None:  # fmt: skip
    """One-GPU commands in list order, ``per_gpu`` lanes per GPU; a command whose ``after`` has
    not ended yet waits and the next one takes the free lane; an exclusive command that finds
    no idle GPU holds back the ones after it until a GPU empties."""
    pending, running = list(commands), {}  # running: Future -> (command, device, its lanes)
    per_gpu = args.per_gpu or default_per_gpu(gpus)
    free = {d: list(range(per_gpu)) for d in lane_devices(gpus)}  # device -> its free lanes
    shares = lane_cpus(gpus * per_gpu)
    cpus_of = {(d, n): shares[i * per_gpu + n] for i, d in enumerate(free) for n in free[d]}
    print(f"{per_gpu} command(s) at once on each GPU, {len(shares[0])} CPUs each", flush=True)
    with ThreadPoolExecutor(max_workers=gpus * per_gpu) as pool:
        while pending or running:
            busy = {c.name for c, _, _ in running.values()} | {c.name for c in pending}
            for c in [c for c in pending if c.after not in busy]:
                device = free_device(c, free, per_gpu)
                if device is None:
                    break
                pending.remove(c)
                left_s = args.budget_s - (time.monotonic() - start)
                skipped = start_or_skip(c, gpus, left_s, done)
                if skipped is not None:
                    done[c.name] = skipped
                    record(log, skipped, {**command_config(c), "gpus": gpus})
                    continue
                lanes = free[device] if c.exclusive else free[device][:1]
                free[device] = [n for n in free[device] if n not in lanes]
                env = {"CUDA_VISIBLE_DEVICES": device} if gpus > 1 else None
                cache = args.out / "cache" / f"lane{device}.{lanes[0]}"  # its own while it runs
                cpus = set().union(*(cpus_of[device, n] for n in lanes))
                future: Future = pool.submit(run_command, c, run_dir, cache, env, cpus)
                running[future] = (c, device, lanes)
            if not running:
                continue
            for future in wait(running, return_when=FIRST_COMPLETED).done:
                c, device, lanes = running.pop(future)
                free[device] += lanes
                done[c.name] = future.result()
                report(done[c.name], run_dir)
                config = {**command_config(c), "gpus": gpus, "device": device,
                          "commands_on_gpu": 1 if c.exclusive else per_gpu,
                          "cpus": len(set().union(*(cpus_of[device, n] for n in lanes)))}  # fmt: skip
                record(log, done[c.name], config)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    commands = selected(args.only)
    if not commands:
        print(f"no command matches --only {args.only!r}", file=sys.stderr)
        return 2
    if args.list:
        print_list(commands)
        return 0
    gpus = torch.cuda.device_count()
    if gpus == 0:
        print("no CUDA device: the GPU check needs one", file=sys.stderr)
        return 2
    run_dir = args.out / time.strftime("%Y%m%dT%H%M%S")
    run_dir.mkdir(parents=True)
    log = RunLog(run_dir / "gpu_check.jsonl", task="gpu_check", create=True)
    print(f"{gpus} GPU(s): {log.env['gpu']}; logs in {run_dir}", flush=True)
    done: dict[str, Outcome] = {}
    start = time.monotonic()
    several = [c for c in commands if c.min_gpus > 1]
    for c in several:
        outcome = start_or_skip(c, gpus, args.budget_s - (time.monotonic() - start), done)
        done[c.name] = outcome or run_command(c, run_dir, args.out / "cache")
        if outcome is None:
            report(done[c.name], run_dir)
        record(log, done[c.name], {**command_config(c), "gpus": gpus})
    one = [c for c in commands if c.min_gpus <= 1]
    run_in_lanes(one, gpus, args, start, run_dir, log, done)
    if args.with_tests:
        print(f"[pytest-gpu] {TESTS}", flush=True)
        done["pytest-gpu"] = run_tests(run_dir)
        report(done["pytest-gpu"], run_dir)
        record(log, done["pytest-gpu"], {"command": TESTS, "limit_s": TESTS_LIMIT_S, "gpus": gpus})
    outcomes = list(done.values())
    print()
    print(format_table([table_row(o) for o in outcomes]))
    counts = {
        s: sum(o.status == s for o in outcomes)
        for s in ("ok", "failed", "timeout", "skipped", "not-run")
    }
    seconds = time.monotonic() - start
    log.log("total", {"gpus": gpus, "budget_s": args.budget_s if math.isfinite(args.budget_s) else None},
            {"seconds": seconds, **counts})  # fmt: skip
    bad = counts["failed"] + counts["timeout"]
    print(f"\n{counts['ok']} passed, {bad} failed or timed out, {counts['skipped']} skipped, "
          f"{counts['not-run']} not run (budget), {seconds:.0f} s; log: {log.path}")  # fmt: skip
    return 1 if bad or counts["not-run"] else 0


if __name__ == "__main__":
    sys.exit(main())
