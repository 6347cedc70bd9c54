"""The objects the host hands to plugins (see ``hooks.specs``)."""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

from . import taps
from .backend import Backend, CachePolicy
from .specs import DecodeReport

LogitsProcessor = Callable[[mx.array, mx.array], mx.array]
Sampler = Callable[[mx.array], mx.array]


# A request option the server's warm-up sets (hooks/warmup.py): the target's own greedy continuation of the prompt,
# for speculative plugins to propose from (teacher-forced drafts, the verify still deciding every token), so that the
# warm-up meets the shapes of accepted, partly accepted and rejected rounds whatever the drafter accepts there.
WARMUP_CONTINUATION = "warmup_continuation"


@dataclass
class HostConfig:
    """The host's configuration: YAML sections plus CLI overrides.

    ``sections`` is the parsed YAML (``model``, ``server``, ``generation``, ``speculative``...);
    ``overrides`` holds, per section, the values given on the command line (they win over the
    environment, which wins over the YAML).
    """

    sections: Dict[str, Any] = field(default_factory=dict)
    overrides: Dict[str, Dict[str, Any]] = field(default_factory=dict)
    source: Optional[str] = None
    # True (the CLI): a plugin that cannot do what the config asks raises. False (the server):
    # it warns and the host runs without it.
    strict: bool = True
    lines: Dict[str, int] = field(default_factory=dict)  # "speculative.kind" -> its line in the YAML file

    def section(self, name: str) -> Dict[str, Any]:
        value = self.sections.get(name)
        return dict(value) if isinstance(value, dict) else {}

    def where(self, key: str) -> str:
        """``file:line: `` of a YAML key (``file: `` when its line is unknown; nothing without a file),
        to put before an error about its value."""
        if self.source is None:
            return ""
        line = self.lines.get(key)
        return f"{self.source}:{line}: " if line else f"{self.source}: "


@dataclass
class LoadedTarget:
    """A target model as loaded by ``mlx_lm.load``, plus what plugins attached to it."""

    model: nn.Module
    tokenizer: Any  # mlx_lm.tokenizer_utils.TokenizerWrapper
    path: Path
    model_config: Dict[str, Any]
    name: str
    attachments: Dict[str, Any] = field(default_factory=dict)
    cache_policy: Backend = field(default_factory=CachePolicy)  # its caches and forwards (hooks/backend.py)
    cluster: Any = None  # hooks.distributed.Cluster: the model is this rank's shard of a target over several ranks

    @property
    def num_layers(self) -> int:
        return len(taps.decoder_layers(self.model))


@dataclass
class CaptureRequest:
    """Decoder layers (0-based) whose outputs the ordinary forward must expose."""

    layers: List[int] = field(default_factory=list)


@dataclass
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: Optional[int] = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def process(self, logprobs: mx.array) -> mx.array:
        """log p of the distribution one-token decoding samples from, per row: [..., V] -> [..., V].

        The filters, their order and the temperature of mlx-lm's ``make_sampler`` (top-p, min-p,
        top-k on the log-probabilities, then logits / temperature), normalised; filtered-out
        tokens get -inf. Temperature 0: one-hot at the argmax. The target's p and a drafter's q
        both go through this, so that speculative sampling compares like with like.
        """
        if self.greedy:
            hot = mx.arange(logprobs.shape[-1]) == mx.argmax(logprobs, axis=-1, keepdims=True)
            return mx.where(hot, 0.0, -mx.inf)
        if 0 < self.top_p < 1.0:
            logprobs = apply_top_p(logprobs, self.top_p)
        if self.min_p != 0.0:
            logprobs = apply_min_p(logprobs, self.min_p)
        if self.top_k > 0:
            logprobs = apply_top_k(logprobs, self.top_k)
        logits = logprobs * (1.0 / self.temperature)
        return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


class KeyStream:
    """A request's own random keys, hashed from (seed, stream name, n): ``at(position)`` keys a seeded
    request's draw for a sequence position, ``next()`` a stream's n-th draw.

    Counter-based, so drawing touches neither mlx's global random state nor any other stream and
    costs no evaluation. seed None: fresh entropy.
    """

    def __init__(self, seed: Optional[int], name: str):
        self.seed = secrets.randbits(64) if seed is None else int(seed)
        self.name = name
        self.draws = 0

    def next(self) -> mx.array:
        self.draws += 1
        return self._key(self.draws - 1)

    def at(self, position: int) -> mx.array:
        return self._key(f"at{position}")

    def _key(self, n: Any) -> mx.array:
        material = f"{self.seed}:{self.name}:{n}".encode()
        return mx.random.key(int.from_bytes(hashlib.blake2b(material, digest_size=8).digest(), "little"))


def coupled_draw(logits: mx.array, keys: Sequence[mx.array]) -> mx.array:
    """argmax(logits_i + g_i), g_i Gumbel noise from keys[i]: a draw from softmax(logits_i) (the Gumbel-max
    trick). logits [n, V] -> [n]. With the noise keyed by sequence position, the token at a position is a
    function of the seed and its context alone: one-token steps and speculative rounds of any block size draw
    the same one, and a drafter drawing with the same noise proposes it whenever its q is close to p."""
    noise = mx.stack([mx.random.gumbel(shape=(logits.shape[-1],), key=k) for k in keys])  # [n, V]
    return mx.argmax(logits + noise, axis=-1)


@dataclass
class GeneratedToken:
    token: int
    logprobs: mx.array  # [V]


@dataclass
class StepOutput:
    """A decode-step plugin's answer for one row of the batch (see ``host_decode_step``).

    ``tokens`` non-empty: the plugin stepped the row and these are emitted, in order. Empty: the
    plugin declines the row; the host then takes plain one-token steps for it, up to
    ``plain_steps`` of them before it asks again (None: as many as it likes, until rows join).
    """

    tokens: List[GeneratedToken] = field(default_factory=list)
    plain_steps: Optional[int] = 1


@dataclass
class DecodeState:
    """One request (a row of a batch): its tokens, sampling and per-request plugin state.

    The host owns it; plugins read it and write only ``extras[name]`` and ``report[name]`` (a
    ``DecodeReport``, when the request ends) of their own name. The row's caches belong to the batch it
    decodes in (``hooks.batch``).
    """

    target: LoadedTarget
    tokens: List[int]
    prompt_len: int
    sampler: Sampler
    sampling: SamplingParams
    logits_processors: List[LogitsProcessor]
    max_tokens: int
    # The request's options for plugins, e.g. {"speculative": False} (a request turning rounds off).
    options: Dict[str, Any] = field(default_factory=dict)
    # Decoder layers whose outputs the host records for this row (host_prefill_captures).
    capture_layers: List[int] = field(default_factory=list)
    # layer -> [1, n, H]: outputs of the positions the HOST fed (prefill, plain steps) since the last
    # host_decode_step call; handed over once: the host empties it after each call.
    captures: Dict[int, mx.array] = field(default_factory=dict)
    pending_logprobs: Optional[mx.array] = None
    extras: Dict[str, Any] = field(default_factory=dict)
    report: Dict[str, DecodeReport] = field(default_factory=dict)
    # A seeded request's keys (None: mlx's global random state, as in mlx-lm): the target draws
    # the token at each sequence position with ``rng.at(position)``, and so does a drafter
    # proposing that position (coupled sampling, ``draw_drafts``). An unseeded request's drafter draws
    # from ``draft_rng``, its own stream, never the target's.
    rng: Optional[KeyStream] = None
    draft_rng: Optional[KeyStream] = None
    # The server's prompt cache (hooks/prompt_cache.py): prompt positions restored from an earlier
    # request (the row's caches start with tokens[:cached]; prefill and captures cover the rest),
    # and what each plugin saved for them (``host_save_row``), by plugin name.
    cached: int = 0
    restored: Dict[str, Any] = field(default_factory=dict)
    # True when the prompt cache will keep this row's state when it ends (``host_save_row``,
    # ``DraftBatch.export_row``): drafters keep what that needs only then.
    saved: bool = False
    # The ``hooks.batch.DecodeBatch`` the row decodes in (None while it prefills), set by the batch:
    # plugins read its caches (e.g. ``hooks.kv_view.committed_kv(batch.cache[i])``), never change them.
    batch: Any = field(default=None, repr=False, compare=False)

    @property
    def model(self) -> nn.Module:
        return self.target.model

    @property
    def pending(self) -> int:
        return self.tokens[-1]

    @property
    def generated(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def remaining(self) -> int:
        return self.max_tokens - self.generated

    @property
    def decode_report(self) -> Optional[DecodeReport]:
        """The report of the plugin that took decode steps for the request (the first, if several did), once it
        ended; None: every token came from the host's plain steps."""
        return next(iter(self.report.values()), None)

    def add_captures(self, recorded: Dict[int, mx.array]) -> None:
        """Append the host-fed positions' outputs ([1, n, H] per layer) to ``captures``."""
        for i, h in recorded.items():
            self.captures[i] = mx.concatenate([self.captures[i], h], axis=1) if i in self.captures else h

    @property
    def coupled(self) -> bool:
        """A seeded sampling request: coupled sampling (its draws keyed by position, ``position_keys``)."""
        return self.rng is not None and not self.sampling.greedy

    def position_keys(self, n: int, offset: int = 0) -> List[mx.array]:
        """A seeded request's keys for the n sequence positions from ``offset`` past the pending token on."""
        assert self.rng is not None, "position keys are a seeded request's"
        return [self.rng.at(len(self.tokens) + offset + i) for i in range(n)]

    def sample(self, logprobs: mx.array, offset: int = 0) -> mx.array:
        """The target's tokens for n positions from ``offset`` past the pending token on: [n, V] log-probabilities
        (logits processors applied) -> [n]. The request's sampler; a seeded sampling request draws each position
        with that position's noise (``coupled_draw``), so one-token steps and a round's verify draw alike."""
        if not self.coupled:
            return self.sampler(logprobs)
        return coupled_draw(self.sampling.process(logprobs), self.position_keys(logprobs.shape[0], offset))

    def draw_drafts(self, logq: mx.array, offset: int = 0) -> mx.array:
        """Draft tokens from log q: [V] -> [] or [n, V] -> [n], for the block's positions from ``offset`` on
        (0: the position after the pending token). A seeded request's drafts use the noise the target draws
        those positions with (``coupled_draw``): whatever the drafter proposes, the round emits the target's
        own seeded tokens, and a drafter whose q is close to p proposes them. Else a draw from the drafter's
        own stream (rejection sampling then keeps the emitted tokens distributed as p)."""
        if self.coupled:
            rows = logq.reshape(-1, logq.shape[-1])  # [n, V]
            return coupled_draw(rows, self.position_keys(rows.shape[0], offset)).reshape(logq.shape[:-1])
        if self.draft_rng is None:
            self.draft_rng = KeyStream(None, "drafter")  # an unseeded request's: fresh entropy
        return mx.random.categorical(logq, axis=-1, key=self.draft_rng.next())

    def logprobs(self, logits: mx.array, drafts: Sequence[int] = (), start: int = 0) -> mx.array:
        """Processed log-probabilities for each position of a forward over [pending, *drafts].

        logits: [1, n, V] (or [n, V]) with n <= 1 + len(drafts). Logits processors see, for row i,
        the history ``tokens + drafts[:start + i]``, exactly as one-token decoding would
        (``start``: a drafter scoring its position ``start`` alone). Returns [n, V].
        """
        rows = logits[0] if logits.ndim == 3 else logits  # [n, V]
        if self.logits_processors:
            rows = mx.concatenate([
                self.apply_processors(mx.array(self.tokens + list(drafts[: start + i]), dtype=mx.uint32), rows[i : i + 1])
                for i in range(rows.shape[0])
            ], axis=0)
        return rows - mx.logsumexp(rows, axis=-1, keepdims=True)

    def apply_processors(self, history: mx.array, row: mx.array) -> mx.array:
        """The logits processors, in order, on one position's logits [1, V] given its history."""
        for processor in self.logits_processors:
            row = processor(history, row)
        return row
