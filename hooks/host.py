"""The mlx-lm host: loads targets with ``mlx_lm.load``, prefills requests and decodes them in batches.

With no plugin taking decode steps, a request's tokens equal ``mlx_lm.generate.generate_step``'s
for the same prompt, sampler and logits processors. ``stream`` and ``generate`` (the CLI) run one
request through the same scheduler (``hooks.scheduler``) the server runs many through.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import mlx.core as mx
import pluggy
from mlx_lm.sample_utils import make_sampler

from . import attention, knobs, loading, recurrent, taps
from .batch import DecodeBatch, forward
from .manager import make_plugin_manager
from .backend import Backend
from .specs import DecodeReport, Description
from .state import DecodeState, HostConfig, KeyStream, LoadedTarget, LogitsProcessor, SamplingParams
from .step import BatchDecoder, PlainRun

DEFAULT_PREFILL_STEP = 2048
_log = logging.getLogger("mlx_speculative.server")


@dataclass
class GenerationParams:
    max_tokens: int = 256
    sampling: SamplingParams = field(default_factory=SamplingParams)
    logits_processors: List[LogitsProcessor] = field(default_factory=list)
    stop_token_ids: Optional[Sequence[int]] = None  # default: the tokenizer's EOS ids
    prefill_step_size: int = DEFAULT_PREFILL_STEP
    max_kv_size: Optional[int] = None
    # Stop sequences on tokens (mlx-lm's ``StopSequences``: anything with ``.matcher()`` whose
    # ``advance(token)`` says a sequence completed); the request ends with the completing token.
    stop_sequences: Any = None
    # The request's options for plugins (DecodeState.options), e.g. {"speculative": False}.
    options: Dict[str, Any] = field(default_factory=dict)


@dataclass
class HostEvent:
    """One emitted token, as the CLI and the server stream it."""

    token: int
    text: str
    logprobs: mx.array
    finish_reason: Optional[str] = None  # "stop" | "length" | None
    emitted: bool = True  # False for a stop token (EOS): it ends the request but is not output


@dataclass
class GenerationResult:
    tokens: List[int]
    text: str
    prompt_tokens: int
    finish_reason: str
    prompt_seconds: float
    generation_seconds: float
    report: Dict[str, DecodeReport]  # by plugin name (``DecodeState.report``)

    @property
    def generation_tps(self) -> float:
        return len(self.tokens) / self.generation_seconds if self.generation_seconds > 0 else 0.0


class Host:
    """An mlx-lm host that honours the contract of ``hooks.specs``."""

    def __init__(self, config: Optional[HostConfig] = None, pm: Optional[pluggy.PluginManager] = None,
                 cluster: Optional[Any] = None):
        self.config = config or HostConfig()
        self.pm = pm if pm is not None else make_plugin_manager()
        self.cluster = cluster  # hooks.distributed.Cluster: targets load sharded over its ranks

    # model-load -----------------------------------------------------------------------------
    def load(self, spec: str) -> LoadedTarget:
        # The runtime: section (and its flags) under the environment, for this load and what follows (hooks/knobs.py)
        knobs.install(self.config.sections.get(knobs.SECTION), self.config.overrides.get(knobs.SECTION), self.config.where)
        path = loading.resolve_path(spec, "model")
        config = loading.read_config(path, "model")
        loading.check_safetensors(path, "model")
        # mlx_lm.load; a checkpoint's extra prediction layers (DeepSeek nextn) are left out.
        model, tokenizer = loading.load_target(path, config)
        if self.cluster is not None:  # this rank's share (mlx-lm's own shard()), before any plugin sees the model
            from .distributed import shard

            shard(model, config, self.cluster)
        # Recurrent layers of this model can then keep part of a forward (hooks/recurrent.py).
        recurrent.scope_model(model)
        target = LoadedTarget(model=model, tokenizer=tokenizer, path=path, model_config=config, name=spec,
                              cluster=self.cluster)
        self.pm.hook.host_model_loaded(target=target, config=self.config)
        self.apply_policy(target, self.pm.hook.host_cache_policy(target=target))
        return target

    @staticmethod
    def apply_policy(target: LoadedTarget, policy: Optional[Backend]) -> None:
        """Make ``policy`` (``host_cache_policy``'s answer; None: keep mlx-lm's) the target's backend: its attention
        and projection dispatchers route this model's layers only (hooks/attention.py), the layers it will
        record are tapped, then it prepares."""
        if policy is not None:
            target.cache_policy = policy
        backend = target.cache_policy
        attention.route_policy(target.model, backend)
        layers = sorted(backend.capture_layers)
        if layers:  # the layers its rounds will record, as new_state taps them for a request
            taps.install_taps(target.model, layers)
        backend.prepare(target.model)

    # requests ---------------------------------------------------------------------------------
    def new_state(self, target: LoadedTarget, prompt: Sequence[int], params: GenerationParams) -> DecodeState:
        if len(prompt) == 0:
            raise ValueError("the prompt is empty: expected at least one token")
        sampling = params.sampling
        state = DecodeState(
            target=target,
            tokens=[int(t) for t in prompt],
            prompt_len=len(prompt),
            sampler=make_sampler(sampling.temperature, top_p=sampling.top_p, min_p=sampling.min_p, top_k=sampling.top_k),
            sampling=sampling,
            logits_processors=list(params.logits_processors),
            max_tokens=params.max_tokens,
            options=dict(params.options),
        )
        if sampling.seed is not None:
            # Per-request keys by sequence position, not mx.random.seed: a seeded request then gives the
            # same tokens whatever other requests draw meanwhile, and whether steps or rounds decode it.
            state.rng = KeyStream(sampling.seed, "target")
        layers: set[int] = set()
        for request in self.pm.hook.host_prefill_captures(target=target, state=state):
            if request is not None:
                layers.update(request.layers)
        state.capture_layers = sorted(layers)
        if state.capture_layers:
            taps.install_taps(target.model, state.capture_layers)
        return state

    def new_caches(self, target: LoadedTarget, params: GenerationParams) -> List[Any]:
        return target.cache_policy.make_cache(target.model, max_kv_size=params.max_kv_size)

    def prefill(self, state: DecodeState, caches: List[Any], step: int = DEFAULT_PREFILL_STEP) -> Iterator[int]:
        """Feed the prompt in chunks of ``step`` (yielding the positions fed after each), then take
        the first decode step on the last prompt token alone, as ``generate_step`` does: its token
        becomes ``pending`` and ``caches`` hold every prompt token. ``caches`` may already hold the
        first ``state.cached`` prompt tokens (the server's prompt cache): those are not fed again."""
        prompt = state.tokens[: state.prompt_len]
        done = state.cached
        assert done < len(prompt), "a restored prefix leaves at least one prompt token to feed"
        while len(prompt) - done > 1:
            n = min(step, len(prompt) - done - 1)
            _, captured = forward(state.model, [prompt[done : done + n]], caches, state.capture_layers)
            state.add_captures(captured)
            mx.eval([c.state for c in caches], list(state.captures.values()))
            done += n
            mx.clear_cache()
            yield done
        alone = DecodeBatch(state.target, single=True)
        alone.join(state, caches)
        PlainRun(alone, 1).next(lambda: False)
        caches[:] = alone.take()
        yield len(prompt)

    def decoder(self, batch: DecodeBatch) -> BatchDecoder:
        return BatchDecoder(self.pm, batch)

    def finished(self, state: DecodeState, discarded: int = 0) -> None:
        self.pm.hook.host_request_finished(state=state, discarded=discarded)

    # one request (the CLI) --------------------------------------------------------------------
    def stream(
        self, target: LoadedTarget, prompt: Sequence[int], params: GenerationParams,
        state_out: Optional[List[DecodeState]] = None, stop: Callable[[], bool] = lambda: False,
    ) -> Iterator[HostEvent]:
        """Emit tokens with their text until a stop token or ``max_tokens``: a batch of one. ``stop()``
        true (Ctrl-C) cancels the request between two steps (prefill chunks, decode steps)."""
        from .scheduler import Scheduler

        scheduler = Scheduler(self, target)
        request = scheduler.submit(prompt, params)
        if state_out is not None:
            state_out.append(request.state)
        try:
            while not request.done and not stop():
                for _, event in scheduler.step():
                    yield event
        finally:
            if not request.done:
                scheduler.cancel(request)
                scheduler.step()

    def generate(self, target: LoadedTarget, prompt: Sequence[int], params: GenerationParams) -> GenerationResult:
        holder: List[DecodeState] = []
        tokens: List[int] = []
        text: List[str] = []
        finish = "length"
        start = time.perf_counter()
        first_at: Optional[float] = None
        for event in self.stream(target, prompt, params, state_out=holder):
            if first_at is None:
                first_at = time.perf_counter()
            text.append(event.text)
            if event.emitted:
                tokens.append(event.token)
            if event.finish_reason is not None:
                finish = event.finish_reason
        end = time.perf_counter()
        first_at = first_at or end
        return GenerationResult(
            tokens=tokens, text="".join(text), prompt_tokens=len(prompt), finish_reason=finish,
            prompt_seconds=first_at - start, generation_seconds=end - first_at,
            report=holder[0].report if holder else {},
        )


# Start-up of a long-running host (mlx-spec serve) ---------------------------------------------------

def load_with_plugins(config: HostConfig, model: str, pm: Optional[Any] = None,
                      cluster: Optional[Any] = None) -> Tuple[Host, LoadedTarget, Optional[str]]:
    """Load the target with the plugins (``pm``: default, the entry points); if a plugin cannot
    even start, serve plain decoding.

    The config is non-strict, so a drafter that fails to load or is incompatible already gives
    a warning and plain decoding; this also covers settings the plugin refuses.
    """
    host = Host(config, pm=pm, cluster=cluster)
    try:
        return host, host.load(model), None
    except Exception as e:  # noqa: BLE001
        reason = f"{type(e).__name__}: {e}"
    plain = Host(config, pm=make_plugin_manager(load_entry_points=False), cluster=cluster)
    target = plain.load(model)  # a problem with the model itself raises again here: fatal
    _log.warning("the plugins could not start (%s); serving %s with plain decoding", reason, model)
    return plain, target, reason


def describe(host: Host, target: LoadedTarget, startup_error: Optional[str]) -> List[Description]:
    """What the plugins attached (``host_describe``); a plugin that could not start is reported too."""
    found = [d for d in host.pm.hook.host_describe(target=target) if d is not None]
    if startup_error is not None:
        found.append(Description("speculative", False, [f"speculative decoding is off: {startup_error}"],
                                 {"error": startup_error}))
    return found
