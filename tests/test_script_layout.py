"""Task scripts stay thin: at most 400 lines each, and none imports a sibling script (shared
logic lives in effdl)."""

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
TASKS = ("task1_loss_scaling", "task2_batching", "task3_vit_profiling", "memory_efficient_gpt2",
         "swiglu_checkpoint", "lm_training")  # fmt: skip
SCRIPTS = sorted(p for task in TASKS for p in (REPO / task).rglob("*.py"))


def test_there_are_scripts_to_check():
    assert len(SCRIPTS) > 20


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(REPO)))
def test_script_is_at_most_400_lines_and_imports_no_sibling(script: Path):
    source = script.read_text(encoding="utf-8")
    assert len(source.splitlines()) <= 400
    siblings = {p.stem for p in script.parent.glob("*.py")} - {script.stem}
    imported = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            imported.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            imported.add(node.module.split(".")[0])
    assert not imported & siblings
