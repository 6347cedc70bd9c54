"""Plugins and drafters import the host only through its API module, ``hooks/api.py``.

A check over the syntax tree of every .py file under plugin/, drafters/, benchmarks/, testing/ and examples/: an import of a
host module other than ``hooks.api`` (absolute ``mlx_speculative.hooks.X``, relative ``..hooks.X``,
``from .. import hooks``, ``from ..hooks import X``; at module level or inside a function) is reported
as file:line, and so is a private name read through the API (``from ..hooks.api import _x``,
``tm._x``). The API itself re-exports the same objects as their home modules, lists in ``__all__``
exactly the names its users import, and exports every one of them.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path
from typing import Dict, List, Optional, Set, Tuple

import pytest

import mlx_speculative.hooks.api as api

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("plugin", "drafters", "benchmarks", "testing", "examples")
HOST = "mlx_speculative.hooks"
API = HOST + ".api"


def _package(path: Path) -> Optional[List[str]]:
    """The package a file under the repository belongs to (``drafters/dflash/model.py`` ->
    mlx_speculative.drafters.dflash); None outside the mlx_speculative packages (examples/)."""
    rel = path.relative_to(ROOT).parts
    if rel[0] not in ("plugin", "drafters", "hooks", "benchmarks", "testing"):
        return None
    return ["mlx_speculative", *rel[:-1]]


def _resolve(node: ast.ImportFrom, package: Optional[List[str]]) -> Optional[str]:
    """The absolute module of a ``from X import ...`` (None: a relative import outside our packages)."""
    if node.level == 0:
        return node.module
    if package is None or node.level > len(package):
        return None
    base = package[: len(package) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def _is_host(module: str) -> bool:
    return module == HOST or module.startswith(HOST + ".")


def violations(source: str, name: str, package: Optional[List[str]]) -> List[str]:
    """``name:line: why`` for every host import other than hooks.api, and every private name read
    through it, in ``source`` (a file of ``package``)."""
    tree = ast.parse(source, name)
    found: List[str] = []
    via_api: Set[str] = set()  # local names bound to the API module or to names it exports
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _is_host(alias.name) and alias.name != API:
                    found.append(f"{name}:{node.lineno}: imports {alias.name} (import the host through {API})")
                elif alias.name == API:
                    via_api.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom):
            module = _resolve(node, package)
            if module is None:
                continue
            for alias in node.names:
                full = f"{module}.{alias.name}"
                if module == API:
                    via_api.add(alias.asname or alias.name)
                    if alias.name.startswith("_"):
                        found.append(f"{name}:{node.lineno}: imports the private {alias.name} from {API}")
                elif full == API:
                    via_api.add(alias.asname or alias.name)
                elif _is_host(module) or _is_host(full):
                    found.append(f"{name}:{node.lineno}: imports {full} (import the host through {API})")
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in via_api
                and node.attr.startswith("_") and not node.attr.startswith("__")):
            found.append(f"{name}:{node.lineno}: reads the private {node.value.id}.{node.attr} through {API}")
    return found


def _files() -> List[Path]:
    return sorted(p for d in SCANNED for p in (ROOT / d).rglob("*.py") if ".venv" not in p.parts)


def _api_imports(path: Path) -> Set[str]:
    """The names ``path`` imports from hooks.api."""
    tree = ast.parse(path.read_text(), str(path))
    return {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
            and _resolve(n, _package(path)) == API for a in n.names}


def test_plugins_and_drafters_import_the_host_only_through_its_api() -> None:
    files = _files()
    assert len(files) > 50 and any(p.parts[-2:] == ("dflash", "model.py") for p in files)
    found = [v for p in files for v in violations(p.read_text(), str(p.relative_to(ROOT)), _package(p))]
    assert not found, "host imports outside hooks/api.py:\n" + "\n".join(found)


@pytest.mark.parametrize("source, package, expected", [
    ("from ..hooks.batch import forward\n", ["mlx_speculative", "plugin"],
     "x.py:1: imports mlx_speculative.hooks.batch.forward"),
    ("def f():\n    from ...hooks import knobs\n", ["mlx_speculative", "drafters", "dflash"],
     "x.py:2: imports mlx_speculative.hooks.knobs"),
    ("from .. import hooks\n", ["mlx_speculative", "plugin"], "x.py:1: imports mlx_speculative.hooks"),
    ("import mlx_speculative.hooks.state as s\n", None, "x.py:1: imports mlx_speculative.hooks.state"),
    ("from mlx_speculative.hooks.loading import read_config\n", None,
     "x.py:1: imports mlx_speculative.hooks.loading.read_config"),
    ("from ..hooks.api import _LAZY\n", ["mlx_speculative", "benchmarks"], "x.py:1: imports the private _LAZY"),
    ("from ...hooks.api import knobs as k\nx = k._secret(1)\n", ["mlx_speculative", "drafters", "mtp"],
     "x.py:2: reads the private k._secret"),
])
def test_the_checker_reports_a_forbidden_import(source: str, package: Optional[List[str]], expected: str) -> None:
    found = violations(source, "x.py", package)
    assert len(found) == 1 and found[0].startswith(expected), found


@pytest.mark.parametrize("source, package", [
    ("from ..hooks.api import DecodeBatch, forward\n", ["mlx_speculative", "plugin"]),
    ("def f():\n    from ...hooks.api import knobs\n    return knobs.value('x')\n",
     ["mlx_speculative", "drafters", "dflash"]),
    ("from mlx_speculative.hooks.api import read_config\nfrom mlx_speculative.drafters.base import Drafter\n", None),
    ("from .hooks import batch\n", None),  # a relative import in a third-party package is its own
])
def test_the_checker_accepts_the_api(source: str, package: Optional[List[str]]) -> None:
    assert violations(source, "x.py", package) == []


def _home_modules() -> Dict[str, Tuple[str, Optional[str]]]:
    """name -> (home module, attribute; None: the module itself), from api.py's own imports and its lazy table."""
    tree = ast.parse((ROOT / "hooks" / "api.py").read_text())
    homes: Dict[str, Tuple[str, Optional[str]]] = {}
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            for a in node.names:
                homes[a.asname or a.name] = (node.module, a.name) if node.module else (a.name, None)
    homes.update({k: (m, a) for k, (m, a) in api._LAZY.items()})
    return homes


def test_the_api_re_exports_the_home_modules_objects() -> None:
    assert len(api.__all__) == len(set(api.__all__))
    missing = [n for n in api.__all__ if not hasattr(api, n)]
    assert not missing, f"hooks.api lists names it does not export: {missing}"
    assert not [n for n in api.__all__ if n.startswith("_")]
    homes = _home_modules()
    assert set(api.__all__) == set(homes), sorted(set(api.__all__) ^ set(homes))
    for name, (module, attr) in homes.items():
        home = importlib.import_module(f"{HOST}.{module}")
        assert getattr(api, name) is (home if attr is None else getattr(home, attr)), name
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        getattr(api, "nope")


def test_the_api_lists_exactly_the_names_its_users_import() -> None:
    used = set().union(*(_api_imports(p) for p in _files()))
    assert used - set(api.__all__) == set(), "imported from hooks.api but not in its __all__"
    assert set(api.__all__) - used == set(), "in hooks.api's __all__ but imported by no plugin or drafter"


CUDA_BACKEND = "cuda"  # the package of the plugin's CUDA backend: plugin/cuda/


def backend_imports(source: str, name: str, package: Optional[List[str]]) -> List[str]:
    """``name:line: module`` for every import of the plugin's CUDA backend (the package plugin/cuda/ or any of its
    modules) in ``source``."""
    found: List[str] = []
    for node in ast.walk(ast.parse(source, name)):
        modules: List[str] = []
        if isinstance(node, ast.Import):
            modules = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = _resolve(node, package)
            if module is not None:
                modules = [module] + [f"{module}.{a.name}" for a in node.names]
        for m in modules:
            part = m[len("mlx_speculative.plugin."):].split(".")[0] if m.startswith("mlx_speculative.plugin.") else ""
            if part == CUDA_BACKEND:
                found.append(f"{name}:{node.lineno}: {m}")
                break
    return found


def test_drafters_do_not_import_the_cuda_backend() -> None:
    """Drafters get what the backend offers (a cache factory, compiled calls, routing) through the hook contract
    (``DraftTarget.backend``, a ``hooks.api.DraftBackend``)."""
    files = sorted((ROOT / "drafters").rglob("*.py"))
    assert len(files) > 10
    found = [v for p in files for v in backend_imports(p.read_text(), str(p.relative_to(ROOT)), _package(p))]
    assert not found, found
    # The check itself can fail: a relative and an absolute import of backend modules are both reported.
    pkg = ["mlx_speculative", "drafters", "dflash"]
    assert backend_imports("from ...plugin.cuda import backend\n", "x.py", pkg) == [
        "x.py:1: mlx_speculative.plugin.cuda"]
    assert backend_imports("import mlx_speculative.plugin.cuda.cuda_matmul as m\n", "y.py", pkg) == [
        "y.py:1: mlx_speculative.plugin.cuda.cuda_matmul"]
    assert backend_imports("from ...plugin import cuda\n", "w.py", pkg) == ["w.py:1: mlx_speculative.plugin.cuda"]
    assert backend_imports("from ...plugin.draft import DraftError\n", "z.py", pkg) == []
