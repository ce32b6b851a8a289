"""effdl reaches into torch only through its public API: no private attribute of another object
(a tensor, an autograd node, the autograd engine) and no private torch module, in the package's
source."""

from __future__ import annotations

import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "effdl"
EXEMPT: set[str] = set()  # every module keeps to the public API
PRIVATE_TORCH_NAMES = (
    "_backward_hooks",
    "_register_hook_dict",
    "_version",
    "_base",
    "_execution_engine",
    "_python_dispatch",
    "_current_graph_task_id",
    "_will_engine_execute_node",
    "_is_view",
)
PRIVATE_ACCESS = re.compile(r"\.(" + "|".join(PRIVATE_TORCH_NAMES) + r")\b")
# Any ``x._name`` but on the object itself or on a class's own name.
FOREIGN_PRIVATE_ACCESS = re.compile(r"(?<!\bself)(?<!\bcls)\._[a-z]\w*")


def sources() -> list[Path]:
    return sorted(
        p for p in PACKAGE.rglob("*.py") if p.relative_to(PACKAGE).as_posix() not in EXEMPT
    )


def hits(pattern: re.Pattern[str], path: Path) -> list[str]:
    lines = path.read_text(encoding="utf-8").splitlines()
    return [f"{path.relative_to(PACKAGE)}:{n}: {line.strip()}"
            for n, line in enumerate(lines, 1) if pattern.search(line)]  # fmt: skip


def test_the_pattern_catches_what_it_must() -> None:
    for line in ("t._backward_hooks = {}", "node._register_hook_dict(t)", "v._version",
                 "v._base.grad_fn", "torch.autograd.Variable._execution_engine.queue_callback(f)",
                 "from torch.utils._python_dispatch import TorchDispatchMode"):  # fmt: skip
        assert PRIVATE_ACCESS.search(line), line
    assert not PRIVATE_ACCESS.search("self._versions = 1; t.base_node; t.version")
    assert FOREIGN_PRIVATE_ACCESS.search("x = t._foo")
    assert not FOREIGN_PRIVATE_ACCESS.search("self._foo = cls._bar")


def test_no_private_torch_attribute_or_module_is_used() -> None:
    found = [hit for path in sources() for hit in hits(PRIVATE_ACCESS, path)]
    assert not found, "\n".join(found)


def test_no_module_touches_a_private_attribute_of_another_object() -> None:
    found = [hit for path in sources() for hit in hits(FOREIGN_PRIVATE_ACCESS, path)]
    assert not found, "\n".join(found)
