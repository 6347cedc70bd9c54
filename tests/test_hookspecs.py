"""Every hookspec of the host contract, exercised through the real host on a tiny llama."""

from __future__ import annotations

import inspect
from typing import Any, Dict, List, Optional

import mlx.core as mx
import pytest

from conftest import encode, greedy_reference, no_stop
from mlx_speculative.hooks import specs, taps
from mlx_speculative.hooks.cli import build_parser
from mlx_speculative.hooks.host import Host
from mlx_speculative.hooks.manager import make_plugin_manager
from mlx_speculative.hooks.state import CaptureRequest, DecodeState, GeneratedToken, HostConfig, StepOutput

hookimpl = specs.hookimpl
SPEC_NAMES = ["host_model_loaded", "host_add_commands", "host_prefill_captures", "host_decode_step",
              "host_batch_refusal", "host_decode_batch"]


def test_every_hookspec_is_documented_with_its_signature() -> None:
    found = sorted(n for n, f in vars(specs).items() if n.startswith("host_") and callable(f))
    assert found == sorted(SPEC_NAMES)
    for name in found:
        fn = getattr(specs, name)
        assert inspect.getdoc(fn) and len(inspect.getdoc(fn)) > 120, name
        assert all(p.annotation is not inspect.Parameter.empty for p in inspect.signature(fn).parameters.values())


class Recorder:
    def __init__(self) -> None:
        self.loaded: List[Any] = []

    @hookimpl
    def host_model_loaded(self, target: Any, config: HostConfig) -> None:
        self.loaded.append((target.name, config.sections.get("marker")))
        target.attachments["recorder"] = "attached"


def test_host_model_loaded_called_once_per_target(llama_pair: Dict[str, Any]) -> None:
    rec = Recorder()
    host = Host(HostConfig(sections={"marker": 7}), pm=make_plugin_manager(False, [rec]))
    target = host.load(str(llama_pair["target"]))
    assert rec.loaded == [(str(llama_pair["target"]), 7)]
    assert target.attachments["recorder"] == "attached"


def test_host_add_commands_adds_a_subcommand() -> None:
    class Commands:
        @hookimpl
        def host_add_commands(self, subparsers: Any) -> None:
            p = subparsers.add_parser("hello")
            p.set_defaults(func=lambda args: 42)

    parser = build_parser(make_plugin_manager(False, [Commands()]))
    args = parser.parse_args(["hello"])
    assert args.func(args) == 42
    with pytest.raises(SystemExit):
        build_parser(make_plugin_manager(False)).parse_args(["hello"])


class Capture:
    def __init__(self, layers: List[int]) -> None:
        self.layers = layers

    @hookimpl
    def host_prefill_captures(self, target: Any) -> Optional[CaptureRequest]:
        return CaptureRequest(self.layers)


def _reference_hidden(model: Any, tokens: List[int], layer: int) -> mx.array:
    """Layer outputs from scratch: run the decoder stack by hand on a fresh cache."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    with taps.record([layer]) as rec:
        model(mx.array([tokens]), cache=cache)
    return mx.concatenate(rec[layer], axis=1)


def test_host_prefill_captures_records_chunked_prefill_and_decode(llama_pair: Dict[str, Any]) -> None:
    host = Host(HostConfig(), pm=make_plugin_manager(False, [Capture([0, 2]), Capture([2])]))
    target = host.load(str(llama_pair["target"]))
    prompt = encode(target, "red green blue one two three red green blue one two three four five")
    params = no_stop(6)
    params.prefill_step_size = 5  # several chunks
    states: List[DecodeState] = []
    tokens = [e.token for e in host.stream(target, prompt, params, state_out=states)]
    state = states[0]
    assert state.capture_layers == [0, 2]
    fed = prompt + tokens[:-1]  # the last emitted token is pending, not fed
    for layer in (0, 2):
        got = state.captures[layer]
        assert got.shape[1] == len(fed)
        ref = _reference_hidden(target.model, fed, layer)
        assert mx.allclose(got, ref, atol=1e-4).item(), layer


class EchoSteps:
    """Returns two tokens per step: the target's own greedy choices, computed by a 2-token forward."""

    def __init__(self) -> None:
        self.calls = 0

    @hookimpl
    def host_decode_step(self, state: DecodeState) -> Optional[StepOutput]:
        self.calls += 1
        if self.calls % 2:
            return None  # every other step: the host's own one-token step
        logits = state.forward([state.pending])
        first = state.logprobs(logits)[0]
        t1 = int(mx.argmax(first).item())
        logits = state.forward([t1])
        second = state.logprobs(logits)[0]
        t2 = int(mx.argmax(second).item())
        state.tokens += [t1, t2]
        return StepOutput([GeneratedToken(t1, first), GeneratedToken(t2, second)])


class Never:
    @hookimpl
    def host_decode_step(self, state: DecodeState) -> Optional[StepOutput]:
        raise AssertionError("firstresult: not reached once another plugin returned a step")


def test_host_decode_step_multi_token_steps_and_none(llama_pair: Dict[str, Any]) -> None:
    echo, never = EchoSteps(), Never()
    pm = make_plugin_manager(False, [never, echo])  # registered last, called first
    host = Host(HostConfig(), pm=pm)
    target = host.load(str(llama_pair["target"]))
    prompt = encode(target, "query key value tree query")
    ref = greedy_reference(target.model, prompt, 25)
    with pytest.raises(AssertionError, match="firstresult"):
        host.generate(target, prompt, no_stop(25))
    pm.unregister(never)
    echo.calls = 0
    result = host.generate(target, prompt, no_stop(25))
    assert echo.calls > 5
    assert result.tokens == ref  # truncated exactly at max_tokens, nothing lost or repeated


def test_plain_host_equals_generate_step_with_stop_token(llama_pair: Dict[str, Any]) -> None:
    host = Host(HostConfig(), pm=make_plugin_manager(False))
    target = host.load(str(llama_pair["target"]))
    prompt = encode(target, "river stone light night day code")
    ref = greedy_reference(target.model, prompt, 30)
    stop = ref[7]
    params = no_stop(30)
    params.stop_token_ids = [stop]
    result = host.generate(target, prompt, params)
    assert result.finish_reason == "stop" and result.tokens == ref[: ref.index(stop)]


def test_host_batch_refusal_and_host_decode_batch(llama_pair: Dict[str, Any]) -> None:
    """A plugin may refuse batching; host_decode_batch returning None gives the host's own batched step."""
    from mlx_speculative.hooks.batch import DecodeBatch

    class Batcher:
        def __init__(self) -> None:
            self.calls: List[int] = []
            self.reason: Optional[str] = None

        @hookimpl
        def host_batch_refusal(self, target: Any) -> Optional[str]:
            return self.reason

        @hookimpl
        def host_decode_batch(self, batch: Any) -> Optional[List[StepOutput]]:
            self.calls.append(len(batch.rows))
            return None

    plugin = Batcher()
    host = Host(HostConfig(), pm=make_plugin_manager(False, [plugin]))
    target = host.load(str(llama_pair["target"]))
    assert host.batch_refusal(target) is None
    plugin.reason = "not today"
    assert host.batch_refusal(target) == "not today"
    prompts = [encode(target, t) for t in ("the model token draft", "red green blue one two three red")]
    batch = DecodeBatch(target)
    got = []
    for p in prompts:
        state = host.new_state(target, p, no_stop(12))
        host.prefill(state)
        batch.join(state)
        got.append([state.pending])
    for _ in range(11):
        for g, out in zip(got, host.decode_batch(batch)):
            g.extend(t.token for t in out.tokens)
    assert plugin.calls == [2] * 11
    for g, p in zip(got, prompts):
        assert g == greedy_reference(target.model, p, 12)


class NeverIdle:
    """Takes no step but never promises so: the host keeps its unpipelined one-token steps."""

    @hookimpl
    def host_decode_step(self, state: DecodeState) -> Optional[StepOutput]:
        return None


class IdleAfter:
    def __init__(self, steps: int) -> None:
        self.steps = steps
        self.calls = 0

    @hookimpl
    def host_decode_step(self, state: DecodeState) -> Optional[StepOutput]:
        self.calls += 1
        if self.calls >= self.steps:
            state.idle_plugins.add(self)
        return None


@pytest.mark.parametrize("sampling", [dict(), dict(temperature=0.8, top_p=0.9, seed=11)])
def test_idle_plugins_let_the_host_pipeline_the_same_tokens(sampling: Dict[str, Any], llama_pair: Dict[str, Any]) -> None:
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_logits_processors

    from mlx_speculative.hooks.state import SamplingParams

    def run(plugins: List[Any]) -> List[int]:
        host = Host(HostConfig(), pm=make_plugin_manager(False, plugins))
        target = host.load(str(llama_pair["target"]))
        params = no_stop(40, logits_processors=make_logits_processors({3: 1.5}, repetition_penalty=1.3))
        params.sampling = SamplingParams(**sampling)
        return host.generate(target, encode(target, "river stone light night"), params).tokens

    idle = IdleAfter(5)
    unpipelined, pipelined, switched = run([NeverIdle()]), run([]), run([idle])
    assert unpipelined == pipelined == switched
    assert idle.calls == 5  # asked until it went idle, never after
    if not sampling:
        target = Host(HostConfig(), pm=make_plugin_manager(False)).load(str(llama_pair["target"]))
        prompt = encode(target, "river stone light night")
        ref = [int(t) for t, _ in generate_step(mx.array(prompt), target.model, max_tokens=40,
                                                logits_processors=make_logits_processors({3: 1.5}, repetition_penalty=1.3))]
        assert pipelined == ref


class PlainRuns:
    """Declines every step, granting plain runs of ``run`` steps; records the captures it is handed."""

    def __init__(self, run: int, layers: List[int]) -> None:
        self.run, self.layers, self.calls = run, layers, 0

    @hookimpl
    def host_prefill_captures(self, target: Any) -> Optional[CaptureRequest]:
        return CaptureRequest(self.layers)

    @hookimpl
    def host_decode_step(self, state: DecodeState) -> Optional[StepOutput]:
        assert state.plain_run == 0  # reset by the host before every call
        self.calls += 1
        state.plain_run = self.run
        return None


@pytest.mark.parametrize("sampling", [dict(), dict(temperature=0.8, top_p=0.9, seed=5)])
def test_plain_run_takes_pipelined_steps_with_captures(sampling: Dict[str, Any], llama_pair: Dict[str, Any]) -> None:
    from mlx_speculative.hooks.state import SamplingParams

    plugin = PlainRuns(7, [1])
    host = Host(HostConfig(), pm=make_plugin_manager(False, [plugin]))
    target = host.load(str(llama_pair["target"]))
    prompt = encode(target, "river stone light night river")
    params = no_stop(30)
    params.sampling = SamplingParams(**sampling)
    states: List[DecodeState] = []
    tokens = [e.token for e in host.stream(target, prompt, params, state_out=states)]
    reference = Host(HostConfig(), pm=make_plugin_manager(False, [NeverIdle()]))
    assert tokens == reference.generate(target, prompt, params).tokens
    assert plugin.calls == -(-29 // 7)  # 29 steps after the first token, asked once per run of 7
    fed = prompt + tokens[:-1]
    got = states[0].captures[1]
    assert got.shape[1] == len(fed)  # every fed position captured, none twice
    assert mx.allclose(got, _reference_hidden(target.model, fed, 1), atol=1e-4).item()
    # the last step of a run queues nothing: the caches hold exactly the fed tokens (the invariant)
    assert states[0].cache[0].offset == len(fed)

