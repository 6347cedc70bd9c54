"""Greedy rounds on recurrent targets equal mlx-lm's ``generate_step`` token for token (fp32, CPU).

Targets: tiny random qwen3_5 and qwen3_next (GatedDeltaNet), falcon_h1 and mamba2 (Mamba-2 SSM),
jamba (Mamba with its own selective scan) and lfm2 (gated short convolutions). Drafters:
draft_model (identical: full acceptance; cut from the target: partial; random: zero), ngram, and
dflash (a tiny random drafter whose proposals an oracle replaces with the target's continuation,
corrupted in some rounds: zero, partial and full). Each request alone (``host.generate``), and all
of them in one batch (the scheduler, rows accepting different counts in the same step). Prompts:
one plain, two that hold the target's own continuation between two copies of a start (the ngram
drafter then finds what the target says next, for partial and full rounds).

Recurrent caches keep partial rounds from their recorded forward (hooks/recurrent.py), with no
model replay; jamba's recurrence is not a shared primitive, so its partial commits take the replay.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any, Dict, List, Tuple

import mlx.core as mx
import pytest
from mlx_lm import load

from conftest import greedy_reference, make_host, no_stop
from mlx_speculative.drafters.base import Proposal
from mlx_speculative.drafters.dflash import DFlashBatch, tiny
from mlx_speculative.testing import tiny_models as tm
from mlx_speculative.hooks.scheduler import Scheduler
from mlx_speculative.hooks.transaction import CacheTransaction

pytestmark = pytest.mark.integration

ARCHS = ["qwen3_5", "qwen3_next", "falcon_h1", "mamba2", "jamba", "lfm2"]
REPLAYS = {"jamba"}  # recurrences the recording cannot re-run: partial commits replay the kept tokens
FIXTURES = Path(__file__).parent / "fixtures" / "dflash"
STARTS = [[5, 6, 7, 8, 9, 10, 11], [20, 21, 22, 20, 21, 22, 20, 21], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50]]
ECHO = 12  # tokens of the target's continuation held in the 2nd and 3rd prompts
LENGTHS = [20, 26, 32]  # max_tokens per prompt (rows of a batch end at different steps)
BLOCK = 5  # pinned: 4 draft tokens per round, no adaptive pauses
MODES = ["alone", "batch"]
def cases(known: Dict[Tuple[str, str], Any]) -> List[Any]:
    return [pytest.param(a, m, marks=known[a, m]) if (a, m) in known else pytest.param(a, m)
            for a in ARCHS for m in MODES]


def _layers(config: Dict[str, Any]) -> int:
    return int(config["num_hidden_layers"])


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Dict[str, Dict[str, Any]]:
    """Per architecture: the target, its drafters, and mlx-lm's greedy tokens for each prompt."""
    real = json.loads((FIXTURES / "z-lab__Qwen3.5-4B-DFlash.config.json").read_text())
    made: Dict[str, Dict[str, Any]] = {}
    for i, arch in enumerate(ARCHS):
        root = tmp_path_factory.mktemp(arch)
        config = tm.EXTRA_CONFIGS[arch]()
        n = _layers(config)
        target = tm.make_checkpoint(root / "target", config, seed=40 + i, tokenizer_dir=tokenizer_dir,
                                    logit_scale=3.0, quiet_layers_from=1)
        keep = 2 if n == 4 else 1  # hybrids: one layer of each kind
        truncated = tm.make_truncated_drafter(target, root / "truncated", num_layers=keep)
        random_drafter = tm.make_checkpoint(root / "random", dict(config, num_hidden_layers=keep), seed=140 + i,
                                            tokenizer_dir=tokenizer_dir)
        dflash_config = tiny.shrink_config(real, target_layer_ids=[0, 1] if n == 4 else [0], mask_token_id=383,
                                           num_target_layers=n)
        dflash = tiny.write_checkpoint(root / "dflash", dflash_config, seed=240 + i)
        model = load(str(target))[0]  # mlx-lm's own model: the reference
        prompts = [STARTS[0]] + [p + greedy_reference(model, p, ECHO) + p for p in STARTS[1:]]
        refs = {tuple(p): greedy_reference(model, p, max(LENGTHS) + BLOCK) for p in prompts}
        made[arch] = {"target": target, "identical": target, "truncated": truncated, "random": random_drafter,
                      "dflash": dflash, "prompts": prompts, "refs": refs}
    return made


@pytest.mark.parametrize("arch", ARCHS)
def test_checkpoint_loads_as_saved(arch: str, checkpoints: Dict[str, Dict[str, Any]]) -> None:
    """mlx_lm.load (with the architecture's sanitize) reads back exactly the weights written."""
    from mlx.utils import tree_flatten

    path = checkpoints[arch]["target"]
    model, _ = load(str(path))
    saved = mx.load(str(path / "model.safetensors"))
    loaded = dict(tree_flatten(model.parameters()))
    assert set(saved) == set(loaded)
    assert all(mx.array_equal(saved[k], loaded[k]).item() for k in saved)
    kinds = {type(x).__name__ for c in model.make_cache() for x in getattr(c, "caches", [c])}
    assert "ArraysCache" in kinds, kinds


class Commits:
    """Every cache transaction's commit: (recurrent caches set from the recording, positions replayed)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.seen: List[Tuple[int, Any]] = []
        commit = CacheTransaction.commit

        def counting(txn: CacheTransaction, n: Any, written: Any = None) -> None:
            commit(txn, n, written)
            self.seen.append((txn.taped, txn.replayed))

        monkeypatch.setattr(CacheTransaction, "commit", counting)

    @property
    def taped(self) -> int:
        return sum(1 for t, _ in self.seen if t)

    @property
    def replayed(self) -> int:
        return sum(1 for _, r in self.seen if r)


class Oracle:
    """Replaces a DFlash batch's proposals (after its real forward) with each row's greedy
    continuation, corrupted at a random position in some rounds: zero, partial and full rounds."""

    def __init__(self, refs: Dict[tuple, List[int]], monkeypatch: pytest.MonkeyPatch, seed: int = 0):
        rng = random.Random(seed)
        original = DFlashBatch.propose

        def propose(batch: DFlashBatch, rows: Any, max_drafts: Any) -> List[Proposal]:
            out = []
            for row, p, m in zip(rows, original(batch, rows, max_drafts), max_drafts):
                if not m:
                    out.append(p)
                    continue
                g = row.generated
                drafts = list(refs[tuple(row.tokens[: row.prompt_len])][g : g + m])
                case = rng.choice(["zero", "partial", "full", "full"])
                if case != "full":
                    j = 0 if case == "zero" or m == 1 else rng.randrange(1, m)
                    drafts[j] = (drafts[j] + 1) % 384
                out.append(Proposal(drafts, p.logprobs))
            return out

        monkeypatch.setattr(DFlashBatch, "propose", propose)


def run(made: Dict[str, Any], speculative: Dict[str, Any], mode: str) -> Dict[str, int]:
    """Each prompt alone, or all in one batch: tokens equal generate_step's. Returns round counts."""
    host = make_host(dict(speculative, block_size=BLOCK))
    target = host.load(str(made["target"]))
    att = target.attachments["speculative"]
    assert att.drafter is not None, att.error
    prompts, refs = made["prompts"], made["refs"]
    totals = {"rounds": 0, "accepted": 0, "drafted": 0, "zero": 0, "partial": 0, "full": 0, "mixed_steps": 0}

    def count(stats: Any) -> None:
        assert stats is not None and stats.fallback is None, stats and stats.fallback
        totals["rounds"] += stats.rounds
        totals["accepted"] += stats.accepted_tokens
        totals["drafted"] += stats.draft_tokens
        for key, c in stats.rounds_by_acceptance.items():
            totals[key] += c

    if mode == "alone":
        for prompt, n in zip(prompts, LENGTHS):
            result = host.generate(target, prompt, no_stop(n))
            assert result.tokens == refs[tuple(prompt)][:n], (prompt, n)
            count(result.report["speculative"])
        return totals
    scheduler = Scheduler(host, target)
    requests = [scheduler.submit(p, no_stop(n)) for p, n in zip(prompts, LENGTHS)]
    got: Dict[int, List[int]] = {r.id: [] for r in requests}
    while scheduler.busy:
        per_row: Dict[int, int] = {}
        ended = {r.id for r in requests if not got[r.id]}  # a first token comes from the prefill, not a round
        for request, event in scheduler.step():
            if event.emitted:
                got[request.id].append(event.token)
                per_row[request.id] = per_row.get(request.id, 0) + 1
            if event.finish_reason is not None:
                ended.add(request.id)  # cut by max_tokens: not what the round kept
        per_row = {k: v for k, v in per_row.items() if k not in ended}
        if len(per_row) > 1 and len(set(per_row.values())) > 1:
            totals["mixed_steps"] += 1  # rows of one batch step emitting different counts
    for request, prompt, n in zip(requests, prompts, LENGTHS):
        assert got[request.id] == refs[tuple(prompt)][:n], ("batch", prompt, n)
        count(request.state.report["speculative"])
    return totals


@pytest.mark.parametrize("arch,mode", cases({}))
def test_draft_model(arch: str, mode: str, checkpoints: Dict[str, Dict[str, Any]], monkeypatch: pytest.MonkeyPatch) -> None:
    made = checkpoints[arch]
    commits = Commits(monkeypatch)
    full = run(made, {"draft_model": str(made["identical"])}, mode)
    if _uniform(arch, mode):  # rows drafting fewer near their end hold the others back
        assert full["rounds"] > 0 and full["full"] > 0 and full["mixed_steps"] == 0, full
    else:
        assert full["rounds"] > 0 and full["accepted"] == full["drafted"] and full["full"] == full["rounds"], full
    partial = run(made, {"draft_model": str(made["truncated"])}, mode)
    assert 0 < partial["accepted"] < partial["drafted"], partial
    if _uniform(arch, mode):
        assert partial["mixed_steps"] == 0, partial
    else:
        assert partial["partial"] > 0 and (mode == "alone" or partial["mixed_steps"] > 0), partial
    zero = run(made, {"draft_model": str(made["random"])}, mode)
    assert zero["zero"] > 0, zero
    _check_commits(arch, commits)


@pytest.mark.parametrize("arch,mode", cases({}))
def test_ngram(arch: str, mode: str, checkpoints: Dict[str, Dict[str, Any]], monkeypatch: pytest.MonkeyPatch) -> None:
    commits = Commits(monkeypatch)
    totals = run(checkpoints[arch], {"kind": "ngram"}, mode)
    if _uniform(arch, mode):
        assert totals["zero"] > 0 and totals["mixed_steps"] == 0, totals
    else:
        assert totals["zero"] > 0 and totals["partial"] > 0 and totals["full"] > 0, totals
    _check_commits(arch, commits)


@pytest.mark.parametrize("arch,mode", cases({}))
def test_dflash(arch: str, mode: str, checkpoints: Dict[str, Dict[str, Any]], monkeypatch: pytest.MonkeyPatch) -> None:
    made = checkpoints[arch]
    commits = Commits(monkeypatch)
    Oracle(made["refs"], monkeypatch, seed=len(arch))
    totals = run(made, {"draft_model": str(made["dflash"]), "kind": "dflash"}, mode)
    if _uniform(arch, mode):
        assert totals["zero"] > 0 and totals["accepted"] > 0 and totals["mixed_steps"] == 0, totals
    else:
        assert totals["zero"] > 0 and totals["partial"] > 0 and totals["full"] > 0, totals
        assert mode == "alone" or totals["mixed_steps"] > 0, totals
    _check_commits(arch, commits)


def _uniform(arch: str, mode: str) -> bool:
    """Rows of a batch of a target whose partial commits replay the model keep equal lengths
    (plugin/commit.py ``fit``): a replay of unequal rows would need lengths jamba's scan ignores."""
    return mode == "batch" and arch in REPLAYS


def _check_commits(arch: str, commits: Commits) -> None:
    """Partial commits of recurrent caches: from the recording, or (jamba) through the replay."""
    if arch in REPLAYS:
        assert commits.taped == 0 and commits.replayed > 0, commits.seen
    else:
        assert commits.taped > 0 and commits.replayed == 0, [s for s in commits.seen if s[1]]
