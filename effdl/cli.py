"""What every task script shares at its edge: common flags, typed configs, one-line errors.

A script keeps its settings in a config dataclass with a full and a ``--quick`` preset; its
flags, bound through :class:`ConfigFlags`, only override fields the user gave, and the result is
validated once. :func:`start_run` is the preamble (device, seed, run log); :func:`run_main` turns
:class:`UsageError` into a one-line message and exit code 2, without a traceback; the run ends
with :func:`print_table`.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import random
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, NoReturn, TypeVar

import numpy as np
import torch

from effdl.results import RunLog, new_run_id
from effdl.tables import format_table

C = TypeVar("C")


class UsageError(Exception):
    """Bad arguments or input data; shown to the user as one line, no traceback."""


class Interrupted(KeyboardInterrupt):
    """Ctrl-C inside a unit of measured work; ``partial`` holds what it measured before, for the
    caller to log before the run ends (:func:`run_main` exits 130 as for any Ctrl-C)."""

    def __init__(self, partial: Any) -> None:
        super().__init__()
        self.partial = partial


class ArgumentParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line (``prog: error: ...``, exit code 2), like
    :func:`run_main`'s: the usage is left to ``--help``."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def base_parser(description: str, default_out: str) -> argparse.ArgumentParser:
    """An ArgumentParser with the flags every task script takes.

    ``--device`` (auto|cpu|cuda|cuda:N), ``--quick`` (small sizes for a CPU smoke run),
    ``--out`` (folder for run logs, default ``default_out``), ``--seed`` (an integer in
    [0, 2**32 - 1], the range numpy's seeding takes).
    """
    p = ArgumentParser(
        description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--device", default="auto", help="auto = cuda if available, else cpu")
    p.add_argument("--quick", action="store_true", help="small sizes: a smoke run on a CPU")
    p.add_argument("--out", type=Path, default=Path(default_out), help="folder for run logs")
    p.add_argument("--seed", type=seed_arg, default=0, help="in [0, 2**32 - 1]")
    return p


MAX_SEED = 2**32 - 1


def seed_arg(text: str) -> int:
    """argparse type of ``--seed``: an integer numpy, torch and random all accept."""
    try:
        seed = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if not 0 <= seed <= MAX_SEED:
        raise argparse.ArgumentTypeError(f"must be in [0, 2**32 - 1], got {seed}")
    return seed


def add_text_corpus_args(p: argparse.ArgumentParser, cache: bool = True) -> None:
    """``--data`` (WikiText-103 files or a parquet; default: the generated corpus) and, with
    ``cache``, ``--cache`` (an .npz of token ids, written on first use and reused after)."""
    p.add_argument(
        "--data",
        type=Path,
        default=None,
        help="wiki.train.raw/.tokens, their folder, or a parquet with a 'text' column; "
        "default: the generated WikiText-103-like corpus",
    )
    if cache:
        p.add_argument(
            "--cache", default=None, help=".npz cache of the token ids (reused if present)"
        )


def resolve_device(device: str | torch.device | None = "auto") -> torch.device:
    """``"auto"``/None -> CUDA when available, else CPU; anything else is passed to torch.device.

    A CUDA device always comes back with its index (``cuda`` -> ``cuda:<current>``): some torch
    APIs, such as ``set_per_process_memory_fraction``, refuse an index-less device.
    """
    if device is None or str(device) == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None and torch.cuda.is_available():
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def device_from_arg(arg: str) -> torch.device:
    """Parse ``--device``; asking for CUDA on a machine without it is a usage error."""
    try:
        dev = resolve_device(arg)
    except (RuntimeError, ValueError) as e:
        raise UsageError(f"--device: cannot parse {arg!r} ({e})") from None
    if dev.type not in ("cpu", "cuda"):
        raise UsageError(f"--device {arg}: expected cpu or cuda (or auto)")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(
            f"--device {arg}: CUDA is not available on this machine (use --device cpu)"
        )
    return dev


def require_cuda(arg: str, what: str) -> torch.device:
    """The CUDA device ``--device`` ``arg`` names (``auto``: the current one), or a UsageError
    saying that ``what`` (a script whose numbers are GPU times: CUDA events, kernel times) has
    nothing to measure on a CPU."""
    if not torch.cuda.is_available():
        raise UsageError(f"{what} needs CUDA; this machine has none")
    dev = device_from_arg(arg)
    if dev.type != "cuda":
        raise UsageError(f"--device {arg}: {what} needs CUDA")
    return dev


def require_path(path: Path, what: str, flag: str) -> Path:
    """Fail with a one-line error unless ``path`` exists; ``what`` says what was expected there."""
    if not path.exists():
        raise UsageError(f"{flag}: {path} does not exist (expected {what})")
    return path


def require_writable_folder(path: Path, flag: str) -> Path:
    """Fail with a one-line error unless ``path`` is a folder this process can write, or can be
    created as one; creates nothing (the run's first write makes it)."""
    path = Path(path)
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise UsageError(f"{flag}: {existing} is a file, expected a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UsageError(f"{flag}: cannot write {path} ({existing} is not writable)")
    return path


def flag_of(name: str) -> str:
    """The command-line flag of a config field: ``batch_size`` -> ``--batch-size``."""
    return "--" + name.replace("_", "-")


@dataclass(frozen=True)
class BoundFlag:
    """A flag :meth:`ConfigFlags.add` bound: the config field, the flag, the keywords it gave
    ``add_argument`` (``type``, ``choices``, ``action``, ``nargs`` ...), and whether the field is
    a folder the run writes (``output``)."""

    field: str
    flag: str
    options: Mapping[str, Any]
    output: bool = False


class ConfigFlags(Generic[C]):
    """Command-line flags bound to the fields of a config dataclass with two presets.

    Every flag added with :meth:`add` defaults to "not given", so :meth:`resolve` starts from the
    full preset (or the quick one under ``--quick``) and replaces exactly the fields the user gave:
    a flag given is honoured, ``--quick`` only changes defaults. The help text shows both presets.
    The config is validated once: ``--out`` (where the parser has it) and every ``output`` field
    must be a folder that can be written, then the config's ``validate()`` method (if it has
    one) checks it, and every number given must be finite.
    """

    def __init__(self, parser: argparse.ArgumentParser, full: C, quick: C | None = None) -> None:
        if not dataclasses.is_dataclass(full):
            raise TypeError(f"ConfigFlags needs a dataclass instance, got {type(full).__name__}")
        self.parser = parser
        self.full = full
        self.quick = full if quick is None else quick
        self._fields = {f.name for f in dataclasses.fields(full)}
        self._bound: list[BoundFlag] = []

    @property
    def bound(self) -> tuple[BoundFlag, ...]:
        """The flags added so far, in order."""
        return tuple(self._bound)

    def add(
        self,
        name: str,
        *,
        flag: str | None = None,
        help: str = "",
        output: bool = False,
        **kwargs: Any,
    ) -> None:
        """Add ``--name`` (or ``flag``) for field ``name``; kwargs go to ``add_argument``.
        ``output``: the field is a folder the run writes, checked to be writable (when set) by
        :meth:`resolve`."""
        if name not in self._fields:
            raise ValueError(f"{type(self.full).__name__} has no field {name!r}")
        full, quick = getattr(self.full, name), getattr(self.quick, name)
        shown = f"default {_show(full)}" + ("" if full == quick else f"; --quick {_show(quick)}")
        flag = flag or flag_of(name)
        self.parser.add_argument(
            flag,
            dest=name,
            default=argparse.SUPPRESS,
            help=f"{help} ({shown})" if help else f"({shown})",
            **kwargs,
        )
        self._bound.append(BoundFlag(name, flag, dict(kwargs), output))

    def resolve(self, args: argparse.Namespace) -> C:
        """The preset ``args.quick`` picks, with every given flag's value; validated."""
        base = self.quick if getattr(args, "quick", False) else self.full
        given = {b.field: getattr(args, b.field) for b in self._bound if hasattr(args, b.field)}
        if getattr(args, "out", None) is not None:
            require_writable_folder(args.out, "--out")
        cfg = dataclasses.replace(base, **given)
        for b in self._bound:
            if b.output and getattr(cfg, b.field) is not None:
                require_writable_folder(getattr(cfg, b.field), b.flag)
        validate = getattr(cfg, "validate", None)
        if validate is not None:
            validate()
        for b in self._bound:  # what validate() left unchecked
            if b.field in given:
                require_finite(b.flag, given[b.field])
        return cfg


def _show(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return " ".join(map(str, value))
    return str(value)


def require_memory(
    flags: str, need_bytes: float, device: torch.device | str, what: str = ""
) -> None:
    """UsageError naming ``flags`` unless ``need_bytes`` fit in what ``device`` has free now
    (GPU memory on CUDA, the host's available memory otherwise); ``what`` says what needs it."""
    device = torch.device(device)
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
    else:
        import psutil

        free = psutil.virtual_memory().available
    if need_bytes > free:
        gib = 2**30
        where = "the host" if device.type == "cpu" else f"the {device.type}"
        raise UsageError(
            f"{flags}: {what + ' ' if what else ''}needs at least {need_bytes / gib:,.1f} GiB, "
            f"{where} has {free / gib:,.1f} GiB free"
        )


def require_finite(flag: str, value: Any) -> None:
    """UsageError naming ``flag`` if ``value`` (or an element of it, for a list) is a float that
    is NaN or infinite: no setting means either."""
    values = value if isinstance(value, (list, tuple)) else [value]
    for v in values:
        if isinstance(v, float) and not math.isfinite(v):
            raise UsageError(f"{flag}: expected a finite number, got {v!r}")


def require_converged(flags: str, what: str, value: float) -> float:
    """``value`` (a measured loss) if finite, else a UsageError naming the ``flags`` that set
    the step size: a diverged run's numbers are not results."""
    if not math.isfinite(value):
        raise UsageError(f"{what} diverged (loss {value}): lower {flags}")
    return value


def require_fits(flags: str, numel: float, what: str, bytes_per_element: int = 4) -> None:
    """UsageError naming ``flags`` unless ``numel`` elements of ``bytes_per_element`` bytes (a
    lower estimate of what the run allocates, from its size flags; ``what`` names it) fit in
    the host's available memory: for a config's ``validate``, before any device is chosen or
    anything is allocated."""
    need = min(numel * bytes_per_element, 1e300)  # a float even for an int past float's range
    require_memory(flags, float(need), "cpu", what)


def require_positive(cfg: Any, *names: str, minimum: float = 1) -> None:
    """UsageError naming the flag unless each field ``names`` of ``cfg`` is a finite number
    >= ``minimum`` (every element, for a list)."""
    for name in names:
        value = getattr(cfg, name)
        values = value if isinstance(value, (list, tuple)) else [value]
        for v in values:
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise UsageError(f"{flag_of(name)}: expected a number, got {v!r}")
            if not math.isfinite(v) or v < minimum:
                raise UsageError(f"{flag_of(name)} must be >= {minimum:g}, got {v!r}")


PROCESSES_PER_CORE = 4  # ranks, workers or threads one flag may start per core, oversubscribed
MIN_PROCESS_CAP = 16  # ... and never fewer than this, on a machine of few cores


def process_cap() -> int:
    """The most processes (ranks, loader workers) or threads one flag may ask for here:
    :data:`PROCESSES_PER_CORE` per core this process may run on, at least
    :data:`MIN_PROCESS_CAP`. Past it a run is a fork bomb, not a measurement."""
    from effdl.parallel.launch import available_cores

    return max(MIN_PROCESS_CAP, PROCESSES_PER_CORE * available_cores())


def require_processes(cfg: Any, *names: str, minimum: int = 0) -> None:
    """UsageError naming the flag unless each field ``names`` of ``cfg`` (a count of processes
    or threads; every element, for a list; None and ``"auto"`` are left alone) is an integer in
    [``minimum``, :func:`process_cap`]."""
    cap = process_cap()
    for name in names:
        value = getattr(cfg, name)
        values = value if isinstance(value, (list, tuple)) else [value]
        for v in values:
            if v is None or v == AUTO:
                continue
            if isinstance(v, bool) or not isinstance(v, int):
                raise UsageError(f"{flag_of(name)}: expected an integer, got {v!r}")
            if v < minimum:
                raise UsageError(f"{flag_of(name)} must be >= {minimum}, got {v}")
            if v > cap:
                raise UsageError(
                    f"{flag_of(name)} {v}: at most {cap} processes or threads on this machine "
                    f"({PROCESSES_PER_CORE} per core, at least {MIN_PROCESS_CAP})"
                )


def require_multiple(cfg: Any, name: str, of: str) -> None:
    """UsageError naming both flags unless field ``name`` of ``cfg`` is a multiple of field
    ``of`` (e.g. a batch made of whole micro-batches)."""
    value, unit = getattr(cfg, name), getattr(cfg, of)
    if value % unit:
        raise UsageError(f"{flag_of(name)} {value} is not a multiple of {flag_of(of)} {unit}")


def require_choices(cfg: Any, name: str, choices: Iterable[str]) -> None:
    """UsageError naming the flag unless field ``name`` (a value or a list) is among ``choices``."""
    choices = list(choices)
    value = getattr(cfg, name)
    values = value if isinstance(value, (list, tuple)) else [value]
    unknown = [v for v in values if v not in choices]
    if unknown:
        raise UsageError(f"{flag_of(name)}: unknown {unknown}; expected one of {choices}")


@dataclass
class Run:
    """What a script's preamble sets up: the device and the run logs, opened before any work."""

    device: torch.device
    logs: dict[str, RunLog]
    run_id: str
    seed: int
    out: Path = field(default_factory=Path)

    @property
    def log(self) -> RunLog:
        """The first (usually only) log."""
        return next(iter(self.logs.values()))

    @property
    def where(self) -> str:
        """The GPU's name, or the CPU's."""
        env = self.log.env
        return env["gpu"] or env["cpu"]


def start_run(
    args: argparse.Namespace,
    task: str,
    logs: str | Sequence[str],
    *,
    quick_cpu: bool = True,
) -> Run:
    """The preamble every script shares: the device from ``--device`` (``auto`` means the CPU
    under ``--quick`` when ``quick_cpu``), all seeds from ``--seed``, and the run logs
    ``--out/<name>`` opened now, so an unwritable ``--out`` fails before the work, not after."""
    arg = args.device
    if quick_cpu and getattr(args, "quick", False) and arg == "auto":
        arg = "cpu"
    device = device_from_arg(arg)
    seed_everything(args.seed)
    names = [logs] if isinstance(logs, str) else list(logs)
    run_id = new_run_id()
    opened = {}
    for name in names:
        path = Path(args.out) / name
        try:
            opened[Path(name).stem] = RunLog(
                path, task=task, create=True, run_id=run_id, seed=args.seed
            )
        except OSError as e:
            raise UsageError(f"--out: cannot write {path} ({e.strerror or e})") from None
    return Run(device=device, logs=opened, run_id=run_id, seed=args.seed, out=Path(args.out))


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def print_table(rows: Sequence[Mapping[str, Any]], title: str | None = None) -> None:
    if title:
        print(f"\n{title}")
    print(format_table(rows), flush=True)


def one_line(text: str) -> str:
    """``text`` with its lines joined by spaces: an error quoting a library's message of several
    lines still reads as one line."""
    return " ".join(line.strip() for line in text.splitlines() if line.strip())


def check_failed(what: str) -> int:
    """A check the script performs failed (a correctness check, a cap, a target): one line on
    stderr naming it, and exit code 1 for :func:`run_main` to return once the logs are written
    (``return check_failed(...)`` from ``main``)."""
    print(f"{Path(sys.argv[0]).name}: failed: {one_line(what)}", file=sys.stderr)
    return 1


def run_main(main: Callable[[], int | None]) -> None:
    """Run a script's ``main`` and exit with the code it returns (``None``: 0; a failed check:
    1, see :func:`check_failed`); usage errors print one line to stderr and exit 2, a run that
    outgrows the device's memory one line and 1."""
    prog = Path(sys.argv[0]).name
    try:
        code = main()
    except UsageError as e:
        print(f"{prog}: error: {one_line(str(e))}", file=sys.stderr)
        sys.exit(2)
    except torch.OutOfMemoryError as e:
        said = ". ".join(one_line(str(e)).split(". ")[:2])  # what ran out, and the request
        print(f"{prog}: error: out of device memory ({said}); a smaller batch, sequence or "
              "model fits", file=sys.stderr)  # fmt: skip
        sys.exit(1)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        sys.exit(130)
    sys.exit(code or 0)


AUTO = "auto"


def int_or_auto(text: str) -> int | str:
    """An argparse type: ``auto`` (a setting decided later, for the device) or an integer."""
    return text if text == AUTO else int(text)


def decide_auto(value: Any, decided: Any) -> Any:
    """``decided`` where ``value`` is ``"auto"``, else ``value`` as the user gave it."""
    return decided if value == AUTO else value
