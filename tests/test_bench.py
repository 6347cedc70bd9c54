"""Smoke test of `mlx-spec bench` on a tiny synthetic target (CPU), and the oracle maths."""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path

import pytest

from mlx_speculative.hooks import blas
from mlx_speculative.benchmarks import oracle
from mlx_speculative.benchmarks.methods import allocate_lengths

pytestmark = pytest.mark.integration


def test_alpha_gives_tau() -> None:
    for tau, block in ((6.5, 16), (3.0, 16), (2.0, 4)):
        alpha = oracle.alpha_for_tau(tau, block)
        assert abs(1 + oracle.expected_accepted(alpha, block - 1) - tau) < 1e-6
    assert oracle.alpha_for_tau(1.0, 16) == pytest.approx(0.0, abs=1e-9)
    with pytest.raises(ValueError, match="allowed: 1 to the block size"):
        oracle.alpha_for_tau(20, 16)


def test_fresh_lengths_are_disjoint() -> None:
    lengths = allocate_lengths([100, 150], 4, 50)
    ranges = sorted((L - 1, L + 50) for row in lengths for L in row)
    assert all(a[1] <= b[0] for a, b in zip(ranges, ranges[1:]))


def test_bench_smoke(tmp_path: Path) -> None:
    from mlx_speculative.hooks.cli import main

    out = tmp_path / "bench.json"
    rc = main(["bench", "--synthetic-target", "tiny", "--cpu", "--kind", "draft_model", "--oracle-acceptance", "3",
               "--block-sizes", "4", "--prompt-lengths", "64,300", "--max-tokens", "12", "--json", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    for regime in ("fresh", "warm"):
        rows = report["results"][regime]
        assert set(rows) == {"mlx_lm.generate_step", "host plain (KVCache)", "plugin draft_model b4 tau3",
                             "mlx_lm.speculative_generate_step b4 tau3"}
        spec = rows["plugin draft_model b4 tau3"]
        assert spec["identical_share"] == 1.0  # fp32 on the CPU: lossless
        assert 1.5 < spec["tau"] <= 4 and spec["rounds"] > 0
        assert set(spec["ms_per_round"]) == {"draft", "verify", "commit", "host_overhead"}
        steps, split = spec["ms_per_round_steps"], spec["ms_per_round"]  # the round's steps add up to its split
        assert {"draft", "adopt", "verify", "plan", "read", "commit", "commit_drafter"} <= set(steps)
        assert "queue" not in steps and "settle" not in steps  # nothing verified ahead (the CPU, no compiled calls)
        assert abs(steps["draft"] - split["draft"]) < 0.01 and abs(steps["commit_drafter"] - split["commit"]) < 0.01
        assert abs(sum(v for k, v in steps.items() if k not in ("draft", "commit_drafter")) - split["verify"]) < 0.02
        assert rows["mlx_lm.generate_step"]["speedup_vs_mlx_lm_plain"] == 1.0
    assert report["versions"]["mlx"] and report["machine"]["backend"] == "cpu"
    assert report["machine"]["blas"]["kind"] == blas.in_use().kind and "ld_preload" in report["machine"]["blas"]
    costs = report["kernel_costs"]  # bare forwards at each prompt's key length: the target over 1, 4, 16, 32 positions
    keys = costs["run_key_lengths"]  # mid-decode: 64..151 and 300..387 keys + 6, rounded up to 256
    assert keys == [256, 512] and costs["extra_key_lengths"] == []  # the CPU: no extra lengths by default
    assert set(costs["by_key_length"]) == {str(L) for L in keys} and costs["key_length"] in keys
    for c in costs["by_key_length"].values():
        assert set(c["target_forward_ms"]) == {"1", "4", "16", "32"} and set(c["draft_ms"]["draft_model"]) == {"4"}
    assert costs["target_forward_ms"] == costs["by_key_length"][str(costs["key_length"])]["target_forward_ms"]
    assert costs["cache"] == "KVCache"
    for regime in ("fresh", "warm"):
        rows = report["results"][regime]
        spec = rows["plugin draft_model b4 tau3"]
        plain = rows["mlx_lm.generate_step"]["tok_s_per_prompt"]
        prompt_keys = spec["bare_key_length_per_prompt"]
        assert prompt_keys == [256, 512] and len(plain) == 2
        bare, bounds, ceilings, shares = [], [], [], []
        for i, L in enumerate(prompt_keys):  # per prompt: its key length's bare round, its own tau and plain speed
            c = costs["by_key_length"][str(L)]
            verify = c["target_forward_ms"]["4"]
            bare.append(verify + c["draft_ms"]["draft_model"]["4"])
            tau, step_ms = spec["tau_per_prompt"][i], 1000.0 / plain[i]
            bounds.append(tau * step_ms / bare[i])
            ceilings.append(tau * step_ms / verify)
            shares.append(spec["tok_s_per_prompt"][i] * bare[i] / (1000.0 * tau))
        assert spec["bare_round_ms"] == pytest.approx(statistics.median(bare), abs=1e-3)
        assert spec["kernel_bound_per_prompt"] == pytest.approx(bounds, rel=1e-2)
        assert spec["kernel_bound_vs_mlx_lm_plain"] == pytest.approx(statistics.median(bounds), rel=1e-2)
        assert spec["verify_ceiling_vs_mlx_lm_plain"] == pytest.approx(statistics.median(ceilings), rel=1e-2)
        assert spec["kernel_bound_share_per_prompt"] == pytest.approx(shares, rel=1e-2)
        assert spec["kernel_bound_share"] == pytest.approx(statistics.median(spec["kernel_bound_share_per_prompt"]), abs=1e-4)
        # the share is the speed-up over the bound, prompt by prompt
        speedups = [x / y for x, y in zip(spec["tok_s_per_prompt"], plain)]
        assert [s / b for s, b in zip(speedups, bounds)] == pytest.approx(shares, rel=1e-2)
        assert not {"ideal_bound", "share_of_ideal"} & set(spec)
        assert "kernel_bound_vs_mlx_lm_plain" not in rows["mlx_lm.speculative_generate_step b4 tau3"]


def test_bench_cost_keys(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """``--cost-keys``: the bare forwards also at the given key lengths (as given, not rounded); bad values refused."""
    from mlx_speculative.hooks.cli import main

    out = tmp_path / "bench.json"
    assert main(["bench", "--synthetic-target", "tiny", "--cpu", "--kind", "draft_model", "--oracle-acceptance", "3",
                 "--block-sizes", "4", "--prompt-lengths", "64", "--max-tokens", "8", "--no-mlx-lm-spec",
                 "--cost-keys", "300", "--json", str(out)]) == 0
    costs = json.loads(out.read_text())["kernel_costs"]
    assert costs["extra_key_lengths"] == [300] and costs["run_key_lengths"] == [256]
    assert set(costs["by_key_length"]) == {"256", "300"} and costs["key_length"] == 256
    assert set(costs["by_key_length"]["300"]["target_forward_ms"]) == {"1", "4", "16", "32"}
    printed = capsys.readouterr()
    assert "   300 keys: target by positions 1:" in printed.out
    # Progress and the [run] lines go to stderr, plain lines into a file or pipe (no \r, no escapes)
    assert "[run]" not in printed.out and re.search(r"^\[run\] fresh L=\d+ plugin draft_model b4 tau3: ", printed.err, re.M)
    assert "[bench] loading the target\n" in printed.err and "\r" not in printed.err and "\033" not in printed.err
    from mlx_speculative.benchmarks import _cost_keys

    assert _cost_keys(None) is None and _cost_keys("none") == [] and _cost_keys("8192, 16384") == [8192, 16384]
    for bad in ("0", "abc", "300,-1"):
        assert main(["bench", "--synthetic-target", "tiny", "--cpu", "--cost-keys", bad]) != 0, bad
        err = capsys.readouterr().err
        assert f"--cost-keys: got {bad!r}; expected the key lengths" in err and "allowed: positive integers" in err


def test_bench_switches_the_attention_kernel(capsys: pytest.CaptureFixture) -> None:
    """``--kernel``: the JSON says which attention path each method's timed calls took. A stand-in with the
    CUDA kernel's contract takes the kernel's place on the CPU; mlx-lm's methods keep mlx-lm's attention."""
    from mlx_speculative.hooks.cli import main
    from mlx_speculative.plugin.cuda import attention, projections
    from mlx_speculative.benchmarks.core import BenchSettings, run_bench
    from test_attention_dispatch import StandIn

    kernel = StandIn()
    disp = attention.Dispatcher(attention.Kernel("stand-in", kernel, None, None), min_keys={"mlx-mask": 0, "array": 0})
    s = BenchSettings(synthetic_target="tiny", cpu=True, kind="draft_model", taus=[3.0], block_sizes=[4],
                      prompt_lengths=[64], max_tokens=8, padded="on", bucket=32)
    proj = projections.stand_in()
    report = run_bench(s, on_progress=lambda msg: None, dispatcher=disp, projection_dispatcher=proj)
    assert report["attention"]["kernel"] == "on" and report["attention"]["dispatcher"]["calls"]["kernel"] > 0
    # The projections: the host's rounds through the dispatcher; mlx-lm's methods and the bare forwards "off"
    # ran unrouted (MLX's matmuls, not even asking it).
    calls = report["attention"]["projections"]["calls"]
    assert calls["kernel"] > 0 and "mlx" not in calls, calls
    for regime in ("fresh", "warm"):
        rows = report["results"][regime]
        spec = rows["plugin draft_model b4 tau3"]
        assert spec["identical_share"] == 1.0 and spec["attention_kernel_share"] > 0, spec.get("attention_calls")
        for name in ("mlx_lm.generate_step", "mlx_lm.speculative_generate_step b4 tau3"):
            assert set(rows[name]["attention_calls"]) == {"mlx: off"}, rows[name]["attention_calls"]
    costs = report["kernel_costs"]
    assert costs["attention"] == "kernel" and set(costs["target_forward_ms_kernel_off"]) == {"1", "4", "16", "32"}
    for c in costs["by_key_length"].values():
        assert set(c["target_forward_ms_kernel_off"]) == {"1", "4", "16", "32"} and set(c["draft_ms_kernel_off"]) == {"draft_model"}
    capsys.readouterr()
    assert main(["bench", "--synthetic-target", "tiny", "--cpu", "--kernel", "on", "--prompt-lengths", "64"]) != 0
    assert "--kernel on: the attention kernel needs MLX built with CUDA" in capsys.readouterr().err
    assert main(["bench", "--synthetic-target", "tiny", "--cpu", "--projection-kernel", "on", "--prompt-lengths", "64"]) != 0
    assert "--projection-kernel on: the projection kernel needs MLX built with CUDA" in capsys.readouterr().err


def test_bench_paired_regime(tmp_path: Path) -> None:
    """--paired: a third regime in which every method decodes the same prompt per base, so ratios between
    methods compare like with like; the fresh regime's lengths stay disjoint."""
    from mlx_speculative.hooks.cli import main

    out = tmp_path / "bench.json"
    assert main(["bench", "--synthetic-target", "tiny", "--cpu", "--kind", "draft_model", "--oracle-acceptance", "3",
                 "--adaptive-at", "1", "--block-sizes", "4", "--prompt-lengths", "64,100", "--max-tokens", "8",
                 "--no-mlx-lm-spec", "--cost-keys", "none", "--paired", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert list(report["results"]) == ["fresh", "warm", "paired"] and "paired" in report["regimes"]
    paired, fresh = report["results"]["paired"], report["results"]["fresh"]
    lens = {name: r["prompt_lens"] for name, r in paired.items()}
    assert len({tuple(v) for v in lens.values()}) == 1, lens  # the same prompt for every method
    assert list(lens.values())[0] == report["prompt_lengths"]["paired"]
    assert len({tuple(r["prompt_lens"]) for r in fresh.values()}) == len(fresh)  # fresh: each its own lengths
    for name, r in paired.items():
        if r["family"] == "spec":
            assert r["identical_share"] == 1.0, name
    no_pairs = tmp_path / "plain.json"
    assert main(["bench", "--synthetic-target", "tiny", "--cpu", "--kind", "draft_model", "--oracle-acceptance", "3",
                 "--block-sizes", "4", "--prompt-lengths", "64", "--max-tokens", "8", "--no-mlx-lm-spec",
                 "--cost-keys", "none", "--json", str(no_pairs)]) == 0
    assert list(json.loads(no_pairs.read_text())["results"]) == ["fresh", "warm"]


def test_bench_repeated_paired_regime(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """--paired 3: the paired regime three times (the order rotated once more each time) and 'paired median',
    each method's middle run by tok/s per prompt, taken from those three."""
    from mlx_speculative.hooks.cli import main

    out = tmp_path / "bench.json"
    assert main(["bench", "--synthetic-target", "tiny", "--cpu", "--kind", "draft_model", "--oracle-acceptance", "3",
                 "--block-sizes", "4", "--prompt-lengths", "64,100", "--max-tokens", "8", "--no-mlx-lm-spec",
                 "--cost-keys", "none", "--paired", "3", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    regimes = ["paired", "paired 2", "paired 3"]
    assert list(report["results"]) == ["fresh", "warm", *regimes, "paired median"]
    assert set(report["regimes"]) == set(report["results"])
    for name, med in report["results"]["paired median"].items():
        runs = [report["results"][g][name]["tok_s_per_prompt"] for g in regimes]
        assert med["tok_s_per_prompt"] == [sorted(x)[1] for x in zip(*runs)], name
        assert med["prompt_lens"] == report["prompt_lengths"]["paired"]
        if med["family"] == "spec":
            assert med["identical_share"] == 1.0 and med["rounds"] > 0
    capsys.readouterr()
    assert main(["bench", "--synthetic-target", "tiny", "--cpu", "--prompt-lengths", "64", "--paired", "-1"]) != 0
    assert "--paired: got -1; expected the number of paired regimes" in capsys.readouterr().err
    assert main(["bench", "--synthetic-target", "tiny", "--cpu", "--prompt-lengths", "64", "--compiled-widths", "0"]) != 0
    assert "--compiled-widths: got [0]; allowed: integers from 1 to 32" in capsys.readouterr().err


def test_bench_ahead_modes_side_by_side(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """--draft-ahead verify,on,off: a DFlash method per mode in one process (compiled calls forced on the CPU),
    all lossless; only 'verify' verifies ahead. A bad mode is refused before anything loads."""
    from mlx_speculative.hooks.cli import main

    out = tmp_path / "ahead.json"
    assert main(["bench", "--synthetic-target", "tiny", "--cpu", "--kind", "dflash", "--oracle-acceptance", "3",
                 "--block-sizes", "4", "--prompt-lengths", "64", "--max-tokens", "24", "--compiled-forward", "on",
                 "--padded-cache", "on", "--draft-ahead", "verify,on,off", "--no-mlx-lm-spec", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["results"]["fresh"]
    names = {"plugin dflash b4 tau3": "verify", "plugin dflash b4 tau3 draft-ahead": "on",
             "plugin dflash b4 tau3 no-ahead": "off"}
    for name, mode in names.items():
        assert rows[name]["draft_ahead"] == mode and rows[name]["identical_share"] == 1.0
        assert (rows[name]["rounds_verified_ahead"] > 0) == (mode == "verify"), (name, rows[name]["rounds_verified_ahead"])
    assert main(["bench", "--synthetic-target", "tiny", "--cpu", "--prompt-lengths", "64", "--draft-ahead", "fast"]) != 0
    assert "--draft-ahead: got 'fast'; allowed: on, verify, off" in capsys.readouterr().err


def test_bench_plot_keeps_its_title_one_value_axes_and_method_colours() -> None:
    pytest.importorskip("matplotlib")
    from mlx_speculative.benchmarks import report as bench_report

    def row(name: str, kind: str, tau: float, speedup: float) -> dict:
        return {"name": name, "kind": kind, "family": "spec", "adaptive": False, "block": 4, "oracle_tau": tau,
                "tau": tau, "speedup_vs_mlx_lm_plain": speedup}

    rows = {r["name"]: r for r in (row("plugin dflash b4 tau3", "dflash", 3.0, 1.4),
                                   row("plugin dflash b4 tau2", "dflash", 2.0, 1.1),
                                   row("mlx_lm.speculative_generate_step b4 tau3", "draft_model", 3.0, 1.2))}
    target = "synthetic llama-8b: random bfloat16 weights built in memory; large logit margins by construction " * 2
    fig = bench_report.figure({"target": target, "results": {"fresh": rows, "warm": rows}})
    assert fig._suptitle.get_text().replace("\n", " ") == target.strip()
    by_block, by_tau = fig.axes[0], fig.axes[1]
    assert by_block.get_xlim() == (3.0, 5.0) and list(by_block.get_xticks()) == [4.0]
    colours = [{line.get_label().split()[1]: line.get_color() for line in ax.get_lines() if line.get_label()[0] != "_"}
               for ax in (by_block, by_tau)]
    assert colours[0] == colours[1] and len(set(colours[0].values())) == 2, colours
