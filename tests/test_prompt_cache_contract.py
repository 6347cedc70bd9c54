"""The prompt cache's contract and its parts (hooks/prompt_cache.py): a host plugin's ``RowSnapshot``
comes back to the next request (``host_save_row``, ``state.restored``, ``state.cached``), rows that
capture reuse only what snapshots cover, entries replace the entries they cover, the default bound
and ``server.prompt_cache_bytes``'s sizes, and `mlx-spec generate` keeps no cache.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Optional

import mlx.core as mx
import pytest

from conftest import encode, make_host, no_stop
from mlx_speculative.hooks import prompt_cache as pc
from mlx_speculative.hooks.scheduler import Scheduler
from mlx_speculative.hooks.specs import RowSnapshot, hookimpl
from mlx_speculative.hooks.state import CaptureRequest
from test_prompt_cache import BIG, _run

pytestmark = pytest.mark.integration


class Keeper:
    """A second host plugin: it captures layer 1 and keeps a note per row in the prompt cache."""

    def __init__(self, covers: Optional[int]):
        self.covers: Optional[int] = covers
        self.seen: List[Any] = []

    @hookimpl
    def host_prefill_captures(self, target: Any, state: Any) -> Any:
        return CaptureRequest([1])

    @hookimpl
    def host_save_row(self, state: Any, batch: Any, positions: int) -> Any:
        if self.covers is None:
            return None
        return RowSnapshot("keeper", min(self.covers, positions), {"note": len(state.tokens)}, nbytes=1000)

    @hookimpl
    def host_decode_step(self, batch: Any) -> Any:
        for row in batch.rows:
            self.seen.append((row.cached, row.restored.get("keeper"), row.captures[1].shape[1]))
        return None


@pytest.mark.parametrize("covers", [None, 20, 10**6])
def test_a_plugin_gets_its_snapshot_back_and_captures_limit_reuse(covers: Optional[int], llama_pair: Dict[str, Path]) -> None:
    from mlx_speculative.hooks.host import Host
    from mlx_speculative.hooks.manager import make_plugin_manager
    from mlx_speculative.hooks.state import HostConfig

    keeper = Keeper(covers)
    host = Host(HostConfig(), pm=make_plugin_manager(False, [keeper]))
    target = host.load(str(llama_pair["target"]))
    cache = pc.PromptCache(BIG)
    scheduler = Scheduler(host, target, prompt_cache=cache)
    prompt = [3 + (i * 11) % 370 for i in range(30)]
    [(first, _)] = _run(scheduler, [(prompt, no_stop(5))])
    assert cache.nbytes == sum(pc.cache_bytes(e.caches) for e in cache.entries) + (0 if covers is None else 1000)
    keeper.seen.clear()
    [(_, request)] = _run(scheduler, [(prompt + first + [9], no_stop(3))])
    # A row that captures reuses only what the snapshots cover (nothing without one): the host
    # cannot re-create the captures of positions it skips.
    expected = 0 if covers is None else min(covers, len(prompt) + 4)
    assert request.state.cached == expected
    # At its first decode step: the snapshot, and captures of exactly the prompt positions fed.
    cached, snap, captured = keeper.seen[0]
    assert cached == expected and captured == request.state.prompt_len - expected
    if expected:
        assert snap.positions == expected and snap.value == {"note": len(prompt) + 5}
    else:
        assert snap is None
    assert request.state.restored == {}  # let go when the request ended (the entry keeps its own)


def test_entries_replace_the_entries_they_cover() -> None:
    from mlx_lm.models.cache import KVCache

    def kv(n: int) -> List[Any]:
        c = KVCache()
        c.update_and_fetch(mx.zeros((1, 2, n, 4)), mx.zeros((1, 2, n, 4)))
        return [c]

    def snap(m: int) -> Dict[str, RowSnapshot]:
        return {"speculative": RowSnapshot("speculative", m, None, 8)}

    cache = pc.PromptCache(BIG)
    tokens = list(range(3, 23))
    assert cache.insert(tokens, kv(20), snap(18))
    assert cache.insert(tokens, kv(20), snap(17))  # a lagging drafter state: it still replaces (no captures)
    assert len(cache) == 1 and cache.entries[0].snapshots["speculative"].positions == 17
    assert cache.insert(tokens + [30, 31], kv(22), snap(21), captures=True)  # an extension replaces it
    assert [len(e.tokens) for e in cache.entries] == [22]
    assert cache.insert(tokens + [30, 31, 32], kv(23), snap(10))  # covers less for rows that capture: both stay
    assert sorted(len(e.tokens) for e in cache.entries) == [22, 23]
    assert cache.insert(tokens + [30, 31], kv(22), {})  # no drafter state (speculation off): both stay
    assert len(cache) == 3 and cache.nbytes == sum(e.nbytes for e in cache.entries)
    # Rows that capture take the entry whose state covers them; the others the longest prefix.
    prompt = tokens + [30, 31, 32, 33]
    assert cache.fetch(prompt, captures=True).positions == 21
    assert cache.fetch(prompt).positions == 23
    small = pc.PromptCache(1000)
    assert not small.insert(tokens, kv(20), {}) and len(small) == 0 and small.nbytes == 0  # alone above the bound


def test_generate_keeps_no_cache(llama_pair: Dict[str, Path]) -> None:
    host = make_host(None, plugins=False)
    target = host.load(str(llama_pair["target"]))
    prompt = encode(target, "the model token draft verify")
    for _ in range(2):
        states: List[Any] = []
        tokens = [e.token for e in host.stream(target, prompt, no_stop(4), state_out=states)]
        assert len(tokens) == 4 and states[0].cached == 0 and states[0].restored == {}
    assert Scheduler(host, target).prompt_cache is None


def test_default_bound_and_byte_sizes(llama_pair: Dict[str, Path]) -> None:
    from mlx_speculative.hooks import validate

    host = make_host(None, plugins=False)
    target = host.load(str(llama_pair["target"]))
    weights = pc.weight_bytes(target.model)
    assert pc.default_bytes(target.model, memory=weights + (8 << 20)) == 2 << 20
    assert pc.default_bytes(target.model, memory=weights // 2) == 0
    assert pc.default_bytes(target.model) > 0
    assert validate.byte_size("8GB", "f") == 8 * 10**9 and validate.byte_size("4GiB", "f") == 4 << 30
    assert validate.byte_size(0, "f") == 0 and validate.byte_size("auto", "f") is None
    with pytest.raises(validate.SettingError, match=r"^server\.prompt_cache_bytes: got -1; allowed: a number of bytes"):
        validate.byte_size(-1, "server.prompt_cache_bytes")
