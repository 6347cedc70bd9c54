"""The methods ``mlx-spec bench`` times: mlx-lm's own loops and this host, plain and speculative.

Every method decodes the same prompts greedily; its tokens are compared with a plain reference
(``divergence``), and speculative methods may replace their drafter's proposals by an oracle's
(``oracle.py``) while the drafter's forward still runs.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import mlx.core as mx

from ..hooks.api import Backend, CachePolicy, GenerationParams, Host, HostConfig, LoadedTarget, Scheduler, make_plugin_manager
from ..plugin import hookimpls
from ..plugin.costs import CostTable
from ..plugin.rank0_drafts import for_ranks
from ..plugin.settings import SpeculativeSettings
from . import oracle as orc


@dataclass
class Reference:
    tokens: List[int]
    margins: List[float]  # top-1 minus top-2 log-probability at each generated position


@dataclass
class Run:
    method: str
    regime: str
    prompt_len: int
    tokens: List[int]
    decode_seconds: float
    tok_s: float
    peak_memory_gb: float
    spec: Optional[Dict[str, Any]] = None
    drafted: List[int] = field(default_factory=list)
    divergence: Optional[Dict[str, Any]] = None
    attention: Optional[Dict[str, int]] = None  # attention calls by path (plugin/cuda/attention.py), when routed


class Method:
    name: str = ""
    family: str = "plain"  # plain | spec
    tau: Optional[float] = None
    block: Optional[int] = None
    adaptive: bool = False
    ahead: Optional[str] = None  # spec methods: what rounds queue before reading their outcome (MLX_SPEC_DRAFT_AHEAD)
    kind: str = ""

    def run(self, prompt: List[int], max_tokens: int, ref: Optional[Reference], seed: int) -> Run:
        raise NotImplementedError

    def describe(self) -> Dict[str, Any]:
        return {"name": self.name, "family": self.family, "kind": self.kind, "oracle_tau": self.tau,
                "block": self.block, "adaptive": self.adaptive, "draft_ahead": self.ahead,
                # where the measured tau comes from: the drafter's own proposals, or the oracle's
                "proposals": None if self.family != "spec" else ("oracle" if self.tau else "real")}


def _sync() -> None:
    mx.synchronize() if hasattr(mx, "synchronize") else None


class MlxLmPlain(Method):
    family = "plain"

    def __init__(self, model: Any):
        self.model = model
        self.name = "mlx_lm.generate_step"

    def run(self, prompt, max_tokens, ref, seed):
        from mlx_lm.generate import generate_step

        gen = generate_step(mx.array(prompt, dtype=mx.uint32), self.model, max_tokens=max_tokens)
        first, _ = next(gen)
        t0 = time.perf_counter()
        tokens = [int(first)] + [int(t) for t, _ in gen]
        dt = time.perf_counter() - t0
        return Run(self.name, "", len(prompt), tokens, dt, (len(tokens) - 1) / dt if dt > 0 else 0.0, 0.0)


class MlxLmSpec(Method):
    family = "spec"
    kind = "draft_model"

    def __init__(self, model: Any, draft: Any, block: int, tau: Optional[float], vocab: int):
        self.model, self.draft, self.block, self.tau, self.vocab = model, draft, block, tau, vocab
        self.name = f"mlx_lm.speculative_generate_step b{block}" + (f" tau{tau:g}" if tau else "")
        self.oracle = orc.Oracle(orc.alpha_for_tau(tau, block), vocab) if tau else None
        self.lm = orc.OracleDraftLM(draft, self.oracle, vocab) if tau else draft

    def run(self, prompt, max_tokens, ref, seed):
        from mlx_lm.generate import speculative_generate_step

        if self.oracle is not None:
            self.oracle.set_request(prompt, ref.tokens if ref else [], seed)
            self.lm.set_request()
        gen = speculative_generate_step(mx.array(prompt, dtype=mx.uint32), self.model, self.lm,
                                        num_draft_tokens=self.block - 1, max_tokens=max_tokens)
        first, _, _ = next(gen)
        t0 = time.perf_counter()
        rest = [(int(t), bool(d)) for t, _, d in gen]
        dt = time.perf_counter() - t0
        tokens = [int(first)] + [t for t, _ in rest]
        # rounds: each ends with one target token (from_draft False); drafts accepted in a row
        rounds, accepted, per_pos, run = 0, 0, [0] * (self.block - 1), 0
        for _, from_draft in rest:
            if from_draft:
                if run < len(per_pos):
                    per_pos[run] += 1
                run += 1
                accepted += 1
            else:
                rounds += 1
                run = 0
        spec = {"rounds": rounds, "accepted_tokens": accepted, "draft_tokens": rounds * (self.block - 1),
                "mean_acceptance_length": 1 + accepted / rounds if rounds else 0.0,
                "acceptance_rate": accepted / (rounds * (self.block - 1)) if rounds else 0.0,
                "accepted_per_position": per_pos, "seconds": {}}
        return Run(self.name, "", len(prompt), tokens, dt, (len(tokens) - 1) / dt if dt > 0 else 0.0, 0.0,
                   spec=spec, drafted=[self.block - 1] * rounds)


class HostMethod(Method):
    """Decoding through this project's host: plain (no plugin step) or the speculative plugin."""

    def __init__(self, target: LoadedTarget, name: str, policy: Optional[Backend],
                 drafter: Any = None, block: Optional[int] = None, tau: Optional[float] = None,
                 adaptive: bool = False, vocab: int = 0, plugin: Any = None, ahead: str = "on"):
        """``plugin``: the host's speculative plugin (default: this project's hookimpls; bench/round_trace.py:
        a traced one). ``ahead``: what rounds queue before reading their outcome, as $MLX_SPEC_DRAFT_AHEAD says
        (on: the next block; verify: the block and its verify; off: nothing; plugin/round.py)."""
        self.name = name
        attachments: Dict[str, Any] = {}
        self.wrapped = None
        if drafter is None:
            self.family = "plain"
            self.host = Host(HostConfig(), pm=make_plugin_manager(load_entry_points=False))
        else:
            self.family = "spec"
            self.kind, self.block, self.tau, self.adaptive, self.ahead = drafter.kind, block, tau, adaptive, ahead
            self.oracle = orc.Oracle(orc.alpha_for_tau(tau, block), vocab) if tau else None
            self.wrapped = orc.WrappedDrafter(drafter, self.oracle)
            settings = SpeculativeSettings(enabled=True, kind=drafter.kind, block_size=None if adaptive else block,
                                           adaptive=adaptive)
            costs, drafting = CostTable(), self.wrapped
            if target.cluster is not None:  # a sharded target: the ranks' lockstep, as under mlx-spec generate
                drafting = for_ranks(self.wrapped, costs, target.cluster)
            attachments[hookimpls.NAME] = hookimpls.Attachment(settings=settings, drafter=drafting, block_size=block,
                                                               policy=policy, ahead_mode=ahead, costs=costs)
            self.host = Host(HostConfig(), pm=make_plugin_manager(load_entry_points=False,
                                                                  plugins=[plugin if plugin is not None else hookimpls]))
        self.target = dataclasses.replace(target, attachments=attachments, cache_policy=policy or CachePolicy())

    def run(self, prompt, max_tokens, ref, seed):
        if self.wrapped is not None:
            self.wrapped.drafted.clear()
            if self.oracle is not None:
                self.oracle.set_request(prompt, ref.tokens if ref else [], seed)
        tokens, dt, _, state = decode(self.host, self.target, prompt, max_tokens)
        stats = state.report.get(hookimpls.NAME)
        spec = stats.to_dict() if stats is not None else None
        if spec is not None:
            spec["decode_seconds"] = dt
        return Run(self.name, "", len(prompt), tokens, dt, (len(tokens) - 1) / dt if dt > 0 else 0.0, 0.0,
                   spec=spec, drafted=list(self.wrapped.drafted) if self.wrapped else [])


def decode(host: Host, target: LoadedTarget, prompt: List[int], max_tokens: int) -> Tuple[List[int], float, List[float], Any]:
    """One greedy request through the host's scheduler: (tokens, seconds after the first token,
    log-probability margin at each token, the request's state). The prefill is not timed."""
    scheduler = Scheduler(host, target)
    request = scheduler.submit(prompt, GenerationParams(max_tokens=max_tokens, stop_token_ids=[]))
    events: List[Any] = []
    while not events:
        events += [e for _, e in scheduler.step()]
    _sync()
    t0 = time.perf_counter()
    while not request.done:
        events += [e for _, e in scheduler.step()]
    dt = time.perf_counter() - t0
    return [e.token for e in events], dt, [_margin(e.logprobs) for e in events], request.state


# -- references, divergence, prompts --------------------------------------------------------------

def reference(target: LoadedTarget, prompt: List[int], max_tokens: int, policy: Optional[Backend]) -> Reference:
    """Plain greedy decoding (untimed) with the log-probability margin at every position.

    With shape-stable caches on, the reference uses them: it then meets no exact key length that a
    timed fresh run will meet (the CPU tests show both give the same tokens)."""
    m = HostMethod(target, "reference", policy)
    tokens, _, margins, _ = decode(m.host, m.target, prompt, max_tokens)
    return Reference(tokens, margins)


def _margin(logprobs: mx.array) -> float:
    top = mx.topk(logprobs.astype(mx.float32), 2)
    return float((mx.max(top) - mx.min(top)).item())


def divergence(tokens: Sequence[int], ref: Reference) -> Dict[str, Any]:
    n = min(len(tokens), len(ref.tokens))
    first = next((i for i in range(n) if tokens[i] != ref.tokens[i]), None)
    if first is None and len(tokens) != len(ref.tokens):
        first = n
    return {"identical": first is None, "first": first,
            "margin_there": round(ref.margins[first], 4) if first is not None and first < len(ref.margins) else None}


def allocate_lengths(bases: Sequence[int], n_methods: int, stride: int) -> List[List[int]]:
    """lengths[p][m]: disjoint key-length ranges [L - 1, L + stride) for every (prompt, method)."""
    used: List[Tuple[int, int]] = []
    out: List[List[int]] = []
    for p, base in enumerate(bases):
        row = [0] * n_methods
        for j in range(n_methods):
            m = (j + p) % n_methods  # rotate which method gets the shortest length
            L = base
            while any(not (L + stride <= a or L - 1 >= b) for a, b in used):
                L += 1
            used.append((L - 1, L + stride))
            row[m] = L
        out.append(row)
    return out


