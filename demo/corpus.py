"""The demo's text: the Python standard library's own source, present on every machine with Python.

The files are chosen by a fixed rule from the stdlib of the running interpreter (or ``--stdlib``); a
sixteenth of the library's modules (not its tests) is held out for prompts and bits per byte. The
manifest pins the Python version, the file list and every file's hash: a build on another Python
would read other text, so ``--pin`` refuses it with the files that differ.
"""

from __future__ import annotations

import hashlib
import json
import random
import sys
import sysconfig
from pathlib import Path
from typing import Any, Dict, List, Tuple

PYTHON = "3.12"  # the pinned minor version (the GPU machine's python3 is 3.12.3)
SKIP_PARTS = ("site-packages", "dist-packages", "__pycache__", "idlelib", "tkinter", "turtledemo", "lib2to3",
              "ensurepip", "pydoc_data", "encodings")
HELDOUT_EVERY = 16  # library (non-test) module i is held out when i % 16 == 7
RULE = (f"*.py under the stdlib, sorted by relative path, without {', '.join(SKIP_PARTS)}, skipping files that "
        f"are not UTF-8; the library's modules (not under test/) numbered in that order, those with "
        f"i % {HELDOUT_EVERY} == 7 held out")
PROMPT_CHARS = 600  # about the last 600 characters before a line boundary: whole lines
REFERENCE_CHARS = 1000


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def collect(root: Path, max_files: int = 0) -> Dict[str, Any]:
    """{"python", "rule", "train": [[rel, sha256]], "heldout": [...], "hash"}; ``max_files`` (tests) keeps
    only that many training files."""
    train: List[Tuple[str, str]] = []
    held: List[Tuple[str, str]] = []
    library = 0
    for path in sorted(root.rglob("*.py"), key=lambda p: p.relative_to(root).as_posix()):
        rel = path.relative_to(root).as_posix()
        if any(part in SKIP_PARTS for part in Path(rel).parts) or not path.is_file():
            continue
        data = path.read_bytes()
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            continue  # a few tests are written in other encodings on purpose
        is_test = rel.startswith("test/") or "/test/" in rel or "/tests/" in rel
        if not is_test:
            library += 1
            if library % HELDOUT_EVERY == 7:
                held.append((rel, _sha(data)))
                continue
        train.append((rel, _sha(data)))
    if max_files:
        train = train[:max_files]
        held = held[:max(2, max_files // 4)]
    files = {"train": train, "heldout": held}
    return {"python": "%d.%d.%d" % sys.version_info[:3], "stdlib": str(root), "rule": RULE, **files,
            "hash": _sha(json.dumps(files).encode())}


def check_pin(found: Dict[str, Any], pinned: Dict[str, Any]) -> None:
    """Refuse to build from other text than the pinned manifest's."""
    if found["hash"] == pinned["hash"]:
        return
    a = dict(map(tuple, pinned["train"] + pinned["heldout"]))  # type: ignore[arg-type]
    b = dict(map(tuple, found["train"] + found["heldout"]))  # type: ignore[arg-type]
    differ = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
    raise SystemExit(
        f"--pin: the pinned corpus is Python {pinned['python']}'s standard library (hash {pinned['hash'][:16]}); "
        f"this stdlib ({found['stdlib']}, Python {found['python']}) differs in {len(differ)} files, e.g. "
        f"{', '.join(differ[:5])}. Run the build with python{PYTHON} (pinned: {pinned['python']}), or --stdlib DIR "
        f"pointing at that version's Lib/, or leave out --pin to make a new manifest.")


def read(root: Path, files: List[List[str]]) -> List[str]:
    return [(root / rel).read_text(encoding="utf-8") for rel, _ in files]


def prompts(root: Path, heldout: List[List[str]], count: int, seed: int = 0) -> List[Dict[str, Any]]:
    """``count`` prompts from the held-out files: whole lines (about PROMPT_CHARS) ending at a line
    boundary inside the file, and the file's next REFERENCE_CHARS characters as the reference."""
    rng = random.Random(seed)
    texts = read(root, heldout)
    usable = [i for i, t in enumerate(texts) if len(t) > PROMPT_CHARS + REFERENCE_CHARS + 200]
    if not usable:
        raise SystemExit("held-out files are too short for prompts")
    out: List[Dict[str, Any]] = []
    for k in range(count):
        i = usable[k % len(usable)]
        text = texts[i]
        cut = text.find("\n", rng.randrange(PROMPT_CHARS, len(text) - REFERENCE_CHARS)) + 1
        start = text.find("\n", cut - PROMPT_CHARS) + 1
        line = text.count("\n", 0, cut) + 1
        out.append({"file": heldout[i][0], "line": line, "prompt": text[start:cut],
                    "reference": text[cut:cut + REFERENCE_CHARS]})
    return out
