"""A target sharded over several processes with ``mx.distributed``: every rank runs the same engine in lockstep.

Each process (a rank, started by ``mlx.launch``) loads the whole checkpoint and keeps its share of it through
mlx-lm's own tensor-parallel ``model.shard(group)`` (attention heads and MLP columns split; the embedding, the
head and the norms replicated). After a layer's ``all_sum`` every rank holds the full hidden state, so the
logits, the sampled tokens and the hidden-state taps a drafter reads are the same on every rank: the rounds are
computed identically everywhere and need no messages of their own beyond what is not:

- the prompt and the request's seed (rank 0 owns the request): broadcast once per request;
- the measured costs that steer the adaptive block size (each rank times its own steps): rank 0's are taken by
  every rank (``Cluster.agree``), so that every rank picks the same block sizes and pauses;
- with ``drafter: rank0`` the drafter runs on rank 0 alone and its proposals are broadcast
  (plugin/rank0_drafts.py).

A broadcast is ``all_sum`` of a tensor that is zero on every rank but 0. A rank that dies makes the others'
next collective fail ("[ring] connection to a peer was lost"): ``failed`` turns it into one clear error and the
process ends at once. At the end of a request every rank checks that all produced the same tokens.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import sys
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, NoReturn, Optional, Sequence, Tuple

import mlx.core as mx

from .validate import HostConfigError, SettingError

BACKENDS = ("ring", "mpi", "nccl", "jaccl", "any")
DRAFTERS = ("replicated", "rank0")
KEYS = ("backend", "drafter")
FLAGS = {"backend": "--distributed", "drafter": "--distributed-drafter"}


class DistributedError(ValueError):
    """The ranks cannot run together (no launcher, a model that cannot be sharded, ranks that diverged)."""


@dataclass(frozen=True)
class DistributedSettings:
    backend: str = "ring"
    drafter: str = "replicated"  # replicated: every rank drafts (identically); rank0: rank 0 drafts and broadcasts


def settings(section: Optional[Any], cli: Optional[Mapping[str, Any]] = None,
             where: Any = lambda key: "") -> Optional[DistributedSettings]:
    """The ``distributed:`` YAML section under the flags; None: not distributed. Bad values raise with the key,
    the value and what is allowed."""
    cli = {k: v for k, v in (cli or {}).items() if v is not None}
    if section is None and not cli:
        return None
    if section is not None and not isinstance(section, Mapping):
        raise HostConfigError(f"{where('distributed')}distributed: got {section!r}; allowed: a mapping with keys "
                              f"{', '.join(KEYS)} (e.g. {{backend: ring, drafter: replicated}})", "distributed")
    values: Dict[str, Any] = {}
    for source, layer in (("yaml", dict(section or {})), ("cli", cli)):
        for key, value in layer.items():
            field = f"distributed.{key}" if source == "yaml" else FLAGS.get(key, key)
            prefix = where(field) if source == "yaml" else ""
            if key not in KEYS:
                raise HostConfigError(f"{prefix}{field}: unknown key (value {value!r}); allowed keys: {', '.join(KEYS)}",
                                      field)
            allowed = BACKENDS if key == "backend" else DRAFTERS
            if not isinstance(value, str) or value.strip().lower() not in allowed:
                raise HostConfigError(f"{prefix}{SettingError(field, value, ', '.join(allowed))}", field)
            values[key] = value.strip().lower()
    return DistributedSettings(**values)


class Cluster:
    """This process's place among the ranks, and the few messages the engine exchanges besides the model's."""

    def __init__(self, group: Any, config: DistributedSettings):
        self.group = group
        self.config = config
        self.rank: int = group.rank()
        self.size: int = group.size()

    @property
    def primary(self) -> bool:
        """Rank 0: owns requests and output."""
        return self.rank == 0

    @property
    def drafts_here(self) -> bool:
        """Whether this rank runs the drafter's forwards."""
        return self.config.drafter == "replicated" or self.primary

    def broadcast(self, x: mx.array) -> mx.array:
        """Rank 0's ``x`` on every rank (lazy): the sum of rank 0's tensor and zeros elsewhere. Every rank must pass
        the same shape and dtype."""
        return mx.distributed.all_sum(x if self.primary else mx.zeros_like(x), group=self.group)

    def broadcast_ints(self, values: Sequence[int], count: int) -> List[int]:
        """``count`` ints from rank 0 (other ranks' ``values`` are ignored)."""
        buf = mx.array(list(values) if self.primary else [0] * count, dtype=mx.int32)  # token ids and seeds < 2**31
        return [int(v) for v in self.broadcast(buf).tolist()]

    def broadcast_tokens(self, tokens: Sequence[int]) -> List[int]:
        """Rank 0's token list (a prompt) on every rank: its length, then the tokens."""
        (n,) = self.broadcast_ints([len(tokens)], 1)
        return self.broadcast_ints(list(tokens), n) if n else []

    def seed(self, seed: Optional[int]) -> int:
        """The request's seed, the same on every rank: the given one, else one rank 0 draws (a request without a
        seed would otherwise draw fresh entropy on each rank, and the ranks would sample apart)."""
        mine = int(seed) if seed is not None else secrets.randbits(31)
        return self.broadcast_ints([mine], 1)[0]

    def agree(self, seconds: float) -> float:
        """Rank 0's measurement on every rank (the adaptive block size decides from measured costs)."""
        return float(self.broadcast(mx.array([seconds], dtype=mx.float32)).item())

    def check_same(self, tokens: Sequence[int], what: str = "the generated tokens") -> None:
        """Raise on every rank unless every rank holds the same ``tokens`` (their count and a digest)."""
        digest = int.from_bytes(hashlib.blake2b(repr(list(tokens)).encode(), digest_size=3).digest(), "little")
        mine = mx.array([len(tokens), digest], dtype=mx.int32)
        every = mx.distributed.all_gather(mine[None], group=self.group).tolist()  # [size, 2]
        if any(row != every[0] for row in every):
            raise DistributedError(f"the ranks diverged: {what} differ between ranks (count, digest by rank: {every}); "
                                   "expected the same on every rank (same checkpoint, same settings, same mlx build)")


def init(config: DistributedSettings) -> Cluster:
    """Join the ranks (``mx.distributed.init``); outside a launcher this fails with what to do."""
    try:
        group = mx.distributed.init(strict=True, backend=config.backend)
    except RuntimeError as e:
        raise DistributedError(
            f"distributed (backend {config.backend!r}) could not start: {e}. Start every rank with mlx.launch, e.g. "
            "`mlx.launch --backend ring --hostfile hosts.json -- mlx-spec generate ...` (it sets MLX_RANK and "
            "MLX_HOSTFILE); or drop the distributed: section / --distributed flag") from None
    if group.size() < 2:
        raise DistributedError(f"distributed: the group has {group.size()} rank; expected at least 2 (mlx.launch with "
                               "two or more hosts)")
    return Cluster(group, config)


def shard(model: Any, config: Dict[str, Any], cluster: Cluster) -> None:
    """mlx-lm's own tensor-parallel ``model.shard(group)``, after checking that the model has one and that its heads
    and MLP columns split evenly over the ranks."""
    kind = config.get("model_type", "?")
    if not callable(getattr(model, "shard", None)):
        raise DistributedError(f"distributed: the target's architecture {kind!r} has no shard() in mlx-lm; expected "
                               "one with tensor-parallel sharding (e.g. llama, qwen3, qwen2, mistral, deepseek_v3)")
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    n = cluster.size
    for key in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        value = text.get(key)
        if isinstance(value, int) and value % n:
            raise DistributedError(f"distributed: the target's {key} = {value} does not split over {n} ranks; expected "
                                   f"a multiple of the number of ranks")
    model.shard(cluster.group)
    mx.eval(model.parameters())


def failed(cluster: Cluster, error: BaseException) -> NoReturn:
    """End this rank at once with one clear line: a peer that died makes the collectives fail; this rank's own
    failure ends it, and its closed connections end the others'. ``os._exit``: no teardown that could wait on a
    peer."""
    text = str(error).strip() or type(error).__name__
    if isinstance(error, KeyboardInterrupt):
        text = "interrupted (Ctrl-C); the other ranks stop at their next exchange"
    if "[ring]" in text or "peer" in text or "connection" in text.lower():
        text = f"another rank failed or left ({text}); every rank stops"
    print(f"mlx-spec: error: rank {cluster.rank} of {cluster.size}: {text}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(3)


def start(args: Any, config_path: Optional[str]) -> Optional[Cluster]:
    """The ranks joined, where the YAML's ``distributed:`` section or the flags ask for it (None: one process)."""
    from .config import load_host_config

    config = load_host_config(config_path) if config_path else None
    section = config.sections.get("distributed") if config is not None else None
    if config is not None and "distributed" in config.sections and section is None:
        section = {}  # "distributed:" alone: on, with the defaults (as an empty speculative: section)
    cli = {"backend": getattr(args, "distributed", None), "drafter": getattr(args, "distributed_drafter", None)}
    chosen = settings(section, cli, where=config.where if config is not None else (lambda key: ""))
    return init(chosen) if chosen is not None else None


# -- what the ranks exchange (the bench's figures) ------------------------------------------------

AGREE_BYTES = 4  # Cluster.agree: rank 0's round cost, one float32 per round


def all_sums(model: Any) -> Tuple[int, int]:
    """(all_sums per forward, their bytes per position and row) of a model sharded by mlx-lm's ``shard()``: one
    all_sum of [rows, L, out] per sharded-to-all layer (dense llama / qwen / mistral: o_proj and down_proj, 2 per
    layer). Activations have the layer's dtype (a quantized layer's: its scales')."""
    import mlx.nn as nn

    kinds = (nn.ShardedToAllLinear, nn.QuantizedShardedToAllLinear)
    layers = [m for _, m in model.named_modules() if isinstance(m, kinds)]
    return len(layers), sum(int(m.weight.shape[0]) * getattr(m, "scales", m.weight).dtype.size for m in layers)


def dense_all_sums(config: Mapping[str, Any], itemsize: int = 4) -> Tuple[int, int]:
    """``all_sums`` from a dense llama-family config alone (no sharded model at hand): 2 per layer of [., hidden]."""
    text = config.get("text_config") if isinstance(config.get("text_config"), Mapping) else config
    layers, hidden = int(text["num_hidden_layers"]), int(text["hidden_size"])
    return 2 * layers, 2 * layers * hidden * itemsize


def exchanged(collectives: int, position_bytes: int, block: int, tau: Optional[float]) -> Dict[str, Any]:
    """Bytes and collectives each rank sends per plain step and per round (one row, verify width ``block``):
    ``collectives`` all_sums of ``position_bytes`` per position (``all_sums``), a round over ``block`` positions,
    plus the engine's own messages (rank 0's round cost; with ``drafter: rank0`` its proposals). ``tau``: tokens
    per round, for the per-token figures (None: not given)."""
    rank0 = 4 * (2 + 2 + (block - 1))  # the proposals' int32 message: header, k, has-q, block - 1 tokens (greedy: no q)
    plain = {"bytes": position_bytes, "collectives": collectives}
    round_ = {"bytes": block * position_bytes + AGREE_BYTES, "collectives": collectives + 1}
    out: Dict[str, Any] = {
        "plain_step": plain, "round": round_,
        "round_drafter_rank0": {"bytes": round_["bytes"] + rank0, "collectives": round_["collectives"] + 1},
        "round_over_plain_step_bytes": round(round_["bytes"] / plain["bytes"], 3),
        "how": "all_sum tensor bytes per rank from the sharded layers' shapes: one [1, L, out] per sharded-to-all "
               "layer (L = 1 plain, L = block in a round), plus the engine's float32 cost agreement per round (and "
               "rank 0's proposals)",
    }
    if tau:
        out["per_token"] = {"tau": tau, "plain_bytes": plain["bytes"], "plain_collectives": plain["collectives"],
                            "speculative_bytes": round(round_["bytes"] / tau, 1),
                            "speculative_collectives": round(round_["collectives"] / tau, 2)}
    return out
