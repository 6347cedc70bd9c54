"""The server's warm-up meets accepted rounds whatever the drafter proposes (a warm-up whose drafts were all rejected
never met their shapes: on MLX-CUDA they were compiled mid-load, stalls of seconds), shown with the served
benchmark's oracle drafter; bench/stack_sampler.py finds where a thread waits."""

from __future__ import annotations

import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Tuple

import mlx.core as mx
import pytest

from test_bench_scripts import BENCH, script

pytestmark = pytest.mark.integration


def _tiny(sb: Any) -> Tuple[Dict[str, Any], Any, Any]:
    """The served benchmark's tiny synthetic target: (config, model, its word tokenizer)."""
    from mlx_speculative.benchmarks import synthetic

    config = synthetic.config_for("tiny")
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = sb.word_tokenizer(config["vocab_size"], Path(tmp) / "tokenizer")
    return config, synthetic.build(config), tokenizer


def test_the_warm_up_meets_accepted_rounds_whatever_the_drafter_proposes() -> None:
    """The served benchmark's oracle drafter knows only the served prompts: on the warm-up's text every draft it
    proposes is wrong. The warm-up's teacher drafts (the target's own continuation, plugin/draft.py ``teacher``)
    still give it accepted rounds; the same batches without them accept nothing."""
    from mlx_speculative.hooks import warmup
    from mlx_speculative.hooks.host import GenerationParams, Host
    from mlx_speculative.hooks.manager import make_plugin_manager
    from mlx_speculative.hooks.scheduler import Scheduler
    from mlx_speculative.hooks.state import HostConfig
    from mlx_speculative.plugin.metrics import METRICS

    sb = script("server_batching")
    device = mx.default_device()
    mx.set_default_device(mx.cpu)

    def accepted(run: Callable[[], None]) -> int:
        before = METRICS.snapshot()["spec_decode_num_accepted_tokens_total"]
        run()
        return METRICS.snapshot()["spec_decode_num_accepted_tokens_total"] - before

    try:
        config, model, tokenizer = _tiny(sb)
        reqs = sb.prompts(2, config["vocab_size"], 64)

        def untaught() -> None:
            target, plugins = sb.target_for("dflash", model, config, tokenizer, "tiny", 16, 6.0, reqs, 32)
            scheduler = Scheduler(Host(HostConfig(), pm=make_plugin_manager(False, plugins)), target,
                                  raise_errors=True, prompt_cache=None)
            for prompts, new_tokens in warmup.batches(target, 2, 512):
                batch = [scheduler.submit(p, GenerationParams(max_tokens=new_tokens, stop_token_ids=[])) for p in prompts]
                while not all(r.done for r in batch):
                    scheduler.step()

        def taught() -> None:
            target, plugins = sb.target_for("dflash", model, config, tokenizer, "tiny", 16, 6.0, reqs, 32)
            warmup.warm_up(Host(HostConfig(), pm=make_plugin_manager(False, plugins)), target, 2, True, 512)

        counts = accepted(untaught), accepted(taught)  # each on a fresh target: no prices measured before it
    finally:
        mx.set_default_device(device)
    assert counts[0] == 0 and counts[1] > 0, counts


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


def test_teacher_drafts_follow_the_continuation_and_nothing_else() -> None:
    from types import SimpleNamespace

    from mlx_speculative.drafters.base import Proposal
    from mlx_speculative.hooks.state import WARMUP_CONTINUATION
    from mlx_speculative.plugin.draft import teacher

    def row(generated: int, options: dict) -> SimpleNamespace:
        tokens = [5, 6, 7] + [10 + i for i in range(generated)]  # a 3-token prompt, its pending token last
        return SimpleNamespace(tokens=tokens, prompt_len=3, generated=generated, options=options)

    served = Proposal(mx.array([1, 2, 3, 4], dtype=mx.int32))
    assert teacher(row(2, {}), served, 100) is served  # outside the warm-up: unchanged
    ref = {WARMUP_CONTINUATION: [10 + i for i in range(40)]}
    kinds = set()
    for generated in range(1, 30):
        got = teacher(row(generated, ref), served, 100)
        assert got.tokens.dtype == mx.int32
        right = [10 + generated + i for i in range(4)]  # the continuation after the row's tokens
        tokens = got.tokens.tolist()
        cut = next((i for i, (t, r) in enumerate(zip(tokens, right)) if t != r), 4)
        assert cut in (4, 2, 0) and tokens[cut:] == [(r + 1) % 100 for r in right[cut:]], (generated, tokens)
        kinds.add(cut)
    assert kinds == {4, 2, 0}  # whole, half and none of the block right, over the positions
    past = teacher(row(38, ref), Proposal([1, 2, 3, 4]), 100).tokens  # 2 left in the continuation, then 0s
    assert past in ([48, 49, 0, 0], [48, 49, 1, 1], [49, 50, 1, 1]), past  # whole, half, none right


def test_teacher_drafts_in_rounds_equal_plain_decoding_alone_and_in_a_batch(llama_pair: Dict[str, Path]) -> None:
    """Requests carrying the warm-up's continuation (half of it: drafts past its end are wrong) decode through
    real rounds exactly as plain one-token decoding, alone and two in a batch, with rounds accepting all, part and
    none of their drafts."""
    from conftest import PROMPTS, encode, greedy_reference, make_host
    from mlx_speculative.hooks.host import GenerationParams
    from mlx_speculative.hooks.scheduler import Scheduler
    from mlx_speculative.hooks.state import WARMUP_CONTINUATION

    host = make_host({"draft_model": str(llama_pair["drafter"]), "block_size": 4, "adaptive": False})
    target = host.load(str(llama_pair["target"]))
    prompts = [encode(target, text) for text in PROMPTS[:2]]
    refs = [greedy_reference(target.model, p, 40) for p in prompts]

    def params(ref: List[int]) -> GenerationParams:
        return GenerationParams(max_tokens=40, stop_token_ids=[], options={WARMUP_CONTINUATION: ref[:20]})

    totals = {"zero": 0, "partial": 0, "full": 0}
    alone = host.generate(target, prompts[0], params(refs[0]))
    assert alone.tokens == refs[0]
    for key, count in alone.report["speculative"].rounds_by_acceptance.items():
        totals[key] += count
    assert all(totals.values()), totals
    scheduler = Scheduler(host, target)
    batch = [scheduler.submit(p, params(ref)) for p, ref in zip(prompts, refs)]
    got: Dict[int, List[int]] = {id(r): [] for r in batch}
    while scheduler.busy:
        for request, event in scheduler.step():
            got[id(request)].append(event.token)
    assert [got[id(r)] for r in batch] == refs


def test_served_speculative_requests_reuse_the_prompt_cache_as_plain_ones() -> None:
    """A prompt sent again starts from the server's prompt cache in every mode of the served benchmark: the oracle
    drafter's batch keeps the real drafter's saved state (DFlash: its context), so a speculative request prefills
    no more than a plain one (with the defaults it found no usable entry and prefilled every prompt whole)."""
    sb = script("server_batching")
    device = mx.default_device()
    mx.set_default_device(mx.cpu)
    try:
        config, model, tokenizer = _tiny(sb)
        reqs = sb.prompts(1, config["vocab_size"], 64)
        for mode in ("plain", "plain-compiled", "dflash", "dflash-tau1"):
            target, plugins = sb.target_for(mode, model, config, tokenizer, "tiny", 16, 6.0, reqs, 16)
            server = sb.serve(target, plugins, {"max_active": 1, "max_queue": 4})
            try:
                url = f"http://127.0.0.1:{server.server_address[1]}/v1"
                first = sb.one(url, reqs[0], 16)[0]
                before = sb.metrics(server)
                again = sb.one(url, reqs[0], 16)[0]
                after = sb.metrics(server)
            finally:
                sb.served_real.stop(server)
            hits = after["mlx_spec_prompt_cache_hits_total"] - before.get("mlx_spec_prompt_cache_hits_total", 0)
            reused = after["mlx_spec_prompt_cache_reused_tokens_total"] - before.get("mlx_spec_prompt_cache_reused_tokens_total", 0)
            assert again == first and hits == 1 and reused >= len(tokenizer.encode(reqs[0])) - 1, (mode, hits, reused)
    finally:
        mx.set_default_device(device)
