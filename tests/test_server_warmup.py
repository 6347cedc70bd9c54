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


def test_warm_up_decodes_every_row_count_and_leaves_outputs_alone(llama_pair: Dict[str, Path]) -> None:
    host = make_host({"draft_model": str(llama_pair["drafter"])})
    target = host.load(str(llama_pair["target"]))
    costs = target.attachments["speculative"].costs
    before = METRICS.snapshot()
    seconds = warmup.warm_up(host, target, 3, new_tokens=12)
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


def test_default_rows_and_the_setting() -> None:
    assert warmup.default_rows(8) == 0  # a CPU compiles little per shape: no warm-up unless asked
    assert server_value("warmup_rows", 4, "server.warmup_rows") == 4
    with pytest.raises(SettingError, match="server.warmup_rows.*an integer >= 0"):
        server_value("warmup_rows", -1, "server.warmup_rows")
