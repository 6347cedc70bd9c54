"""The mlx-lm host: loads targets with ``mlx_lm.load`` and runs prefill and decode through the hooks.

With no plugin taking decode steps, the token stream equals ``mlx_lm.generate.generate_step``'s
for the same prompt, sampler and logits processors.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Sequence

import mlx.core as mx
import pluggy
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import make_sampler

from . import loading, taps
from .batch import DecodeBatch, cache_refusal
from .manager import make_plugin_manager
from .state import (
    DecodeState,
    GeneratedToken,
    HostConfig,
    KeyStream,
    LoadedTarget,
    LogitsProcessor,
    SamplingParams,
    StepOutput,
    keyed_sampler,
)

DEFAULT_PREFILL_STEP = 2048


@dataclass
class GenerationParams:
    max_tokens: int = 256
    sampling: SamplingParams = field(default_factory=SamplingParams)
    logits_processors: List[LogitsProcessor] = field(default_factory=list)
    stop_token_ids: Optional[Sequence[int]] = None  # default: the tokenizer's EOS ids
    prefill_step_size: int = DEFAULT_PREFILL_STEP
    max_kv_size: Optional[int] = None
    # Seeds DecodeState.extras, e.g. {"speculative_enabled": False} turns rounds off for one request.
    extras: Dict[str, Any] = field(default_factory=dict)


@dataclass
class HostEvent:
    """One emitted token, as the CLI and the server stream it."""

    token: int
    text: str
    logprobs: mx.array
    finish_reason: Optional[str] = None  # "stop" | "length" | None


@dataclass
class GenerationResult:
    tokens: List[int]
    text: str
    prompt_tokens: int
    finish_reason: str
    prompt_seconds: float
    generation_seconds: float
    report: Dict[str, Any]

    @property
    def generation_tps(self) -> float:
        return len(self.tokens) / self.generation_seconds if self.generation_seconds > 0 else 0.0


class Host:
    """An mlx-lm host that honours the contract of ``hooks.specs``."""

    def __init__(self, config: Optional[HostConfig] = None, pm: Optional[pluggy.PluginManager] = None):
        self.config = config or HostConfig()
        self.pm = pm if pm is not None else make_plugin_manager()

    # model-load -----------------------------------------------------------------------------
    def load(self, spec: str) -> LoadedTarget:
        from mlx_lm import load as mlx_load

        path = loading.resolve_path(spec, "model")
        config = loading.read_config(path, "model")
        loading.check_safetensors(path, "model")
        model, tokenizer = mlx_load(str(path))
        target = LoadedTarget(model=model, tokenizer=tokenizer, path=path, model_config=config, name=spec)
        self.pm.hook.host_model_loaded(target=target, config=self.config)
        return target

    # prefill + decode -----------------------------------------------------------------------
    def new_state(self, target: LoadedTarget, prompt: Sequence[int], params: GenerationParams) -> DecodeState:
        if len(prompt) == 0:
            raise ValueError("the prompt is empty: expected at least one token")
        capture_layers: set[int] = set()
        for request in self.pm.hook.host_prefill_captures(target=target):
            if request is not None:
                capture_layers.update(request.layers)
        layers = sorted(capture_layers)
        if layers:
            taps.install_taps(target.model, layers)
        sampling = params.sampling
        state = DecodeState(
            target=target,
            # A plugin may offer shape-stable caches (plugin/padded_cache.py); default: mlx-lm's.
            cache=target.attachments.get("cache_factory", make_prompt_cache)(target.model, max_kv_size=params.max_kv_size),
            tokens=[int(t) for t in prompt],
            prompt_len=len(prompt),
            sampler=make_sampler(
                sampling.temperature, top_p=sampling.top_p, min_p=sampling.min_p, top_k=sampling.top_k
            ),
            sampling=sampling,
            logits_processors=list(params.logits_processors),
            max_tokens=params.max_tokens,
            capture_layers=layers,
        )
        state.extras.update(params.extras)
        if sampling.seed is not None:
            # Per-request streams, not mx.random.seed: a seeded request then gives the same tokens
            # whatever other requests draw meanwhile, and the drafter's draws never move the target's.
            state.rng = KeyStream(sampling.seed, "target")
            if not sampling.greedy:
                state.sampler = keyed_sampler(sampling, state.next_key)
        return state

    def prefill(self, state: DecodeState, step: int = DEFAULT_PREFILL_STEP) -> None:
        """Feed the prompt in chunks, then sample the first token (it becomes ``pending``)."""
        prompt = state.tokens[: state.prompt_len]
        done = 0
        while len(prompt) - done > 1:
            n = min(step, len(prompt) - done - 1)
            state.forward(prompt[done : done + n])
            state.keep_captures(n)
            mx.eval([c.state for c in state.cache], list(state.captures.values()))
            done += n
            mx.clear_cache()
        # The last prompt token alone, like generate_step: its logits give the first token.
        self._plain_step(state)

    def _plain_step(self, state: DecodeState) -> GeneratedToken:
        """Feed the pending token and append the sampled next token (the new pending one)."""
        logits = state.forward([state.pending])
        state.keep_captures(1)
        logprobs = state.logprobs(logits[:, -1:])  # [1, V]
        sampled = state.sampler(logprobs)
        # The captures too: left lazy, a run of steps would leave a chain of concatenations for the
        # next round to build and run on its critical path.
        mx.eval(sampled, logprobs, list(state.captures.values()))
        out = GeneratedToken(int(sampled.item()), logprobs[0])
        state.tokens.append(out.token)
        state.pending_logprobs = out.logprobs
        return out

    def _pipelined_plain_steps(self, state: DecodeState, limit: Optional[int] = None) -> Iterator[GeneratedToken]:
        """One-token steps with the next forward queued before the current token is read.

        The same operations as ``_plain_step``, so the same tokens; only the synchronisation moves.
        While a run is under way the target's caches are one token ahead of ``pending`` between
        yields, so it runs only when no plugin will take a step in the meantime: to the end of the
        request once every plugin is idle, or for ``limit`` steps a plugin granted (``plain_run``);
        the last step of a run queues nothing, so the caches then match ``pending`` again.
        The tapped layers (``state.capture_layers``) of every fed position are kept, as ``_plain_step`` does.
        """
        history = mx.array(state.tokens, dtype=mx.uint32)  # ends with the pending token

        def step(token: mx.array, extend: bool) -> tuple:
            nonlocal history
            if extend and state.logits_processors:
                history = mx.concatenate([history, token])
            logits = state.forward(token)
            state.keep_captures(1)
            logits = state.apply_processors(history, logits[:, -1, :])  # [1, V]
            logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            return state.sampler(logprobs), logprobs

        y, logprobs = step(mx.array([state.pending], dtype=mx.uint32), extend=False)
        mx.async_eval(y, logprobs, list(state.captures.values()))
        n = 0
        while True:
            n += 1
            last = state.remaining <= 1 or (limit is not None and n >= limit)
            if not last:
                next_y, next_logprobs = step(y, extend=True)
                mx.async_eval(next_y, next_logprobs, list(state.captures.values()))
            out = GeneratedToken(int(y.item()), logprobs[0])
            state.tokens.append(out.token)
            state.pending_logprobs = out.logprobs
            yield out
            if last:
                return
            y, logprobs = next_y, next_logprobs
            if n % 256 == 0:
                mx.clear_cache()

    def decode_steps(self, state: DecodeState) -> Iterator[GeneratedToken]:
        """Tokens after the first one, one decode step (plain or a plugin's) at a time."""
        n_step = 0
        while state.remaining > 0:
            if all(impl.plugin in state.idle_plugins for impl in self.pm.hook.host_decode_step.get_hookimpls()):
                yield from self._pipelined_plain_steps(state)
                return
            state.plain_run = 0
            out = self.pm.hook.host_decode_step(state=state)
            if out is None:
                run, state.plain_run = state.plain_run, 0
                if run > 1:
                    yield from self._pipelined_plain_steps(state, limit=run)
                else:
                    yield self._plain_step(state)
            else:
                assert out.tokens, "a decode step must emit at least one token"
                yield from out.tokens
            n_step += 1
            if n_step % 256 == 0:
                mx.clear_cache()

    def batch_refusal(self, target: LoadedTarget) -> Optional[str]:
        """Why ``target``'s requests cannot decode in one ``DecodeBatch`` (host caches or a plugin), or None."""
        reasons = [cache_refusal(target)] + list(self.pm.hook.host_batch_refusal(target=target))
        return "; ".join(r for r in reasons if r) or None

    def decode_batch(self, batch: DecodeBatch) -> List[StepOutput]:
        """One decode step for every row of a ``DecodeBatch``: a plugin's batched step or the host's own."""
        out = self.pm.hook.host_decode_batch(batch=batch)
        if out is None:
            return batch.plain_step()
        if len(out) != len(batch.rows) or not all(o.tokens for o in out):
            raise RuntimeError(f"host_decode_batch returned {len(out)} steps for {len(batch.rows)} rows, or an empty step")
        batch.compact()
        return out

    def stream(
        self, target: LoadedTarget, prompt: Sequence[int], params: GenerationParams,
        state_out: Optional[List[DecodeState]] = None,
    ) -> Iterator[HostEvent]:
        """Emit tokens with their text until a stop token or ``max_tokens``."""
        state = self.new_state(target, prompt, params)
        if state_out is not None:
            state_out.append(state)
        if params.max_tokens <= 0:
            return
        stop = set(params.stop_token_ids if params.stop_token_ids is not None else target.tokenizer.eos_token_ids)
        detok = target.tokenizer.detokenizer
        detok.reset()
        self.prefill(state, params.prefill_step_size)
        first = GeneratedToken(state.pending, state.pending_logprobs)

        def tokens() -> Iterator[GeneratedToken]:
            yield first
            yield from self.decode_steps(state)

        emitted = 0
        for gen in tokens():
            if gen.token in stop:
                detok.finalize()
                yield HostEvent(gen.token, detok.last_segment, gen.logprobs, "stop")
                return
            emitted += 1
            detok.add_token(gen.token)
            if emitted >= params.max_tokens:
                detok.finalize()
                yield HostEvent(gen.token, detok.last_segment, gen.logprobs, "length")
                return
            yield HostEvent(gen.token, detok.last_segment, gen.logprobs)

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
            if event.finish_reason == "stop":
                finish = "stop"
                break
            tokens.append(event.token)
        end = time.perf_counter()
        first_at = first_at or end
        report = holder[0].report if holder else {}
        return GenerationResult(
            tokens=tokens,
            text="".join(text),
            prompt_tokens=len(prompt),
            finish_reason=finish,
            prompt_seconds=first_at - start,
            generation_seconds=end - first_at,
            report=report,
        )
