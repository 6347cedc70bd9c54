"""Shared fixtures: tiny real mlx-lm checkpoints with random weights and a locally trained tokenizer."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, TypeVar

import mlx.core as mx
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
TEST_CACHE = None  # the cache folder made for this run (None: the caller's $MLX_SPEC_CACHE is used)
if not os.environ.get("MLX_SPEC_CACHE"):  # what the tests make is theirs: not ~/.cache/mlx-speculative
    TEST_CACHE = os.environ["MLX_SPEC_CACHE"] = tempfile.mkdtemp(prefix="mlx-spec-test-cache-")
    atexit.register(shutil.rmtree, TEST_CACHE, True)
mx.set_default_device(mx.cpu)

from mlx_speculative.drafters.base import DraftBatch, ForwardingDraftBatch  # noqa: E402
from mlx_speculative.testing import tiny_models as tm  # noqa: E402
from mlx_speculative.hooks.host import GenerationParams, Host  # noqa: E402
from mlx_speculative.hooks.manager import make_plugin_manager  # noqa: E402
from mlx_speculative.hooks.state import HostConfig  # noqa: E402

PROMPTS = [
    "the model token draft verify",
    "red green blue one two three red green blue one two",
    "river stone light night day code",
    "a b c d e f g",
    "test plan build run step loop test plan build run step loop test plan",
    "the cache layer block round target fast slow small large",
    "one two three four five six seven eight nine ten",
    "query key value tree query key value tree query",
    "speed decode prefill sample greedy window state hidden head",
    "page book word line page book word line",
    "if then else when and or but",
    "time space word line page",
    "draft draft draft draft",
    "hello world this is a prompt",
    "Zebra!? 123 ### unusual text",
    "the the the the the the",
    "green river night code stone",
    "accept commit accept commit accept commit accept",
    "small",
    "x",
]


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("tokenizer")
    tm.train_tokenizer(d)
    return d


def _pair(root: Path, tokenizer_dir: Path, config: Dict[str, Any], seed: int) -> Dict[str, Path]:
    target = tm.make_checkpoint(root / "target", config, seed=seed, tokenizer_dir=tokenizer_dir,
                                logit_scale=3.0, quiet_layers_from=2)
    drafter = tm.make_truncated_drafter(target, root / "drafter", num_layers=2)
    random_drafter = tm.make_checkpoint(root / "random_drafter", dict(config, num_hidden_layers=1, tie_word_embeddings=False), seed=seed + 100,
                                        tokenizer_dir=tokenizer_dir)
    return {"target": target, "drafter": drafter, "random_drafter": random_drafter}


@pytest.fixture(scope="session")
def llama_pair(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Dict[str, Path]:
    return _pair(tmp_path_factory.mktemp("llama"), tokenizer_dir, tm.llama_config(num_hidden_layers=4), seed=1)


@pytest.fixture(scope="session")
def qwen3_pair(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Dict[str, Path]:
    return _pair(tmp_path_factory.mktemp("qwen3"), tokenizer_dir, tm.qwen3_config(num_hidden_layers=4, tie_word_embeddings=False), seed=2)


def make_host(speculative: Dict[str, Any] | None = None, plugins: bool = True) -> Host:
    sections = {} if speculative is None else {"speculative": speculative}
    return Host(HostConfig(sections=sections), pm=make_plugin_manager(load_entry_points=plugins))


def greedy_reference(model: Any, prompt: List[int], max_tokens: int) -> List[int]:
    """mlx-lm's own generate_step, greedy, no stop tokens."""
    from mlx_lm.generate import generate_step

    return [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens)]


def encode(target: Any, text: str) -> List[int]:
    return list(target.tokenizer.encode(text, add_special_tokens=False))


def no_stop(max_tokens: int, **kw: Any) -> GenerationParams:
    return GenerationParams(max_tokens=max_tokens, stop_token_ids=[], **kw)


def seeded_rounds(host: Host, target: Any, prompt: List[int], max_tokens: int, seed: int,
                  monkeypatch: pytest.MonkeyPatch) -> Dict[str, int]:
    """A seeded sampling request through rounds (coupled sampling, docs/lossless.md): its tokens equal plain
    one-token decoding with the same seed, and each round's drafts were drawn at block offsets 0, 1, ...
    (where the target draws those positions; a drafter drawing elsewhere would only be accepted less, so
    the offsets are checked themselves). Returns the rounds by acceptance."""
    from mlx_speculative.hooks.state import DecodeState, SamplingParams

    offsets: List[tuple] = []  # (offset, drafts drawn) per call
    real = DecodeState.draw_drafts

    def recording(self: DecodeState, logq: mx.array, offset: int = 0) -> mx.array:
        offsets.append((offset, 1 if logq.ndim == 1 else logq.shape[0]))
        return real(self, logq, offset)

    monkeypatch.setattr(DecodeState, "draw_drafts", recording)
    params = no_stop(max_tokens, sampling=SamplingParams(temperature=0.8, top_p=0.95, seed=seed))
    result = host.generate(target, prompt, params)
    assert result.tokens == make_host(None, plugins=False).generate(target, prompt, params).tokens
    stats = result.report["speculative"]
    assert stats.fallback is None and stats.rounds > 0, stats
    blocks: List[int] = []  # drafts drawn per round, each block's from offset 0 on
    for offset, n in offsets:
        if offset == 0:
            blocks.append(0)
        assert blocks and offset == blocks[-1], offsets
        blocks[-1] += n
    assert 0 < len(blocks) <= stats.rounds and sum(blocks) >= stats.draft_tokens, (blocks, stats.rounds)
    return dict(stats.rounds_by_acceptance)


T = TypeVar("T")


def wait_for(condition: Callable[[], T], timeout: float, what: Callable[[], str]) -> T:
    """Wait until ``condition()`` is truthy and return its value; after ``timeout`` seconds fail with ``what()``.

    For states of a server in another process (its readiness line, /metrics gauges), which a test cannot wait
    on as a threading.Event: the condition is re-read every 20 ms, so a test waits as long as the state takes
    and no longer, instead of sleeping a guessed time. A condition may raise AssertionError to fail at once
    (a server process that exited)."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"not reached within {timeout} s: {what()}")
        time.sleep(0.02)  # the poll interval, not a wait for the state


def price(costs: Any, kind: str, rows: int, width: int, seconds: float) -> None:
    """Price a shape of ``costs`` (plugin/costs.py ``CostTable``) at ``seconds`` as measurements would: the first
    observation (the compile) and ``trust`` more."""
    for _ in range(costs.trust + 1):
        costs.observe(kind, rows, width, seconds)


class BareForwarding(ForwardingDraftBatch):
    """A drafter's batch, wrapped for a test that watches or replaces its rounds: forwarded but for what a round
    may use beyond sync / prepare / propose / commit, which keeps ``DraftBatch``'s defaults (no drafting ahead, no
    probing of paused rows, nothing saved for the prompt cache)."""

    drafts_ahead, worth_probing = DraftBatch.drafts_ahead, DraftBatch.worth_probing
    export_row, restore_row = DraftBatch.export_row, DraftBatch.restore_row
