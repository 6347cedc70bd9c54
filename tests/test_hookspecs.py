"""Every hookspec of the host contract, exercised through the real host on a tiny llama."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path
from typing import Any, Dict, List, Optional

import mlx.core as mx
import pytest

from conftest import encode, greedy_reference, make_host, no_stop
from mlx_speculative.hooks import specs, taps
from mlx_speculative.hooks.batch import DecodeBatch
from mlx_speculative.hooks.cli import build_parser
from mlx_speculative.hooks.host import Host
from mlx_speculative.hooks.manager import make_plugin_manager
from mlx_speculative.hooks.scheduler import Scheduler
from mlx_speculative.hooks.state import CachePolicy, CaptureRequest, DecodeState, GeneratedToken, HostConfig, StepOutput
from mlx_speculative.hooks.transaction import CacheTransaction

pytestmark = pytest.mark.integration

hookimpl = specs.hookimpl
ROOT = Path(__file__).resolve().parents[1]
SPEC_NAMES = ["host_model_loaded", "host_cache_policy", "host_describe", "host_add_commands", "host_add_arguments",
              "host_overrides", "host_demo", "host_plain_reason", "host_prefill_captures", "host_decode_step", "host_request_finished",
              "host_save_row", "host_metrics"]


def test_every_hookspec_is_documented_with_its_signature() -> None:
    found = sorted(n for n, f in vars(specs).items() if n.startswith("host_") and callable(f))
    assert found == sorted(SPEC_NAMES)
    for name in found:
        fn = getattr(specs, name)
        assert inspect.getdoc(fn) and len(inspect.getdoc(fn)) > 60, name
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


class CountingPolicy(CachePolicy):
    name = "counting"

    def __init__(self) -> None:
        self.made = 0

    def make_cache(self, model: Any, max_kv_size: Optional[int] = None) -> List[Any]:
        self.made += 1
        return super().make_cache(model, max_kv_size)


def test_host_cache_policy_makes_every_request_cache(llama_pair: Dict[str, Any]) -> None:
    policy = CountingPolicy()

    class Policy:
        @hookimpl
        def host_cache_policy(self, target: Any) -> Optional[CachePolicy]:
            return policy

    host = Host(HostConfig(), pm=make_plugin_manager(False, [Policy()]))
    target = host.load(str(llama_pair["target"]))
    assert target.cache_policy is policy
    prompt = encode(target, "the model token draft")
    assert host.generate(target, prompt, no_stop(5)).tokens == greedy_reference(target.model, prompt, 5)
    assert policy.made == 1
    assert make_host(None, plugins=False).load(str(llama_pair["target"])).cache_policy.name == "mlx-lm"


def _reference_hidden(model: Any, tokens: List[int], layer: int) -> mx.array:
    """Layer outputs from scratch: one forward over the whole sequence on a fresh cache."""
    from mlx_lm.models.cache import make_prompt_cache

    with taps.record([layer]) as rec:
        model(mx.array([tokens]), cache=make_prompt_cache(model))
    return mx.concatenate(rec[layer], axis=1)


class Capture:
    """Asks for layers; declines every step granting ``run`` plain steps; keeps the captures handed over."""

    def __init__(self, layers: List[int], run: Optional[int] = 1) -> None:
        self.layers, self.run = layers, run
        self.calls = 0
        self.seen: Dict[int, List[mx.array]] = {}

    @hookimpl
    def host_prefill_captures(self, target: Any, state: DecodeState) -> Optional[CaptureRequest]:
        return CaptureRequest(self.layers)

    @hookimpl
    def host_decode_step(self, batch: DecodeBatch) -> Optional[List[StepOutput]]:
        self.calls += 1
        for i, h in batch.rows[0].captures.items():
            self.seen.setdefault(i, []).append(h)
        return [StepOutput([], self.run) for _ in batch.rows]


@pytest.mark.parametrize("run", [1, 7])
def test_captures_cover_chunked_prefill_and_plain_steps_once(llama_pair: Dict[str, Any], run: int) -> None:
    plugin, other = Capture([0, 2], run), Capture([2], run)
    host = Host(HostConfig(), pm=make_plugin_manager(False, [other, plugin]))
    target = host.load(str(llama_pair["target"]))
    prompt = encode(target, "red green blue one two three red green blue one two three four five")
    params = no_stop(20)
    params.prefill_step_size = 5  # several chunks
    tokens = [e.token for e in host.stream(target, prompt, params)]
    assert tokens == greedy_reference(target.model, prompt, 20)
    assert plugin.calls == -(-19 // run) and other.calls == 0  # firstresult: the first plugin answers
    fed = prompt + tokens[:-1]
    handed = {i: mx.concatenate(v, axis=1) for i, v in plugin.seen.items()}
    # Every position fed up to the last question, each once (the last run's are never asked about).
    asked = handed[0].shape[1]
    assert asked == len(prompt) + (plugin.calls - 1) * run and set(handed) == {0, 2}
    for layer in (0, 2):
        assert mx.allclose(handed[layer], _reference_hidden(target.model, fed[:asked], layer), atol=1e-4).item()


class EchoSteps:
    """Steps every row on alternate calls: two tokens, the target's own greedy choices, through
    batch.forward inside a transaction (the second one's position rolled back)."""

    def __init__(self) -> None:
        self.calls = 0

    @hookimpl
    def host_decode_step(self, batch: DecodeBatch) -> Optional[List[StepOutput]]:
        self.calls += 1
        if self.calls % 2:
            return [StepOutput([], 1) for _ in batch.rows]  # the host's own step, then ask again
        rows = batch.rows
        with CacheTransaction(batch.cache) as txn:
            logits, _ = batch.forward([[r.pending] for r in rows])
            first = [r.logprobs(logits[b : b + 1])[0] for b, r in enumerate(rows)]
            t1 = [int(mx.argmax(f).item()) for f in first]
            logits, _ = batch.forward([[t] for t in t1])
            second = [r.logprobs(logits[b : b + 1])[0] for b, r in enumerate(rows)]
            t2 = [int(mx.argmax(s).item()) for s in second]
            txn.commit(2)  # keep both positions fed; t2 becomes pending
        return [StepOutput([GeneratedToken(a, f), GeneratedToken(b, s)]) for a, f, b, s in zip(t1, first, t2, second)]


class Never:
    @hookimpl
    def host_decode_step(self, batch: DecodeBatch) -> Optional[List[StepOutput]]:
        raise AssertionError("firstresult: not reached once another plugin returned a step")


def test_host_decode_step_multi_token_steps_and_none(llama_pair: Dict[str, Any]) -> None:
    class Silent:
        @hookimpl
        def host_decode_step(self, batch: DecodeBatch) -> Optional[List[StepOutput]]:
            return None

    echo, never = EchoSteps(), Never()
    host = Host(HostConfig(), pm=make_plugin_manager(False, [never, echo]))  # registered last, called first
    target = host.load(str(llama_pair["target"]))
    prompts = [encode(target, t) for t in ("query key value tree query", "one two three four five", "a b c")]
    refs = [greedy_reference(target.model, p, 25) for p in prompts]
    silent = Host(HostConfig(), pm=make_plugin_manager(False, [never, Silent()]))
    with pytest.raises(AssertionError, match="firstresult"):  # None: the next plugin is asked
        silent.generate(silent.load(str(llama_pair["target"])), prompts[0], no_stop(25))
    assert host.generate(target, prompts[0], no_stop(25)).tokens == refs[0]  # cut exactly at max_tokens
    assert echo.calls > 5
    scheduler = Scheduler(host, target)
    requests = [scheduler.submit(p, no_stop(25)) for p in prompts]
    got: Dict[int, List[int]] = {r.id: [] for r in requests}
    while scheduler.busy:
        for request, event in scheduler.step():
            got[request.id].append(event.token)
    assert [got[r.id] for r in requests] == refs  # a batch of three, stepped by the plugin and the host


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


class Finished:
    def __init__(self) -> None:
        self.calls: List[Any] = []

    @hookimpl
    def host_request_finished(self, state: DecodeState, discarded: int) -> None:
        self.calls.append((state.generated, discarded))


def test_request_finished_counts_tokens_cut_by_a_stop_token(llama_pair: Dict[str, Any]) -> None:
    finished, echo = Finished(), EchoSteps()
    host = Host(HostConfig(), pm=make_plugin_manager(False, [echo, finished]))
    target = host.load(str(llama_pair["target"]))
    prompt = encode(target, "the model token draft verify")
    ref = greedy_reference(target.model, prompt, 25)
    # Tokens: 0 (prefill), 1 (host), 2-3 (echo), 4 (host), 5-6 (echo)...: a stop token first in
    # an echo pair cuts the second one.
    j = next(j for j in range(2, 25, 3) if ref[j] not in ref[:j])
    params = no_stop(25)
    params.stop_token_ids = [ref[j]]
    result = host.generate(target, prompt, params)
    assert result.tokens == ref[:j] and result.finish_reason == "stop"
    assert finished.calls == [(j + 2, 1)]


class Reporting:
    """A third-party plugin reporting its decode steps: the host reads the report by type, not by name."""

    @hookimpl
    def host_request_finished(self, state: DecodeState, discarded: int) -> None:
        state.report["echo"] = specs.DecodeReport(kind="echo", rounds=3, draft_tokens=6, accepted_tokens=4,
                                                  mean_acceptance_length=2.3333333, acceptance_rate=4 / 6,
                                                  plain_tokens=specs.PlainTokens(paused=2, other=1),
                                                  pause_reason="slow", steps={"draft": 0.0012345})


def test_the_host_reads_a_plugins_decode_report(llama_pair: Dict[str, Any]) -> None:
    from mlx_speculative.hooks.metrics import timings

    host = Host(HostConfig(), pm=make_plugin_manager(False, [EchoSteps(), Reporting()]))
    target = host.load(str(llama_pair["target"]))
    states: List[DecodeState] = []
    list(host.stream(target, encode(target, "the model token"), no_stop(6), state_out=states))
    report = states[0].decode_report
    assert report is states[0].report["echo"] and report.plain_tokens.total == 3
    t = timings(3, 0.1, 6, 0.2, report)
    assert (t["draft_kind"], t["draft_rounds"], t["draft_n"], t["draft_n_accepted"]) == ("echo", 3, 6, 4)
    assert (t["mean_acceptance_length"], t["acceptance_rate"], t["draft_pause_reason"]) == (2.3333, 0.6667, "slow")
    assert t["round_steps_ms"] == {"draft": 1.234} and t["draft_plain_steps"] == 0
    d = report.to_dict()
    assert d["plain_tokens"] == {"paused": 2, "fallback": 0, "other": 1} and d["steps"] == {"draft": 0.001234}
    assert list(d) == ["kind", "rounds", "draft_tokens", "accepted_tokens", "mean_acceptance_length",
                       "acceptance_rate", "accepted_per_position", "rounds_by_acceptance", "block_sizes",
                       "plain_steps", "round_tokens", "plain_tokens", "pause_reason", "verified_ahead", "fallback",
                       "seconds", "steps"]
    plain = Host(HostConfig(), pm=make_plugin_manager(False))
    states = []
    list(plain.stream(plain.load(str(llama_pair["target"])), [1, 2], no_stop(2), state_out=states))
    assert states[0].decode_report is None and "draft_kind" not in timings(2, 0.1, 2, 0.1, None)


class Decline:
    """Declines every step granting ``run`` plain steps (None: unlimited), counting the questions."""

    def __init__(self, run: Optional[int]) -> None:
        self.run, self.calls = run, 0

    @hookimpl
    def host_decode_step(self, batch: DecodeBatch) -> Optional[List[StepOutput]]:
        self.calls += 1
        return [StepOutput([], self.run) for _ in batch.rows]


@pytest.mark.parametrize("sampling", [dict(), dict(temperature=0.8, top_p=0.9, seed=11)])
def test_plain_runs_pipeline_the_same_tokens(sampling: Dict[str, Any], llama_pair: Dict[str, Any]) -> None:
    """Unpipelined (one step per question), runs of 7, and unlimited runs give the same tokens as generate_step."""
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_logits_processors

    from mlx_speculative.hooks.state import SamplingParams

    def run(plugins: List[Any]) -> List[int]:
        host = Host(HostConfig(), pm=make_plugin_manager(False, plugins))
        target = host.load(str(llama_pair["target"]))
        params = no_stop(40, logits_processors=make_logits_processors({3: 1.5}, repetition_penalty=1.3))
        params.sampling = SamplingParams(**sampling)
        return host.generate(target, encode(target, "river stone light night"), params).tokens

    one, seven, unlimited = Decline(1), Decline(7), Decline(None)
    assert run([one]) == run([seven]) == run([unlimited]) == run([])
    assert one.calls == 39 and seven.calls == -(-39 // 7) and unlimited.calls == 1
    if not sampling:
        target = Host(HostConfig(), pm=make_plugin_manager(False)).load(str(llama_pair["target"]))
        prompt = encode(target, "river stone light night")
        ref = [int(t) for t, _ in generate_step(mx.array(prompt), target.model, max_tokens=40,
                                                logits_processors=make_logits_processors({3: 1.5}, repetition_penalty=1.3))]
        assert run([]) == ref


class StepLogger:
    """A second host plugin written only against hooks/specs.py: logs each step's rows, takes none."""

    def __init__(self) -> None:
        self.steps: List[int] = []
        self.stacks: List[List[str]] = []

    @hookimpl
    def host_decode_step(self, batch: DecodeBatch) -> Optional[List[StepOutput]]:
        self.steps.append(len(batch.rows))
        self.stacks.append([f.function for f in inspect.stack()[1:12]])
        return None


def test_a_second_plugin_beside_the_speculative_one(llama_pair: Dict[str, Any]) -> None:
    from mlx_speculative.plugin import hookimpls

    logger = StepLogger()
    config = HostConfig(sections={"speculative": {"draft_model": str(llama_pair["drafter"])}})
    host = Host(config, pm=make_plugin_manager(False, [hookimpls, logger]))  # the logger is asked first
    target = host.load(str(llama_pair["target"]))
    prompt = encode(target, "the cache layer block round target fast slow")
    result = host.generate(target, prompt, no_stop(30))
    assert result.tokens == greedy_reference(target.model, prompt, 30)
    stats = result.report["speculative"]
    assert stats.rounds > 0 and stats.accepted_tokens > 0
    assert logger.steps and all(n == 1 for n in logger.steps)
    assert len(logger.steps) == stats.rounds + stats.plain_steps  # every decode step asked both plugins


def _calls_of_model(path: Path) -> List[str]:
    """`X.model(...)` / `model(...)` call sites in a source file, as 'function: line'."""
    tree = ast.parse(path.read_text())
    out: List[str] = []
    for node in ast.walk(tree):
        for fn in [n for n in ast.walk(node) if isinstance(n, ast.FunctionDef)] if isinstance(node, ast.Module) else []:
            for call in ast.walk(fn):
                if isinstance(call, ast.Call) and (
                    (isinstance(call.func, ast.Attribute) and call.func.attr == "model")
                    or (isinstance(call.func, ast.Name) and call.func.id == "model")
                ):
                    out.append(f"{path.relative_to(ROOT)}::{fn.name}")
    return sorted(set(out))


def test_the_target_is_called_only_by_the_hosts_forward() -> None:
    """The host's prefill, plain step and the plugin's verify all go through hooks/batch.forward."""
    found = [c for folder in ("hooks", "plugin") for p in sorted((ROOT / folder).rglob("*.py"))
             if "bench" not in p.parts for c in _calls_of_model(p)]
    assert found == ["hooks/batch.py::forward"]


@pytest.mark.server  # also in the server group: it serves HTTP in a thread
def test_the_cli_and_the_server_run_the_same_step(llama_pair: Dict[str, Any]) -> None:
    """The CLI's request and the server's go through the scheduler's step and the batch decoder."""
    import json
    import threading
    import urllib.request

    from mlx_speculative.hooks.server import build_server
    from mlx_speculative.hooks.server_settings import server_settings

    logger = StepLogger()
    host = Host(HostConfig(), pm=make_plugin_manager(False, [logger]))
    target = host.load(str(llama_pair["target"]))
    host.generate(target, encode(target, "one two three"), no_stop(3))
    cli_stack = logger.stacks[0]
    server = build_server(HostConfig(), str(llama_pair["target"]),
                          server_settings(HostConfig(overrides={"server": {"port": 0}})),
                          pm=make_plugin_manager(False, [logger]))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        port = server.server_address[1]
        body = json.dumps({"prompt": "one two three", "max_tokens": 3}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                         {"Content-Type": "application/json"})
        assert json.loads(urllib.request.urlopen(request, timeout=60).read())["choices"]
    finally:
        server.shutdown()
        server.engine.stop()
        server.server_close()
    server_stack = logger.stacks[-1]
    for stack in (cli_stack, server_stack):
        i = stack.index("_ask")  # BatchDecoder._ask / .step, then Scheduler._decode / .step
        assert stack[i : i + 4] == ["_ask", "step", "_decode", "step"], stack
