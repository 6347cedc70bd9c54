"""Random streams: seeded requests replay exactly, alone or among others, and equal one-token decoding
with the same seed whatever the drafter (coupled sampling); the drafter's draws never move the target's
stream. Also: the processing the round applies is mlx-lm's sampler's."""

from __future__ import annotations

from typing import Any, Dict, Iterator, List, Optional

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.sample_utils import make_repetition_penalty, make_sampler

from conftest import encode, greedy_reference, make_host, no_stop
from mlx_speculative.hooks.host import GenerationParams, HostEvent
from mlx_speculative.hooks.state import DecodeState, SamplingParams
from test_sampling_stats import PASS_P, chisquare

pytestmark = pytest.mark.integration

PROMPT_TEXT = "the model token draft verify accept commit"


def _setup(pair: Dict[str, Any], **speculative: Any):
    host = make_host({"draft_model": str(pair["drafter"]), "block_size": 4, **speculative})
    target = host.load(str(pair["target"]))
    return host, target, encode(target, PROMPT_TEXT)


def _sampled(seed: Optional[int], n: int = 24, temperature: float = 0.8, **kw: Any) -> GenerationParams:
    return no_stop(n, sampling=SamplingParams(temperature=temperature, top_p=0.9, seed=seed), **kw)


@pytest.mark.parametrize("speculative", [{}, {"acceptance": "exact"}, {"kind": "ngram", "block_size": 6}])
def test_seeded_request_replays_exactly(llama_pair: Dict[str, Any], speculative: Dict[str, Any]) -> None:
    host, target, prompt = _setup(llama_pair, **speculative)
    first = host.generate(target, prompt, _sampled(7))
    mx.random.seed(12345)  # the global state must not matter to a seeded request
    second = host.generate(target, prompt, _sampled(7))
    assert first.tokens == second.tokens
    assert first.report["speculative"].rounds > 0
    assert host.generate(target, prompt, _sampled(8)).tokens != first.tokens


def test_seeded_request_is_unchanged_by_requests_in_flight(llama_pair: Dict[str, Any]) -> None:
    host, target, prompt = _setup(llama_pair)
    alone = host.generate(target, prompt, _sampled(7)).tokens

    # Interleave it token by token with a seeded and an unseeded request on the same target.
    streams: List[Iterator[HostEvent]] = [
        host.stream(target, prompt, _sampled(7)),
        host.stream(target, encode(target, "red green blue one two"), _sampled(99, n=30)),
        host.stream(target, prompt, _sampled(None, n=30, temperature=1.0)),
    ]
    outputs: List[List[int]] = [[] for _ in streams]
    live = set(range(len(streams)))
    while live:
        for i in sorted(live):
            event = next(streams[i], None)
            if event is None:
                live.discard(i)
            else:
                outputs[i].append(event.token)
                mx.random.uniform()  # others drawing from mlx's global state meanwhile
    assert outputs[0] == alone


def _prefilled(host: Any, target: Any, prompt: List[int], seed: Optional[int], params: Any = None) -> DecodeState:
    """A request after its prefill, in a batch of its own (``state.extras['batch']``, test-only)."""
    from mlx_speculative.hooks.batch import DecodeBatch

    params = params or _sampled(seed)
    state = host.new_state(target, prompt, params)
    caches = host.new_caches(target, params)
    for _ in host.prefill(state, caches):
        pass
    batch = DecodeBatch(target, single=True)
    batch.join(state, caches)
    state.extras["batch"] = batch
    return state


def _plain_tokens(state: DecodeState, n: int) -> List[int]:
    """The host's own plain steps (no plugin asked)."""
    from mlx_speculative.hooks.step import PlainRun

    run = PlainRun(state.extras["batch"], n)
    return [gens[0].token for _ in range(n) for _, gens in run.next(lambda: True)]


@pytest.mark.parametrize("seed", [3, None])
def test_drafter_sampling_does_not_move_the_target_stream(llama_pair: Dict[str, Any], seed: Optional[int]) -> None:
    host, target, prompt = _setup(llama_pair)
    drafter = target.attachments["speculative"].drafter
    sampled = []
    for draft_first in (False, True):
        mx.random.seed(5)  # the unseeded target stream is mlx's global state
        state = _prefilled(host, target, prompt, seed)
        global_before = np.array(mx.random.state[0])
        target_draws = state.rng.draws if state.rng is not None else None
        if draft_first:
            drafts = drafter.new_batch()
            drafts.sync([state])
            drafts.prepare([state])
            proposal = drafts.propose([state], [3])[0]
            assert proposal.logprobs is not None and proposal.logprobs.shape == (3, state.pending_logprobs.shape[-1])
            # Seeded: the drafts are coupled to the target's position keys (no stream of their own moves).
            assert (state.draft_rng is None) if seed is not None else (state.draft_rng.draws == 3)
            # Neither the request's own target stream nor mlx's global state moved.
            np.testing.assert_array_equal(np.array(mx.random.state[0]), global_before)
            assert (state.rng.draws if state.rng is not None else None) == target_draws
        # The target's next draws are the same as if the drafter had never drawn.
        sampled.append(_plain_tokens(state, 4))
    assert sampled[0] == sampled[1]


def test_position_keys_depend_on_the_position_alone(llama_pair: Dict[str, Any]) -> None:
    host, target, prompt = _setup(llama_pair)
    state = _prefilled(host, target, prompt, 3)
    keys = [np.array(k).tolist() for k in state.position_keys(4)]
    assert len(set(map(tuple, keys))) == 4
    assert [np.array(k).tolist() for k in state.position_keys(2, offset=2)] == keys[2:]
    again = _prefilled(host, target, prompt, 3)
    assert [np.array(k).tolist() for k in again.position_keys(4)] == keys
    other = _prefilled(host, target, prompt, 4)
    assert not set(map(tuple, keys)) & {tuple(np.array(k).tolist()) for k in other.position_keys(4)}
    unseeded = _prefilled(host, target, prompt, None)
    unseeded.draw_drafts(mx.zeros((2, 8)))
    assert unseeded.draft_rng is not None and unseeded.draft_rng.draws == 1  # its own stream, not position keys


@pytest.mark.parametrize("drafter, speculative, acceptance", [
    ("drafter", {}, "partial"),
    ("drafter", {"acceptance": "exact", "block_size": 7}, "partial"),
    ("random_drafter", {}, "zero"),
    ("target", {"block_size": 6}, "full"),  # the target drafting for itself: q = p
    ("drafter", {"kind": "ngram", "block_size": 6}, None),
])
def test_seeded_sampling_is_one_token_decoding(llama_pair: Dict[str, Any], drafter: str,
                                               speculative: Dict[str, Any], acceptance: Optional[str]) -> None:
    """A seeded request's tokens are those of plain one-token decoding with the same seed, whatever drafts."""
    plain = make_host(None, plugins=False)
    host = make_host({"draft_model": str(llama_pair[drafter]), "block_size": 4, **speculative})
    target = host.load(str(llama_pair["target"]))
    whole = plain.load(str(llama_pair["target"]))
    rounds = {"zero": 0, "partial": 0, "full": 0}
    for seed, text in enumerate(["the model token draft verify accept commit", "one two three one two three"]):
        prompt = encode(target, text)
        result = host.generate(target, prompt, _sampled(seed, n=40))
        assert result.tokens == plain.generate(whole, prompt, _sampled(seed, n=40)).tokens
        report = result.report["speculative"]
        assert report.rounds > 0
        for name, n in report.rounds_by_acceptance.items():
            rounds[name] += n
    if acceptance == "full":
        assert rounds["full"] > 0 and rounds["zero"] == rounds["partial"] == 0, rounds
    elif acceptance is not None:
        assert rounds[acceptance] > 0 and rounds["zero"] + rounds["partial"] > 0, rounds


def test_unseeded_plain_decoding_is_mlx_lm_generate_step(llama_pair: Dict[str, Any]) -> None:
    from mlx_lm.generate import generate_step

    plain = make_host(None, plugins=False)
    target = plain.load(str(llama_pair["target"]))
    prompt = encode(target, PROMPT_TEXT)
    mx.random.seed(21)
    ours = plain.generate(target, prompt, _sampled(None, n=20)).tokens
    mx.random.seed(21)
    sampler = make_sampler(0.8, top_p=0.9)
    ref = [int(t) for t, _ in generate_step(mx.array(prompt), target.model, max_tokens=20, sampler=sampler)]
    assert ours == ref


@pytest.mark.parametrize("speculative", [{}, {"kind": "ngram", "block_size": 6}])
def test_seeded_greedy_is_the_greedy_walk(llama_pair: Dict[str, Any], speculative: Dict[str, Any]) -> None:
    host, target, prompt = _setup(llama_pair, **speculative)
    result = host.generate(target, prompt, _sampled(4, n=30, temperature=0.0))
    assert result.tokens == greedy_reference(target.model, prompt, 30)
    assert result.report["speculative"].accepted_tokens > 0


@pytest.mark.statistical  # also in the statistical group: a chi-square test
@pytest.mark.parametrize(
    "params",
    [
        dict(temperature=0.7, top_p=0.9),
        dict(temperature=1.0, top_k=5),
        dict(temperature=1.3, min_p=0.05),
        dict(temperature=0.6, top_p=0.8, min_p=0.02, top_k=12),
    ],
)
def test_process_is_the_distribution_mlx_lm_samples(params: Dict[str, Any]) -> None:
    # One row of log-probabilities repeated 30,000 times: mlx-lm's sampler draws once per row.
    logits = mx.random.normal((24,), key=mx.random.key(0)) * 2.0
    logprobs = logits - mx.logsumexp(logits)
    sampling = SamplingParams(**params)
    sampler = make_sampler(
        sampling.temperature, top_p=sampling.top_p, min_p=sampling.min_p, top_k=sampling.top_k
    )
    mx.random.seed(1)
    draws = np.array(sampler(mx.broadcast_to(logprobs, (30_000, 24))))
    probs = np.array(mx.exp(sampling.process(logprobs)))
    assert abs(probs.sum() - 1) < 1e-5 and (probs == 0).any()
    assert chisquare(np.bincount(draws, minlength=24), probs)[2] > PASS_P


def test_draft_q_gets_the_targets_processing_with_draft_history(llama_pair: Dict[str, Any]) -> None:
    # A repetition penalty reads the history: row i of q must see the committed tokens + drafts[:i].
    host = make_host({"draft_model": str(llama_pair["drafter"]), "block_size": 4})
    target = host.load(str(llama_pair["target"]))
    prompt = encode(target, "draft draft draft draft the the")
    params = _sampled(3, logits_processors=[make_repetition_penalty(3.0, 20)])
    state = _prefilled(host, target, prompt, 3, params)
    drafter = target.attachments["speculative"].drafter
    drafts = drafter.new_batch()
    drafts.sync([state])
    drafts.prepare([state])
    proposal = drafts.propose([state], [3])[0]
    tokens = list(state.tokens)
    penalty = make_repetition_penalty(3.0, 20)
    for i, x in enumerate(proposal.tokens):
        history = tokens + proposal.tokens[:i]
        logits = drafter.model(mx.array([history]))[:, -1, :]  # [1, V]
        logits = penalty(mx.array(history), logits)
        q = state.sampling.process(logits - mx.logsumexp(logits, axis=-1, keepdims=True))[0]
        np.testing.assert_allclose(np.exp(np.array(proposal.logprobs[i])), np.exp(np.array(q)), atol=1e-4)
        assert float(q[x]) > -np.inf  # the draft lies in q's support


def test_a_q_of_the_wrong_shape_falls_back_with_a_clear_reason(llama_pair: Dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    from mlx_speculative.drafters.base import Proposal
    from mlx_speculative.drafters.draft_model import DraftModelBatch

    real = DraftModelBatch.propose

    def narrow_q(self, rows, max_drafts):
        # q over 100 tokens, not the vocabulary
        return [Proposal(p.tokens, p.logprobs[:, :100]) for p in real(self, rows, max_drafts)]

    monkeypatch.setattr(DraftModelBatch, "propose", narrow_q)
    host, target, prompt = _setup(llama_pair)
    plain = make_host(None, plugins=False)
    result = host.generate(target, prompt, _sampled(7, n=12))
    assert "draft log-probabilities q have shape (3, 100); expected (3, 384)" in result.report["speculative"].fallback
    assert result.tokens == plain.generate(target, prompt, _sampled(7, n=12)).tokens  # plain decoding, same stream
