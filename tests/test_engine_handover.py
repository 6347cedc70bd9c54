"""The generation thread hands a streaming request's tokens to its HTTP thread every step, a non-streaming
request's once at its end: each hand-over wakes that thread to contend with the generation thread for the
interpreter, and a non-streaming one has nothing to send before the end."""

from __future__ import annotations

import queue
from pathlib import Path
from typing import Any, Dict, List

import pytest

from conftest import PROMPTS, encode, greedy_reference, make_host
from mlx_speculative.hooks import openai_compat as oc
from mlx_speculative.hooks.engine import Engine, Finished, Job
from mlx_speculative.hooks.metrics import HostCounters
from mlx_speculative.hooks.server_settings import ServerSettings
from mlx_speculative.hooks.state import SamplingParams

pytestmark = pytest.mark.integration
TOKENS = 24


def _outputs(job: Job) -> List[Any]:
    got: List[Any] = []
    while not got or not isinstance(got[-1], Finished):
        got.append(job.out.get(timeout=120))
    return got


@pytest.mark.parametrize("speculative", [False, True])
def test_tokens_reach_a_streaming_request_each_step_and_others_at_the_end(
        speculative: bool, llama_pair: Dict[str, Path]) -> None:
    host = make_host({"draft_model": str(llama_pair["drafter"])} if speculative else None, plugins=speculative)
    targets = []

    def load() -> Any:
        targets.append(host.load(str(llama_pair["target"])))
        return host, targets[-1]

    engine = Engine(load, ServerSettings(warmup_rows=0, max_active=2), HostCounters())
    engine.start()
    try:
        prompt = encode(targets[0], PROMPTS[1])
        jobs = [Job(oc.ParsedRequest(kind="text", model="m", prompt=prompt, max_tokens=TOKENS, sampling=SamplingParams(),
                                     logits_args={}, stop_words=[], stream=stream), "text") for stream in (True, False)]
        for job in jobs:
            engine.submit(job)
        streamed, whole = (_outputs(job) for job in jobs)
    finally:
        assert engine.stop()
    ref = greedy_reference(targets[0].model, prompt, TOKENS)
    for got in (streamed, whole):
        assert [t.token for step in got[:-1] for t in step] == ref
        assert got[-1].outcome == "ok" and got[-1].completion_tokens == TOKENS
    assert len(whole) == 2  # its tokens, then Finished
    assert len(streamed) > 2  # a step's tokens at a time (a round's several, a plain step's one)
    with pytest.raises(queue.Empty):
        jobs[1].out.get_nowait()
