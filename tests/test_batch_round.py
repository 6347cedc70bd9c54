"""Batched speculative rounds (plugin/batch_round.py) on a persistent DecodeBatch, without the server.

Rows accept different numbers of draft tokens in the same verify forward (zero, partial and full
acceptance together), join after their own prefill and leave mid-generation; every row must equal
mlx-lm's generate_step for its prompt, greedy, token for token.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List, Optional

import pytest

from conftest import encode, greedy_reference, make_host, no_stop
from mlx_speculative.drafters.base import DraftSession
from mlx_speculative.hooks.batch import DecodeBatch, RowEvents, cache_refusal
from mlx_speculative.hooks.state import GeneratedToken
from mlx_speculative.plugin.adaptive import BlockSizeController
from mlx_speculative.plugin.batch_round import run_batch_round
from mlx_speculative.plugin.metrics import SpecStats
from mlx_speculative.plugin.round import RequestRounds
from mlx_speculative.plugin.settings import resolve
from mlx_speculative.plugin.types import Proposal

K = 4  # draft tokens per round
N = 36  # tokens per row
PROMPTS = ["the model token draft verify", "red green blue one two three red green blue",
           "river stone light night day code", "one two three four five six seven eight nine ten"]


class OracleSession(DraftSession):
    """Drafts the row's true continuation with a wrong token at a position that cycles round by round."""

    def __init__(self, reference: List[int], prompt_len: int, wrong_cycle: List[int]):
        self.reference, self.prompt_len, self.cycle, self.round = reference, prompt_len, wrong_cycle, 0

    def propose(self, state: Any, max_drafts: int) -> Proposal:
        at = len(state.tokens) - self.prompt_len  # index in the reference of the first draft
        drafts = list(self.reference[at : at + max_drafts])
        wrong = self.cycle[self.round % len(self.cycle)]
        self.round += 1
        if wrong < len(drafts):
            drafts[wrong] = (drafts[wrong] + 1) % 384
        return Proposal(drafts)


class FailingSession(DraftSession):
    def __init__(self) -> None:
        self.calls = 0

    def propose(self, state: Any, max_drafts: int) -> Proposal:
        self.calls += 1
        if self.calls == 2:
            raise RuntimeError("drafter broke")
        return Proposal([7] * max_drafts)


def rounds(session: DraftSession) -> RequestRounds:
    return RequestRounds(session=session, controller=BlockSizeController(cap=K + 1, adaptive=False),
                         stats=SpecStats(kind="oracle"), settings=resolve({"kind": "ngram"}), vocab_size=384)


@pytest.fixture(scope="module")
def setup(llama_pair: Dict[str, Any]) -> Dict[str, Any]:
    host = make_host()
    target = host.load(str(llama_pair["target"]))
    prompts = [encode(target, p) for p in PROMPTS]
    return {"host": host, "target": target, "prompts": prompts,
            "refs": [greedy_reference(target.model, p, N + 2 * K) for p in prompts]}


def test_ragged_rounds_equal_generate_step(setup: Dict[str, Any]) -> None:
    host, target, prompts, refs = setup["host"], setup["target"], setup["prompts"], setup["refs"]
    assert cache_refusal(target) is None
    # Row b's wrong-token position cycles: 0 (nothing accepted), 2 (partial), K (all accepted).
    cycles = [[0, 2, K], [K, 0, 2], [2, K, 0], [1, 3]]
    batch = DecodeBatch(target)
    reqs: Dict[int, Optional[RequestRounds]] = {}
    got: Dict[int, List[int]] = {}
    states: Dict[int, Any] = {}
    per_round: List[List[int]] = []

    def join(b: int) -> None:
        state = host.new_state(target, prompts[b], no_stop(N))
        host.prefill(state)
        got[b] = [state.pending]
        batch.join(state)
        states[b] = state
        # Row 3 decodes plainly (speculation off) in the same forwards.
        reqs[b] = None if b == 3 else rounds(OracleSession(refs[b], len(prompts[b]), cycles[b]))

    join(0)
    join(1)
    step = dropped = 0
    while batch.rows:
        if step == 2:
            join(2)  # joins mid-generation
        if step == 4:
            join(3)
        order = [next(b for b, s in states.items() if s is row) for row in batch.rows]
        outs = run_batch_round(batch, [reqs[b] for b in order])
        dropped += batch.compact(at_least=1)  # padding all rows share goes; nothing they read changes
        per_round.append([len(o.tokens) - 1 for o in outs])
        for b, out in zip(order, outs):
            got[b].extend(g.token for g in out.tokens)
            if len(got[b]) >= N:
                batch.leave(states[b])  # rows leave at different times
        step += 1
    for b in range(4):
        assert got[b][:N] == refs[b][:N], b
        assert got[b] == refs[b][: len(got[b])]
    assert dropped > 0
    accepted = {a for r in per_round for a in r}
    assert {0, K} <= accepted and accepted & {1, 2, 3}
    # Zero and full acceptance in one verify forward.
    assert any(0 in r and K in r for r in per_round)
    stats = [reqs[b].stats for b in range(3)]
    assert all(s.rounds > 0 and 0 < s.accepted_tokens < s.draft_tokens for s in stats)


def test_failing_drafter_row_falls_back_others_go_on(setup: Dict[str, Any]) -> None:
    host, target, prompts, refs = setup["host"], setup["target"], setup["prompts"], setup["refs"]
    batch = DecodeBatch(target)
    states, got = [], []
    for p in prompts[:2]:
        s = host.new_state(target, p, no_stop(N))
        host.prefill(s)
        batch.join(s)
        states.append(s)
        got.append([s.pending])
    reqs = [rounds(FailingSession()), rounds(OracleSession(refs[1], len(prompts[1]), [K]))]
    while len(got[0]) < N:
        for g, out in zip(got, run_batch_round(batch, reqs)):
            g.extend(t.token for t in out.tokens)
    assert reqs[0].failed is not None and "drafter broke" in reqs[0].failed
    assert reqs[1].failed is None and reqs[1].stats.accepted_tokens > 0
    for g, ref in zip(got, refs[:2]):
        n = min(len(g), len(ref))
        assert n >= N and g[:n] == ref[:n]


@pytest.fixture(scope="module")
def dflash_drafter(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random DFlash drafter (z-lab b16 layout) over layers 0 and 2 of the 4-layer target."""
    from mlx_speculative.drafters.dflash import tiny

    real = json.loads((Path(__file__).parent / "fixtures" / "dflash" / "z-lab__Qwen3-4B-DFlash-b16.config.json").read_text())
    config = tiny.shrink_config(real, target_layer_ids=[0, 2], mask_token_id=383, num_target_layers=4)
    return tiny.write_checkpoint(tmp_path_factory.mktemp("dflash") / "b16", config, seed=34, prefix="")


@pytest.mark.parametrize("kind", ["draft_model", "ngram", "dflash", None])
def test_host_decode_batch_with_the_plugin(llama_pair: Dict[str, Any], dflash_drafter: Path, kind: Optional[str]) -> None:
    """Through the hooks: Host.decode_batch runs the plugin's batched round (or the host's plain step)."""
    spec = {"draft_model": {"draft_model": str(llama_pair["drafter"]), "block_size": 4},
            "ngram": {"kind": "ngram", "block_size": 4},
            "dflash": {"draft_model": str(dflash_drafter), "kind": "auto", "block_size": 4}, None: None}[kind]
    host = make_host(spec)
    target = host.load(str(llama_pair["target"]))
    assert host.batch_refusal(target) is None
    prompts = [encode(target, p) for p in PROMPTS]
    refs = [greedy_reference(target.model, p, N) for p in prompts]
    # Row 0 ends on a stop token (the first of its output not seen before position 9) while the others go on.
    at = next(i for i in range(9, N) if refs[0][i] not in refs[0][:i])
    expected = [refs[0][: at + 1]] + refs[1:]
    batch = DecodeBatch(target)
    events: Dict[int, RowEvents] = {}
    got: Dict[int, List[int]] = {}
    for b, p in enumerate(prompts):
        s = host.new_state(target, p, no_stop(N))
        host.prefill(s)
        batch.join(s)
        events[id(s)] = RowEvents(target, N, [refs[0][at]] if b == 0 else [])
        got[id(s)] = [s.pending]
        events[id(s)].event(GeneratedToken(s.pending, s.pending_logprobs))
    order = list(batch.rows)
    while batch.rows:
        rows = list(batch.rows)
        for s, out in zip(rows, host.decode_batch(batch)):
            for g in out.tokens:
                ev = events[id(s)].event(g)
                got[id(s)].append(ev.token)
                if ev.finish_reason:
                    batch.leave(s)
                    break
    for s, ref in zip(order, expected):
        assert got[id(s)] == ref
    if kind is not None:
        assert target.attachments["speculative"].drafter.kind == kind
        assert all(s.report["speculative"].fallback is None for s in order)
        assert sum(s.report["speculative"].rounds for s in order) > 0
        if kind != "dflash":  # a random DFlash drafter rarely agrees with the target
            assert sum(s.report["speculative"].accepted_tokens for s in order) > 0


def test_targets_that_cannot_batch_say_why(tmp_path: Any, tokenizer_dir: Any) -> None:
    """Rotating windows and recurrent state keep the interleaved policy, with the reason."""
    from mlx_speculative.hooks import tiny_models as tm

    host = make_host({"kind": "ngram"})
    for arch, config in (("gemma3_text", tm.gemma3_text_config()), ("qwen3_5", tm.qwen3_5_config())):
        path = tm.make_checkpoint(tmp_path / arch, config, seed=3, tokenizer_dir=tokenizer_dir)
        reason = host.batch_refusal(host.load(str(path)))
        assert reason is not None and "BatchKVCache" in reason, reason
