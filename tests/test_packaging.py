"""Every subpackage under hooks/, plugin/ and drafters/ ships in the wheel, under mlx_speculative."""

from __future__ import annotations

from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[1]
TOP = {"hooks": "mlx_speculative.hooks", "plugin": "mlx_speculative.plugin", "drafters": "mlx_speculative.drafters"}


def test_pyproject_lists_every_subpackage() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert config["package-dir"] == {v: k for k, v in TOP.items()}
    found = set()
    for folder, package in TOP.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder).parts
            found.add(".".join((package, *rel)))
    assert set(config["packages"]) == found
    assert not any(p.split(".")[0] in TOP for p in config["packages"]), "nothing installs as top-level hooks/plugin/drafters"
