"""Speculative rounds over a target sharded with mx.distributed: 2 ranks over the ring backend on loopback, started
by the test itself (as mlx.launch starts them: MLX_RANK, MLX_HOSTFILE), on tiny llama and qwen3 targets.

One launch runs every case (tests/distributed_worker.py): draft_model, ngram and dflash drafters, replicated and
on rank 0 alone, zero / partial / full acceptance (forced for DFlash), greedy output equal to the whole target's
token for token on every rank, seeded sampling equal across ranks, the sharded hidden-state taps equal to the whole
target's. Then `mlx-spec generate` under mlx.launch itself, a killed rank (the other ends within seconds), and
`mlx-spec serve` over 2 ranks (HTTP on rank 0, the same completions, a clean shutdown, a killed rank while idle).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List

import pytest

from conftest import PROMPTS
from mlx_speculative.drafters.dflash import tiny
from mlx_speculative.hooks import distributed
from mlx_speculative.hooks.cli import main

pytestmark = pytest.mark.integration

FIXTURES = Path(__file__).parent / "fixtures" / "dflash"
WORKER = Path(__file__).parent / "distributed_worker.py"
RANKS = 2


def free_ports(n: int) -> List[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def hostfile(tmp: Path) -> Path:
    """mlx.launch's ring hostfile: one list of "ip:port" per rank."""
    path = tmp / "hosts.json"
    path.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in free_ports(RANKS)]))
    return path


def launch(tmp: Path, command: List[str], **kw: Any) -> List[subprocess.Popen]:
    hosts = hostfile(tmp)
    env = dict(os.environ, MLX_HOSTFILE=str(hosts), MLX_SPEC_BLAS="off", HF_HUB_OFFLINE="1")
    return [subprocess.Popen(command, env=dict(env, MLX_RANK=str(r)), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, **kw) for r in range(RANKS)]


def finish(procs: List[subprocess.Popen], timeout: float) -> List[Dict[str, Any]]:
    out = []
    for p in procs:
        try:
            stdout, stderr = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise AssertionError("a rank hung")
        out.append({"rc": p.returncode, "stdout": stdout, "stderr": stderr})
    return out


@pytest.fixture(scope="module")
def dflash(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random DFlash checkpoint (z-lab layout) for the 4-layer targets, tapping layers 0 and 2."""
    config = json.loads((FIXTURES / "z-lab__Qwen3-4B-DFlash-b16.config.json").read_text())
    config = tiny.shrink_config(config, target_layer_ids=[0, 2], mask_token_id=383, num_target_layers=4)
    return tiny.write_checkpoint(tmp_path_factory.mktemp("dist") / "dflash", config, seed=66)


def cases(arch: str, pair: Dict[str, Path], dflash: Path) -> List[Dict[str, Any]]:
    t = str(pair["target"])
    greedy = {"target": t, "max_tokens": 24}
    return [
        dict(greedy, name=f"{arch}-draft_model", prompts=PROMPTS[:4],
             speculative={"draft_model": str(pair["drafter"]), "block_size": 4}),
        dict(greedy, name=f"{arch}-draft_model-adaptive-rank0", prompts=PROMPTS[4:6], drafter="rank0",
             speculative={"draft_model": str(pair["drafter"])}),
        dict(greedy, name=f"{arch}-identical-rank0", prompts=PROMPTS[:1], drafter="rank0",
             speculative={"draft_model": t, "block_size": 5}),
        dict(greedy, name=f"{arch}-random", prompts=PROMPTS[:1],
             speculative={"draft_model": str(pair["random_drafter"]), "block_size": 3, "adaptive": False}),
        dict(greedy, name=f"{arch}-ngram", prompts=PROMPTS[1:3], speculative={"kind": "ngram", "block_size": 6}),
        dict(greedy, name=f"{arch}-dflash", prompts=PROMPTS[:2], oracle=True, max_tokens=30,
             speculative={"draft_model": str(dflash), "block_size": 6}),
        dict(greedy, name=f"{arch}-dflash-rank0", prompts=PROMPTS[2:4], oracle=True, max_tokens=30, drafter="rank0",
             speculative={"draft_model": str(dflash), "block_size": 6}),
        dict(greedy, name=f"{arch}-sampled-rank0", prompts=PROMPTS[:2], drafter="rank0",
             speculative={"draft_model": str(pair["drafter"]), "block_size": 4},
             sampling={"temperature": 0.8, "seed": 5}),
        dict(greedy, name=f"{arch}-sampled", prompts=PROMPTS[:2],
             speculative={"draft_model": str(pair["drafter"]), "block_size": 4},
             sampling={"temperature": 0.8, "seed": 5}),
        dict(greedy, name=f"{arch}-taps", prompts=PROMPTS[:1], taps=[0, 2]),
        dict(greedy, name=f"{arch}-failing-rank0", prompts=PROMPTS[:1], drafter="rank0", fail_after=2,
             speculative={"draft_model": str(dflash), "block_size": 4}),
    ]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory, llama_pair: Dict[str, Path], qwen3_pair: Dict[str, Path],
            dflash: Path) -> Dict[str, List[Dict[str, Any]]]:
    """Every case on 2 ranks in one launch: by case name, each rank's result."""
    tmp = tmp_path_factory.mktemp("dist_run")
    (tmp / "cases.json").write_text(json.dumps(cases("llama", llama_pair, dflash) + cases("qwen3", qwen3_pair, dflash)))
    procs = launch(tmp, [sys.executable, str(WORKER), str(tmp / "cases.json"), str(tmp / "out")])
    ended = finish(procs, timeout=150)
    assert all(e["rc"] == 0 for e in ended), [e["stderr"][-2000:] for e in ended]
    by_rank = [json.loads((tmp / f"out.rank{r}.json").read_text()) for r in range(RANKS)]
    return {case["name"]: [by_rank[r][i] for r in range(RANKS)] for i, case in enumerate(by_rank[0])}


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_greedy_equals_the_whole_target_on_every_rank(results: Dict[str, List[Dict[str, Any]]], arch: str) -> None:
    totals = {"zero": 0, "partial": 0, "full": 0}
    for name, ranks in results.items():
        if not name.startswith(arch + "-") or "sampled" in name or "taps" in name or "failing" in name:
            continue
        for rank in ranks:
            for run in rank["runs"]:
                assert run["tokens"] == run["reference"], (name, rank)
                assert run["fallback"] is None and run["rounds"] > 0, (name, run)
        for key in totals:
            totals[key] += sum(run["acceptance"][key] for run in ranks[0]["runs"])
    assert all(v > 0 for v in totals.values()), totals
    # forced per family: everything accepted (the target drafting for itself), nothing (a random drafter, pinned)
    full = results[f"{arch}-identical-rank0"][0]["runs"][0]["acceptance"]
    assert full["zero"] == full["partial"] == 0 < full["full"]
    assert results[f"{arch}-random"][0]["runs"][0]["acceptance"]["zero"] > 0
    dflash = [r["acceptance"] for name in (f"{arch}-dflash", f"{arch}-dflash-rank0") for r in results[name][0]["runs"]]
    assert all(sum(a[k] for a in dflash) > 0 for k in totals), dflash


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_a_drafter_failing_on_rank_0_falls_back_on_every_rank(results: Dict[str, List[Dict[str, Any]]], arch: str) -> None:
    ranks = [rank["runs"][0] for rank in results[f"{arch}-failing-rank0"]]
    for run in ranks:
        assert run["tokens"] == run["reference"] and run["rounds"] == 2, run
    assert "drafter broke on purpose" in ranks[0]["fallback"]
    assert "the drafter on rank 0 failed" in ranks[1]["fallback"]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_seeded_sampling_is_the_same_on_every_rank(results: Dict[str, List[Dict[str, Any]]], arch: str) -> None:
    for name in (f"{arch}-sampled", f"{arch}-sampled-rank0"):
        ranks = results[name]
        assert [r["tokens"] for r in ranks[0]["runs"]] == [r["tokens"] for r in ranks[1]["runs"]]
        assert all(len(r["tokens"]) == 24 and r["rounds"] > 0 and r["fallback"] is None for r in ranks[0]["runs"])
    # the same seed and settings: the drafter on rank 0 alone or everywhere gives the same tokens
    assert ([r["tokens"] for r in results[f"{arch}-sampled"][0]["runs"]]
            == [r["tokens"] for r in results[f"{arch}-sampled-rank0"][0]["runs"]])


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_taps_of_the_sharded_target_are_the_whole_hidden_states(results: Dict[str, List[Dict[str, Any]]], arch: str) -> None:
    for rank in results[f"{arch}-taps"]:
        assert rank["taps_max_diff"] < 1e-4, rank


def test_generate_under_mlx_launch(tmp_path: Path, llama_pair: Dict[str, Path], capsys: pytest.CaptureFixture) -> None:
    """The CLI as a user runs it: mlx.launch starts both ranks; rank 0 prints the whole target's tokens."""
    common = ["generate", "--model", str(llama_pair["target"]), "--prompt", PROMPTS[1], "--max-tokens", "32",
              "--ignore-chat-template", "--json", "--draft-model", str(llama_pair["drafter"])]
    assert main(common + ["--no-speculative"]) == 0
    plain = json.loads(capsys.readouterr().out)
    port = free_ports(1)[0]
    launcher = Path(sys.executable).with_name("mlx.launch")
    cli = Path(sys.executable).with_name("mlx-spec")
    done = subprocess.run([str(launcher), "--backend", "ring", "--hosts", "127.0.0.1,127.0.0.1", "--starting-port",
                           str(port), "--", str(cli), *common, "--distributed", "ring", "--distributed-drafter", "rank0"],
                          capture_output=True, text=True, timeout=60, env=dict(os.environ, MLX_SPEC_BLAS="off"))
    assert done.returncode == 0, done.stderr[-2000:]
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1  # rank 0 alone prints
    out = lines[0]
    assert out["tokens"] == plain["tokens"] and out["speculative"]["rounds"] > 0
    assert out["distributed"] == {"ranks": 2, "rank": 0, "backend": "ring", "drafter": "rank0"}


def test_bench_under_two_ranks(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """`mlx-spec bench --distributed` on 2 ranks: rank 0 alone reports; the sharded fields; every speculative run
    equals its (sharded) plain reference and every run's tokens equal the unsharded run's (--compare-unsharded)."""
    common = ["bench", "--synthetic-target", "tiny", "--cpu", "--kind", "draft_model", "--block-sizes", "4",
              "--oracle-acceptance", "3", "--prompt-lengths", "64", "--max-tokens", "16"]
    whole, out = tmp_path / "whole.json", tmp_path / "sharded.json"
    assert main(common + ["--json", str(whole)]) == 0
    capsys.readouterr()
    cli = Path(sys.executable).with_name("mlx-spec")
    procs = launch(tmp_path, [str(cli), *common, "--json", str(out), "--distributed", "ring", "--distributed-drafter",
                              "rank0", "--compare-unsharded", str(whole)])
    ended = finish(procs, timeout=90)
    assert [e["rc"] for e in ended] == [0, 0], [e["stderr"][-2000:] for e in ended]
    assert "distributed: 2 ranks" in ended[0]["stdout"] and ended[1]["stdout"] == ""  # rank 0 alone prints
    report = json.loads(out.read_text())
    d = report["distributed"]
    assert (d["ranks"], d["backend"], d["drafter"], d["same_tokens_on_every_rank"]) == (2, "ring", "rank0", True)
    assert (d["all_sums_per_forward"], d["all_sum_bytes_per_position"]) == (8, 8 * 64 * 4)  # 4 layers, hidden 64, f32
    x = d["exchanged"]["plugin draft_model b4 tau3"]
    assert x["plain_step"]["bytes"] == 2048 and x["round"]["bytes"] == 4 * 2048 + 4 and x["per_token"]["tau"] > 1
    for regime, rows in report["results"].items():
        assert {r["identical_share"] for r in rows.values() if r["family"] == "spec"} == {1.0}, (regime, rows)
    compared = d["compared"]
    assert compared["outputs_match_unsharded"] is True
    assert set(compared["sharded_over_unsharded_tok_s"]["warm"]) == set(report["results"]["warm"])
    assert main(common + ["--compare-unsharded", str(whole)]) == 2
    assert "--compare-unsharded: given without --distributed" in capsys.readouterr().err


def test_a_killed_rank_ends_the_others(tmp_path: Path, llama_pair: Dict[str, Path]) -> None:
    cli = Path(sys.executable).with_name("mlx-spec")
    procs = launch(tmp_path, [str(cli), "generate", "--distributed", "ring", "--model", str(llama_pair["target"]),
                              "--draft-model", str(llama_pair["drafter"]), "--prompt", PROMPTS[0], "--max-tokens",
                              "4000", "--ignore-chat-template", "--verbose", "false"])
    first = procs[0].stdout.read(1)  # rank 0 streams its text: the ranks are decoding
    assert first, procs[0].stderr.read()
    procs[1].kill()
    killed = time.monotonic()
    ended = finish(procs, timeout=20)
    took = time.monotonic() - killed
    print(f"rank 0 ended {took:.2f} s after rank 1 was killed")
    assert took < 10
    assert ended[0]["rc"] != 0
    assert "mlx-spec: error: rank 0 of 2: another rank failed or left" in ended[0]["stderr"], ended[0]["stderr"][-1000:]


def _post(port: int, body: Dict[str, Any]) -> Dict[str, Any]:
    import urllib.request

    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def _listening(procs: List[subprocess.Popen], deadline: float = 60) -> None:
    """Wait for rank 0's "listening" line (its stderr), failing if a rank ends first."""
    end, seen = time.monotonic() + deadline, ""
    while time.monotonic() < end:
        line = procs[0].stderr.readline()
        seen += line
        if "listening on" in line:
            return
        if any(p.poll() is not None for p in procs):
            break
    raise AssertionError(f"the server did not start: {seen[-2000:]}")


@pytest.mark.server  # also in the server group: rank 0 serves HTTP
def test_serve_over_two_ranks(tmp_path: Path, llama_pair: Dict[str, Path]) -> None:
    """Rank 0 serves HTTP, rank 1 follows: greedy completions are the whole target's; a seeded sampled one repeats;
    SIGTERM to rank 0 ends both cleanly. Then, idle, a killed rank 1 ends rank 0 within seconds (the heartbeat)."""
    from conftest import encode, greedy_reference, make_host, no_stop

    plain = make_host(None, plugins=False)
    whole = plain.load(str(llama_pair["target"]))
    cli = Path(sys.executable).with_name("mlx-spec")
    for attempt in ("shutdown", "killed"):
        port = free_ports(1)[0]
        procs = launch(tmp_path, [str(cli), "serve", "--distributed", "ring", "--model", str(llama_pair["target"]),
                                  "--draft-model", str(llama_pair["drafter"]), "--port", str(port)]
                       + (["--distributed-drafter", "rank0"] if attempt == "killed" else []))
        try:
            _listening(procs)
            for text in PROMPTS[:2]:
                got = _post(port, {"prompt": text, "max_tokens": 24, "temperature": 0})
                ref = plain.generate(whole, encode(whole, text), no_stop(24))  # the whole target, one process
                assert ref.tokens == greedy_reference(whole.model, encode(whole, text), 24)
                assert got["usage"]["completion_tokens"] == 24 and got["choices"][0]["text"] == ref.text, text
            sampled = [_post(port, {"prompt": PROMPTS[1], "max_tokens": 16, "temperature": 0.9, "seed": 3})
                       for _ in range(2)]
            assert sampled[0]["choices"][0]["text"] == sampled[1]["choices"][0]["text"]
            if attempt == "shutdown":
                procs[0].terminate()
                ended = finish(procs, timeout=30)
                assert [e["rc"] for e in ended] == [0, 0], [e["stderr"][-1000:] for e in ended]
            else:
                procs[1].kill()
                killed = time.monotonic()
                ended = finish(procs, timeout=20)
                assert time.monotonic() - killed < 8
                assert ended[0]["rc"] != 0 and "another rank failed or left" in ended[0]["stderr"]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()


def test_settings_are_checked(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert distributed.settings(None) is None
    assert distributed.settings({"backend": "ring", "drafter": "rank0"}) == distributed.DistributedSettings("ring", "rank0")
    with pytest.raises(distributed.HostConfigError, match="distributed.drafter.*'everywhere'.*replicated, rank0"):
        distributed.settings({"drafter": "everywhere"})
    with pytest.raises(distributed.HostConfigError, match="--distributed.*'tcp'.*ring, mpi"):
        distributed.settings(None, {"backend": "tcp"})
    with pytest.raises(distributed.HostConfigError, match="distributed.ranks: unknown key.*allowed keys: backend, drafter"):
        distributed.settings({"ranks": 2})
    yaml = tmp_path / "host.yaml"
    yaml.write_text("model: demo\ndistributed:\n  backend: ring\n  drafter: all\n")
    assert main(["generate", "--config", str(yaml)]) == 2
    assert "host.yaml:4: distributed.drafter" in capsys.readouterr().err
    yaml.write_text("model: demo\ndistributed:\n")  # alone: on, with the defaults
    # outside a launcher: what to do
    assert main(["generate", "--config", str(yaml)]) == 2
    err = capsys.readouterr().err
    assert "could not start" in err and "MLX_RANK" in err and "mlx.launch --backend ring --hostfile" in err
    assert main(["serve", "--config", str(yaml), "--distributed-drafter", "rank0"]) == 2
    assert "could not start" in capsys.readouterr().err
