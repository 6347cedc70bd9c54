"""Speculative sampling leaves the target's distribution unchanged: tiny models, exact references.

A tiny llama pair with a 16-token vocabulary (so that counts per token are meaningful) and a
one-token prompt. The target's exact law of the tokens at the first POSITIONS positions under
its own one-token sampling (temperature, top-p 0.9) is computed from the model by enumerating
every reachable context, one batched forward per position. Against it:

- ``simulate``: the host's decode loop with rounds of a fixed block, vectorised over 20,000
  independent continuations (100,000 tokens per temperature). Drafts are sampled from the
  drafter's q and judged by the real ``accept.rejection_accept`` on the real p and q: both models
  score every context of up to POSITIONS - 1 tokens once, processed by ``SamplingParams.process``
  as the round does. A deliberately wrong acceptance rule fails the same test.
- the real host with the speculative plugin (draft_model kind): fewer continuations (each costs
  ~10 ms here), the same test; and a check that every round hands ``rejection_accept`` exactly
  the target's and the drafter's processed distributions at the right contexts.
- seeded requests (coupled sampling): the same test through the host, and the Gumbel-max draw itself.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Dict, List, Tuple

import mlx.core as mx
import numpy as np
import pytest

from conftest import make_host, no_stop
from mlx_speculative.testing import tiny_models as tm
from mlx_speculative.hooks.batch import DecodeBatch
from mlx_speculative.hooks.state import KeyStream, SamplingParams, coupled_draw
from mlx_speculative.plugin import accept
from test_sampling_stats import CAUGHT_P, PASS_P, chisquare, tv

pytestmark = pytest.mark.statistical

VOCAB = 16
PROMPT = [5]
POSITIONS = 5  # tokens per continuation
BLOCK = 4  # up to 3 draft tokens per round, fewer near the end (as the round loop caps them)
TOP_P = 0.9
SIM_SAMPLES = 20_000  # continuations per temperature in the vectorised loop: 100,000 tokens
HOST_SAMPLES = 1_500  # continuations per temperature through the real host: 7,500 tokens
TEMPERATURES = [0.7, 1.0]


def word_tokenizer(out_dir: Path, vocab: int) -> Path:
    """A word-level tokenizer of ``vocab`` tokens (mlx-lm loads it like any tokenizer.json)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<s>", "</s>", "<unk>"] + [f"w{i}" for i in range(vocab - 3)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "unk_token": "<unk>", "add_bos_token": False,
    }))
    return out_dir


def small_vocab_pair(root: Path) -> Dict[str, Path]:
    """A 2-layer target (hidden 16) and a drafter cut from its first layer: they agree often, not always."""
    config = tm.llama_config(
        hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, vocab_size=VOCAB,
    )
    tok = word_tokenizer(root / "tokenizer", VOCAB)
    target = tm.make_checkpoint(root / "target", config, seed=11, tokenizer_dir=tok, logit_scale=2.0)
    drafter = tm.make_truncated_drafter(target, root / "drafter", num_layers=1)
    return {"target": target, "drafter": drafter}


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Dict[str, Any]:
    paths = small_vocab_pair(tmp_path_factory.mktemp("vocab16"))
    host = make_host({"draft_model": str(paths["drafter"]), "block_size": BLOCK})
    target = host.load(str(paths["target"]))
    drafter = target.attachments["speculative"].drafter.model
    return {**paths, "target_model": target.model, "drafter_model": drafter}


# Exact references --------------------------------------------------------------------------------


def _score(model: Any, contexts: np.ndarray, sampling: SamplingParams) -> np.ndarray:
    """Processed next-token probabilities after PROMPT + each context: [n, V], one batched forward."""
    tokens = np.concatenate([np.tile(PROMPT, (len(contexts), 1)), contexts], axis=1)
    rows = []
    for start in range(0, len(tokens), 8192):
        logits = model(mx.array(tokens[start : start + 8192]))[:, -1, :]  # [b, V]
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        rows.append(np.array(mx.exp(sampling.process(logprobs))))
    return np.concatenate(rows).astype(np.float64)


def exact_distributions(model: Any, sampling: SamplingParams) -> Tuple[np.ndarray, np.ndarray]:
    """The target's own one-token sampling after PROMPT: P(token at position j = v) [POSITIONS, V]
    and the joint law of the first two tokens [V * V]. Only contexts of positive probability are
    scored (top-p prunes many)."""
    contexts = np.zeros((1, 0), dtype=np.int64)  # [n, j]
    weights = np.ones(1)  # [n] probability of each context
    marginals, pairs = [], np.zeros(VOCAB * VOCAB)
    for j in range(POSITIONS):
        p = _score(model, contexts, sampling)  # [n, V]
        marginals.append(weights @ p)
        joint = weights[:, None] * p  # [n, V]
        ctx, tok = np.nonzero(joint > 0)
        contexts = np.concatenate([contexts[ctx], tok[:, None]], axis=1)
        weights = joint[ctx, tok]
        if j == 1:
            np.add.at(pairs, contexts[:, 0] * VOCAB + contexts[:, 1], weights)
    return np.stack(marginals), pairs


def fit(counts: np.ndarray, pair_counts: np.ndarray, exact: Tuple[np.ndarray, np.ndarray]) -> List[Tuple[str, float, float]]:
    """(what, p-value, total variation) per position, then for the first two tokens jointly."""
    marginals, pairs = exact
    assert (marginals == 0).any(), "top-p should filter some tokens out"
    out = [(f"position {j + 1}", chisquare(c, e)[2], tv(c, e)) for j, (c, e) in enumerate(zip(counts, marginals))]
    return out + [("positions 1-2 jointly", chisquare(pair_counts, pairs)[2], tv(pair_counts, pairs))]


def tally(tokens: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """tokens [n, POSITIONS] -> counts per position [POSITIONS, V] and of the first two [V * V]."""
    counts = np.stack([np.bincount(tokens[:, j], minlength=VOCAB) for j in range(POSITIONS)])
    return counts, np.bincount(tokens[:, 0] * VOCAB + tokens[:, 1], minlength=VOCAB * VOCAB)


# The vectorised decode loop ----------------------------------------------------------------------


class Tables:
    """log p and log q after PROMPT + every context of up to POSITIONS - 1 tokens.

    A context of d tokens s_1..s_d is row OFFSET[d] + (s_1 ... s_d in base V).
    """

    OFFSET = np.cumsum([0] + [VOCAB**d for d in range(POSITIONS)])

    def __init__(self, pair: Dict[str, Any], sampling: SamplingParams):
        p, q = [], []
        for d in range(POSITIONS):
            contexts = np.stack(np.unravel_index(np.arange(VOCAB**d), (VOCAB,) * d), axis=1) if d else np.zeros((1, 0), np.int64)
            p.append(_score(pair["target_model"], contexts, sampling))
            q.append(_score(pair["drafter_model"], contexts, sampling))
        with np.errstate(divide="ignore"):
            self.log_p = mx.array(np.log(np.concatenate(p)).astype(np.float32))  # [contexts, V]
            self.log_q = mx.array(np.log(np.concatenate(q)).astype(np.float32))

    def rows(self, depth: int, code: np.ndarray) -> mx.array:
        return mx.array(self.OFFSET[depth] + code)


def simulate(tables: Tables, n: int, seed: int, rule: Callable = accept.rejection_accept) -> np.ndarray:
    """n continuations of POSITIONS tokens by the host's loop: rounds of up to BLOCK - 1 drafts drawn
    from q, judged by ``rule``; a plain step from p where one token remains. Returns [n, POSITIONS]."""
    key = mx.random.key(seed)
    out = np.zeros((n, POSITIONS), dtype=np.int64)
    depth = np.zeros(n, dtype=np.int64)  # tokens emitted so far
    code = np.zeros(n, dtype=np.int64)  # the emitted tokens in base V
    while (depth < POSITIONS).any():
        for d in np.unique(depth[depth < POSITIONS]):
            idx = np.nonzero(depth == d)[0]
            k = min(BLOCK - 1, POSITIONS - d - 1)
            key, k_draft, k_accept = mx.random.split(key, 3)
            if k < 1:  # the host's own one-token step
                x = np.array(mx.random.categorical(tables.log_p[tables.rows(d, code[idx])], key=k_draft))
                out[idx, d], depth[idx], code[idx] = x, d + 1, code[idx] * VOCAB + x
                continue
            drafts = np.zeros((len(idx), k), dtype=np.int64)
            codes = [code[idx]]  # context after the first i drafts
            draft_keys = mx.random.split(k_draft, k)
            for i in range(k):
                log_q_i = tables.log_q[tables.rows(d + i, codes[i])]  # [m, V]
                drafts[:, i] = np.array(mx.random.categorical(log_q_i, key=draft_keys[i]))
                codes.append(codes[i] * VOCAB + drafts[:, i])
            log_p = mx.stack([tables.log_p[tables.rows(d + i, codes[i])] for i in range(k + 1)], axis=1)  # [m, k+1, V]
            log_q = mx.stack([tables.log_q[tables.rows(d + i, codes[i])] for i in range(k)], axis=1)  # [m, k, V]
            a, bonus = rule(mx.array(drafts, dtype=mx.uint32), log_q, log_p, k_accept)
            a, bonus = np.array(a), np.array(bonus)
            emitted = np.concatenate([drafts, np.zeros((len(idx), 1), np.int64)], axis=1)
            emitted[np.arange(len(idx)), a] = bonus  # drafts[:a], then the bonus
            for j in range(k + 1):
                live = j <= a
                out[idx[live], d + j] = emitted[live, j]
            code[idx] = np.stack(codes, axis=1)[np.arange(len(idx)), a] * VOCAB + bonus  # context + drafts[:a] + bonus
            depth[idx] = d + a + 1
    return out


def _bonus_from_p(drafts: mx.array, log_q: Any, log_p: mx.array, key: Any) -> Tuple[mx.array, mx.array]:
    """A deliberately wrong rule, a classic bug: after a rejection draw the bonus from p instead of
    norm(max(0, p - q))."""
    saved = accept.residual
    accept.residual = lambda p, q: p
    try:
        return accept.rejection_accept(drafts, log_q, log_p, key)
    finally:
        accept.residual = saved


@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_rounds_keep_the_target_distribution(pair: Dict[str, Any], temperature: float) -> None:
    sampling = SamplingParams(temperature=temperature, top_p=TOP_P)
    tables = Tables(pair, sampling)
    exact = exact_distributions(pair["target_model"], sampling)
    tokens = simulate(tables, SIM_SAMPLES, seed=1)
    assert tokens.size >= 20_000
    results = fit(*tally(tokens), exact)
    assert all(pv > PASS_P for _, pv, _ in results), results
    # The control: the same test catches a wrong acceptance rule.
    wrong = fit(*tally(simulate(tables, SIM_SAMPLES, seed=1, rule=_bonus_from_p)), exact)
    assert min(pv for _, pv, _ in wrong) < CAUGHT_P, wrong


# The real host -----------------------------------------------------------------------------------


def host_tokens(pair: Dict[str, Any], temperature: float, samples: int, seeded: bool = False,
                **speculative: Any) -> Tuple[np.ndarray, Dict[str, int]]:
    """``samples`` continuations through the host and the plugin: [n, POSITIONS].

    Unseeded (rejection sampling): continuation s draws the target from mlx's global state seeded with s
    and the drafter from its own stream keyed by s, so that a run replays. ``seeded``: request seed s
    (coupled sampling). The prompt is one token, so there is nothing to prefill but the pending token
    itself: every position comes from the host's decode loop, i.e. from rounds (a plain step where one
    token remains).
    """
    host = make_host({"draft_model": str(pair["drafter"]), "block_size": BLOCK, **speculative})
    target = host.load(str(pair["target"]))
    out = np.zeros((samples, POSITIONS), dtype=np.int64)
    rounds = {"zero": 0, "partial": 0, "full": 0}
    for seed in range(samples):
        sampling = SamplingParams(temperature=temperature, top_p=TOP_P, seed=seed if seeded else None)
        params = no_stop(POSITIONS, sampling=sampling)
        state = host.new_state(target, PROMPT, params)
        if not seeded:
            mx.random.seed(seed)
            state.draft_rng = KeyStream(seed, "drafter")
        state.pending_logprobs = mx.zeros((VOCAB,))  # what prefill leaves; the plugin reads its width
        batch = DecodeBatch(target, single=True)
        batch.join(state, host.new_caches(target, params))  # nothing fed yet: PROMPT is the pending token
        decoder = host.decoder(batch)
        tokens: List[int] = []
        while state.remaining > 0:
            tokens += [g.token for _, gens in decoder.step() for g in gens]
        out[seed] = tokens
        host.finished(state)  # the request ends: the plugin writes its report
        for name, n in state.report["speculative"].rounds_by_acceptance.items():
            rounds[name] += n
    return out, rounds


@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_host_rounds_keep_the_target_distribution(pair: Dict[str, Any], temperature: float) -> None:
    tokens, rounds = host_tokens(pair, temperature, HOST_SAMPLES)
    assert all(n > 0 for n in rounds.values()), rounds  # zero, partial and full acceptance all occur
    exact = exact_distributions(pair["target_model"], SamplingParams(temperature=temperature, top_p=TOP_P))
    results = fit(*tally(tokens), exact)
    assert all(pv > PASS_P for _, pv, _ in results), results


def test_host_test_catches_a_wrong_rule(pair: Dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    # The control at the host's sample size: after a rejection, the bonus drawn from p.
    monkeypatch.setattr(accept, "residual", lambda p, q: p)
    tokens, _ = host_tokens(pair, 1.0, HOST_SAMPLES)
    exact = exact_distributions(pair["target_model"], SamplingParams(temperature=1.0, top_p=TOP_P))
    results = fit(*tally(tokens), exact)
    assert min(pv for _, pv, _ in results) < CAUGHT_P, results


def test_host_exact_rule_keeps_the_target_distribution(pair: Dict[str, Any]) -> None:
    # mlx-lm's token-match rule is lossless too; it only accepts less.
    tokens, _ = host_tokens(pair, 1.0, HOST_SAMPLES // 3, acceptance="exact")
    exact = exact_distributions(pair["target_model"], SamplingParams(temperature=1.0, top_p=TOP_P))
    results = fit(*tally(tokens), exact)
    assert all(pv > PASS_P for _, pv, _ in results), results


def test_host_coupled_rounds_keep_the_target_distribution(pair: Dict[str, Any]) -> None:
    # Seeded requests: the target's Gumbel-max draw at each position, the drafts drawn with the same noise.
    tokens, rounds = host_tokens(pair, 1.0, HOST_SAMPLES, seeded=True)
    assert all(n > 0 for n in rounds.values()), rounds
    exact = exact_distributions(pair["target_model"], SamplingParams(temperature=1.0, top_p=TOP_P))
    results = fit(*tally(tokens), exact)
    assert all(pv > PASS_P for _, pv, _ in results), results


def test_coupled_draw_is_the_categorical_law() -> None:
    # The Gumbel-max draw over 30,000 keys against p itself, and a biased noise (the control) caught.
    logits = mx.random.normal((VOCAB,), key=mx.random.key(3)) * 1.5
    logprobs = logits - mx.logsumexp(logits)
    keys = [KeyStream(11, "target").at(i) for i in range(30_000)]
    draws = np.array(coupled_draw(mx.broadcast_to(logprobs, (len(keys), VOCAB)), keys))
    probs = np.exp(np.array(logprobs, dtype=np.float64))
    assert chisquare(np.bincount(draws, minlength=VOCAB), probs)[2] > PASS_P
    skewed = np.array(coupled_draw(mx.broadcast_to(logprobs * 1.3, (len(keys), VOCAB)), keys))
    assert chisquare(np.bincount(skewed, minlength=VOCAB), probs)[2] < CAUGHT_P


def test_rounds_hand_over_the_processed_p_and_q_of_the_right_contexts(pair: Dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """What makes the host's rounds match ``simulate``: each call of ``rejection_accept`` gets log p
    and log q equal to the target's and the drafter's processed distributions after the committed
    tokens plus the drafts before each position, and every draft lies in q's support."""
    calls: List[Tuple[List[int], Any, Any, Any]] = []
    contexts: List[List[int]] = []
    real_accept, real_rows = accept.rejection_accept, accept.plan_rows

    def recording_rows(rows, proposals, drafts, logprobs, acceptance):
        contexts.extend(list(r.tokens) for r, p in zip(rows, proposals) if len(p.tokens))
        return real_rows(rows, proposals, drafts, logprobs, acceptance)

    def recording_accept(drafts, log_q, log_p, key=None):
        calls.append((np.array(drafts).tolist(), np.array(log_q), np.array(log_p), key))
        return real_accept(drafts, log_q, log_p, key)

    monkeypatch.setattr(accept, "plan_rows", recording_rows)
    monkeypatch.setattr(accept, "rejection_accept", recording_accept)
    host_tokens(pair, 0.7, 40)
    assert len(calls) == len(contexts) > 40
    sampling = SamplingParams(temperature=0.7, top_p=TOP_P)
    for context, (drafts, log_q, log_p, key) in zip(contexts, calls):
        assert key is None  # unseeded: mlx's global random state, as one-token decoding draws
        prefixes = [np.array([context[len(PROMPT):] + drafts[:i]], dtype=np.int64) for i in range(len(drafts) + 1)]
        p = np.concatenate([_score(pair["target_model"], s, sampling) for s in prefixes])  # [k+1, V]
        q = np.concatenate([_score(pair["drafter_model"], s, sampling) for s in prefixes[:-1]])  # [k, V]
        np.testing.assert_allclose(np.exp(log_p), p, atol=2e-5)
        np.testing.assert_allclose(np.exp(log_q), q, atol=2e-5)
        assert all(q[i, x] > 0 for i, x in enumerate(drafts))
