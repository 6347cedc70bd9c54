"""The user documentation stays true to the tree: README.md is short, every relative link in README.md,
docs/*.md and bench/README.md resolves, every environment variable and YAML key the library reads is
documented in docs/configuration.md, and docs/architecture.md names files that exist, among them every
module a speculative round passes through. Reads files only (no model, no device)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Iterator, List, Set, Tuple

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
LIBRARY = ("hooks", "plugin", "drafters", "benchmarks", "testing")  # the packages whose environment reads must be documented
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")  # [text](target); images are links too for our purpose
# os.environ.get("X" / os.environ["X"] / getenv("X" / environ.get("X"; and NAME = "MLX_SPEC_X" constants
ENV_READ = re.compile(r"""(?:environ\.get\(|environ\[|getenv\()\s*["']([A-Z][A-Z0-9_]+)["']""")
ENV_CONST = re.compile(r"""["']((?:MLX_SPEC|MLX_VLM)_[A-Z0-9_]*[A-Z0-9])["']""")
# Backquoted repository paths in docs/architecture.md: `hooks/batch.py`, `plugin/round.py`, `drafters/dflash/`
PATH = re.compile(r"`((?:hooks|plugin|drafters|demo|benchmarks|bench|testing|tests|examples)/[A-Za-z0-9_./-]*)`")
# Every module one speculative round passes through (propose, verify, accept, commit): the architecture page
# must name each, so that a reader can follow a round file by file.
ROUND_FILES = ("hooks/backend.py", "hooks/batch.py", "hooks/scheduler.py", "hooks/specs.py", "hooks/state.py",
               "hooks/transaction.py", "plugin/hookimpls.py", "plugin/round.py", "plugin/draft.py",
               "plugin/draft_ahead.py", "plugin/cuda/verify_ahead.py", "plugin/verify.py", "plugin/accept.py",
               "plugin/commit.py", "plugin/adaptive.py", "plugin/metrics.py", "drafters/base.py")


def doc_files() -> List[Path]:
    return [ROOT / "README.md", ROOT / "bench" / "README.md", *sorted(DOCS.glob("*.md"))]


def links(path: Path) -> Iterator[Tuple[int, str]]:
    """(line number, target) of every relative link outside code fences."""
    fence = False
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.lstrip().startswith("```"):
            fence = not fence
            continue
        if fence:
            continue
        for m in LINK.finditer(line):
            target = m.group(1)
            if not re.match(r"^[a-z]+:", target) and not target.startswith("#"):
                yield n, target


def test_readme_is_short() -> None:
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines <= 200, f"README.md has {lines} lines; allowed: at most 200 (move reference text into docs/)"


def test_docs_exist() -> None:
    for name in ("architecture", "configuration", "drafters", "gguf", "training", "server", "lossless", "gpu",
                 "benchmarks"):
        assert (DOCS / f"{name}.md").is_file(), f"docs/{name}.md is missing"


@pytest.mark.parametrize("path", doc_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path: Path) -> None:
    broken = []
    for n, target in links(path):
        file, _, anchor = target.partition("#")
        linked = path.parent / file if file else path
        if not linked.exists():
            broken.append(f"{path.relative_to(ROOT)}:{n}: {target}")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            broken.append(f"{path.relative_to(ROOT)}:{n}: {target} (no such heading)")
    assert not broken, "links to files or headings that do not exist:\n" + "\n".join(broken)


def anchors(path: Path) -> Set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces as hyphens."""
    out: Set[str] = set()
    fence = False
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("```"):
            fence = not fence
        elif not fence and line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            out.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return out


def library_environment() -> Set[str]:
    """Every environment variable the library's source reads (by literal name or through a constant), and every
    variable of the runtime knobs' registry (hooks/knobs.py reads them for the modules that used to)."""
    from mlx_speculative.hooks.knobs import KNOBS

    names: Set[str] = {k.env for k in KNOBS.values()}
    for package in LIBRARY:
        for source in (ROOT / package).rglob("*.py"):
            text = source.read_text()
            names.update(ENV_READ.findall(text))
            names.update(ENV_CONST.findall(text))
    return names


def test_environment_reads_are_found() -> None:
    """The scan itself can fail: it must find the variables we know the library reads."""
    names = library_environment()
    assert {"MLX_SPEC_CACHE", "MLX_SPEC_DRAFT_AHEAD", "MLX_VLM_DRAFT_KIND", "HF_HUB_OFFLINE"} <= names, names


def test_every_environment_variable_is_documented() -> None:
    text = (DOCS / "configuration.md").read_text()
    missing = sorted(n for n in library_environment() if f"`{n}`" not in text)
    assert not missing, f"docs/configuration.md does not list (as `NAME`): {', '.join(missing)}"


def test_every_yaml_key_is_documented() -> None:
    from mlx_speculative.hooks.config import SECTIONS
    from mlx_speculative.hooks.knobs import KNOBS
    from mlx_speculative.hooks.server_settings import SERVER_KEYS
    from mlx_speculative.hooks.validate import GENERATION_KEYS
    from mlx_speculative.plugin.settings import KEYS

    text = (DOCS / "configuration.md").read_text()
    keys = [*SECTIONS, *(f"server.{k}" for k in SERVER_KEYS), *(f"generation.{k}" for k in GENERATION_KEYS),
            *(f"speculative.{k}" for k in KEYS), *(f"runtime.{k}" for k in KNOBS)]
    missing = [k for k in keys if f"`{k}`" not in text]
    assert not missing, f"docs/configuration.md does not list (as `section.key`): {', '.join(missing)}"


def test_architecture_names_files_that_exist() -> None:
    text = (DOCS / "architecture.md").read_text()
    named = set(PATH.findall(text))
    assert len(named) >= len(ROUND_FILES), named
    gone = sorted(p for p in named if not (ROOT / p.rstrip("/")).exists())
    assert not gone, f"docs/architecture.md names paths that do not exist: {', '.join(gone)}"
    absent = [p for p in ROUND_FILES if p not in named]
    assert not absent, f"docs/architecture.md does not name these files of a round: {', '.join(absent)}"


@pytest.mark.parametrize("path", doc_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_paths_named_in_docs_exist(path: Path) -> None:
    """Backquoted repository paths (`plugin/round.py`, `bench/results/...json`) in every page exist."""
    text = path.read_text()
    gone = sorted(p for p in set(PATH.findall(text)) if "*" not in p and "{" not in p and "..." not in p
                  and not (ROOT / p.rstrip("/.")).exists())
    assert not gone, f"{path.relative_to(ROOT)} names paths that do not exist: {', '.join(gone)}"


def test_no_issue_or_session_numbers() -> None:
    pattern = re.compile(r"\b(?:issue|session)s? #?\d+", re.IGNORECASE)
    found = [f"{p.relative_to(ROOT)}:{n}: {line.strip()[:80]}" for p in doc_files()
             for n, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert not found, "issue or session numbers in the docs:\n" + "\n".join(found)
