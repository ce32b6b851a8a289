"""The tables a report opens with: each question of its assignment answered with a number from
the logs and a link to the section that shows it, then the project's own targets, met or not.

A report's first code cell builds its rows from the run logs and displays these tables
(``display(Markdown(answers_table(rows)))``), so the numbers change with the logs, never by hand.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from effdl.tables import MISSING


@dataclass(frozen=True)
class Answer:
    """One graded item: ``asked`` (a few words of the assignment's wording), ``answer`` (with its
    number and unit) and ``section`` (the heading of the section that shows the evidence)."""

    asked: str
    answer: str
    section: str


@dataclass(frozen=True)
class Target:
    """One of the project's own targets: ``what`` (the target as set), ``measured`` (the number,
    or None where no log holds it) and ``met`` (None: not measured)."""

    what: str
    measured: str | None
    met: bool | None


HEADERS = {
    "en": ("Asked", "Answer", "Shown in", "Target (ours)", "Measured", "Verdict"),
    "ru": ("Вопрос", "Ответ", "Где показано", "Цель (наша)", "Измерено", "Итог"),
}
VERDICTS = {
    "en": {True: "met", False: "**not met**", None: MISSING},
    "ru": {True: "выполнено", False: "**не выполнено**", None: "не измерено"},
}


def anchor(heading: str) -> str:
    """The link target Jupyter and nbconvert give a markdown heading: its text with spaces as
    hyphens (``"## Loss curves (fp16)"`` -> ``#Loss-curves-(fp16)``)."""
    return "#" + heading.lstrip("#").strip().replace(" ", "-")


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


# A number formatted from a NaN or an infinity ("nan ms", "nanx", "inf%"), not a word that starts so.
_NOT_A_NUMBER = re.compile(r"(?<![A-Za-z])(nan|-?inf)(?![a-wyzA-Z])")


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Markdown table text; a row that prints a NaN or an infinity is refused (ValueError naming
    the row), so a missing value is said in words ("not measured") or not said at all."""
    for row in rows:
        if any(_NOT_A_NUMBER.search(str(cell)) for cell in row):
            raise ValueError(f"table row {row[0]!r} prints a NaN or an infinity: {list(row)}")
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def answers_table(answers: Sequence[Answer], lang: str = "en") -> str:
    """The answers as markdown table text, one row per item, each linking to its section."""
    asked, answer, shown = HEADERS[lang][:3]
    rows = [(a.asked, a.answer, f"[{a.section}]({anchor(a.section)})") for a in answers]
    return _table((asked, answer, shown), rows)


def targets_table(targets: Sequence[Target], lang: str = "en") -> str:
    """The project's own targets as markdown table text: the measured number, met or not."""
    rows = [
        (t.what, MISSING if t.measured is None else t.measured, VERDICTS[lang][t.met])
        for t in targets
    ]
    return _table(HEADERS[lang][3:], rows)
