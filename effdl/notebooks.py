"""Execute the report notebooks against a results folder and write executed copies and HTML.

    python3 -m effdl.notebooks --results runs --out runs/reports           # fresh demo logs
    python3 -m effdl.notebooks --results reports/results --in-place        # committed GPU logs

The results folder reaches each notebook through ``$EFFDL_RESULTS`` (read with
:func:`effdl.results.results_dir`); notebooks run with ``reports/`` as working directory.
A notebook that fails is reported by name and the command exits non-zero; the executed copy is
written only when execution succeeded (a temporary file is renamed into place).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from effdl.results import RESULTS_ENV_VAR

REPORTS = Path(__file__).resolve().parent.parent / "reports"


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def execute_notebook(
    notebook: Path, results: Path, out_dir: Path | None, timeout: int = 900
) -> tuple[Path, Path | None]:
    """Run ``notebook`` top to bottom with ``$EFFDL_RESULTS=results``.

    Writes ``<out_dir>/<name>.ipynb`` and ``.html`` (or, with ``out_dir=None``, overwrites the
    notebook in place and writes no HTML). Returns the paths written.
    """
    import nbclient
    import nbformat
    from nbconvert import HTMLExporter

    nb = nbformat.read(notebook, as_version=4)
    previous = os.environ.get(RESULTS_ENV_VAR)
    os.environ[RESULTS_ENV_VAR] = str(results.resolve())
    try:
        nbclient.NotebookClient(
            nb,
            timeout=timeout,
            kernel_name="python3",
            resources={"metadata": {"path": str(notebook.parent)}},
        ).execute()
    finally:
        if previous is None:
            os.environ.pop(RESULTS_ENV_VAR, None)
        else:
            os.environ[RESULTS_ENV_VAR] = previous
    if out_dir is None:
        _write_atomic(notebook, nbformat.writes(nb))
        return notebook, None
    out_dir.mkdir(parents=True, exist_ok=True)
    ipynb = out_dir / notebook.name
    html = ipynb.with_suffix(".html")
    _write_atomic(ipynb, nbformat.writes(nb))
    body, _ = HTMLExporter().from_notebook_node(nb)
    _write_atomic(html, body)
    return ipynb, html


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--results", type=Path, required=True, help="folder of run logs (<task>/*.jsonl)"
    )
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--out", type=Path, help="folder for executed copies and HTML")
    where.add_argument("--in-place", action="store_true", help="overwrite reports/*.ipynb")
    p.add_argument("notebooks", nargs="*", type=Path, help="default: every reports/*.ipynb")
    args = p.parse_args(argv)

    if not args.results.is_dir():
        print(f"effdl.notebooks: error: --results {args.results} is not a folder", file=sys.stderr)
        return 2
    notebooks = args.notebooks or sorted(REPORTS.glob("*.ipynb"))
    failed = []
    for nb in notebooks:
        t0 = time.perf_counter()
        try:
            written = execute_notebook(nb, args.results, None if args.in_place else args.out)
        except Exception as e:  # report every notebook, then fail
            first = str(e).strip().splitlines()
            print(f"FAILED  {nb.name}: {type(e).__name__}: {first[-1] if first else ''}")
            failed.append(nb.name)
            continue
        print(
            f"ok      {nb.name} ({time.perf_counter() - t0:.0f} s) -> "
            + ", ".join(str(w) for w in written if w)
        )
    if failed:
        print(f"{len(failed)} notebook(s) failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
