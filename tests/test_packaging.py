"""pyproject.toml declares what effdl imports, and requirements.txt (what `make` installs) agrees.

`pip install -e .` into a fresh environment must give a package whose modules import: every
third-party import in effdl/ is a declared dependency (or, where only a function needs it, in an
extra), the scripts and tests need nothing beyond those, and the installed versions satisfy the
declared bounds.
"""

from __future__ import annotations

import ast
import functools
import importlib
import importlib.metadata
import json
import re
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
SCRIPT_FOLDERS = [
    "task1_loss_scaling",
    "task2_batching",
    "task3_vit_profiling",
    "lm_training",
    "memory_efficient_gpt2",
    "swiglu_checkpoint",
    "tools",
]

# Import names whose distribution is named otherwise (used when it is not installed here).
DISTRIBUTION_OF = {
    "PIL": "pillow",
    "sklearn": "scikit-learn",
    "yaml": "pyyaml",
    "IPython": "ipython",
    "cv2": "opencv-python",
}
IMPORT_NAME_OF = {dist: name for name, dist in DISTRIBUTION_OF.items()}
# Imported but deliberately not declared, and why.
UNDECLARED = {
    "triton": "comes with torch's Linux wheels; imported behind ImportError guards",
    "torchao": "peer compared against by memory_efficient_gpt2/peer_torchao.py only",
    "torchtitan": "peer compared against by lm_training/probes/torchtitan_peer.py only",
}
CATCHES_IMPORT_ERROR = {"ImportError", "ModuleNotFoundError", "Exception", "BaseException"}


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirements(lines: list[str]) -> dict[str, Requirement]:
    reqs = [Requirement(line) for line in lines]
    return {normalize(r.name): r for r in reqs}


RUNTIME = requirements(PYPROJECT["project"]["dependencies"])
EXTRAS = {
    extra: requirements(lines)
    for extra, lines in PYPROJECT["project"].get("optional-dependencies", {}).items()
}
DECLARED = {**RUNTIME, **{n: r for reqs in EXTRAS.values() for n, r in reqs.items()}}


def requirements_txt() -> dict[str, Requirement]:
    lines = (ROOT / "requirements.txt").read_text(encoding="utf-8").splitlines()
    entries = [line.split("#")[0].strip() for line in lines]
    return requirements([e for e in entries if e and not e.startswith("-")])


@functools.cache
def installed_distributions() -> dict[str, list[str]]:
    return importlib.metadata.packages_distributions()


def distribution(import_name: str) -> str:
    installed = installed_distributions().get(import_name)
    if installed:
        return normalize(installed[0])
    return normalize(DISTRIBUTION_OF.get(import_name, import_name))


def _guards_imports(node: ast.Try) -> bool:
    for handler in node.handlers:
        if handler.type is None:
            return True
        types = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
        if any(isinstance(t, ast.Name) and t.id in CATCHES_IMPORT_ERROR for t in types):
            return True
    return False


def _type_checking_only(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports(tree: ast.AST) -> list[tuple[str, str, int]]:
    """(top-level name, 'module' | 'function', line) of every absolute import that an
    ImportError guard or ``if TYPE_CHECKING:`` does not cover."""
    found = []

    def visit(node: ast.AST, where: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(node, ast.Try) and child in node.body and _guards_imports(node):
                continue
            if isinstance(node, ast.If) and child in node.body and _type_checking_only(node):
                continue
            inner = where
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                inner = "function"
            if isinstance(child, ast.Import):
                found.extend((a.name.split(".")[0], where, child.lineno) for a in child.names)
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                found.append((child.module.split(".")[0], where, child.lineno))
            visit(child, inner)

    visit(tree, "module")
    return found


def third_party(paths: list[Path], local: set[str]) -> list[tuple[str, str, str]]:
    """(import name, 'module' | 'function', 'file:line') of the third-party imports in ``paths``."""
    out = []
    for path in paths:
        siblings = {p.stem for p in path.parent.glob("*.py")}
        for name, where, line in imports(ast.parse(path.read_text(encoding="utf-8"))):
            if name in sys.stdlib_module_names or name in local or name in siblings:
                continue
            out.append((name, where, f"{path.relative_to(ROOT)}:{line}"))
    return out


def python_files(*folders: str) -> list[Path]:
    return sorted(
        p for f in folders for p in (ROOT / f).rglob("*.py") if "__pycache__" not in p.parts
    )


def test_imports_collects_unguarded_ones_and_where_they_sit():
    tree = ast.parse(
        "import numpy as np\n"
        "import torch.nn\n"
        "from . import sibling\n"
        "if TYPE_CHECKING:\n    from transformers import GPT2Config\n"
        "try:\n    import triton\nexcept ImportError:\n    triton = None\n"
        "try:\n    import yaml\nfinally:\n    pass\n"
        "def f():\n    import psutil\n"
        "    try:\n        from sklearn import datasets\n    except (OSError, ImportError):\n"
        "        pass\n"
    )
    assert imports(tree) == [
        ("numpy", "module", 1),
        ("torch", "module", 2),
        ("yaml", "module", 11),
        ("psutil", "function", 15),
    ]


def test_a_third_party_name_maps_to_its_distribution():
    assert distribution("PIL") == "pillow"
    assert distribution("sklearn") == "scikit-learn"
    assert distribution("yaml") == "pyyaml"
    assert distribution("torch") == "torch"


def test_every_effdl_import_is_declared():
    """Module-level imports need a dependency; one inside a function may sit in an extra
    (effdl.notebooks imports nbclient only when it executes notebooks)."""
    missing = []
    for name, where, at in third_party(python_files("effdl"), local={"effdl"}):
        dist = distribution(name)
        allowed = RUNTIME if where == "module" else DECLARED
        if dist not in allowed and name not in UNDECLARED:
            missing.append(f"{at}: {name} ({dist}, {where} level)")
    assert not missing, "declare in pyproject.toml [project] dependencies:\n" + "\n".join(missing)


def test_scripts_and_tests_need_nothing_undeclared():
    paths = python_files(*SCRIPT_FOLDERS, "tests")
    missing = [
        f"{at}: {name}"
        for name, _, at in third_party(paths, local={"effdl", "tests"})
        if distribution(name) not in DECLARED and name not in UNDECLARED
    ]
    assert not missing, "\n".join(missing)


def test_report_notebooks_need_only_the_reports_extra():
    allowed = {**RUNTIME, **EXTRAS["reports"]}
    missing = []
    for notebook in sorted((ROOT / "reports").glob("*.ipynb")):
        cells = json.loads(notebook.read_text(encoding="utf-8"))["cells"]
        code = "\n".join(
            "".join(c["source"]) for c in cells if c["cell_type"] == "code"
        ).splitlines()
        tree = ast.parse(
            "\n".join(line for line in code if not line.lstrip().startswith(("%", "!")))
        )
        for name, _, line in imports(tree):
            if name in sys.stdlib_module_names or name == "effdl":
                continue
            if distribution(name) not in allowed:
                missing.append(f"{notebook.name}:{line}: {name}")
    assert not missing, "add to the reports extra:\n" + "\n".join(missing)


def test_extras_are_named_for_what_they_install():
    assert {"test", "reports"} <= set(EXTRAS)
    assert {"pytest", "hypothesis"} <= set(EXTRAS["test"])
    assert {"nbclient", "nbformat", "nbconvert", "ipykernel", "matplotlib"} <= set(
        EXTRAS["reports"]
    )
    for name in UNDECLARED:
        assert normalize(name) not in DECLARED, name


def test_declared_versions_are_lower_bounds_not_pins():
    for name, req in DECLARED.items():
        operators = {spec.operator for spec in req.specifier}
        assert operators == {">="}, f"{name}: {req.specifier} (a lower bound, >=X, only)"
        assert req.marker is None and not req.url, name


def test_requirements_txt_installs_exactly_the_declared_set_at_compatible_versions():
    pinned = requirements_txt()
    assert set(pinned) == set(DECLARED), {
        "only in pyproject.toml": sorted(set(DECLARED) - set(pinned)),
        "only in requirements.txt": sorted(set(pinned) - set(DECLARED)),
    }
    for name, req in DECLARED.items():
        floors = [Version(s.version) for s in pinned[name].specifier if s.operator in {">=", "=="}]
        assert floors, f"requirements.txt: {name} needs a lower bound"
        assert all(req.specifier.contains(v, prereleases=True) for v in floors), (
            f"{name}: requirements.txt {pinned[name].specifier} allows versions below "
            f"pyproject.toml's {req.specifier}"
        )


def test_every_declared_distribution_is_installed_at_an_allowed_version():
    for name, req in DECLARED.items():
        try:
            version = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pytest.fail(f"{name} is declared but not installed (make installs requirements.txt)")
        assert req.specifier.contains(version, prereleases=True), f"{name} {version}: {req}"


def test_every_runtime_dependency_imports():
    names = installed_distributions()
    for dist in RUNTIME:
        tops = {n for n, ds in names.items() if dist in map(normalize, ds)}
        module = IMPORT_NAME_OF.get(dist, dist.replace("-", "_"))
        assert module in tops, f"{dist} provides {sorted(tops)}, not {module}"
        importlib.import_module(module)
