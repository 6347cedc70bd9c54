"""One decode engine: requests decoded together equal each one decoded alone.

A batch of 8 greedy requests (different prompts and lengths) with draft_model, ngram and dflash
drafters on llama and qwen3_5 targets: every request's tokens equal mlx-lm's generate_step; rows
accept different counts in the same step; each draft step is one drafter forward for all rows.
Seeded sampling requests give the same tokens in the main batch, other requests beside them. A long prompt is
prefilled in chunks between the decode steps of the rows already running.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any, Dict, List, Sequence, Tuple

import mlx.core as mx
import pytest

from conftest import PROMPTS, BareForwarding, encode, greedy_reference, make_host, no_stop
from mlx_speculative.drafters.base import DraftBatch, Drafter, Proposal, Verified
from mlx_speculative.drafters.dflash import tiny
from mlx_speculative.testing import tiny_models as tm
from mlx_speculative.hooks.host import GenerationParams
from mlx_speculative.hooks.scheduler import Scheduler
from mlx_speculative.hooks.state import SamplingParams

pytestmark = pytest.mark.integration

FIXTURES = Path(__file__).parent / "fixtures" / "dflash"
ROWS = 8


class Watched(BareForwarding):
    """A drafter's batch, watched: forwards per round, accepted per row per round; with ``truth``
    its proposals are replaced (after the drafter really ran) by each row's greedy continuation,
    corrupted at a random position, so that rows accept different counts."""

    def __init__(self, inner: DraftBatch, log: Dict[str, List[Any]], truth: Dict[Tuple[int, ...], List[int]]):
        super().__init__(inner)
        self.log, self.truth = log, truth
        self.rng = random.Random(0)

    def prepare(self, rows: Sequence[Any]) -> None:
        self._before = self.inner.forwards
        self.inner.prepare(rows)

    def propose(self, rows: Sequence[Any], max_drafts: Sequence[int]) -> List[Proposal]:
        out = self.inner.propose(rows, max_drafts)
        self.log["forwards"].append((self.inner.forwards - self._before, max(max_drafts), len(rows)))
        if not self.truth:
            return out
        forced = []
        for row, m in zip(rows, max_drafts):
            ref = self.truth[tuple(row.tokens[: row.prompt_len])]
            drafts = list(ref[row.generated : row.generated + m])
            j = self.rng.randrange(m + 1)
            if j < len(drafts):
                drafts[j] = (drafts[j] + 1) % 384
            forced.append(Proposal(drafts) if m else Proposal([]))
        return forced

    def commit(self, rows: Sequence[Any], verified: Sequence[Verified]) -> List[int]:
        self.log["accepted"].append([v.accepted for v in verified if v.drafted])
        return self.inner.commit(rows, verified)


class WatchedDrafter(Drafter):
    def __init__(self, inner: Drafter, log: Dict[str, List[Any]], truth: Dict[Tuple[int, ...], List[int]]):
        self.inner, self.log, self.truth = inner, log, truth
        self.kind, self.family, self.default_block_size = inner.kind, inner.family, inner.default_block_size

    def capture_layers(self) -> List[int]:
        return self.inner.capture_layers()

    def new_batch(self) -> DraftBatch:
        return Watched(self.inner.new_batch(), self.log, self.truth)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Dict[str, Path]:
    root = tmp_path_factory.mktemp("engine")
    out: Dict[str, Path] = {}
    for arch, config in (("llama", tm.llama_config(num_hidden_layers=4)), ("qwen3_5", tm.qwen3_5_config()),
                         ("gemma3_text", tm.gemma3_text_config())):
        out[arch] = tm.make_checkpoint(root / arch, config, seed=41, tokenizer_dir=tokenizer_dir, logit_scale=3.0,
                                       quiet_layers_from=2)
        out[arch + ":draft_model"] = tm.make_truncated_drafter(out[arch], root / f"{arch}-draft", num_layers=2)
    real = json.loads((FIXTURES / "z-lab__Qwen3-4B-DFlash-b16.config.json").read_text())
    config = tiny.shrink_config(real, target_layer_ids=[0, 2], mask_token_id=383, num_target_layers=4)
    out["dflash"] = tiny.write_checkpoint(root / "dflash", config, seed=42)
    return out


def _requests(target: Any) -> List[Tuple[List[int], int]]:
    return [(encode(target, PROMPTS[i * 2 + 1]), 14 + 5 * i) for i in range(ROWS)]


def _run_batch(host: Any, target: Any, requests: List[Tuple[List[int], int]], prefill_step: int = 2048,
               sampling: Any = None) -> List[List[int]]:
    scheduler = Scheduler(host, target)
    submitted = []
    for prompt, n in requests:
        params = GenerationParams(max_tokens=n, stop_token_ids=[], prefill_step_size=prefill_step,
                                  sampling=sampling or SamplingParams())
        submitted.append(scheduler.submit(prompt, params))
    got: Dict[int, List[int]] = {r.id: [] for r in submitted}
    while scheduler.busy:
        for request, event in scheduler.step():
            got[request.id].append(event.token)
    return [got[r.id] for r in submitted]


@pytest.mark.parametrize("kind", ["draft_model", "ngram", "dflash"])
@pytest.mark.parametrize("arch", ["llama", "qwen3_5"])
def test_a_batch_of_eight_equals_each_request_alone(arch: str, kind: str, models: Dict[str, Path]) -> None:
    spec = {"kind": "ngram"} if kind == "ngram" else {
        "draft_model": str(models[arch + ":draft_model"] if kind == "draft_model" else models["dflash"])}
    host = make_host({**spec, "block_size": 6})
    target = host.load(str(models[arch]))
    requests = _requests(target)
    refs = [greedy_reference(target.model, p, n) for p, n in requests]
    att = target.attachments["speculative"]
    assert att.drafter.kind == kind
    log: Dict[str, List[Any]] = {"forwards": [], "accepted": []}
    truth = {tuple(p): r for (p, _), r in zip(requests, refs)} if kind == "dflash" else {}
    att.drafter = WatchedDrafter(att.drafter, log, truth)
    assert _run_batch(host, target, requests) == refs
    # Several rows in one round, accepting different counts in the same step.
    assert max(len(a) for a in log["accepted"]) >= 4
    assert any(len(set(a)) > 1 for a in log["accepted"])
    flat = [x for a in log["accepted"] for x in a]
    assert 0 in flat and max(flat) == 5 and any(0 < x < 5 for x in flat)  # zero, partial, full
    if kind == "draft_model":  # one forward per draft step, whatever the number of rows
        assert all(f == k for f, k, _ in log["forwards"]) and any(b > 1 for _, _, b in log["forwards"])
    elif kind == "dflash":  # one forward per round for every row
        assert all(f == 1 for f, _, _ in log["forwards"]) and any(b > 1 for _, _, b in log["forwards"])


def test_seeded_sampling_reproduces_beside_other_requests(models: Dict[str, Path]) -> None:
    host = make_host({"draft_model": str(models["llama:draft_model"]), "block_size": 4})
    target = host.load(str(models["llama"]))
    prompt = encode(target, PROMPTS[5])
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=1234)
    alone = host.generate(target, prompt, GenerationParams(max_tokens=30, stop_token_ids=[], sampling=seeded)).tokens
    scheduler = Scheduler(host, target)
    others = [scheduler.submit(encode(target, PROMPTS[i]), GenerationParams(
        max_tokens=30, stop_token_ids=[], sampling=SamplingParams(temperature=0.7 * (i % 2)))) for i in range(4)]
    mine = scheduler.submit(prompt, GenerationParams(max_tokens=30, stop_token_ids=[], sampling=seeded))
    got: List[int] = []
    main_rows: List[int] = []
    beside: List[int] = []  # rows in the seeded request's batch, per step
    while scheduler.busy:
        main_rows.append(max((len(b) for b in scheduler.batches() if not b.single), default=0))
        if mine.state.batch is not None:
            beside.append(len(mine.state.batch.rows))
        for request, event in scheduler.step():
            if request is mine:
                got.append(event.token)
    assert got == alone
    assert max(main_rows) >= 2 and max(beside) >= 2  # it shared the main batch with the others
    assert all(r.done for r in others)


def test_a_long_prompt_is_prefilled_between_decode_steps(models: Dict[str, Path]) -> None:
    host = make_host(None, plugins=False)
    target = host.load(str(models["llama"]))
    scheduler = Scheduler(host, target)
    rows = [scheduler.submit(encode(target, PROMPTS[i]), no_stop(400, prefill_step_size=256)) for i in range(4)]
    while any(not r.events.emitted for r in rows):
        scheduler.step()
    long_prompt = [3 + (i * 7) % 370 for i in range(4000)]
    late = scheduler.submit(long_prompt, no_stop(4, prefill_step_size=256))
    emitted_during, chunks = 0, 0
    while late.prefill is not None:
        chunks += 1
        emitted_during += sum(1 for request, _ in scheduler.step() if request in rows)
    assert chunks >= 4000 // 256  # one chunk per scheduling step
    assert emitted_during >= chunks - 1  # the four rows kept decoding during the prefill
    while not late.done:
        scheduler.step()
    assert late.state.tokens[late.state.prompt_len:] == greedy_reference(target.model, long_prompt, 4)


def test_a_request_after_the_last_row_ended_mid_run(models: Dict[str, Path]) -> None:
    """The only row ends at a stop token while its next plain step is queued; a later request must
    still join and decode (the queued step is dropped with the row)."""
    host = make_host(None, plugins=False)
    target = host.load(str(models["llama"]))
    prompt = encode(target, PROMPTS[3])
    ref = greedy_reference(target.model, prompt, 30)
    stop = next(t for i, t in enumerate(ref) if i > 4 and t not in ref[:i])
    scheduler = Scheduler(host, target)
    first = scheduler.submit(prompt, GenerationParams(max_tokens=30, stop_token_ids=[stop]))
    while not first.done:
        scheduler.step()
    assert first.finish_reason == "stop" and scheduler._main(create=False).in_run is False
    second = scheduler.submit(prompt, no_stop(12))
    steps = 0
    while not second.done and steps < 100:
        scheduler.step()
        steps += 1
    assert second.state.tokens[second.state.prompt_len:] == ref[:12]


class Exploding(Watched):
    """Raises the second time it drafts for three rows or more, after the drafter's forward ran."""

    def propose(self, rows: Sequence[Any], max_drafts: Sequence[int]) -> List[Proposal]:
        out = super().propose(rows, max_drafts)
        if len(rows) >= 3 and not self.log["exploded"]:
            self.log["wide"].append(len(rows))
            if len(self.log["wide"]) == 2:
                self.log["exploded"].append(len(rows))
                raise RuntimeError("drafter exploded")
        return out


class ExplodingDrafter(WatchedDrafter):
    def new_batch(self) -> DraftBatch:
        return Exploding(self.inner.new_batch(), self.log, self.truth)


@pytest.mark.parametrize("arch", ["llama", "qwen3_5"])
def test_a_drafter_failing_mid_batch_loses_no_token(arch: str, models: Dict[str, Path]) -> None:
    """The batch's drafter raises mid-round: the round is rolled back, every row it drafted for goes
    on with plain steps, rows joining later draft again, and every request equals its greedy decoding."""
    host = make_host({"draft_model": str(models[arch + ":draft_model"]), "block_size": 4})
    target = host.load(str(models[arch]))
    requests = _requests(target)[:4]
    refs = [greedy_reference(target.model, p, n) for p, n in requests]
    log: Dict[str, List[Any]] = {"forwards": [], "accepted": [], "exploded": [], "wide": []}
    att = target.attachments["speculative"]
    att.drafter = ExplodingDrafter(att.drafter, log, {})
    scheduler = Scheduler(host, target)
    submitted = [scheduler.submit(p, GenerationParams(max_tokens=n, stop_token_ids=[])) for p, n in requests]
    got: Dict[int, List[int]] = {r.id: [] for r in submitted}
    while scheduler.busy:
        for request, event in scheduler.step():
            got[request.id].append(event.token)
    assert [got[r.id] for r in submitted] == refs
    reports = [r.state.report["speculative"] for r in submitted]
    failed = [s for s in reports if s.fallback]
    assert log["exploded"] and len(failed) == log["exploded"][0] >= 3
    assert all("drafter exploded" in s.fallback for s in failed) and sum(s.rounds for s in failed) > 0


@pytest.mark.parametrize("kind", ["draft_model", "ngram"])
def test_sliding_windows_that_wrap_batch_exactly(kind: str, models: Dict[str, Path]) -> None:
    """gemma3_text (windows of 8): rows shorter than the window join rows past it (left padding in a
    wrapped BatchRotatingKVCache), then verify multi-token blocks; each equals its greedy decoding."""
    spec = {"kind": "ngram"} if kind == "ngram" else {"draft_model": str(models["gemma3_text:draft_model"])}
    host = make_host({**spec, "block_size": 5})
    target = host.load(str(models["gemma3_text"]))
    loops = [20, 21, 22, 20, 21, 22, 20, 21, 22, 20, 21, 22, 23, 24]
    requests = [(loops[:n], 40) for n in (14, 3, 12, 5)] + [([40 + i, 41, 42], 40) for i in range(2)]
    refs = [greedy_reference(target.model, p, n) for p, n in requests]
    log: Dict[str, List[Any]] = {"forwards": [], "accepted": []}
    att = target.attachments["speculative"]
    att.drafter = WatchedDrafter(att.drafter, log, {})
    assert _run_batch(host, target, requests) == refs
    assert any(len(a) > 1 and max(a) > 0 for a in log["accepted"])  # rounds of several rows that accepted


def test_plain_runs_hand_every_row_its_captures(llama_pair: Dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """A plain run keeps the batch's tapped outputs and hands them over once (hooks/step.py): the rows still in
    the batch at the run's end, and a row that finishes mid-run before the prompt cache saves it, each get one
    [1, n, H] per layer covering exactly the positions the run fed for it (its queued step included), the
    values of its own row of each step's forward."""
    from mlx_speculative.hooks import prompt_cache as pc
    from mlx_speculative.hooks import step, taps

    host = make_host(None, plugins=False)
    target = host.load(str(llama_pair["target"]))
    layers = [1, 2]
    taps.install_taps(target.model, layers)
    starts: Dict[int, int] = {}  # id(row) -> positions in its caches when the latest run began
    steps: List[Tuple[List[int], Dict[int, Any]]] = []  # each step's rows and tapped outputs, as fed
    init, queue = step.PlainRun.__init__, step.PlainRun._queue

    def recording_init(self: Any, batch: Any, limit: Any) -> None:
        init(self, batch, limit)
        starts.update({id(r): len(r.tokens) - 1 for r in batch.rows})

    def recording_queue(self: Any, rows: Any, fed: Any) -> None:
        queue(self, rows, fed)
        if self._captured:
            steps.append(([id(r) for r in rows], dict(self._captured[-1][1])))

    monkeypatch.setattr(step.PlainRun, "__init__", recording_init)
    monkeypatch.setattr(step.PlainRun, "_queue", recording_queue)
    saved: Dict[int, Tuple[int, Dict[int, Any]]] = {}
    keep = Scheduler._keep

    def recording_keep(self: Any, request: Any, caches: Any, held: int, own: int, batch: Any) -> None:
        if batch is not None:
            saved[id(request.state)] = (held, dict(request.state.captures))
        keep(self, request, caches, held, own, batch)

    monkeypatch.setattr(Scheduler, "_keep", recording_keep)
    scheduler = Scheduler(host, target, prompt_cache=pc.PromptCache(1 << 30))
    prompts = [encode(target, PROMPTS[i]) for i in range(3)]
    requests = [scheduler.submit(p, no_stop(n)) for p, n in zip(prompts, (6, 11, 17))]
    for r in requests:
        r.state.capture_layers = layers
    while scheduler.busy:
        scheduler.step()
    assert len(saved) == 3 and len(steps) > 10
    for r in requests:
        held, captures = saved[id(r.state)]
        n = held - starts[id(r.state)]
        assert n > 0 and sorted(captures) == layers
        for i in layers:
            assert captures[i].shape[:2] == (1, n), (r.state.max_tokens, i, captures[i].shape, n)
            # The row's own slice of the run's last n steps that fed it.
            mine = [h[i][ids.index(id(r.state))] for ids, h in steps if id(r.state) in ids][-n:]
            assert mx.array_equal(captures[i][0], mx.concatenate(mine, axis=0)).item()
