"""The backend seam: everything the host, its plugins and their drafters may ask of the code that makes a target's
caches and runs its attention, projections and decode forwards on one device.

``Backend`` is the contract (a ``typing.Protocol``: any object with these members is one). The host's default,
``CachePolicy``, is mlx-lm's own caches, attention and matmuls (CPU and Metal) with neutral values; a plugin hands
another from ``host_cache_policy`` (the speculative plugin: plugin/cuda/, shape-stable caches, compiled forwards and
kernels on MLX-CUDA, docs/gpu.md). Every backend has every member, so callers read them as typed attributes.

Drafters never hold the backend: the plugin passes them a ``DraftBackend`` made by ``draft_backend`` (the members a
drafter's own model may use: its caches, its prewarm bounds, the compiled calls, routing), in ``DraftTarget.backend``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Hashable, List, Optional, Protocol, Sequence, Tuple, runtime_checkable

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache, make_prompt_cache

from .attention import Dispatcher as AttentionDispatcher
from .attention import Projections as ProjectionDispatcher
from .attention import route, route_projections

# (logits [B, W, V], {layer: hidden [B, W, H]}): what the target's forward over inputs [B, W] returns
ForwardOutput = Tuple[mx.array, Dict[int, mx.array]]


class DecodeForward(Protocol):
    """The target's forward for decode-batch calls (``DecodeBatch.forward``: rounds' verifies, plain steps)."""

    def __call__(self, model: nn.Module, inputs: mx.array, cache: Sequence[Any],
                 layers: Sequence[int]) -> Optional[ForwardOutput]:
        """``inputs`` [B, W] token ids over ``cache`` (the batch's caches, one per layer): the same values as
        ``hooks.batch.forward`` (logits [B, W, V], the outputs of ``layers`` [B, W, H] each), the caches left as
        that leaves them (W positions more per row). None: declined, the caches untouched; the host's own
        forward then runs."""


class CompiledCalls(Protocol):
    """Compiled calls of any function over a backend's caches (``kv_cache``'s, or a batch of them): what a drafter
    compiles its own steps with (DFlash's block, drafts and context appends)."""

    grow: int
    """Cache buffers are grown to multiples of this many positions (the lengths a prewarm steps through)."""

    def call(self, key: Hashable, owner: Any, fn: Callable[..., List[mx.array]], cache: Sequence[Any],
             arrays: Sequence[mx.array], writes: int, advance: int, name: str, shift: Optional[mx.array] = None,
             base: Optional[int] = None, install: bool = True) -> Optional[List[mx.array]]:
        """``fn(owner, caches, *arrays) -> [arrays]`` compiled per (owner, key) and run over ``cache``: its outputs,
        or None where it declines (the caller then runs ``fn``'s work plainly). ``writes``: positions past the
        caches' offset ``fn`` writes; ``advance``: positions the caches keep; ``shift`` (a device scalar) moves
        the offset for this call; ``base``: the offset those count from; ``install`` False leaves the caches as
        they are and appends each cache's (keys, values) buffers to the outputs."""


@runtime_checkable
class Backend(Protocol):
    """How a target's caches are made and its forwards run (``host_cache_policy``'s answer;
    ``LoadedTarget.cache_policy``).

    The host makes each request's caches with ``make_cache``; rows of a batch merge through the caches' own
    ``merge`` / ``extend`` / ``extract``, so a backend's cache classes provide those too. At load the host routes the
    target's attention and projections through the dispatchers (this model only: hooks/attention.py), taps
    ``capture_layers``, then calls ``prepare`` once.
    """

    @property
    def name(self) -> str:
        """Shown in the start log and /v1/models (``mlx-lm``: the host's own)."""

    @property
    def shape_stable(self) -> bool:
        """True: attention shapes hold over ``bucket`` key lengths and verify widths are ``verify_width``'s (the
        shapes ``prepare`` warmed); rounds then keep their block size near a request's end and price blocks by
        measured costs."""

    @property
    def bucket(self) -> Optional[int]:
        """Key lengths are padded to multiples of this many positions (warm-ups and drafters' prewarms step by it);
        None: exact key lengths."""

    @property
    def prewarm_tokens(self) -> int:
        """``prepare`` and drafters warm shapes for key lengths up to this many positions (0: nothing to warm)."""

    block_size: Optional[int]
    """The largest block rounds verify (the widths ``prepare`` warms), set by the plugin before ``prepare``."""
    capture_layers: Sequence[int]
    """Decoder layers whose outputs rounds record (the drafter's), set by the plugin: the host taps them before
    ``prepare``, so that a compiled forward is warmed with them."""

    @property
    def attention(self) -> Optional[AttentionDispatcher]:
        """With the signature of mlx-lm's ``scaled_dot_product_attention`` (q [B, Hq, L, D], k, v [B, Hkv, S, D],
        cache=, scale=, mask=): the host routes the target's attention through it, drafters their own models'
        (``DraftBackend.route``). None: mlx-lm's attention."""

    @property
    def projections(self) -> Optional[ProjectionDispatcher]:
        """(x [..., K], weight [N, K]) -> x @ weight.T [..., N], or None (mlx's matmul for that call): the host
        routes the target's ``nn.Linear`` layers through it (hooks/attention.py ``route_projections`` also asks
        for the optional ``rows``, ``many``, ``max_weights``, ``routes_quantized`` / ``quantized``). None: mlx's
        matmuls."""

    @property
    def forward(self) -> Optional[DecodeForward]:
        """Tried first for every decode-batch forward (``DecodeBatch.forward``); None: the host's own forward."""

    @property
    def calls(self) -> Optional[CompiledCalls]:
        """Compiled calls over this backend's caches for drafters' own functions; None: drafters run plainly."""

    def make_cache(self, model: nn.Module, max_kv_size: Optional[int] = None) -> List[Any]:
        """One request's caches for ``model``, one per layer (as mlx-lm's ``make_prompt_cache``)."""

    def kv_cache(self) -> Any:
        """A fresh attention cache (K/V [B, H, S, D]) for one layer of a drafter's own model: its
        ``update_and_fetch``, ``make_mask``, ``trim`` and ``merge`` are ``KVCache``'s contract."""

    def verify_width(self, n: int) -> int:
        """The positions a verify of n positions feeds (>= n; the extra ones are trimmed like rejected drafts)."""

    def prepare(self, model: nn.Module) -> None:
        """Once per loaded target, after routing and tapping: e.g. run once the shapes its caches will meet."""


class CachePolicy:
    """The host's default backend: mlx-lm's caches (``make_prompt_cache``), attention and matmuls; nothing to warm.

    Plugins may subclass it and override only what differs.
    """

    name: str = "mlx-lm"
    shape_stable: bool = False
    bucket: Optional[int] = None
    prewarm_tokens: int = 0
    block_size: Optional[int] = None
    capture_layers: Sequence[int] = ()
    attention: Optional[AttentionDispatcher] = None
    projections: Optional[ProjectionDispatcher] = None
    forward: Optional[DecodeForward] = None

    @property
    def calls(self) -> Optional[CompiledCalls]:
        return None

    def make_cache(self, model: nn.Module, max_kv_size: Optional[int] = None) -> List[Any]:
        return make_prompt_cache(model, max_kv_size=max_kv_size)

    def kv_cache(self) -> Any:
        return KVCache()

    def verify_width(self, n: int) -> int:
        return n

    def prepare(self, model: nn.Module) -> None:
        pass


@dataclass(frozen=True)
class DraftBackend:
    """What a drafter may use of its target's backend (``DraftTarget.backend``), made from it by ``draft_backend``."""

    name: str = CachePolicy.name
    shape_stable: bool = False  # the backend's: drafters pad block widths and context counts to powers of two
    bucket: Optional[int] = None  # the backend's key bucket (None: exact lengths; drafters then prewarm nothing)
    prewarm_tokens: int = 0  # drafters warm their shapes up to this many context positions
    kv_cache: Callable[[], Any] = KVCache  # one layer's attention cache for the drafter's own model
    make_cache: Callable[..., List[Any]] = make_prompt_cache  # (model, max_kv_size=None): a draft LM's caches
    calls: Optional[CompiledCalls] = None  # compiled calls over ``kv_cache``'s caches, or None
    attention: Optional[AttentionDispatcher] = field(default=None, repr=False)  # read through ``route``
    projections: Optional[ProjectionDispatcher] = field(default=None, repr=False)

    def route(self, model: nn.Module) -> int:
        """Route ``model``'s attention and projections (this instance only) through the backend's dispatchers, as
        the host routes the target's; returns how many modules run under either (0: nothing to route)."""
        return route(model, self.attention) + route_projections(model, self.projections)


def draft_backend(backend: Optional[Backend] = None) -> DraftBackend:
    """The drafters' view of ``backend`` (None: the host's default)."""
    if backend is None:
        return DraftBackend()
    return DraftBackend(name=backend.name, shape_stable=backend.shape_stable, bucket=backend.bucket,
                        prewarm_tokens=backend.prewarm_tokens, kv_cache=backend.kv_cache,
                        make_cache=backend.make_cache, calls=backend.calls, attention=backend.attention,
                        projections=backend.projections)
