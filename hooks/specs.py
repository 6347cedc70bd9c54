"""The host contract: what an mlx-lm style host calls, and when.

A plugin is a module (or object) with functions named like the specs below, decorated with
``hookimpl``. The host finds plugins through the entry-point group ``mlx_speculative.host``
(see ``hooks.manager``); the speculative plugin registers itself there in pyproject.toml.

Life of one request, seen from a plugin::

    host_model_loaded(target, config)        once per loaded target model
    host_add_commands(subparsers)            once per CLI start
    host_prefill_captures(target)            before each prefill; the host taps those layers
    host_decode_step(state)                  before every decode step, until max_tokens or a stop token

A host that decodes several requests of one target together (the server's batched scheduling,
``hooks.batch.DecodeBatch``) asks instead::

    host_batch_refusal(target)               once per target: may its requests share a batch?
    host_decode_batch(batch)                 before every decode step of the batch (all its rows)

Who may change what:
- ``target.attachments[name]``: a plugin stores what it loaded for a target under its own name.
- ``state.extras[name]`` / ``state.report[name]``: per-request scratch and the request's report
  (the CLI's ``--json`` and the server's ``usage`` read ``report``).
- ``state.cache``, ``state.tokens``: only through a decode step that returns its tokens
  (see ``host_decode_step``). Nothing else is written by plugins.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, List, Optional

import pluggy

if TYPE_CHECKING:
    from .batch import DecodeBatch
    from .state import CaptureRequest, DecodeState, HostConfig, LoadedTarget, StepOutput

PROJECT = "mlx_speculative"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


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


@hookspec
def host_add_commands(subparsers: "argparse._SubParsersAction") -> None:
    """Called once when ``mlx-spec`` builds its argument parser.

    A plugin adds its subcommands with ``subparsers.add_parser(name, ...)`` and sets
    ``func=<callable(args) -> int>`` as the parser default; the return value is the exit code.
    """


@hookspec
def host_prefill_captures(target: "LoadedTarget") -> Optional["CaptureRequest"]:
    """Called before each request's prefill: what the ordinary forward must expose.

    Return a ``CaptureRequest`` naming decoder layers whose *output* (0-based: layer i's
    output) the host records, or None. The host takes the union of all requests, taps those
    layers of the target's own decoder stack and records them through the (chunked) prefill
    into ``state.captures[layer]`` as ``[1, L, H]`` arrays covering every prompt position fed
    to the target. Decode steps that run forwards through ``state.forward`` record the same
    layers for the positions they feed. A plugin that consumed captured states may clear them.
    """


@hookspec(firstresult=True)
def host_decode_step(state: "DecodeState") -> Optional["StepOutput"]:
    """Called before each decode step; the first non-None result wins.

    Invariant on entry: ``state.tokens`` is the prompt plus every emitted token, and the target's
    caches hold every token but the last (``state.pending``), which is emitted but not yet fed.

    Return None to let the host run its own one-token step (feed ``pending``, apply the logits
    processors, sample). Or run one step yourself and return a ``StepOutput`` whose ``tokens``
    (one or more, each with its log-probabilities) the host emits in order; on return the
    invariant must hold again with the last returned token as the new ``pending``: every other
    returned token, and the old pending one, fed to the target's caches, nothing more. The host
    truncates the emitted tokens at a stop token or at ``max_tokens`` (then generation ends, so
    the caches' extra positions are never read). ``state.remaining`` tells how many tokens may
    still be emitted; a step should not return more.

    A plugin that will return None for every remaining step of this request adds itself (the
    object it registered) to ``state.idle_plugins``; once all implementers have, the host
    pipelines its own one-token steps like mlx-lm's ``generate_step`` (the next forward is queued
    before the current token is read) and stops calling this hook for the request.

    A plugin returning None may also set ``state.plain_run = n`` (the host resets it to 0 before
    each call): the host then takes up to n plain one-token steps, pipelined the same way and
    recording ``state.capture_layers`` for every fed position, before calling this hook again.
    Between those steps the caches run one token ahead; after the last one the invariant holds.
    """


@hookspec
def host_batch_refusal(target: "LoadedTarget") -> Optional[str]:
    """Called once per target by a host that can decode requests in a batch (the server).

    Return a reason (str) why this plugin's decode steps for ``target`` cannot run as batched
    steps (``host_decode_batch``), or None. Any reason, or a target whose caches the host cannot
    batch (``hooks.batch.cache_refusal``), keeps every request of the target on per-request
    ``host_decode_step`` calls; the host logs the reason.
    """


@hookspec(firstresult=True)
def host_decode_batch(batch: "DecodeBatch") -> Optional[List["StepOutput"]]:
    """Called before each decode step of a batch of requests of one target; the first non-None wins.

    ``batch.rows`` are the requests' ``DecodeState``s; ``batch.cache`` (one ``BatchKVCache`` per
    layer, left-padded rows) holds their positions and ``batch.forward(inputs)`` runs the target's
    ordinary forward over one equally long token list per row ([B, W] -> logits [B, W, V]),
    recording each row's captures into its ``last_captures``. The invariant of ``host_decode_step``
    holds per row on entry and must hold again on return.

    Return None to let the host run its own one-token step for every row (``batch.plain_step``),
    or a list of one ``StepOutput`` per row, in row order, each as ``host_decode_step`` would
    return it for that row alone (one or more tokens, at most ``state.remaining``). Rows may emit
    different numbers of tokens: the positions a row does not keep must be taken out of
    ``batch.cache`` for that row only (``plugin.commit.CacheTransaction`` commits per-row lengths).
    The host ends a row at a stop token or ``max_tokens`` and removes it from the batch; after a
    step it drops the left padding all rows share (``batch.compact``).
    """
