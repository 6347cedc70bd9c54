"""The objects the host hands to plugins (see ``hooks.specs``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn

from . import taps

LogitsProcessor = Callable[[mx.array, mx.array], mx.array]
Sampler = Callable[[mx.array], mx.array]


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

    def section(self, name: str) -> Dict[str, Any]:
        value = self.sections.get(name)
        return dict(value) if isinstance(value, dict) else {}


@dataclass
class LoadedTarget:
    """A target model as loaded by ``mlx_lm.load``, plus what plugins attached to it."""

    model: nn.Module
    tokenizer: Any  # mlx_lm.tokenizer_utils.TokenizerWrapper
    path: Path
    model_config: Dict[str, Any]
    name: str
    attachments: Dict[str, Any] = field(default_factory=dict)

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


@dataclass
class GeneratedToken:
    token: int
    logprobs: mx.array  # [V]


@dataclass
class StepOutput:
    """What a decode step returns: the tokens to emit, in order (see ``host_decode_step``)."""

    tokens: List[GeneratedToken]


@dataclass
class DecodeState:
    """One request's decode state, shared by the host and the plugins."""

    target: LoadedTarget
    cache: List[Any]
    tokens: List[int]
    prompt_len: int
    sampler: Sampler
    sampling: SamplingParams
    logits_processors: List[LogitsProcessor]
    max_tokens: int
    capture_layers: List[int] = field(default_factory=list)
    # layer -> [1, L, H]: outputs for positions fed to the target and not yet consumed.
    captures: Dict[int, mx.array] = field(default_factory=dict)
    # layer -> [1, n, H]: outputs of the positions fed by the latest ``forward``.
    last_captures: Dict[int, mx.array] = field(default_factory=dict)
    pending_logprobs: Optional[mx.array] = None
    extras: Dict[str, Any] = field(default_factory=dict)
    report: Dict[str, Any] = field(default_factory=dict)
    rng_key: Optional[mx.array] = None

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

    def forward(self, tokens: Sequence[int]) -> mx.array:
        """The target's ordinary forward over ``tokens`` on ``cache``: logits [1, n, V].

        Records the requested layers of the fed positions into ``last_captures``.
        """
        inputs = mx.array([list(tokens)], dtype=mx.uint32)
        with taps.record(self.capture_layers) as rec:
            logits = self.model(inputs, cache=self.cache)
        self.last_captures = {i: mx.concatenate(v, axis=1) if len(v) > 1 else v[0] for i, v in rec.items() if v}
        return logits

    def keep_captures(self, n: int) -> None:
        """Append the first n positions of ``last_captures`` to ``captures``."""
        for i, h in self.last_captures.items():
            h = h[:, :n]
            self.captures[i] = mx.concatenate([self.captures[i], h], axis=1) if i in self.captures else h
        self.last_captures = {}

    def logprobs(self, logits: mx.array, drafts: Sequence[int] = ()) -> mx.array:
        """Processed log-probabilities for each position of a forward over [pending, *drafts].

        logits: [1, n, V] with n == 1 + len(drafts) (or fewer rows). Logits processors see,
        for row i, the history ``tokens + drafts[:i]``, exactly as one-token decoding would.
        Returns [n, V].
        """
        rows = logits[0]  # [n, V]
        if self.logits_processors:
            processed = []
            for i in range(rows.shape[0]):
                history = mx.array(self.tokens + list(drafts[:i]), dtype=mx.uint32)
                row = rows[i : i + 1]
                for processor in self.logits_processors:
                    row = processor(history, row)
                processed.append(row)
            rows = mx.concatenate(processed, axis=0)
        return rows - mx.logsumexp(rows, axis=-1, keepdims=True)
