"""The README's Set up, Use and Server commands run as written, from the repository root, on a fresh
install of the package, against the demo pair.

The package is built and installed (not editable) from a copy of this tree into a new virtual
environment that borrows the test environment's dependencies (no network). The one liberty taken:
servers get a free port instead of 8080 (the same substitution in the client commands).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Dict, Iterator, List, Tuple

import pytest

from conftest import wait_for

pytestmark = pytest.mark.server

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
IGNORE = shutil.ignore_patterns(".git", ".venv*", ".tox", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache")


def section(text: str, title: str) -> str:
    """The text under ``## title`` up to the next heading of any level."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() == f"## {title}")
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("#")), len(lines))
    return "\n".join(lines[start + 1:end])


def commands(text: str) -> Tuple[List[str], List[str]]:
    """(shell commands, python snippets) of a section: indented blocks and ```sh/```python fences.

    Indented lines ending in a backslash continue on the next line; other fences (```text,
    ```yaml) are output or configuration, not commands."""
    shell: List[str] = []
    python: List[str] = []
    fence = None
    body: List[str] = []
    pending = ""
    for line in text.splitlines():
        if line.startswith("```"):
            if fence is None:
                fence, body = line[3:].strip(), []
            else:
                if fence == "python":
                    python.append("\n".join(body))
                elif fence in ("sh", "bash", "shell", "console"):
                    shell.extend(b for b in body if b.strip())
                fence = None
            continue
        if fence is not None:
            body.append(line)
        elif line.startswith("    ") and (pending or line.strip()):
            pending += line.strip()
            if pending.endswith("\\"):
                pending = pending[:-1] + " "
            else:
                shell.append(pending)
                pending = ""
    assert fence is None and not pending, "unterminated block"
    return shell, python


@pytest.fixture(scope="module")
def fresh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Dict[str, object]]:
    """A copy of the tree (the commands' cwd) with the package installed into a new venv."""
    root = tmp_path_factory.mktemp("readme")
    repo = root / "repo"
    shutil.copytree(ROOT, repo, ignore=IGNORE)
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    # The dependencies (mlx, mlx-lm, openai, setuptools, ...) come from this test environment.
    deps = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (site / "_test_environment.pth").write_text("\n".join(sorted(deps)) + "\n")
    done = subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-deps",
                           "--no-build-isolation", "--no-index", str(repo)], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLX_VLM_", "MLX_SPEC_", "PYTHON"))}
    env.update(PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}", MLX_SPEC_CACHE=str(root / "cache"),
               HF_HUB_OFFLINE="1", KEY="readme-test-key", VIRTUAL_ENV=str(venv))
    yield {"repo": repo, "env": env, "python": str(py)}


def sh(command: str, fresh: Dict[str, object], timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", command], cwd=fresh["repo"], env=fresh["env"], capture_output=True,
                          text=True, timeout=timeout)


def test_extraction_finds_the_commands() -> None:
    text = README.read_text()
    use, use_py = commands(section(text, "Use"))
    server, server_py = commands(section(text, "Server"))
    assert any(c.startswith("mlx-spec generate --model demo --draft-model demo-drafter") for c in use)
    assert "mlx-spec --version" in use and use_py == []
    assert sum("mlx-spec serve" in c for c in server) == 3 and any(c.startswith("curl") for c in server)
    assert len(server_py) == 1 and "OpenAI(" in server_py[0]
    assert not any(c.startswith("mlx-spec: error") for c in use)  # sample output is fenced as text


def test_setup_and_use_commands_run_as_written(fresh: Dict[str, object]) -> None:
    text = README.read_text()
    setup, _ = commands(section(text, "Set up"))
    first = setup[0].split("&&")
    assert first[0].strip() == "python -m pip install ."  # done by the fixture: a fresh, non-editable install
    made = sh(first[1], fresh)
    assert made.returncode == 0, made.stderr
    assert "target 'demo', drafter 'demo-drafter'" in made.stderr, made.stderr
    stats = made.stderr.strip().splitlines()[-1]
    assert "speculative dflash" in stats and "tau" in stats, stats  # real drafts of the trained demo
    assert made.stdout.count("\n") >= 3, made.stdout  # code, line by line
    use, _ = commands(section(text, "Use"))
    for command in use:
        done = sh(command, fresh)
        assert done.returncode == 0 and "Traceback" not in done.stderr, (command, done.stderr)
        if "--json" in command:
            assert json.loads(done.stdout)["speculative"]["kind"] == "dflash", command
        if command.startswith("mlx-spec --version"):
            assert re.match(r"mlx-spec \d+\.\d+", done.stdout), done.stdout
        if command.startswith("mlx-spec check"):
            assert "verdict: compatible" in done.stdout


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(command: str, fresh: Dict[str, object], log: Path) -> subprocess.Popen:
    with log.open("w") as f:
        proc = subprocess.Popen(["bash", "-c", command], cwd=fresh["repo"], env=fresh["env"], stdout=subprocess.DEVNULL,
                                stderr=f, start_new_session=True)

    def listening() -> bool:
        # Printed once the engine has set `ready` and the socket is bound: the server's readiness event.
        if "listening on http://" in log.read_text():
            return True
        if proc.poll() is not None:
            raise AssertionError(f"{command!r} exited with {proc.returncode}:\n{log.read_text()}")
        return False

    try:
        wait_for(listening, 120, lambda: f"{command!r} did not start:\n{log.read_text()}")
    except AssertionError:
        if proc.poll() is None:
            _stop(proc)
        raise
    return proc


def _stop(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(20)


def test_server_commands_run_as_written(fresh: Dict[str, object], tmp_path: Path) -> None:
    shell, python = commands(section(README.read_text(), "Server"))
    servers = [c for c in shell if "mlx-spec serve" in c]
    clients = [c for c in shell if "mlx-spec serve" not in c]
    assert servers and clients and python
    for i, command in enumerate(servers):
        port = _free_port()
        if "--port" in command:
            command = command.replace("--port 8080", f"--port {port}")
        else:
            command = command.replace("mlx-spec serve", f"mlx-spec serve --port {port}", 1)
        log = tmp_path / f"server{i}.log"
        proc = _start(command, fresh, log)
        try:
            for client in clients:
                done = sh(client.replace("8080", str(port)), fresh, timeout=120)
                assert done.returncode == 0 and done.stdout.strip(), (command, client, done.stdout, done.stderr)
                if "/v1/chat/completions" in client:
                    reply = json.loads(done.stdout)
                    assert reply["model"] == "demo" and reply["usage"]["completion_tokens"] > 0, reply
            for snippet in python:
                done = subprocess.run([fresh["python"], "-c", snippet.replace("8080", str(port))], cwd=fresh["repo"],
                                      env=fresh["env"], capture_output=True, text=True, timeout=120)
                assert done.returncode == 0 and "CompletionUsage" in done.stdout, (command, done.stderr)
        finally:
            _stop(proc)
        text = log.read_text()
        assert "Traceback" not in text, text
        if command.startswith("MLX_VLM_DRAFT_KIND=ngram"):  # the override runs ngram, saying so once
            assert text.count("ignoring the draft model 'demo-drafter'") == 1, text
            assert "speculative decoding on: kind ngram" in text, text
