"""The demo's text: the Python standard library's own source, present on every machine with Python.

The files are chosen by a fixed rule from the stdlib of the running interpreter (or ``--stdlib``); a
sixteenth of the library's modules (not its tests) is held out for prompts and bits per byte. The
manifest pins the Python version, the file list and every file's hash: a build on another Python
would read other text, so ``--pin`` refuses it with the files that differ.
"""

from __future__ import annotations

import hashlib
import io
import json
import random
import re
import sys
import sysconfig
import tokenize
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
TRIPLE_QUOTE = re.compile(r"[A-Za-z]{0,2}(\"\"\"|''')")  # with its prefix: r, b, f, rb...


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


def preamble(before: str) -> str:
    """Source after which Python's tokenize stands where it stands at the end of ``before`` (a file's text up
    to a line boundary): an ``if 1:`` line per open block at that block's indentation, then the brackets and
    triple-quoted string an unfinished statement left open. A prompt cut from inside a file reads after it
    as it reads in the file (the demo's parse rule)."""
    lines = before.count("\n")
    indents: List[str] = [""]
    brackets: List[str] = []
    reached: Tuple[int, int] = (1, 0)
    quote = ""
    try:
        for tok in tokenize.generate_tokens(io.StringIO(before).readline):
            if tok.start[0] > lines:
                break  # end of input: its NEWLINE and DEDENTs close nothing the file closed
            reached = tok.end
            if tok.type == tokenize.INDENT:
                indents.append(tok.string)
            elif tok.type == tokenize.DEDENT:
                indents.pop()
            elif tok.type == tokenize.OP and tok.string in "([{":
                brackets.append(tok.string)
            elif tok.type == tokenize.OP and tok.string in ")]}" and brackets:
                brackets.pop()
    except tokenize.TokenError as e:
        if "string" in str(e.args[0]):  # the first triple quote after the last whole token opened it
            offset = sum(len(line) for line in before.splitlines(keepends=True)[:reached[0] - 1]) + reached[1]
            found = TRIPLE_QUOTE.search(before, offset)
            if found is None:
                raise ValueError(f"preamble: {e.args[0]} but no triple quote after line {reached[0]}") from None
            quote = found.group(0)
    out = "".join(indent + "if 1:\n" for indent in indents[:-1])
    if brackets or quote:
        out += indents[-1] + "_ = " + "".join(brackets) + quote + "\n"
    elif indents[-1]:
        out += indents[-1] + "pass\n"  # puts the innermost level on tokenize's stack (the prompt may go deeper)
    return out


def prompts(root: Path, heldout: List[List[str]], count: int, seed: int = 0) -> List[Dict[str, Any]]:
    """``count`` prompts from the held-out files: whole lines (about PROMPT_CHARS) ending at a line
    boundary inside the file, the file's next REFERENCE_CHARS characters as the reference, and the
    preamble that puts tokenize in the file's state at the prompt's first line."""
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
                    "reference": text[cut:cut + REFERENCE_CHARS], "preamble": preamble(text[:start])})
    return out
