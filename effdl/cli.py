"""What every task script shares at its edge: common flags, one-line errors, the summary table.

Scripts stay thin: they parse arguments with :func:`base_parser`, wrap their body in
:func:`run_main` (which turns :class:`UsageError` into a one-line message and exit code 2,
without a traceback), log with :class:`effdl.results.RunLog` under ``--out``, and end with
:func:`print_table`.
"""

from __future__ import annotations

import argparse
import random
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from effdl.profiling.timing import resolve_device


class UsageError(Exception):
    """Bad arguments or input data; shown to the user as one line, no traceback."""


def base_parser(description: str, default_out: str) -> argparse.ArgumentParser:
    """An ArgumentParser with the flags every task script takes.

    ``--device`` (auto|cpu|cuda|cuda:N), ``--quick`` (small sizes for a CPU smoke run),
    ``--out`` (folder for run logs, default ``default_out``), ``--seed``.
    """
    p = argparse.ArgumentParser(
        description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--device", default="auto", help="auto = cuda if available, else cpu")
    p.add_argument("--quick", action="store_true", help="small sizes: a smoke run on a CPU")
    p.add_argument("--out", type=Path, default=Path(default_out), help="folder for run logs")
    p.add_argument("--seed", type=int, default=0)
    return p


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


def device_from_arg(arg: str) -> torch.device:
    """Parse ``--device``; asking for CUDA on a machine without it is a usage error."""
    try:
        dev = resolve_device(arg)
    except (RuntimeError, ValueError) as e:
        raise UsageError(f"--device: cannot parse {arg!r} ({e})") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(
            f"--device {arg}: CUDA is not available on this machine (use --device cpu)"
        )
    return dev


def require_path(path: Path, what: str, flag: str) -> Path:
    """Fail with a one-line error unless ``path`` exists; ``what`` says what was expected there."""
    if not path.exists():
        raise UsageError(f"{flag}: {path} does not exist (expected {what})")
    return path


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def format_table(rows: Sequence[Mapping[str, Any]], floatfmt: str = ".4g") -> str:
    """Plain-text table of dict rows (columns from the union of keys, first-seen order)."""
    if not rows:
        return "(no rows)"
    cols: list[str] = []
    for r in rows:
        cols.extend(k for k in r if k not in cols)

    def cell(v: Any) -> str:
        if isinstance(v, float):
            return format(v, floatfmt)
        return "" if v is None else str(v)

    body = [[cell(r.get(c)) for c in cols] for r in rows]
    widths = [max(len(c), *(len(b[i]) for b in body)) for i, c in enumerate(cols)]
    line = lambda vals: "  ".join(v.rjust(w) for v, w in zip(vals, widths, strict=True))  # noqa: E731
    return "\n".join([line(cols), line(["-" * w for w in widths]), *map(line, body)])


def print_table(rows: Sequence[Mapping[str, Any]], title: str | None = None) -> None:
    if title:
        print(f"\n{title}")
    print(format_table(rows), flush=True)


def run_main(main: Callable[[], int | None]) -> None:
    """Run a script's ``main`` and exit; usage errors print one line to stderr and exit 2."""
    prog = Path(sys.argv[0]).name
    try:
        code = main()
    except UsageError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        sys.exit(130)
    sys.exit(code or 0)
