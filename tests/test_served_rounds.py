"""Batched rounds that pay: rows of very different acceptance in one batch, and rounds priced against plain steps.

Eight greedy requests share a batch, each drafter proposal forced to its row's own acceptance (two rows never
accept, four accept part, two accept everything): every request decodes exactly as alone (fp32, CPU), with the
ragged batch cache (``MLX_SPEC_PADDED_CACHE=on``: rows at their own lengths, compiled forwards) and with mlx-lm's;
in the same verify forward rows verify different widths; the rows that never accept end up verifying their one
pending token (counted: the verify forwards' positions) while the others keep their blocks, which grow as they
would without them. A round the measured costs price below plain steps is not run: the batch takes plain steps.
At an H100's prices, eight served clients whose drafts are never accepted stay within a tenth of plain batching.
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import pytest

from conftest import PROMPTS, BareForwarding, encode, greedy_reference, make_host, price
from mlx_speculative.drafters.base import DraftBatch, Drafter, Proposal
from mlx_speculative.testing import tiny_models as tm
from mlx_speculative.hooks.api import CachePolicy
from mlx_speculative.hooks.host import GenerationParams
from mlx_speculative.hooks.scheduler import Scheduler
from mlx_speculative.plugin import cuda
from mlx_speculative.plugin.cuda import compiled
from mlx_speculative.plugin.costs import CostTable, expected_tokens
from mlx_speculative.plugin.metrics import METRICS

pytestmark = pytest.mark.integration

ACCEPTS = ["zero", "zero", "partial", "partial", "partial", "partial", "full", "full"]
MAX_TOKENS = 48


class Unpriced(CostTable):
    """A cost table that measures nothing: rounds are never priced against plain steps (timing-free tests), and
    batches take no plain steps to price their row counts."""

    def __init__(self) -> None:
        super().__init__(max_asks=0)

    def observe(self, kind: str, rows: int, width: int, seconds: float) -> None:
        return None


class Forced(BareForwarding):
    """A drafter's batch whose proposals (after the drafter really ran) are each row's greedy continuation,
    corrupted at the first draft (zero), mid-block (partial) or not at all (full); logs what each row drafts.
    Rows of other prompts (the server's warm-up: teacher drafts) keep the drafter's own proposals."""

    def __init__(self, inner: DraftBatch, truth: Dict[Tuple[int, ...], Tuple[List[int], str]], log: List[Any]):
        super().__init__(inner)
        self.truth, self.log = truth, log

    def propose(self, rows: Sequence[Any], max_drafts: Sequence[int]) -> List[Proposal]:
        own = self.inner.propose(rows, max_drafts)
        if any(tuple(row.tokens[: row.prompt_len]) not in self.truth for row in rows):
            return own
        out, drafted = [], {}
        for row, m in zip(rows, max_drafts):
            ref, how = self.truth[tuple(row.tokens[: row.prompt_len])]
            drafts = list(ref[row.generated : row.generated + m])
            cut = 0 if how == "zero" else m // 2 if how == "partial" else _geometric(row, m) if how == "tau6" else m
            if cut < len(drafts):
                drafts[cut] = (drafts[cut] + 1) % 384
            out.append(Proposal(drafts) if m else Proposal([]))
            drafted[how + str(id(row))] = m
            self.fed = getattr(self, "fed", 0) + 1 + (len(drafts) if m else 0)  # positions the verify will check
        self.log.append(drafted)
        return out


def _geometric(row: Any, m: int, alpha: float = 0.84) -> int:
    """Drafts accepted before the first rejection, each with probability ``alpha`` (tau 6 at block 16), drawn from
    the row's prompt and position alone: the same whatever the batch or the round structure."""
    rng = random.Random(hash((tuple(row.tokens[: row.prompt_len]), row.generated)))
    return next((i for i in range(m) if rng.random() > alpha), m)


class ForcedDrafter(Drafter):
    def __init__(self, inner: Drafter, truth: Dict[Tuple[int, ...], Tuple[List[int], str]], log: List[Any]):
        self.inner, self.truth, self.log = inner, truth, log
        self.kind, self.family = inner.kind, inner.family
        self.default_block_size, self.max_block_size = inner.default_block_size, inner.max_block_size

    def capture_layers(self) -> List[int]:
        return self.inner.capture_layers()

    def new_batch(self) -> DraftBatch:
        self.batches = getattr(self, "batches", []) + [Forced(self.inner.new_batch(), self.truth, self.log)]
        return self.batches[-1]


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Dict[str, Path]:
    root = tmp_path_factory.mktemp("served")
    target = tm.make_checkpoint(root / "llama", tm.llama_config(num_hidden_layers=4), seed=43,
                                tokenizer_dir=tokenizer_dir, logit_scale=3.0, quiet_layers_from=2)
    return {"target": target, "drafter": tm.make_truncated_drafter(target, root / "draft", num_layers=2)}


def _decode(host: Any, target: Any, requests: List[List[int]], between: float = 0.0) -> Tuple[List[List[int]], List[Any]]:
    """Every request's tokens and report, decoded together; ``between``: seconds slept between the host's steps."""
    scheduler = Scheduler(host, target)
    submitted = [scheduler.submit(p, GenerationParams(max_tokens=MAX_TOKENS, stop_token_ids=[])) for p in requests]
    got: Dict[int, List[int]] = {r.id: [] for r in submitted}
    while scheduler.busy:
        for request, event in scheduler.step():
            got[request.id].append(event.token)
        time.sleep(between)
    return [got[r.id] for r in submitted], [r.state.report["speculative"] for r in submitted]


def _forced_host(pair: Dict[str, Path], requests: List[List[int]], accepts: List[str], log: List[Any],
                 costs: CostTable) -> Tuple[Any, Any, List[List[int]]]:
    host = make_host({"draft_model": str(pair["drafter"])})  # adaptive, from the drafter's block 4 up to 16
    target = host.load(str(pair["target"]))
    refs = [greedy_reference(target.model, p, MAX_TOKENS) for p in requests]
    att = target.attachments["speculative"]
    att.drafter = ForcedDrafter(att.drafter, {tuple(p): (r, a) for p, r, a in zip(requests, refs, accepts)}, log)
    att.costs = costs
    return host, target, refs


@pytest.mark.parametrize("padded", ["on", "off"])
def test_rows_of_very_different_acceptance_each_verify_their_own(padded: str, pair: Dict[str, Path],
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cuda.PADDED_ENV, padded)
    monkeypatch.setenv(compiled.ENV, padded)
    monkeypatch.setenv("MLX_SPEC_PREWARM_TOKENS", "0")
    probe = make_host(None, plugins=False).load(str(pair["target"]))
    requests = [encode(probe, PROMPTS[i]) for i in range(len(ACCEPTS))]
    log: List[Any] = []
    host, target, refs = _forced_host(pair, requests, ACCEPTS, log, Unpriced())
    before = METRICS.snapshot()
    tokens, reports = _decode(host, target, requests)
    assert tokens == refs
    after = METRICS.snapshot()
    positions = after["mlx_spec_verify_positions_total"] - before["mlx_spec_verify_positions_total"]
    slots = after["mlx_spec_verify_slots_total"] - before["mlx_spec_verify_slots_total"]
    forwards = after["mlx_spec_verify_forwards_total"] - before["mlx_spec_verify_forwards_total"]
    # Rounds of all eight rows in which the never-accepting rows verify their pending token alone while the
    # rows accepting everything verify whole blocks, grown past the drafter's own block of 4.
    wide = [r for r in log if len(r) == 8]
    apart = [r for r in wide if all(m == 0 for k, m in r.items() if k.startswith("zero"))
             and all(m > 4 for k, m in r.items() if k.startswith("full"))]
    assert wide and len(apart) >= 3, log
    counted = target.attachments["speculative"].drafter.batches[0].fed
    assert positions == counted and forwards == len(log) and slots > positions
    zero, full = reports[0], reports[-1]
    assert zero.accepted_tokens == 0 and zero.plain_steps > 0 and full.accepted_tokens == full.draft_tokens > 0
    assert max(full.block_sizes) > 4  # grown past the drafter's own block while everything was accepted
    # The rows that accept everything grow their blocks as they do without the rows that never accept.
    alone_log: List[Any] = []
    host, target, _ = _forced_host(pair, requests[6:], ACCEPTS[6:], alone_log, Unpriced())
    alone_tokens, alone_reports = _decode(host, target, requests[6:])
    assert alone_tokens == refs[6:]
    assert [r.block_sizes for r in alone_reports] == [r.block_sizes for r in reports[6:]]


def test_a_round_priced_below_plain_steps_is_not_run(pair: Dict[str, Path]) -> None:
    """With a round of the batch's shape measured at 10x a plain step, rows accepting half their drafts do not
    pay for it: the batch takes plain steps (every row paused) and still decodes exactly."""
    probe = make_host(None, plugins=False).load(str(pair["target"]))
    requests = [encode(probe, PROMPTS[i]) for i in range(4)]
    costs = CostTable()
    for width in range(1, 17):
        for rows in range(1, 5):
            price(costs, "round", rows, width, 0.010 * rows)
            price(costs, "plain", rows, 1, 0.001 * rows)
    log: List[Any] = []
    host, target, refs = _forced_host(pair, requests, ["partial"] * 4, log, costs)
    tokens, reports = _decode(host, target, requests)
    assert tokens == refs and not log  # no round ran: each was priced below plain steps
    assert all(r.rounds == 0 and r.plain_steps == MAX_TOKENS - 1 for r in reports)


class Logged(CostTable):
    """A cost table that keeps every observation, (kind, rows, width, seconds)."""

    def __init__(self) -> None:
        super().__init__()
        self.log: List[Tuple[str, int, int, float]] = []

    def observe(self, kind: str, rows: int, width: int, seconds: float) -> None:
        self.log.append((kind, rows, width, seconds))
        super().observe(kind, rows, width, seconds)


def test_rounds_and_plain_steps_are_priced_alike_from_step_to_step(pair: Dict[str, Path]) -> None:
    """A round and a plain step are each priced by the wall clock from the host's asking for a step to its asking
    for the next, so what the generation thread does between steps (emitting tokens to clients; here a sleep of
    40 ms) is in both prices. Timed from drafting to its commit, a round left it out while plain steps had it,
    and an H100 served 8-row rounds priced below 8-row plain steps whose drafts were never accepted."""
    probe = make_host(None, plugins=False).load(str(pair["target"]))
    requests = [encode(probe, PROMPTS[i]) for i in range(2)]
    costs = Logged()
    host, target, refs = _forced_host(pair, requests, ["zero", "partial"], [], costs)
    assert _decode(host, target, requests, between=0.04)[0] == refs
    kinds = {k for k, *_ in costs.log}
    assert kinds == {"round", "plain"}, costs.log  # the zero row's pauses: plain steps of both rows
    assert all(seconds >= 0.04 for *_, seconds in costs.log), costs.log


def test_cost_table_prices_each_shape_by_its_least_cost() -> None:
    t = CostTable()
    for s in (0.5, 0.012, 0.3, 0.011, 0.4):  # the first pays for the shape's compile; 0.3, 0.4: stalls
        t.observe("round", 2, 16, s)
        if t.seen[("round", 2, 16)] == 3:
            assert t.get("round", 2, 16) == 0.012  # priced from the third observation on
    assert t.get("round", 2, 16) == 0.011 and t.seen[("round", 2, 16)] == 5
    t.observe("round", 2, 16, 5.0)  # a busy machine raises no price
    assert t.get("round", 2, 16) == 0.011 and t.get("round", 2, 8) is None
    t.observe("plain", 2, 1, 0.030)
    assert t.get("plain", 2, 1) is None  # its first observation alone (compiling) prices nothing
    t.observe("plain", 2, 1, 0.004)
    assert t.get("plain", 2, 1) is None  # nor one more: a stall there would price the shape out for good
    t.observe("plain", 2, 1, 0.005)
    assert t.get("plain", 2, 1) == 0.004 and not t.round_loses(2, 16, 6.0) and t.round_loses(2, 16, 4.0)
    assert t.round_loses(2, 8, 1.0) is False  # a shape never measured is not priced
    assert expected_tokens(0.0, 15) == 1.0 and expected_tokens(1.0, 3) == 4.0
    assert abs(expected_tokens(0.5, 2) - 1.75) < 1e-9


def test_a_row_count_is_asked_for_plain_steps_until_priced() -> None:
    """Rounds alone never price a plain step: the table asks a batch of an unpriced row count for plain steps until
    its price is known (three observations), at most ``max_asks`` times (steps where rows joined price nothing)."""
    t = CostTable(max_asks=5)
    asks = 0
    for s in (0.03, 0.006, 0.007):
        assert t.ask_plain(4)
        asks += 1
        t.observe("plain", 4, 1, s)
    assert t.get("plain", 4, 1) == 0.006 and not t.ask_plain(4) and asks == 3
    assert [t.ask_plain(2) for _ in range(7)] == [True] * 5 + [False] * 2  # never priced: five asks, no more
    assert not CostTable(max_asks=0).ask_plain(1)


def test_a_row_count_is_priced_by_runs_of_plain_steps(pair: Dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows whose drafts are all accepted never pause, so their row count's plain step is priced by the plain runs
    the batch is asked to take (``prices_plain``): runs of ``PRICE_STEPS``, not single steps (a run's first step
    is not pipelined: one-step runs priced an H100's 8-row plain step 27% above the runs of paused rows), until
    priced; the outputs stay each request's own."""
    from mlx_speculative.hooks import step as host_step
    from mlx_speculative.plugin import round as spec_round

    monkeypatch.setenv(cuda.PADDED_ENV, "on")  # the shape-stable policy: plain steps are priced
    monkeypatch.setenv(compiled.ENV, "on")
    monkeypatch.setenv("MLX_SPEC_PREWARM_TOKENS", "0")
    limits: List[Optional[int]] = []
    real = host_step.PlainRun.__init__

    def init(self: Any, batch: Any, limit: Optional[int]) -> None:
        if not batch.single:  # not a prompt's last token (hooks/host.py prefill)
            limits.append(limit)
        real(self, batch, limit)

    monkeypatch.setattr(host_step.PlainRun, "__init__", init)
    probe = make_host(None, plugins=False).load(str(pair["target"]))
    requests = [encode(probe, PROMPTS[i]) for i in range(2)]
    costs = Logged()
    host, target, refs = _forced_host(pair, requests, ["full", "full"], [], costs)
    assert _decode(host, target, requests)[0] == refs
    plain = [entry for entry in costs.log if entry[0] == "plain"]
    assert len(plain) >= 3 and costs.get("plain", 2, 1) is not None, costs.log  # priced: three runs
    asked = [n for n in limits if n == spec_round.PRICE_STEPS]
    assert len(asked) >= 3 and 1 not in limits, limits


def test_an_unpriced_row_count_is_bounded_by_its_priced_neighbours() -> None:
    """A batch's row count whose rounds were never timed cleanly (rows joined in each) is priced in the round's
    favour from its neighbours: its round at least a round of fewer rows, its plain step at most a plain step of
    more rows; with no such neighbour it stays unpriced and no round is vetoed."""
    t = CostTable()
    price(t, "round", 1, 16, 0.022)
    price(t, "plain", 4, 1, 0.0025)
    assert t.priced(3, 16) == (0.022, 0.0025) and t.priced(3, 8) is None and t.priced(5, 16) is None
    assert t.round_loses(3, 16, 3.0)  # drafts never accepted: 3 tokens for >= 22 ms against 3 for <= 2.5 ms
    assert not t.round_loses(3, 16, 40.0)  # not vetoed where even the bounds leave the round ahead
    price(t, "round", 3, 16, 0.030)
    price(t, "plain", 3, 1, 0.002)
    assert t.priced(3, 16) == (0.030, 0.002)  # its own prices once measured


def test_a_paused_row_probes_when_its_drafter_sees_a_match() -> None:
    """ngram: a row paused after rejected rounds probes as soon as the last n tokens occurred before (the text
    repeats something, e.g. code copied from the prompt) instead of waiting out its pause."""
    from types import SimpleNamespace

    from mlx_speculative.drafters.ngram import NgramSession, matched
    from mlx_speculative.plugin import round as rnd
    from mlx_speculative.plugin.adaptive import BlockSizeController

    assert matched([1, 2, 3, 9, 1, 2, 3], 3) and not matched([1, 2, 3, 9, 1, 2, 4], 3) and not matched([5], 3)

    class Draft:
        def worth_probing(self, row: Any) -> bool:
            return NgramSession(3).worth_probing(row)

    c = BlockSizeController(cap=8)
    c.update(0, 7)
    c.update(0, 7)  # collapsed without accepting anything: paused
    assert c.paused_left == c.min_pause
    req = SimpleNamespace(controller=c, to_end=False)
    row = SimpleNamespace(tokens=[4, 5, 6, 7, 8, 9], remaining=100, target=SimpleNamespace(cache_policy=CachePolicy()))
    assert rnd._plan(row, req, Draft()) is None and c.paused_left == c.min_pause  # no match: still paused
    assert rnd._grant(row, req, True) == rnd.PROBE_EVERY  # asked again within a few plain steps
    row.tokens += [4, 5, 6]
    assert rnd._plan(row, req, Draft()) == 7 and c.paused_left == 0 and c.probing  # a match: probes now


@pytest.mark.parametrize("policy", ["off", "on"])
def test_the_cli_exits_cleanly_with_every_cache_policy(policy: str) -> None:
    """mlx-lm's caches (off) and the shape-stable policy with compiled forwards (on): the run ends with status 0
    and nothing on stderr from C++ (no "terminate called": no MLX work left running at exit)."""
    from test_cli import mlx_spec

    env = {cuda.PADDED_ENV: policy, compiled.ENV: policy, "MLX_SPEC_PREWARM_TOKENS": "0"}
    proc = mlx_spec("generate", "--max-tokens", "24", "--json", env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "terminate called" not in proc.stderr and "Abort" not in proc.stderr


def test_the_batch_veto_lets_a_pause_end_with_its_probe() -> None:
    """A row vetoed on a dip in its acceptance estimate pauses; when the pause ends its probe round runs (the one
    way the estimate is renewed). Vetoed on the same stale estimate, it paused again, doubling, to its end."""
    from types import SimpleNamespace

    from mlx_speculative.plugin.adaptive import BlockSizeController
    from mlx_speculative.plugin.costs import batch_loses

    costs = CostTable()
    price(costs, "round", 1, 16, 0.0110)
    price(costs, "plain", 1, 1, 0.0062)
    c = BlockSizeController(cap=16, costs=costs, shape_stable=True, shape=(1, 16))
    for _ in range(40):
        c.update(5, 15)  # tau 6 ...
    for _ in range(32):
        c.update(0, 15)  # ... then a dip: nothing accepted over 32 drafts tried
    batch = SimpleNamespace(rows=[object()], target=SimpleNamespace(cache_policy=SimpleNamespace(verify_width=lambda n: n)))
    c.paused_left = c.pause = 0
    why = batch_loses(batch, costs, [c], [15])
    assert "1x16 round 11.0 ms" in why
    c.pause_now(why)
    assert c.paused_left > 0 and not c.probing
    c.take_plain_steps()
    assert c.probing and batch_loses(batch, costs, [c], [15]) == ""
    c.update(6, 15)  # the probe pays (7 tokens for 11 ms against 6.2 ms plain steps): rounds go on
    assert not c.paused_left and c.window == [(6, 7)]


# Prices of the served 8B-shape target on an H100 (bench/results/served/h100-llama8b-tau1-backend-d30.json: a plain
# step of 1 row 6.3 ms, of 2/4/8 rows 12.2/12.0/14.5 ms; a 1x16 round 11.7 ms, 2x16 18.6 ms), interpolated.
H100_PLAIN = {1: 0.0063, 2: 0.0122, 3: 0.0121, 4: 0.0120, 5: 0.0126, 6: 0.0132, 7: 0.0139, 8: 0.0145}


def h100_price(kind: str, rows: int, width: int) -> float:
    return H100_PLAIN[rows] if kind == "plain" else H100_PLAIN[rows] * (1 + 0.8 * min(width, 16) / 16) + 0.0015


class Modeled(CostTable):
    """Every observation replaced by the modelled price of its shape: shapes are priced as they are met (three
    observations each), at GPU prices, whatever the CPU's own timings."""

    def observe(self, kind: str, rows: int, width: int, seconds: float) -> None:
        super().observe(kind, rows, width, h100_price(kind, rows, width))


def _served_seconds(pair: Dict[str, Path], clients: int, how: Optional[str], monkeypatch: pytest.MonkeyPatch,
                    max_tokens: int = MAX_TOKENS, block: int = 0, rounds: Optional[List[int]] = None) -> float:
    """Clients each sending 3 requests in turn (``max_tokens`` long, 7 and 14 fewer), plain (``how`` None) or with
    drafts forced to ``how``, blocks starting at ``block`` (0: the drafter's 4), after the server's warm-up of 1 to 8
    rows (hooks/warmup.py: it prices the shapes, as a served target's is before its first client): the modelled
    device time of every served decode forward, by its shape ([rows, 1]: a plain step). ``rounds``: gets the count
    of served forwards wider than one position (rounds)."""
    from mlx_speculative.hooks import warmup
    from mlx_speculative.hooks.batch import DecodeBatch

    host = make_host({"draft_model": str(pair["drafter"])} if how else None, plugins=how is not None)
    target = host.load(str(pair["target"]))
    prompts = [encode(target, PROMPTS[i % len(PROMPTS)]) for i in range(3 * clients)]
    lengths = [max_tokens - 7 * (i % 3) for i in range(len(prompts))]
    refs = [greedy_reference(target.model, p, n) for p, n in zip(prompts, lengths)]
    if how:
        att = target.attachments["speculative"]
        att.drafter = ForcedDrafter(att.drafter, {tuple(p): (r, how) for p, r in zip(prompts, refs)}, [])
        att.costs = Modeled()
        att.block_size = block or att.block_size
        warmup.warm_up(host, target, clients, tokens=64)
        assert all(att.costs.get("plain", rows, 1) for rows in range(1, clients + 1))
        assert not att.recent.window and not att.recent.pause  # the warm-up's teacher drafts: not the deployment's
    shapes: List[Tuple[int, int]] = []
    real = DecodeBatch.forward

    def forward(self: DecodeBatch, inputs: Any, *a: Any, **k: Any) -> Any:
        shapes.append(tuple(inputs.shape))
        return real(self, inputs, *a, **k)

    monkeypatch.setattr(DecodeBatch, "forward", forward)
    scheduler, waiting, live = Scheduler(host, target), list(range(len(prompts))), []
    got: Dict[int, List[int]] = {}
    while waiting or scheduler.busy:
        while waiting and len(live) < clients:  # a client sends its next request when its last one ended
            i = waiting.pop(0)
            live.append((i, scheduler.submit(prompts[i], GenerationParams(max_tokens=lengths[i], stop_token_ids=[]))))
        for request, event in scheduler.step():
            got.setdefault(request.id, []).append(event.token)
        for i, r in [(i, r) for i, r in live if r.done]:
            assert got[r.id] == refs[i], f"request {i} differs from its greedy reference"
            live.remove((i, r))
    monkeypatch.setattr(DecodeBatch, "forward", real)
    if rounds is not None:
        rounds.append(sum(1 for _, w in shapes if w > 1))
    return sum(h100_price("round" if w > 1 else "plain", b, w) for b, w in shapes)


_SERVED: Dict[str, float] = {}


@pytest.mark.parametrize("how, least", [("zero", 0.97), ("full", 2.0), ("tau6", 1.7)])
def test_served_rounds_at_gpu_prices_never_lose_to_plain_batching(how: str, least: float, pair: Dict[str, Path],
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Eight clients, requests arriving as earlier ones end, at H100 prices: drafts never accepted cost at most 3%
    over plain batching (rounds pause, the batch takes plain steps, probes are rare; 0.94x where each request
    started from a prior of its own, adaptive.py ``Recent``: 0.99x); drafts always
    accepted keep their rounds (at least 2x: the drafter's block starts at 4 and grows while it pays, and these
    requests are short); drafts accepted each with probability 0.84 (tau 6 at block 16) at least 1.7x: a row
    paused on a dip drafts in the rounds the others run (``_ride``; 1.48x without). Outputs equal each request's
    greedy reference."""
    monkeypatch.setenv(cuda.PADDED_ENV, "on")  # the shape-stable policy: measured costs decide
    monkeypatch.setenv(compiled.ENV, "on")
    monkeypatch.setenv("MLX_SPEC_PREWARM_TOKENS", "0")
    if "plain" not in _SERVED:  # the same for both cases
        _SERVED["plain"] = _served_seconds(pair, 8, None, monkeypatch)
    plain, speculative = _SERVED["plain"], _served_seconds(pair, 8, how, monkeypatch)
    assert plain / speculative >= least, (how, plain, speculative)


def test_a_paused_row_probes_early_in_a_round_whose_drafts_cost_it_nothing() -> None:
    """``_ride``: a paused row unlikely to accept drafts proposes some in another row's round only once half its pause
    is over, no more than the widest other row's, and only where one drafter forward drafts every row; then its
    next pause starts with that round's. A row likely to accept rides whenever its batch runs a round."""
    from types import SimpleNamespace

    from mlx_speculative.plugin.adaptive import BlockSizeController
    from mlx_speculative.plugin.round import RIDE_TOKENS, _ride

    costs = CostTable()
    price(costs, "round", 8, 16, 0.0193)
    price(costs, "plain", 8, 1, 0.0146)
    c = BlockSizeController(cap=16, costs=costs, shape_stable=True, shape=(8, 16))
    while not c.paused_left:
        c.update(0, 15)  # tau 1: pauses once its estimate has fallen
    assert c.paused_left == c.pause == 8 and expected_tokens(c.alpha, 15) < RIDE_TOKENS
    row, req = SimpleNamespace(remaining=100), SimpleNamespace(controller=c, to_end=False)
    assert _ride(row, req, 15) is None  # its pause just began
    c.take_plain_steps(3)
    assert _ride(row, req, 15) is None and _ride(row, req, 0) is None
    c.take_plain_steps(1)  # half over
    assert _ride(row, req, 0) is None  # per-row drafting: its drafts would cost drafter work
    assert _ride(row, req, 15) == 15 and _ride(row, req, 3) == 3
    c.update(0, 15)  # the ride accepted nothing: its pause begins again, with the round
    assert c.paused_left == c.pause and _ride(row, req, 15) is None
    good = BlockSizeController(cap=16, costs=costs, shape_stable=True, shape=(8, 16))
    good.update(15, 15)
    good.pause_now("a dip")
    assert _ride(row, SimpleNamespace(controller=good, to_end=False), 0) == 15  # likely to accept: rides at once


def test_paused_rows_whose_drafts_cost_nothing_probe_together(pair: Dict[str, Path],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Eight served clients, drafts never accepted, 256-token requests (each pauses and probes a few times), at H100
    prices: where one drafter forward drafts every row (``DraftBatch.rows_draft_together``) the paused rows probe in
    each other's rounds, so the batch runs fewer rounds than where each probes in a round of its own (19 against
    29); outputs equal each request's greedy reference either way."""
    from mlx_speculative.drafters.draft_model import DraftModelBatch

    monkeypatch.setenv(cuda.PADDED_ENV, "on")
    monkeypatch.setenv(compiled.ENV, "on")
    monkeypatch.setenv("MLX_SPEC_PREWARM_TOKENS", "0")
    together: List[int] = []
    _served_seconds(pair, 8, "zero", monkeypatch, max_tokens=256, rounds=together)
    monkeypatch.setattr(DraftModelBatch, "rows_draft_together", False)
    apart: List[int] = []
    _served_seconds(pair, 8, "zero", monkeypatch, max_tokens=256, rounds=apart)
    assert together[0] < 0.8 * apart[0], (together, apart)
