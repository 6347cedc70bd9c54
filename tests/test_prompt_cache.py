"""The prompt cache in the engine (hooks/prompt_cache.py through hooks/scheduler.py), no HTTP.

A second turn restores the target's caches and the drafter's state (draft_model, ngram, dflash,
eagle3, and the MTP families: the Qwen3.5 head, DeepSeek nextn, the Gemma 4 assistant): its tokens
and every round's proposals equal the same turn without the cache, the rows batch with others, and
the drafter prefills only what was not restored, also for a prompt that branches off inside a
cached one. On a recurrent target (qwen3_5) a hit restores the largest snapshot position <= the
shared prefix, and a wrong state (forced) is caught.
The byte bound holds over 200 distinct long prompts, with mlx's active memory flat once full.
Cancelled requests leave what they fed. (The contract's parts: tests/test_prompt_cache_contract.py.)
"""

from __future__ import annotations

import gc
import json
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
import pytest
from mlx_lm.models.cache import ArraysCache

from conftest import BareForwarding, encode, make_host, no_stop
from mlx_speculative.drafters.base import DraftBatch, Drafter, DraftState, ForwardingDraftBatch, Proposal
from mlx_speculative.drafters.dflash import tiny
from mlx_speculative.drafters.eagle3 import tiny as eagle3_tiny
from mlx_speculative.drafters.mtp import tiny as mtp_tiny
from mlx_speculative.hooks import prompt_cache as pc
from mlx_speculative.testing import tiny_models as tm
from mlx_speculative.hooks.host import GenerationParams
from mlx_speculative.hooks.scheduler import Scheduler
from mlx_speculative.hooks.state import SamplingParams
from test_dflash_rounds import qwen3_5_config

pytestmark = pytest.mark.integration

FIXTURES = Path(__file__).parent / "fixtures"
BIG = 1 << 30
DRAFTERS = {  # name: (target, drafter checkpoint (None: ngram), kind)
    "draft_model": ("llama", "draft_model", "draft_model"),
    "ngram": ("llama", None, "ngram"),
    "dflash": ("llama", "dflash", "dflash"),
    "eagle3": ("llama", "eagle3", "eagle3"),
    "qwen3_5_mtp": ("qwen3_5_mtp", "qwen3_5_mtp", "mtp"),  # the head inside the target's own shards
    "deepseek_nextn": ("deepseek", "deepseek", "mtp"),
    "gemma4_assistant": ("gemma4", "gemma4_assistant", "mtp"),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Dict[str, Path]:
    root = tmp_path_factory.mktemp("prompt_cache")
    out: Dict[str, Path] = {}
    out["llama"] = tm.make_checkpoint(root / "llama", tm.llama_config(num_hidden_layers=4), seed=51,
                                      tokenizer_dir=tokenizer_dir, logit_scale=3.0, quiet_layers_from=2)
    # Every layer speaks: the tokens depend on the recurrent state.
    out["qwen3_5"] = tm.make_checkpoint(root / "qwen3_5", qwen3_5_config(), seed=53, tokenizer_dir=tokenizer_dir,
                                        logit_scale=3.0)
    out["draft_model"] = tm.make_truncated_drafter(out["llama"], root / "draft", num_layers=2)
    real = json.loads((FIXTURES / "dflash" / "z-lab__Qwen3-4B-DFlash-b16.config.json").read_text())
    config = tiny.shrink_config(real, target_layer_ids=[0, 2], mask_token_id=383, num_target_layers=4)
    out["dflash"] = tiny.write_checkpoint(root / "dflash", config, seed=52)
    real = json.loads((FIXTURES / "eagle3" / "SafeAILab__EAGLE__traineagle3.config.json").read_text())
    out["eagle3"] = eagle3_tiny.write_checkpoint(root / "eagle3", eagle3_tiny.shrink_config(real), seed=54)
    out["qwen3_5_mtp"] = mtp_tiny.write_qwen_target(root / "qwen3_5_mtp", mtp_tiny.qwen3_5_config(), seed=55,
                                                    tokenizer_dir=tokenizer_dir)
    out["deepseek"] = mtp_tiny.write_deepseek_target(root / "deepseek", tm.deepseek_v3_config(
        num_hidden_layers=3, num_nextn_predict_layers=1), seed=56, tokenizer_dir=tokenizer_dir)
    gemma = mtp_tiny.gemma4_text_config()  # sliding window 8: a prompt's caches are snapshots
    out["gemma4"] = tm.make_checkpoint(root / "gemma4", gemma, seed=57, tokenizer_dir=tokenizer_dir, logit_scale=3.0)
    real = json.loads((FIXTURES / "mtp" / "google__gemma-4-E2B-it-assistant.config.json").read_text())
    out["gemma4_assistant"] = mtp_tiny.write_assistant(root / "assistant", mtp_tiny.assistant_config(real, gemma),
                                                       seed=58, tokenizer_dir=tokenizer_dir)
    return out


def drafter_states(inner: DraftBatch, rows: Sequence[Any]) -> List[Optional[mx.array]]:
    """Per row, what its first draft is read from: EAGLE-3's output at the last position, an MTP
    head's seed (both attend over every entry of the drafter's cache), the draft model's logits after
    the pending token; None where the drafter keeps no such state."""
    if getattr(inner, "last", None) is not None:
        return [inner.last[b, 0] for b in range(len(rows))]
    if isinstance(getattr(inner, "seeds", None), list):
        return [None if s is None else s[0, 0] for s in inner.seeds]
    if getattr(inner, "first", None) is not None:
        return [inner.first[b] for b in range(len(rows))]
    return [None] * len(rows)


class Recorded(BareForwarding):
    """A drafter's batch, recorded: each row's proposals and drafter states (by its prompt) and the
    rows per round. Forwards the prompt cache's ``export_row`` / ``restore_row`` too."""

    export_row = ForwardingDraftBatch.export_row

    def __init__(self, inner: DraftBatch, log: Dict[str, Any]):
        super().__init__(inner)
        self.log = log

    def propose(self, rows: Sequence[Any], max_drafts: Sequence[int]) -> List[Proposal]:
        states = drafter_states(self.inner, rows)
        out = self.inner.propose(rows, max_drafts)
        self.log["rows"].append(len(rows))
        for row, p, state in zip(rows, out, states):
            tokens = p.tokens.tolist() if isinstance(p.tokens, mx.array) else list(p.tokens)
            self.log["proposals"].setdefault(tuple(row.tokens[: row.prompt_len]), []).append(tokens)
            if state is not None:
                self.log["states"].setdefault(tuple(row.tokens[: row.prompt_len]), []).append(state)
        return out

    def restore_row(self, row: Any, saved: DraftState, n: int) -> bool:
        done = self.inner.restore_row(row, saved, n)
        # By row: a row restored before its prompt's end (a snapshot) is restored again to draft.
        entry = getattr(self.inner, "restored", {}).get(id(row))
        if not done or entry is None:  # the Gemma assistant keeps nothing of its own
            self.log["restored"][id(row)] = (n, None, None) if done else None
            return done
        # (n, positions in the restored caches, positions restored): the caches' plus DFlash's captures
        # not yet in them, or the features EAGLE-3 and the MTP heads hold for every position.
        if len(entry) == 3:
            held = entry[2].shape[1]
        else:
            tail = getattr(self.inner, "pending", {}).get(id(row), [])
            held = entry[1] + sum(next(iter(p.values())).shape[1] for p in tail)
        self.log["restored"][id(row)] = (n, entry[1], held)
        return done


class RecordedDrafter(Drafter):
    def __init__(self, inner: Drafter, log: Dict[str, Any]):
        self.inner, self.log = inner, log
        self.kind, self.family, self.default_block_size = inner.kind, inner.family, inner.default_block_size

    def capture_layers(self) -> List[int]:
        return self.inner.capture_layers()

    def new_session(self, state: Any) -> Any:
        return self.inner.new_session(state)

    def new_batch(self) -> DraftBatch:
        return Recorded(self.inner.new_batch(), self.log)


class CountingModel:
    """The draft model, counting the positions fed to it (hooks.batch.forward calls model(inputs, cache=))."""

    def __init__(self, model: Any):
        self.model, self.fed = model, 0

    def __call__(self, inputs: mx.array, cache: Any = None) -> mx.array:
        self.fed += inputs.shape[0] * inputs.shape[1]
        return self.model(inputs, cache=cache)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)


def _host(name: str, models: Dict[str, Path], arch: Optional[str] = None) -> Tuple[Any, Any, Dict[str, Any]]:
    target_name, drafter, kind = DRAFTERS[name]
    spec = {"kind": "ngram"} if drafter is None else {"draft_model": str(models[drafter])}
    host = make_host({**spec, "block_size": 4})  # pinned: a round every step, no adaptive pauses
    target = host.load(str(models[arch or target_name]))
    att = target.attachments["speculative"]
    assert att.drafter.kind == kind and (kind != "mtp" or att.drafter.family == name)
    log: Dict[str, Any] = {"rows": [], "proposals": {}, "states": {}, "restored": {}}
    att.drafter = RecordedDrafter(att.drafter, log)
    return host, target, log


def _run(scheduler: Scheduler, jobs: List[Tuple[List[int], GenerationParams]]) -> List[Any]:
    """Submit every job at once; their emitted tokens and requests (``request.first``: the first
    token's log-probabilities, [V])."""
    requests = [scheduler.submit(p, params) for p, params in jobs]
    got: Dict[int, List[int]] = {r.id: [] for r in requests}
    while scheduler.busy:
        for request, event in scheduler.step():
            if not got[request.id]:
                request.first = event.logprobs
            if event.emitted:
                got[request.id].append(event.token)
    return [(got[r.id], r) for r in requests]


@pytest.mark.parametrize("name", list(DRAFTERS))
def test_second_turn_restores_target_and_drafter_state(name: str, models: Dict[str, Path],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    host, target, log = _host(name, models)
    kind = DRAFTERS[name][2]
    joined: List[int] = []  # positions the draft model prefilled for rows joining its batch
    if kind == "draft_model":
        from mlx_speculative.drafters.draft_model import DraftModelBatch

        drafter = target.attachments["speculative"].drafter.inner
        counting = drafter.model = CountingModel(drafter.model)
        join = DraftModelBatch._join

        def counted_join(self: Any, row: Any) -> None:
            before = counting.fed
            join(self, row)
            joined.append(counting.fed - before)

        monkeypatch.setattr(DraftModelBatch, "_join", counted_join)
    a1, b1, c = (encode(target, t) for t in ("the model token draft verify layer cache",
                                            "river stone light night day code", "one two three four five six seven"))
    cache = pc.PromptCache(BIG)
    on = Scheduler(host, target, prompt_cache=cache)
    turn1 = _run(on, [(a1, no_stop(12)), (b1, no_stop(9))])
    snapshots = not all(e.trimmable for e in cache.entries)  # qwen3_5's recurrent layers, gemma4's wrapped windows
    assert snapshots == (DRAFTERS[name][0] in ("qwen3_5_mtp", "gemma4")) and min(len(a1), len(b1)) > 9
    a2 = a1 + turn1[0][0] + encode(target, " accept commit")
    b2 = b1 + turn1[1][0] + encode(target, " cache layer")
    seeded = GenerationParams(max_tokens=10, stop_token_ids=[], sampling=SamplingParams(temperature=0.9, seed=7))
    # Branches off a1 after len(a1) - 2 tokens: the drafter state of the cached position before the
    # branch was made with a1's next token, not this one (EAGLE-3 and the MTP heads make it again).
    branch = a1[:-2] + [t for t in encode(target, " stone river light") if t != a1[-2]]
    jobs = [(a2, no_stop(14)), (b2, no_stop(11)), (c, no_stop(8)), (a1 + turn1[0][0][:5], seeded), (branch, no_stop(9))]

    log["proposals"].clear()
    log["states"].clear()
    joined.clear()
    hits = _run(on, jobs)
    on_props, on_states, on_joined, rows = dict(log["proposals"]), dict(log["states"]), sum(joined), list(log["rows"])
    log["proposals"].clear()
    log["states"].clear()
    joined.clear()
    refs = _run(Scheduler(host, target), jobs)  # the same requests, cache off

    cached = [r.state.cached for _, r in hits]
    # What turn 1 left: prompt + answer but its last token (never fed: it was pending). Snapshot
    # targets keep exactly that (the generation's end) and the prompt's end (len(prompt) - 1), usable
    # only at their own lengths: the cut-short prompt gets the prompt's end, the branch nothing.
    if snapshots:
        assert cached == [len(a1) + 12 - 1, len(b1) + 9 - 1, 0, len(a1) - 1, 0]
    else:
        assert cached == [len(a1) + 12 - 1, len(b1) + 9 - 1, 0, len(a1) + 4, len(a1) - 2]
    assert [t for t, _ in hits] == [t for t, _ in refs]
    for (_, r), (_, ref) in zip(hits, refs):
        stats = r.state.report["speculative"]
        assert stats.fallback is None and stats.rounds > 0
        assert stats.rounds == ref.state.report["speculative"].rounds
    # The drafter drafted exactly as without the cache: its state for the reused prefix was right.
    assert on_props == log["proposals"] and on_props[tuple(a2)] and on_props[tuple(branch)]
    # ... and what its drafts were read from, every round (fp32: summation order only).
    stateful = kind in ("draft_model", "eagle3") or name in ("qwen3_5_mtp", "deepseek_nextn")
    assert on_states.keys() == log["states"].keys() and bool(on_states) == stateful
    for key, states in on_states.items():
        assert len(states) == len(log["states"][key])
        assert all(mx.allclose(x, y, atol=1e-4).item() for x, y in zip(states, log["states"][key])), key
    assert max(rows) >= 3  # the restored rows batched with the fresh one
    restored = list(log["restored"].values())
    if kind == "ngram":
        assert restored == []  # nothing to keep: its state is the row's tokens
        return
    assert sorted(n for n, _, _ in restored) == sorted(x for x in cached if x)
    if name == "gemma4_assistant":  # nothing of its own: the target's K/V and the last prompt token's capture
        assert all(held is None for _, _, held in restored)
    elif kind == "draft_model":  # the draft model prefilled only what it did not restore
        assert all(n - 3 <= held <= n for n, _, held in restored)
        assert sum(joined) - on_joined == sum(held for _, _, held in restored)
    else:  # a context of exactly the reused positions
        assert all(held == n for n, _, held in restored)
    if kind in ("eagle3", "mtp"):  # the caches' entry n - 1 made again (at most a round's entries lag) ...
        prompt_end = len(a1) - 1 if snapshots else None  # ... except a prompt's end: saved before it drafted
        assert all(kept == 0 if n == prompt_end else n - 4 <= kept <= n - 1
                   for n, kept, _ in restored if kept is not None), restored


class WrongState(pc.PromptCache):
    """Hands out a snapshot of more tokens than it claims (the recurrent state is not trimmable)."""

    def __init__(self, caches: List[Any], positions: int):
        super().__init__(BIG)
        self.caches, self.positions = caches, positions

    def fetch(self, prompt: Sequence[int], captures: bool = False) -> Optional[pc.Hit]:
        return pc.Hit(pc.copy_caches(self.caches), self.positions, {})


@pytest.mark.parametrize("kind", [None, "dflash", "qwen3_5_mtp"])
def test_recurrent_target_restores_a_snapshot_position(kind: Optional[str], models: Dict[str, Path]) -> None:
    if kind is None:
        host, log = make_host(None, plugins=False), None
        target = host.load(str(models["qwen3_5"]))
    else:  # the MTP head on its own target (a qwen3_5 with mtp.* tensors)
        host, target, log = _host(kind, models, "qwen3_5" if kind == "dflash" else None)
    p = encode(target, "test plan build run step loop test plan build run step loop")
    cache = pc.PromptCache(BIG)
    on = Scheduler(host, target, prompt_cache=cache)
    [(gen, _)] = _run(on, [(p, no_stop(8))])
    # Snapshots: the prompt's end (len(p) - 1) and the generation's end (len(p) + 7).
    assert sorted(len(e.tokens) for e in cache.entries) == [len(p) - 1, len(p) + 7]
    assert not any(e.trimmable for e in cache.entries)
    cases = [
        (p, len(p) - 1),  # the same prompt: one token is still fed
        (p[:-1] + [7], len(p) - 1),  # shares len(p) - 1
        (p + gen[:3] + [9, 10], len(p) - 1),  # shares len(p) + 3: no snapshot there; the one below
        (p + gen + [11], len(p) + 7),  # shares the whole generation
        (p[:6] + [12, 13, 14], 0),  # shares 6: no snapshot at or below
    ]
    for prompt, expected in cases:
        if log is not None:
            log["proposals"].clear()
        [(got, request)] = _run(on, [(prompt, no_stop(10))])
        props = dict(log["proposals"]) if log is not None else None
        if log is not None:
            log["proposals"].clear()
        [(ref, plain)] = _run(Scheduler(host, target), [(prompt, no_stop(10))])
        assert request.state.cached == expected, prompt
        assert got == ref, prompt
        # The restored state is the state: the first token's distribution too (fp32, summation order only).
        assert mx.allclose(request.first, plain.first, atol=1e-4).item(), prompt
        if log is not None:
            assert request.state.report["speculative"].fallback is None
            assert props == log["proposals"]
    # The test can fail: a state of more tokens than the prefix it claims gives other tokens.
    gen_end = next(e for e in cache.entries if len(e.tokens) == len(p) + 7)
    assert any(isinstance(c, ArraysCache) for c in gen_end.caches)
    wrong = pc.copy_caches(gen_end.caches)
    for c in wrong:
        if not isinstance(c, ArraysCache):
            c.trim(4)  # attention says len(p) + 3; the recurrent state holds len(p) + 7
    prompt = p + gen[:3] + [9, 10]
    [(bad, wrong_request)] = _run(Scheduler(host, target, prompt_cache=WrongState(wrong, len(p) + 3)),
                                  [(prompt, no_stop(10))])
    [(ref, plain)] = _run(Scheduler(host, target), [(prompt, no_stop(10))])
    assert bad != ref and not mx.allclose(wrong_request.first, plain.first, atol=1e-2).item()


def test_byte_bound_holds_and_memory_stays_flat(models: Dict[str, Path]) -> None:
    host = make_host(None, plugins=False)
    target = host.load(str(models["llama"]))
    bound = 3 << 20
    cache = pc.PromptCache(bound)
    scheduler = Scheduler(host, target, prompt_cache=cache)
    # Earlier tests' cyclic garbage collected now, not mid-loop: in a full CI run it freed 3.8 MB between two
    # requests and read as a step in this loop's memory.
    gc.collect()
    mx.clear_cache()
    base = mx.get_active_memory()
    memory: List[int] = []
    sizes: List[int] = []
    for i in range(200):
        prompt = [2 + i % 190, 2 + i // 190] + [3 + (i * 31 + j * 7) % 370 for j in range(120)]  # distinct
        [(_, request)] = _run(scheduler, [(prompt, no_stop(2))])
        assert request.state.cached == 0
        assert cache.nbytes <= bound and cache.nbytes == sum(e.nbytes for e in cache.entries)
        sizes.append(len(cache))
        mx.clear_cache()
        memory.append(mx.get_active_memory())
    full = sizes.index(max(sizes))
    assert cache.evictions == 200 - len(cache) and 0 < full < 50 and min(sizes[full:]) == max(sizes)
    entry = max(e.nbytes for e in cache.entries)
    steady = memory[full:]
    # Evicted entries are freed at once (no reference cycle waits for the garbage collector).
    assert max(steady) - min(steady) <= entry, (min(steady), max(steady), entry)
    assert max(memory) - base <= bound + entry


def test_cancelled_requests_leave_what_they_fed(models: Dict[str, Path]) -> None:
    host, target, _ = _host("draft_model", models)
    cache = pc.PromptCache(BIG)
    scheduler = Scheduler(host, target, prompt_cache=cache)
    prompt = [3 + (i * 11) % 370 for i in range(40)]
    decoding = scheduler.submit(prompt, no_stop(30))
    while decoding.state.generated < 6:
        scheduler.step()
    scheduler.cancel(decoding)
    scheduler.step()
    kept = decoding.state.tokens[:-1]  # every token the caches held but the pending one
    assert decoding.finish_reason == "cancelled" and [list(e.tokens) for e in cache.entries] == [kept]
    other = [5 + (i * 13) % 370 for i in range(40)]
    prefilling = scheduler.submit(other, no_stop(8, prefill_step_size=16))
    scheduler.step()
    scheduler.step()
    assert prefilling.fed == 32 and prefilling.prefill is not None
    scheduler.cancel(prefilling)
    scheduler.step()
    assert sorted(len(e.tokens) for e in cache.entries) == [32, len(kept)]
    # Both are found again, and the answers equal the cache-off ones.
    jobs = [(kept + [7], no_stop(6)), (other, no_stop(6))]
    hits = _run(scheduler, jobs)
    assert [r.state.cached for _, r in hits] == [len(kept), 32]
    assert [t for t, _ in hits] == [t for t, _ in _run(Scheduler(host, target), jobs)]


@pytest.mark.parametrize("name", ["eagle3", "qwen3_5_mtp"])
def test_no_feature_log_without_a_prompt_cache(name: str, models: Dict[str, Path]) -> None:
    """The features EAGLE-3 and the MTP heads keep for the prompt cache are kept only for rows it saves."""
    host, target, _ = _host(name, models)
    prompt = encode(target, "the model token draft verify layer cache")
    for cache in (None, pc.PromptCache(BIG)):
        scheduler = Scheduler(host, target, prompt_cache=cache)
        request = scheduler.submit(prompt, no_stop(12))
        logs = []
        while scheduler.busy:
            scheduler.step()
            logs += [bool(b.extras["speculative"].draft.inner.log.buffers)
                     for b in scheduler.batches() if "speculative" in b.extras]
        assert request.state.saved is (cache is not None) and logs, name
        assert any(logs) is (cache is not None), name
