"""The host contract: what an mlx-lm style host calls, and when.

A plugin is a module (or object) with functions named like the specs below, decorated with
``hookimpl``. The host finds plugins through the entry-point group ``mlx_speculative.host``
(see ``hooks.manager``); the speculative plugin registers itself there in pyproject.toml.

Life of a target and its requests, seen from a plugin::

    host_model_loaded(target, config)          once per loaded target
    host_cache_policy(target)                  once per loaded target: how its caches are made
    host_describe(target)                      once per loaded target, for logs and /v1/models
    host_add_commands(subparsers)              once per CLI start
    host_add_arguments(parser, command)        once per CLI start, for each host command (generate, serve)
    host_overrides(args, command)              when a host command starts, before its config file is read
    host_demo(config)                          when no model is given and the host loads its demo target
    host_prefill_captures(target, state)       per request, before its prefill
    host_decode_step(batch)                    before each decode step of a batch of requests
    host_request_finished(state, discarded)    per request, when it ends
    host_save_row(state, batch, positions)     the server keeps a request's caches (prompt cache)
    host_metrics()                             when the server's /metrics is read

The host decodes requests in batches (``hooks.batch.DecodeBatch``; the CLI's request is a batch
of one), so a decode step always concerns every row of one batch.

Data flows one way: the host calls hooks and reads their return values. A plugin writes only
entries under its own name (``target.attachments[name]``, ``batch.extras[name]``,
``state.extras[name]``, ``state.report[name]``: a ``DecodeReport``, the one result of a request the host
reads); everything that changes what the host does next
(which layers to capture, how caches are made, which tokens to emit, how many plain steps to take)
is a hook's return value.

What the host exposes of the ordinary forward, for plugins to read:

- the outputs of decoder layers (``CaptureRequest.layers``, ``host_prefill_captures``): across the
  chunked prefill, the host's plain steps and every ``batch.forward``. A drafter that reads the
  target's final hidden state taps the last decoder layer and applies the target's own final norm.
- the committed K/V of the target's attention caches: ``state.batch`` is the ``DecodeBatch`` a row
  decodes in (None while it prefills), and ``batch.committed_kv(i)`` (``hooks.kv_view``) hands over
  the K/V the cache at index i of the target's cache list holds, with the token position of each
  slot per row, without copying or changing it. On entry to ``host_decode_step`` the caches hold
  every token but each row's pending one, so a drafter attending over them (shared K/V, e.g. the
  Gemma 4 assistant) reads exactly the committed positions.

``hooks.loading.load_target`` loads targets: ``mlx_lm.load``, except that the tensors of a
checkpoint's extra multi-token-prediction layers (``model.layers.{num_hidden_layers + k}``, k below
``num_nextn_predict_layers``) are left out of the target's weights; a plugin may read them itself.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

import pluggy

if TYPE_CHECKING:
    from .batch import DecodeBatch
    from .backend import Backend
    from .state import CaptureRequest, DecodeState, HostConfig, LoadedTarget, StepOutput

PROJECT = "mlx_speculative"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@dataclass
class Description:
    """What a plugin attached to a target, for the host's start log and its /v1/models entry."""

    name: str
    active: bool
    lines: List[str] = field(default_factory=list)  # one log line each
    info: Dict[str, Any] = field(default_factory=dict)  # JSON-able, shown under ``name`` in /v1/models
    # Request fields the plugin accepts (mlx-lm's server API): names a request's ``draft_model`` may
    # use, and the most ``num_draft_tokens`` it may ask for (None: no drafter attached).
    draft_names: Tuple[str, ...] = ()
    draft_tokens: Optional[int] = None


@dataclass
class RowSnapshot:
    """A plugin's state for a row's first ``positions`` tokens, kept in the server's prompt cache.

    The host only stores it, counts ``nbytes`` against ``server.prompt_cache_bytes``, and hands it
    back (``state.restored[name]``) to a later request whose prompt starts with those tokens. It
    must never change after it is returned (a plugin copies what it restores before writing).
    """

    name: str  # the plugin's name: its key in ``state.restored``
    positions: int  # tokens covered: ``state.tokens[:positions]``
    value: Any  # the plugin's own
    nbytes: int = 0


@dataclass(frozen=True)
class DemoPart:
    """What a plugin pairs with the host's embedded demo target (``host_demo``)."""

    label: str  # for the host's start line, e.g. "drafter 'demo-drafter'"
    overrides: Dict[str, Dict[str, Any]]  # configuration values it sets, by section, as its flags would


@dataclass(frozen=True)
class PlainTokens:
    """A request's tokens that came from the host's one-token steps while a plugin took its decode steps, by why."""

    paused: int = 0  # the plugin paused its steps (they would lose to plain steps at the measured costs)
    fallback: int = 0  # after the plugin's decoding failed
    other: int = 0  # the prefill's first token, steps with nothing left to draft

    @property
    def total(self) -> int:
        return self.paused + self.fallback + self.other

    def to_dict(self) -> Dict[str, int]:
        return {"paused": self.paused, "fallback": self.fallback, "other": self.other}


@dataclass(frozen=True)
class DecodeReport:
    """What a plugin that took decode steps (``host_decode_step``) reports of one request: it writes it to
    ``state.report[<plugin name>]`` when the request ends (``host_request_finished``). The host reads it for
    ``mlx-spec generate``'s stats line and ``--json`` (``to_dict``), the server's ``timings`` and request log."""

    kind: str  # the round loop that ran: draft_model, ngram, dflash, eagle3, mtp...
    rounds: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    mean_acceptance_length: float = 0.0  # tau: tokens emitted per round, the bonus included
    acceptance_rate: float = 0.0  # accepted / draft tokens
    accepted_per_position: List[int] = field(default_factory=list)  # rounds that accepted position i of the block
    rounds_by_acceptance: Dict[str, int] = field(default_factory=dict)  # zero | partial | full -> rounds
    block_sizes: List[int] = field(default_factory=list)  # one per round
    plain_steps: int = 0  # one-token steps the host took while the plugin decoded the request
    round_tokens: int = 0  # tokens the rounds emitted (accepted + bonus), those past the request's end left out
    plain_tokens: PlainTokens = PlainTokens()
    generated: int = 0  # the request's tokens
    pause_reason: Optional[str] = None  # why its latest pause began
    verified_ahead: int = 0  # rounds whose verify forward the round before had queued
    fallback: Optional[str] = None  # why the request fell back to plain decoding, if it did
    seconds: Dict[str, float] = field(default_factory=dict)  # by phase: draft, verify, commit
    steps: Dict[str, float] = field(default_factory=dict)  # by step of a round, in the round's order

    def to_dict(self) -> Dict[str, Any]:
        """The JSON object of ``mlx-spec generate --json``'s ``speculative``."""
        return {
            "kind": self.kind,
            "rounds": self.rounds,
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "mean_acceptance_length": round(self.mean_acceptance_length, 4),
            "acceptance_rate": round(self.acceptance_rate, 4),
            "accepted_per_position": list(self.accepted_per_position),
            "rounds_by_acceptance": dict(self.rounds_by_acceptance),
            "block_sizes": list(self.block_sizes),
            "plain_steps": self.plain_steps,
            "round_tokens": self.round_tokens,
            "plain_tokens": self.plain_tokens.to_dict(),
            "pause_reason": self.pause_reason,
            "verified_ahead": self.verified_ahead,
            "fallback": self.fallback,
            "seconds": {k: round(v, 6) for k, v in self.seconds.items()},
            "steps": {k: round(v, 6) for k, v in self.steps.items()},
        }


@dataclass
class Metric:
    """One Prometheus metric a plugin exposes: ``samples`` are (labels, value), labels like '{k="v"}'."""

    name: str
    kind: str  # counter | gauge
    help: str
    samples: List[Tuple[str, Any]] = field(default_factory=list)


@hookspec
def host_model_loaded(target: "LoadedTarget", config: "HostConfig") -> None:
    """Called once after the host loaded a target model with ``mlx_lm.load``.

    ``target`` carries ``model``, ``tokenizer``, ``path`` (local directory), ``model_config``
    (config.json as a dict) and ``attachments`` (a dict, empty at first). ``config`` is the
    host's configuration: the YAML sections and the CLI overrides.

    A plugin resolves its settings, loads and validates what it needs, and stores it in
    ``target.attachments[<plugin name>]``. It must not change the model's weights.
    Returns nothing. An exception here is fatal for the CLI (``mlx-spec generate``); a plugin
    that wants to degrade gracefully (the speculative plugin does, for a bad drafter) warns and
    attaches nothing instead.
    """


@hookspec(firstresult=True)
def host_cache_policy(target: "LoadedTarget") -> Optional["Backend"]:
    """Called once per target after ``host_model_loaded``: how the host makes its caches and runs its forwards.

    Return a ``hooks.backend.Backend`` (every member typed there; subclass ``CachePolicy``, the host's default,
    to override only what differs: e.g. shape-stable caches for a device that compiles attention per shape),
    or None for mlx-lm's own caches, attention and matmuls. The first non-None wins. The backend's cache
    classes must merge into batches (``merge``/``extend``/``extract``) or the host decodes each request of
    the target alone. The host routes the target's attention and projections through its dispatchers
    (``hooks.attention.route_policy``: this model's layers only), taps its ``capture_layers``, then calls
    ``prepare(model)`` once.
    """


@hookspec
def host_describe(target: "LoadedTarget") -> Optional[Description]:
    """Called once per target by the server: a ``Description`` of what the plugin attached, or None."""


@hookspec
def host_add_commands(subparsers: "argparse._SubParsersAction") -> None:
    """Called once when ``mlx-spec`` builds its argument parser.

    A plugin adds its subcommands with ``subparsers.add_parser(name, ...)`` and sets
    ``func=<callable(args) -> int>`` as the parser default; the return value is the exit code.
    """


@hookspec
def host_add_arguments(parser: argparse.ArgumentParser, command: str) -> None:
    """Called once per host command (``command``: ``generate``, ``serve``) when ``mlx-spec`` builds its argument
    parser, after the host's own flags: a plugin adds the flags it reads (``host_overrides`` reads them back).
    Without the plugin the flags are unknown to the command.
    """


@hookspec
def host_overrides(args: argparse.Namespace, command: str) -> Optional[Dict[str, Dict[str, Any]]]:
    """Called once when a host command (``generate``, ``serve``) starts, before its config file is read and any
    model loads: the configuration values the plugin's flags set, by section (``{"speculative": {"kind":
    "ngram"}}``), or None. They win over the environment and the YAML (``HostConfig.overrides``). A bad value
    raises a ``ValueError`` naming the flag, the value and what is allowed (``hooks.validate.SettingError``).
    """


@hookspec
def host_demo(config: "HostConfig") -> Optional[DemoPart]:
    """Called when no model is given (no ``--model``, no ``model:``) and the host loads its embedded demo target:
    what the plugin pairs with it (the speculative plugin: the demo drafter, unless some speculative setting was
    given), or None. The host adds the part's ``overrides`` to ``config.overrides`` and names its ``label`` in
    the start line.
    """


@hookspec(firstresult=True)
def host_plain_reason(args: argparse.Namespace, config: "HostConfig") -> Optional[str]:
    """Called by ``mlx-spec generate`` before its request runs: should no plugin report a ``DecodeReport`` for it
    (every token from the host's plain steps), why, in a few words naming the plugin's setting that turned its
    decode steps off (e.g. ``"--no-speculative"``), or None (it did not). The first non-None wins; with none the
    host says the plugins drafted nothing. The text goes to the stats line and ``--json``'s ``speculative_off``.
    """


@hookspec
def host_prefill_captures(target: "LoadedTarget", state: "DecodeState") -> Optional["CaptureRequest"]:
    """Called before each request's prefill: what the ordinary forward must expose for it.

    ``state`` is the new request (its ``options`` tell e.g. whether it turned rounds off). Return a
    ``CaptureRequest`` naming decoder layers whose *output* (0-based: layer i's output) the host
    records, or None. The host taps those layers of the target's own decoder stack and hands the
    outputs of every position IT feeds (the chunked prefill, its plain steps) to the next
    ``host_decode_step`` call in ``state.captures`` ([1, n, H] per layer), once: after that call
    it empties them. Forwards a plugin runs itself through ``batch.forward`` return their
    captures to it directly.
    """


@hookspec(firstresult=True)
def host_decode_step(batch: "DecodeBatch") -> Optional[List["StepOutput"]]:
    """Called before each decode step of a batch; the first non-None result wins.

    Invariant on entry, per row (``batch.rows``, ``DecodeState``): ``state.tokens`` is the prompt
    plus every emitted token, and the batch's caches (``batch.cache``) hold every token but the
    last (``state.pending``), which is emitted but not yet fed.

    Either step every row: run forwards through ``batch.forward`` (the target's ordinary forward,
    [B, W] -> logits [B, W, V] and the tapped layers' outputs) inside a
    ``hooks.transaction.CacheTransaction`` over ``batch.cache`` and return one ``StepOutput`` per row,
    in row order, each with one or more ``tokens``; on return the caches hold every returned token
    but the last of each row, and the old pending one, nothing more (per-row lengths: the
    transaction commits them). The host appends the tokens to ``state.tokens`` and ends a row at
    a stop token or ``max_tokens`` (extra positions are never read). A step should return at most
    ``state.remaining`` tokens per row.

    Or decline every row: return None, or one ``StepOutput`` with no tokens per row whose
    ``plain_steps`` says how many plain one-token steps the host may take for the row before it
    asks again (None: any number). The host then runs its own step for all rows, pipelined like
    mlx-lm's ``generate_step`` (the next forward is queued before the current token is read), for
    the fewest steps any row allows, and asks again after that or when rows join. Returning None
    means no limit for any row.
    """


@hookspec
def host_request_finished(state: "DecodeState", discarded: int) -> None:
    """Called once when a request ends (stop token, max_tokens, cancelled or failed).

    ``discarded``: tokens of the request's last decode step that were not used because the
    request ended before them (e.g. a stop token in the middle of a round). A plugin that took
    decode steps for the request writes its ``DecodeReport`` (those tokens left out) to
    ``state.report[<plugin name>]``, and releases what it holds for the request.
    """


@hookspec
def host_save_row(state: "DecodeState", batch: Optional["DecodeBatch"], positions: int) -> Optional[RowSnapshot]:
    """Called when the server's prompt cache keeps a copy of a row's target caches, holding
    ``state.tokens[:positions]``: when the row ends (``batch``: the batch it decoded in; the row is
    still in it) and, for targets with recurrent or sliding-window caches, at the end of its prompt
    (``batch`` None: it has not decoded yet). Return the plugin's state for those tokens (a
    ``RowSnapshot`` covering at most ``positions``, evaluated, independent of anything that goes on
    changing), or None. Not called by ``mlx-spec generate``.

    A later request that reuses the first n tokens of the entry finds ``state.cached == n`` (its
    caches hold ``tokens[:n]``; prefill, and the captures handed over, cover only the rest) and the
    snapshots in ``state.restored`` (name -> ``RowSnapshot``), from its first decode step on. A
    plugin that finds nothing there derives its state from the row as usual. A row that captures
    layer outputs (``host_prefill_captures``) reuses only positions all of the entry's snapshots
    cover, none when it has none: the host cannot re-create the captures of positions it skips.
    """


@hookspec
def host_metrics() -> Optional[List[Metric]]:
    """Called when the server's ``/metrics`` is read: the plugin's process-wide metrics, or None."""
