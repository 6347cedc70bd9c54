"""Every test module belongs to exactly one group: a module-level ``pytestmark`` naming ``pytest.mark.unit``,
``integration``, ``server`` or ``statistical`` (alone or in a list beside other marks such as ``skipif``), and
each group is registered in pyproject.toml. A new module without a group fails here. Reads files only; and
the tests' cache folder is their own (tests/conftest.py)."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import List

import pytest

pytestmark = pytest.mark.unit

TESTS = Path(__file__).resolve().parent
GROUPS = ("unit", "integration", "server", "statistical")


def module_groups(source: str) -> List[str]:
    """The groups named by the module-level ``pytestmark = ...`` assignments of one module's source."""
    found: List[str] = []
    for node in ast.parse(source).body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        if not any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in targets) or node.value is None:
            continue
        marks = node.value.elts if isinstance(node.value, (ast.List, ast.Tuple)) else [node.value]
        for mark in marks:
            # pytest.mark.<group>: Attribute(value=Attribute(value=Name("pytest"), attr="mark"), attr=<group>)
            if (isinstance(mark, ast.Attribute) and mark.attr in GROUPS and isinstance(mark.value, ast.Attribute)
                    and mark.value.attr == "mark" and isinstance(mark.value.value, ast.Name) and mark.value.value.id == "pytest"):
                found.append(mark.attr)
    return found


def test_the_check_reads_marks_as_written() -> None:
    """The parser itself can fail: it finds one group alone, one in a list, none in a function, two as two."""
    assert module_groups("import pytest\npytestmark = pytest.mark.unit\n") == ["unit"]
    assert module_groups("pytestmark = [pytest.mark.server, pytest.mark.skipif(True, reason='x')]\n") == ["server"]
    assert module_groups("def f():\n    pytestmark = pytest.mark.unit\n") == []
    assert module_groups("pytestmark = pytest.mark.slow\n") == []
    assert module_groups("pytestmark = (pytest.mark.unit, pytest.mark.statistical)\n") == ["unit", "statistical"]


def test_every_module_has_exactly_one_group() -> None:
    modules = sorted(TESTS.glob("test_*.py"))
    assert len(modules) > 50, modules  # the glob found the suite
    wrong = []
    for path in modules:
        groups = module_groups(path.read_text())
        if len(groups) != 1:
            wrong.append(f"tests/{path.name}: {groups or 'none'}")
    assert not wrong, ("each test module needs exactly one module-level `pytestmark = pytest.mark.<group>`; allowed "
                       f"groups: {', '.join(GROUPS)}; received:\n" + "\n".join(wrong))


def test_groups_are_registered() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    config = tomllib.loads((TESTS.parent / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    registered = {line.split(":", 1)[0] for line in config["markers"]}
    missing = [g for g in (*GROUPS, "slow") if g not in registered]
    assert not missing, f"pyproject.toml's pytest markers lack: {', '.join(missing)}; registered: {sorted(registered)}"
    assert "-m" not in config.get("addopts", ""), "a plain `pytest` runs every group: no -m in addopts"


def test_the_tests_cache_is_their_own_and_announced() -> None:
    """The tests write mlx-spec's cache (GGUF conversions, ...) into a temporary folder of their own, never into
    ~/.cache/mlx-speculative unless the caller's $MLX_SPEC_CACHE says so, and docs/testing.md says it."""
    import os

    from conftest import TEST_CACHE
    from mlx_speculative.hooks import knobs

    assert "`MLX_SPEC_CACHE`" in (TESTS.parent / "docs" / "testing.md").read_text()
    if TEST_CACHE is None:
        pytest.skip("$MLX_SPEC_CACHE was set by the caller: the tests use it")
    home = os.path.join(os.path.expanduser("~"), ".cache", "mlx-speculative")
    assert knobs.cache_root() == TEST_CACHE != home and os.path.isdir(TEST_CACHE)
