"""The server's warm-up (hooks/warmup.py): batches of 1..N rows decoded before serving, through the scheduler and the
plugin like served ones, leaving only measured costs behind; its setting checked like any other."""

from __future__ import annotations

from pathlib import Path
from typing import Dict

import pytest

from conftest import PROMPTS, encode, greedy_reference, make_host
from mlx_speculative.hooks import warmup
from mlx_speculative.hooks.engine import Engine
from mlx_speculative.hooks.metrics import HostCounters
from mlx_speculative.hooks.scheduler import Scheduler
from mlx_speculative.hooks.host import GenerationParams
from mlx_speculative.hooks.server_settings import ServerSettings, server_value
from mlx_speculative.hooks.validate import SettingError
from mlx_speculative.plugin.metrics import METRICS

pytestmark = pytest.mark.integration


def test_warm_up_decodes_every_row_count_and_leaves_outputs_alone(llama_pair: Dict[str, Path]) -> None:
    host = make_host({"draft_model": str(llama_pair["drafter"])})
    target = host.load(str(llama_pair["target"]))
    costs = target.attachments["speculative"].costs
    before = METRICS.snapshot()
    seconds = warmup.warm_up(host, target, 3, tokens=0)
    after = METRICS.snapshot()
    assert seconds > 0
    assert after["mlx_spec_verify_forwards_total"] > before["mlx_spec_verify_forwards_total"]
    # Batches of 1, 2 and 3 rows decoded: a round or a plain step of each row count was timed.
    seen = {rows for (_, rows, _) in costs.seen}
    assert {1, 2, 3} <= seen, costs.report()
    prompt = encode(target, PROMPTS[0])
    scheduler = Scheduler(host, target)
    request = scheduler.submit(prompt, GenerationParams(max_tokens=16, stop_token_ids=[]))
    tokens = []
    while scheduler.busy:
        tokens += [e.token for _, e in scheduler.step()]
    assert request.done and tokens == greedy_reference(target.model, prompt, 16)


def test_the_engine_warms_up_before_it_is_ready(llama_pair: Dict[str, Path]) -> None:
    host = make_host({"draft_model": str(llama_pair["drafter"])})
    loaded = []

    def load():
        target = host.load(str(llama_pair["target"]))
        loaded.append(target)
        return host, target

    engine = Engine(load, ServerSettings(warmup_rows=2, max_active=2), HostCounters())
    engine.start()
    try:
        costs = loaded[0].attachments["speculative"].costs
        assert {1, 2} <= {rows for (_, rows, _) in costs.seen}
    finally:
        assert engine.stop()


def test_warm_up_reaches_each_key_span_of_a_bucketed_policy(llama_pair: Dict[str, Path],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Padded caches (bucket 256): a batch's first row at 48 tokens, then just below 256 and 512 keys, so each
    row count decodes across the 256-, 512- and 768-key spans; the engine's later output is unchanged."""
    from mlx_speculative.plugin import cuda
    from mlx_speculative.plugin.cuda import compiled

    for env in (cuda.PADDED_ENV, compiled.ENV):
        monkeypatch.setenv(env, "on")
    monkeypatch.setenv("MLX_SPEC_PREWARM_TOKENS", "0")
    host = make_host({"draft_model": str(llama_pair["drafter"])})
    target = host.load(str(llama_pair["target"]))
    assert target.cache_policy.bucket == 256
    assert warmup.first_rows(target, 530) == [(48, 64), (240, 32), (496, 32)]
    assert warmup.first_rows(target, 0) == [(48, 64)]
    spans = []
    for case in warmup.first_rows(target, 530):
        assert case[0] + case[1] > -(-case[0] // 256) * 256 or case[0] == 48  # the decode crosses a bucket's end
        spans.append(-(-(case[0] + case[1]) // 256))
    assert spans == [1, 2, 3]
    warmup.warm_up(host, target, 2, tokens=530)
    costs = target.attachments["speculative"].costs
    assert {1, 2} <= {rows for (_, rows, _) in costs.seen}, costs.report()
    prompt = encode(target, PROMPTS[1])
    scheduler = Scheduler(host, target)
    scheduler.submit(prompt, GenerationParams(max_tokens=12, stop_token_ids=[]))
    tokens = []
    while scheduler.busy:
        tokens += [e.token for _, e in scheduler.step()]
    assert tokens == greedy_reference(target.model, prompt, 12)


def test_default_rows_and_the_setting() -> None:
    assert warmup.default_rows(8) == 0  # a CPU compiles little per shape: no warm-up unless asked
    assert server_value("warmup_rows", 4, "server.warmup_rows") == 4
    with pytest.raises(SettingError, match="server.warmup_rows.*an integer >= 0"):
        server_value("warmup_rows", -1, "server.warmup_rows")
    assert server_value("warmup_tokens", 4096, "server.warmup_tokens") == 4096
    with pytest.raises(SettingError, match="server.warmup_tokens.*an integer >= 0"):
        server_value("warmup_tokens", "many", "server.warmup_tokens")
