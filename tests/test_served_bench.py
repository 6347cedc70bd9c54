"""bench/server_batching.py's synthetic mode and bench/stack_sampler.py: the oracle knows the server's warm-up
prompts (a warm-up whose drafts are all rejected never meets the shapes of accepted rounds: on MLX-CUDA they were
compiled mid-load, stalls of seconds), and the sampler finds where a thread waits."""

from __future__ import annotations

import sys
import tempfile
import threading
import time
from pathlib import Path

import mlx.core as mx
import pytest

from test_bench_scripts import BENCH, script

pytestmark = pytest.mark.integration


def test_the_oracle_accepts_in_the_servers_warm_up() -> None:
    from mlx_speculative.benchmarks import synthetic
    from mlx_speculative.hooks import warmup
    from mlx_speculative.hooks.host import Host
    from mlx_speculative.hooks.manager import make_plugin_manager
    from mlx_speculative.hooks.state import HostConfig
    from mlx_speculative.plugin.metrics import METRICS

    sb = script("server_batching")
    device = mx.default_device()
    mx.set_default_device(mx.cpu)
    try:
        config = synthetic.config_for("tiny")
        model = synthetic.build(config)
        with tempfile.TemporaryDirectory() as tmp:
            tokenizer = sb.word_tokenizer(config["vocab_size"], Path(tmp) / "tokenizer")
        reqs = sb.prompts(2, config["vocab_size"], 64)
        accepted = {}
        for rows in (0, 2):  # 0: the oracle knows the served prompts only (as before)
            target, plugins = sb.target_for("dflash", model, config, tokenizer, "tiny", 16, 6.0, reqs, 32, 512, rows)
            oracle = target.attachments["speculative"].drafter.oracle
            known = set(oracle.sequences)
            for prompts, _ in warmup.batches(target, 2, 512):
                assert all((tuple(p) in known) == bool(rows) for p in prompts)
            before = METRICS.snapshot()["spec_decode_num_accepted_tokens_total"]
            warmup.warm_up(Host(HostConfig(), pm=make_plugin_manager(False, plugins)), target, 2, True, 512)
            accepted[rows] = METRICS.snapshot()["spec_decode_num_accepted_tokens_total"] - before
    finally:
        mx.set_default_device(device)
    assert accepted[0] == 0 and accepted[2] > 0, accepted


def test_stack_sampler_finds_the_wait_and_the_stall() -> None:
    sys.path.insert(0, str(BENCH))
    from stack_sampler import StackSampler

    def waits() -> None:
        time.sleep(0.3)

    def work() -> None:
        time.sleep(0.05)
        waits()

    thread = threading.Thread(target=work, name="sampled")
    thread.start()
    sampler = StackSampler("sampled", interval=0.002).start()
    thread.join()
    report = sampler.stop()
    assert report["samples"] > 20
    leaf, share = next(iter(report["leaf_share"].items()))
    assert leaf.endswith(" waits") and share > 0.5, report["leaf_share"]
    assert "test_served_bench.py work" in report["inclusive_share"]
    ms, where = report["stalls"]["longest"][0]
    assert ms >= 200 and where.split(" < ")[0].endswith(" waits"), report["stalls"]
    assert 0 <= report["cpu_s"] < 0.2  # asleep: no CPU time
