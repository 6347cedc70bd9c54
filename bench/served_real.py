"""The real-model mode of bench/server_batching.py: a real checkpoint served with real drafters and real prompts.

The target is a checkpoint folder or a .gguf file, loaded by the server as ``mlx-spec serve --model`` loads it
(hooks/server.py ``build_server`` with no target: the host hooks, the plugins from their entry points). Each mode
is one server whose HostConfig carries a ``speculative:`` section as a deployment's config would (the plugin
resolves it and attaches the drafter itself): ``plain`` (``enabled: false``), one mode per ``--drafter PATH[@B]``
(``draft_model: PATH``, its kind read from the checkpoint as ``mlx-spec bench --drafter`` reads it, or
``--draft-kind``; named by that kind, or by the folder's name when two drafters share a kind) and ``ngram``
(``--kind ngram``). ``--quantize-target BITS`` serves a quantized copy of the target (mlx-lm's
``quantize_model``, group size 64), written once to a temporary folder, as a deployment serves a quantized
checkpoint. Requests: ``--prompts-file`` (benchmarks/real.py ``read_prompts``): raw prompts as /v1/completions
with the text, chat prompts (``"chat": true``) as /v1/chat/completions with one user message (the server applies
the chat template); temperature 0.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

from mlx_speculative.benchmarks import real
from mlx_speculative.drafters import registry
from mlx_speculative.hooks import loading
from mlx_speculative.hooks.server import Server, build_server
from mlx_speculative.hooks.server_settings import server_settings
from mlx_speculative.hooks.state import HostConfig

DEFAULT_PROMPTS = Path(__file__).resolve().parent / "prompts" / "real_heldout.json"
KINDS = ("auto", "ngram")  # --kind: the drafters given only, or the n-gram drafter too


@dataclass
class Mode:
    name: str
    speculative: Dict[str, Any]  # the ``speculative:`` section this mode's server gets
    record: Dict[str, Any]  # what the JSON says about its drafter


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", default=None, metavar="PATH",
                    help="a real target: checkpoint folder or .gguf file (instead of --synthetic-target)")
    ap.add_argument("--drafter", action="append", default=[], metavar="PATH[@B]",
                    help="with --model: a DFlash/EAGLE-3 checkpoint folder or a draft LM (B: its block size); "
                         "one mode each; repeatable")
    ap.add_argument("--draft-kind", action="append", default=[], metavar="KIND",
                    help="with --drafter: the drafter's kind instead of the one read from its checkpoint (once: "
                         "for every --drafter; or once per --drafter, in order)")
    ap.add_argument("--kind", default=None, choices=KINDS, help="with --model: ngram adds the n-gram drafter's mode")
    ap.add_argument("--prompts-file", default=None, metavar="FILE",
                    help="with --model: the prompts (bench/prompts/real_heldout.json's format; default: that file)")
    ap.add_argument("--max-prompts", type=int, default=None, metavar="N", help="with --model: the first N prompts only")


def check(args: argparse.Namespace, error: Callable[[str], None]) -> None:
    """Flags of one mode refused in the other, before anything loads."""
    real_only = {"--drafter": args.drafter, "--draft-kind": args.draft_kind, "--kind": args.kind,
                 "--prompts-file": args.prompts_file, "--max-prompts": args.max_prompts}
    synthetic_only = {"--prompt-words": args.prompt_words, "--tau": args.tau, "--block": args.block}
    if args.model is not None and args.synthetic_target is not None:
        error(f"--model {args.model!r} with --synthetic-target {args.synthetic_target!r}: expected one target, "
              "either --model PATH (a checkpoint folder or a .gguf file) or --synthetic-target NAME")
    given = [k for k, v in (synthetic_only if args.model is not None else real_only).items() if v not in (None, [])]
    if given:
        error(f"{', '.join(given)}: only with " + ("--synthetic-target (the oracle drafter's settings); with --model, "
              "give each drafter as --drafter PATH[@B]" if args.model is not None else
              "--model PATH (a real target with its tokenizer); got --synthetic-target"))
    if args.draft_kind and len(args.draft_kind) not in (1, len(args.drafter)):
        error(f"--draft-kind: got {len(args.draft_kind)} for {len(args.drafter)} --drafter; expected none, one (for "
              "every drafter) or one per --drafter")
    if args.max_prompts is not None and args.max_prompts < 1:
        error(f"--max-prompts: got {args.max_prompts}; allowed: a positive integer")


def modes_for(args: argparse.Namespace) -> List[Mode]:
    """plain, one mode per --drafter (kind read from its checkpoint unless --draft-kind), then ngram."""
    modes = [Mode("plain", {"enabled": False}, {"kind": None})]
    kinds = args.draft_kind * len(args.drafter) if len(args.draft_kind) == 1 else list(args.draft_kind)
    for i, text in enumerate(args.drafter):
        spec = real.parse_drafter(text)  # ValueError: a bad @B
        resolution = registry.resolve(spec.path, kinds[i] if kinds else "auto")  # reads its config only
        for warning in resolution.warnings:
            print(f"[served] {warning}", file=sys.stderr)
        taken = {m.name for m in modes}
        name = resolution.kind if resolution.kind not in taken else Path(spec.path.rstrip("/")).name
        if name in taken:
            name = f"{name}-{i}"
        section = {"enabled": True, "kind": resolution.kind, "draft_model": spec.path}
        if spec.block:
            section["block_size"] = spec.block
        modes.append(Mode(name, section, {"path": spec.path, "resolved_path": str(resolution.path),
                                          "kind": resolution.kind, "family": resolution.family.name,
                                          "block": spec.block, "warnings": list(resolution.warnings)}))
    if args.kind == "ngram" and "ngram" not in {m.name for m in modes}:
        modes.append(Mode("ngram", {"enabled": True, "kind": "ngram"}, {"path": None, "kind": "ngram", "block": None}))
    return modes


def select(modes: List[Mode], wanted: Optional[str], error: Callable[[str], None]) -> List[Mode]:
    """``--modes`` in real mode: a subset of the modes the drafters give, in its order."""
    if wanted is None:
        return modes
    by_name = {m.name: m for m in modes}
    bad = [w for w in wanted.split(",") if w not in by_name]
    if bad:
        error(f"--modes: got {', '.join(bad)}; allowed with --model: {', '.join(by_name)} (plain, one per --drafter, "
              "ngram with --kind ngram)")
    return [by_name[w] for w in wanted.split(",")]


def quantized_copy(model: str, bits: int, root: Path) -> Path:
    """The target's weights at ``bits`` (mlx-lm's ``quantize_model``, group size 64) in a checkpoint folder under
    ``root``, with its tokenizer: the server loads it as any quantized checkpoint."""
    import mlx.core as mx
    from mlx_lm.utils import quantize_model, save

    path = loading.resolve_path(model, "model")  # a .gguf file: its converted folder
    config = loading.read_config(path, "model")
    if config.get("quantization"):
        raise ValueError(f"--quantize-target {bits}: the target {model!r} is already quantized "
                         f"({config['quantization']}); expected a float checkpoint")
    net, tokenizer = loading.load_target(path, config)
    net, qconfig = quantize_model(net, dict(config), 64, bits)
    mx.eval(net.parameters())
    out = root / f"{path.name}-q{bits}"
    save(out, path, net, tokenizer, qconfig, donate_model=False)
    for extra in ("chat_template.jinja", "chat_template.json"):  # a template kept beside the tokenizer
        if (path / extra).exists() and not (out / extra).exists():
            shutil.copy(path / extra, out / extra)
    return out


def serve(model: str, speculative: Dict[str, Any], over: Dict[str, Any]) -> Server:
    """A server loading ``model`` itself, its ``speculative:`` section as a deployment's config gives it."""
    import threading

    config = HostConfig(overrides={"server": {"port": 0, **over}, "speculative": dict(speculative)}, strict=False)
    server = build_server(config, model, server_settings(config))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def stop(server: Server) -> None:
    """End a server started by ``serve`` (or server_batching's synthetic one) and its engine thread."""
    server.shutdown()
    server.engine.stop()
    server.engine.thread.join(timeout=120)  # no MLX work left in flight when the process exits
    server.server_close()


def attached(server: Server, mode: Mode) -> Dict[str, Any]:
    """What the plugin attached; a drafter mode whose drafter did not attach raises (it would measure plain)."""
    target = server.engine.target
    att = target.attachments.get("speculative") if target is not None else None
    if mode.speculative.get("enabled") is False:
        return {"speculative": "off"}
    if att is None or getattr(att, "drafter", None) is None:
        why = getattr(att, "error", None) or "no drafter attached (is the speculative plugin installed?)"
        raise RuntimeError(f"mode {mode.name}: speculative decoding did not start with {mode.speculative}: {why}")
    return {"speculative": att.settings.describe(), "block_size": att.block_size, "max_block": att.max_block,
            "drafter": type(att.drafter).__name__}


def requests(args: argparse.Namespace) -> List[real.TextPrompt]:
    path = args.prompts_file or str(DEFAULT_PROMPTS)
    prompts = real.read_prompts(path)
    return prompts[: args.max_prompts] if args.max_prompts else prompts


def run(args: argparse.Namespace, prompts: List[real.TextPrompt], clients: List[int], modes: List[Mode],
        measure: Callable[..., Dict[str, Any]], one: Callable[..., Any], plugin_counts: Callable[[Any], Dict[str, Any]],
        write: Callable[[Dict[str, Any]], None]) -> Dict[str, Any]:
    """Every mode against every client count (``measure``: server_batching's ``load``); the results by mode."""
    results: Dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="served-real-") as tmp:
        model = args.model
        if args.quantize_target:
            t0 = time.perf_counter()
            model = str(quantized_copy(args.model, args.quantize_target, Path(tmp)))
            print(f"[served] {args.model} quantized to {args.quantize_target} bits in "
                  f"{time.perf_counter() - t0:.1f} s: {model}", file=sys.stderr, flush=True)
        for mode in modes:
            t0 = time.perf_counter()
            over: Dict[str, Any] = {"max_active": max(clients), "max_queue": 4 * max(clients)}
            if args.warmup_tokens is not None:
                over["warmup_tokens"] = args.warmup_tokens
            server = serve(model, mode.speculative, over)
            try:
                drafter = attached(server, mode)
                url = f"http://127.0.0.1:{server.server_address[1]}/v1"
                refs = [one(url, p, args.max_tokens)[0] for p in prompts]  # each request alone
                results[mode.name] = {"speculative_section": mode.speculative, "attached": drafter,
                                      "load_and_refs_s": round(time.perf_counter() - t0, 1), "by_clients": {}}
                for n in clients:
                    # client i sends prompts i, i + n, i + 2n, ...: every prompt of the file, none twice at once
                    row = measure(server, prompts, refs, n, args.duration, args.max_tokens, pool=len(prompts), stride=n)
                    results[mode.name]["by_clients"][str(n)] = row
                    print(f"{mode.name} x{n}: {row}", file=sys.stderr, flush=True)
                results[mode.name]["plugin"] = plugin_counts(server.engine.target)
                write(results)  # after each mode: a run cut short keeps the modes it finished
            finally:
                stop(server)
    return results


def report_fields(args: argparse.Namespace, modes: List[Mode], prompts: List[real.TextPrompt]) -> Dict[str, Any]:
    """The real run's own keys of the JSON (the synthetic run's target, tau, block... do not apply)."""
    return {"model": args.model, "model_resolved": str(loading.resolve_path(args.model, "model")),
            "quantized_bits": args.quantize_target, "max_tokens": args.max_tokens,
            "drafters": {m.name: m.record for m in modes if m.name != "plain"},
            "prompts_file": args.prompts_file or str(DEFAULT_PROMPTS),
            "prompts": {"count": len(prompts), "chat": sum(p.chat for p in prompts)}}
