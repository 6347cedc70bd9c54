"""Every subpackage under hooks/, plugin/, drafters/, demo/, benchmarks/ and testing/ ships in the wheel, under
mlx_speculative."""

from __future__ import annotations

from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
TOP = {"hooks": "mlx_speculative.hooks", "plugin": "mlx_speculative.plugin", "drafters": "mlx_speculative.drafters",
       "demo": "mlx_speculative.demo", "benchmarks": "mlx_speculative.benchmarks", "testing": "mlx_speculative.testing"}


def test_pyproject_lists_every_subpackage() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert config["package-dir"] == {v: k for k, v in TOP.items()}
    found = set()
    for folder, package in TOP.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder).parts
            found.add(".".join((package, *rel)))
    # and the demo's checkpoint folders: data, no code (demo/build.py makes them)
    found |= {f"mlx_speculative.demo.{d.name}" for d in (ROOT / "demo").iterdir() if (d / "config.json").is_file()}
    assert set(config["packages"]) == found
    assert not any(p.split(".")[0] in TOP for p in config["packages"]), "nothing installs as top-level hooks/plugin/drafters"


def _imported_packages(path: Path) -> set:
    """The top-level packages (hooks, plugin, drafters) a module imports, relative imports resolved."""
    import ast

    folder = path.relative_to(ROOT).parts
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:  # relative: climb from the module's package
                base = list(folder[:-1])[: len(folder) - node.level]
                parts = base + (node.module.split(".") if node.module else [])
            else:
                parts = (node.module or "").split(".")[1:] if (node.module or "").startswith("mlx_speculative") else []
            if parts and parts[0] in TOP:
                found.add(parts[0])
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("mlx_speculative."):
                    found.add(alias.name.split(".")[1])
    return found


def test_no_import_cycle_between_hooks_drafters_and_plugin() -> None:
    """The host never imports the plugin, the drafters or the test fixtures (only the demo's folder names); the
    drafters never import the plugin (their tiny.py fixtures build on testing/); the plugin never imports the test
    fixtures nor the bench (a plugin of its own, benchmarks/, which drives the plugin); the demo's build imports none
    of them (it runs `mlx-spec train-drafter`)."""
    allowed = {"hooks": {"hooks", "demo"}, "drafters": {"hooks", "drafters", "testing"},
               "plugin": {"hooks", "drafters", "plugin"}, "demo": {"demo"}, "testing": {"hooks", "testing"},
               "benchmarks": {"hooks", "drafters", "plugin", "benchmarks"}}
    bad = []
    for folder in TOP:
        for path in sorted((ROOT / folder).rglob("*.py")):
            extra = _imported_packages(path) - allowed[folder]
            if extra:
                bad.append(f"{path.relative_to(ROOT)} imports {sorted(extra)}")
    assert not bad, bad
