"""Prompts for a code model, cut from Python source as the file spells them: a function's
signature with its docstring, or a class header with its docstring.

:func:`prompt_candidates` finds them with :mod:`ast`: public functions, methods and classes (no
leading underscore, not nested in a function) whose body opens with a docstring on a line of its
own. :func:`select_prompts` picks ``n`` deterministically: a third
classes, the rest functions, each kind in the order of a hash of (path, qualified name), so the
picks spread over the files instead of following the alphabet, one per file while files last.
"""

from __future__ import annotations

import ast
import hashlib
from collections.abc import Iterable
from dataclasses import dataclass

from effdl.data.stdlib_code import SourceFile

KINDS = ("function", "class")
MIN_PROMPT_CHARS = 40  # a bare one-line header says too little to continue from
MAX_PROMPT_CHARS = 800  # a docstring of a page is a document, not a prompt


@dataclass(frozen=True)
class CodePrompt:
    """Lines ``line``.. of the file at ``path`` (1-based), ending with a newline: a function's
    ``def`` or a class's header, through its docstring."""

    path: str
    name: str  # qualified: Class.method
    kind: str  # one of KINDS
    line: int
    text: str


def _docstring_end(node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) -> int | None:
    """The last line (1-based) of ``node``'s docstring, or None when its body does not open
    with one on a line of its own."""
    first = node.body[0]
    value = getattr(first, "value", None)
    is_doc = isinstance(value, ast.Constant) and isinstance(value.value, str)
    return first.end_lineno if is_doc and first.lineno > node.lineno else None


def prompt_candidates(file: SourceFile) -> list[CodePrompt]:
    """Every prompt of ``file`` in source order (none when it does not parse)."""
    try:
        tree = ast.parse(file.text)
    except (SyntaxError, ValueError):
        return []
    lines = file.text.splitlines()
    found: list[CodePrompt] = []

    def visit(body: Iterable[ast.stmt], scope: str) -> None:
        for node in body:
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            name = f"{scope}{node.name}"
            end = None if node.name.startswith("_") else _docstring_end(node)
            if end is not None:
                text = "\n".join(lines[node.lineno - 1 : end]).rstrip() + "\n"
                kind = "class" if isinstance(node, ast.ClassDef) else "function"
                found.append(CodePrompt(file.path, name, kind, node.lineno, text))
            if isinstance(node, ast.ClassDef):  # methods; functions nested in functions are not
                visit(node.body, f"{name}.")

    visit(tree.body, "")
    return found


def _order(prompt: CodePrompt) -> bytes:
    return hashlib.sha256(f"{prompt.path}:{prompt.name}".encode()).digest()


def select_prompts(
    files: Iterable[SourceFile],
    n: int,
    min_chars: int = MIN_PROMPT_CHARS,
    max_chars: int = MAX_PROMPT_CHARS,
) -> list[CodePrompt]:
    """``n`` prompts of ``files`` between ``min_chars`` and ``max_chars`` characters:
    ``n // 3`` classes, then the functions, each kind in hash order (:func:`_order`), a file's
    second prompt only once every file with a candidate has given one. ValueError when the
    files hold fewer than that many of a kind."""
    candidates = [
        p for f in files for p in prompt_candidates(f) if min_chars <= len(p.text) <= max_chars
    ]
    wanted = {"class": n // 3, "function": n - n // 3}
    used: set[str] = set()
    picked: list[CodePrompt] = []
    for kind in ("function", "class"):
        ordered = sorted((p for p in candidates if p.kind == kind), key=_order)
        if len(ordered) < wanted[kind]:
            raise ValueError(f"the files hold {len(ordered)} {kind} prompts, need {wanted[kind]}")
        fresh = [p for p in ordered if p.path not in used]
        chosen = (fresh + [p for p in ordered if p.path in used])[: wanted[kind]]
        used.update(p.path for p in chosen)
        picked += chosen
    return picked
