"""Loading a task script as a module, for the script tests (scripts import their siblings by
name, so their folder is on sys.path while the module executes)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent


def load_script(folder: str, name: str) -> ModuleType:
    """``<ROOT>/<folder>/<name>.py`` as the module ``<folder>_<name>``."""
    path = ROOT / folder
    sys.path.insert(0, str(path))
    try:
        spec = importlib.util.spec_from_file_location(f"{folder}_{name}", path / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up there
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(path))
    return module
