"""``mlx-spec generate``: one request through ``Host.stream``, its text streamed or one JSON object.

Flags mean what mlx-lm's ``mlx_lm.generate`` flags mean (mlx-lm 0.32.2); every value is checked by
hooks/validate.py before the model loads, the rest (token ids, the chat template, the context length)
once the tokenizer and the model config are known. The stats line and ``--json`` give the prompt's
and the generation's speeds apart, as mlx-lm prints them, peak memory, and for speculative decoding
how many tokens came from rounds and how many from plain one-token steps, and why.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import sys
import time
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

from . import validate

if TYPE_CHECKING:
    from .specs import DecodeReport

# The demo target writes Python (it learnt the standard library's source): a function to continue.
DEFAULT_PROMPT = ('import argparse\n\n\ndef parse_args(argv):\n    """Parse the command line."""\n'
                  '    parser = argparse.ArgumentParser(description=__doc__)')  # no newline: BPE merges it with the indent

MODEL_HELP = "target: path (a folder or a .gguf file), HF repo id, or 'demo' (default: the config's, else the demo pair)"
# generate's sampling flags: argparse dest -> (generation: key, help). Values are checked by
# hooks/validate.py (before any model loads), so the error names the flag and what is allowed.
GENERATION_FLAGS = {
    "max_tokens": ("max_tokens", "tokens to generate (default 100; cut to what the context leaves)"),
    "temp": ("temp", "sampling temperature (0: greedy)"),
    "top_p": ("top_p", "nucleus sampling, (0, 1] (1: off)"),
    "top_k": ("top_k", "keep the k most likely tokens (0: off)"),
    "min_p": ("min_p", "drop tokens below min_p x the top probability, [0, 1] (0: off)"),
    "seed": ("seed", "seed of this request's random streams"),
    "repetition_penalty": ("repetition_penalty", "mlx-lm's repetition penalty (0: off; 1: no change)"),
    "repetition_context_size": ("repetition_context_size", "tokens the repetition penalty looks back (default 20)"),
    "logit_bias": ("logit_bias", 'additive logit bias as JSON, e.g. \'{"12": -100}\''),
}
GENERATION_DEFAULTS = {"max_tokens": 100, "temp": 0.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "seed": None,
                       "repetition_penalty": 0.0, "repetition_context_size": 20, "logit_bias": None}
INTERRUPTED = "interrupted"
NO_PLUGIN_STEPS = "the plugins drafted nothing for this request"  # no plugin said why (host_plain_reason)


def add_generate(subparsers: Any) -> argparse.ArgumentParser:
    """``generate`` and the host's flags; plugins add theirs (``host_add_arguments``)."""
    p = subparsers.add_parser("generate", help="generate text (speculative when configured)")
    p.add_argument("--config", help="host YAML file (model, speculative: ...)")
    p.add_argument("--model", help=MODEL_HELP)
    p.add_argument("--prompt", "-p", default=None, help="prompt text ('-' reads stdin)")
    p.add_argument("--system-prompt", help="system message before the prompt (needs the chat template)")
    for dest, (_, help_) in GENERATION_FLAGS.items():
        flags = ["--" + dest.replace("_", "-")] + (["-m"] if dest == "max_tokens" else [])
        p.add_argument(*flags, dest=dest, default=None, help=help_)
    p.add_argument("--extra-eos-token", nargs="+", default=(), help="more tokens that end generation (text or id)")
    p.add_argument("--max-kv-size", help="keep at most this many positions in the KV cache (a rotating cache)")
    p.add_argument("--prefill-step-size", help="prompt tokens fed per forward (default 2048)")
    p.add_argument("--ignore-chat-template", action="store_true", help="use the raw prompt")
    p.add_argument("--verbose", dest="verbose_output", nargs="?", const="true", default="true",
                   help="mlx-lm's: true (default) streams the text and the stats line, false the text alone")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    add_distributed_flags(p)
    p.set_defaults(func=cmd_generate)
    return p


def add_distributed_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--distributed", metavar="BACKEND", help="shard the target over the ranks mlx.launch started: "
                   "ring (CPU/Mac), mpi, nccl, jaccl or any (distributed.backend)")
    p.add_argument("--distributed-drafter", metavar="WHERE", help="replicated (every rank drafts; default) or rank0 "
                   "(rank 0 drafts and broadcasts the proposals) (distributed.drafter)")


def generation_settings(args: argparse.Namespace, config: Any) -> Dict[str, Any]:
    """Flags over ``generation:`` over the defaults, every value checked."""
    out = dict(GENERATION_DEFAULTS)
    out.update({k: v for k, v in validate.generation_section(config.section("generation")).items() if v is not None})
    for dest, (key, _) in GENERATION_FLAGS.items():
        value = getattr(args, dest)
        if value is not None:
            out[key] = validate.generation_value(key, value, "--" + dest.replace("_", "-"))
    return out


def _warn(message: str) -> None:
    print(f"[mlx-spec] warning: {message}", file=sys.stderr, flush=True)


def user_text(value: Any, field: str) -> str:
    text, warning = validate.utf8_text(value, field)
    if warning:
        _warn(warning)
    return text


def read_prompt(args: argparse.Namespace) -> str:
    if args.prompt is None:
        return DEFAULT_PROMPT
    if args.prompt == "-":
        return user_text(sys.stdin.buffer.read(), "--prompt - (stdin)")
    return user_text(args.prompt, "--prompt")


def encode_prompt(tokenizer: Any, text: str, chat: bool, system: Optional[str] = None) -> List[int]:
    if chat and getattr(tokenizer, "chat_template", None):
        messages = ([{"role": "system", "content": system}] if system is not None else []) + [
            {"role": "user", "content": text}]
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))
    if system is not None:
        why = "--ignore-chat-template is given" if not chat else "this model's tokenizer has no chat template"
        raise validate.SettingError("--system-prompt", system, "only with a chat template (it is the chat's system "
                                    f"turn); {why}")
    return list(tokenizer.encode(text, add_special_tokens=False)) or list(tokenizer.encode(text))


def stop_tokens(tokenizer: Any, extra: List[str], vocab_size: Optional[int]) -> Optional[List[int]]:
    """The tokenizer's EOS ids plus ``--extra-eos-token``'s (None: the EOS ids alone)."""
    if not extra:
        return None
    vocab = tokenizer.get_vocab()
    size = vocab_size or len(vocab)
    ids = [validate.token(user_text(t, "--extra-eos-token"), "--extra-eos-token", vocab, size) for t in extra]
    return sorted(set(tokenizer.eos_token_ids) | set(ids))


def fit_context(prompt: List[int], max_tokens: int, context: Optional[int], max_field: str) -> int:
    """The server's context rule: a prompt that leaves no room is refused; a longer ``max_tokens`` is cut."""
    validate.prompt_fits(len(prompt), context, "--prompt")
    overflow = validate.completion_overflow(len(prompt), max_tokens, context, max_field)
    if overflow is None or context is None:
        return max_tokens
    _warn(f"{overflow}; generating at most {context - len(prompt)}")
    return context - len(prompt)


class Interrupt:
    """Ctrl-C during generation: the first ends the request after its current step (the output so far
    is reported), a second raises KeyboardInterrupt at once."""

    def __init__(self) -> None:
        self.hit = False
        self._old: Any = None

    def __enter__(self) -> "Interrupt":
        self._old = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if self.hit:
            raise KeyboardInterrupt
        self.hit = True

    def __exit__(self, *exc: Any) -> None:
        signal.signal(signal.SIGINT, self._old)


def cmd_generate(args: argparse.Namespace) -> int:
    from . import distributed

    cluster = distributed.start(args, args.config)
    if cluster is None:
        return generate(args, None)
    try:
        return generate(args, cluster)
    except (Exception, KeyboardInterrupt) as e:  # noqa: BLE001 - every failure ends this rank at once (failed says why)
        distributed.failed(cluster, e)


def generate(args: argparse.Namespace, cluster: Any) -> int:
    """One request; on a target sharded over ranks (``cluster``) every rank runs it, rank 0 reads and prints."""
    import mlx.core as mx
    from mlx_lm.sample_utils import make_logits_processors

    from .config import load_host_config, model_or_demo, plugin_overrides
    from .host import GenerationParams, Host
    from .manager import plugins
    from .state import SamplingParams

    pm = plugins(args)
    overrides = plugin_overrides(pm, args, "generate")
    config = load_host_config(args.config, overrides)
    gen = generation_settings(args, config)
    max_kv = validate.optional("max_kv_size", args.max_kv_size, "--max-kv-size")
    step = validate.optional("prefill_step_size", args.prefill_step_size, "--prefill-step-size")
    verbose = validate.flag(args.verbose_output, "--verbose")
    system = user_text(args.system_prompt, "--system-prompt") if args.system_prompt is not None else None
    if system is not None and args.ignore_chat_template:
        raise validate.SettingError("--system-prompt", system, "only with the chat template (it is the chat's system "
                                    "turn); --ignore-chat-template uses the raw prompt")
    prompt_text = read_prompt(args)
    model = model_or_demo(args.model, config, pm)
    host = Host(config, pm=pm, cluster=cluster)
    target = host.load(model)
    cfg = target.model_config
    vocab = cfg.get("vocab_size") or (cfg.get("text_config") or {}).get("vocab_size")
    if gen["logit_bias"]:  # token ids against this model's vocabulary
        if args.logit_bias is not None:
            validate.logit_bias(args.logit_bias, "--logit-bias", vocab)
        else:
            validate.logit_bias(config.section("generation").get("logit_bias"), "generation.logit_bias", vocab)
    stops = stop_tokens(target.tokenizer, list(args.extra_eos_token), vocab)
    prompt = encode_prompt(target.tokenizer, prompt_text, chat=not args.ignore_chat_template, system=system)
    if cluster is not None:  # rank 0's request on every rank: its prompt, and a seed (the ranks sample alike)
        prompt, gen["seed"] = cluster.broadcast_tokens(prompt), cluster.seed(gen["seed"])
    show = cluster is None or cluster.primary
    max_tokens = fit_context(prompt, gen["max_tokens"], validate.context_length(cfg),
                             "--max-tokens" if args.max_tokens is not None else "max_tokens")
    params = GenerationParams(
        max_tokens=max_tokens, stop_token_ids=stops, max_kv_size=max_kv,
        sampling=SamplingParams(temperature=gen["temp"], top_p=gen["top_p"], top_k=gen["top_k"], min_p=gen["min_p"],
                                seed=gen["seed"]),
        logits_processors=make_logits_processors(logit_bias=gen["logit_bias"],
                                                 repetition_penalty=gen["repetition_penalty"],
                                                 repetition_context_size=gen["repetition_context_size"]),
        **({"prefill_step_size": step} if step is not None else {}),
    )
    mx.reset_peak_memory()
    run = Run(len(prompt))
    run.off_reason = pm.hook.host_plain_reason(args=args, config=config) or NO_PLUGIN_STEPS
    # Sharded, Ctrl-C ends the rank at once (a step left out on one rank only would set the ranks apart).
    with (Interrupt() if cluster is None else contextlib.nullcontext()) as interrupt:
        stop = (lambda: interrupt.hit) if interrupt is not None else (lambda: False)
        for event in host.stream(target, prompt, params, state_out=run.states, stop=stop):
            run.event(event)
            if not args.json and show:
                print(event.text, end="", flush=True)
        if interrupt is not None and interrupt.hit:
            run.finish_reason = INTERRUPTED
    run.end(mx.get_peak_memory())
    if cluster is not None:
        cluster.check_same(run.tokens)
        run.distributed = {"ranks": cluster.size, "rank": cluster.rank, "backend": cluster.config.backend,
                           "drafter": cluster.config.drafter}
        if not show:
            return 0
    if args.json:
        print(json.dumps(run.to_dict()), flush=True)
    else:
        print(flush=True)
        if verbose:
            print(run.stats_line(), file=sys.stderr, flush=True)
    return 130 if run.finish_reason == INTERRUPTED else 0


class Run:
    """One generate run's tokens, times and the plugin's report."""

    def __init__(self, prompt_tokens: int):
        self.prompt_tokens = prompt_tokens
        self.states: list = []
        self.tokens: List[int] = []
        self.text: List[str] = []
        self.finish_reason = "length"
        self.start = time.perf_counter()
        self.first: Optional[float] = None
        self.stop = self.start
        self.peak_memory = 0.0
        self.distributed: Optional[Dict[str, Any]] = None  # ranks, backend, drafter: a target sharded over ranks
        self.off_reason = ""  # why there was no speculative decoding, should the plugin report none (host_plain_reason)

    def event(self, event: Any) -> None:
        if self.first is None:
            self.first = time.perf_counter()
        self.text.append(event.text)
        if event.emitted:
            self.tokens.append(event.token)
        if event.finish_reason is not None:
            self.finish_reason = event.finish_reason

    def end(self, peak_bytes: int) -> None:
        self.stop = time.perf_counter()
        self.first = self.first or self.stop
        self.peak_memory = peak_bytes / 1e9

    def speeds(self) -> Tuple[float, float]:
        """(prompt tok/s: the prompt over the time to the first token, generation tok/s after it)."""
        assert self.first is not None
        prompt_s, gen_s = self.first - self.start, self.stop - self.first
        return (self.prompt_tokens / prompt_s if prompt_s > 0 else 0.0,
                len(self.tokens) / gen_s if gen_s > 0 else 0.0)

    @property
    def speculative(self) -> Optional["DecodeReport"]:
        return self.states[0].decode_report if self.states else None

    def to_dict(self) -> Dict[str, Any]:
        prompt_tps, generation_tps = self.speeds()
        spec = self.speculative
        return {"text": "".join(self.text), "tokens": self.tokens, "prompt_tokens": self.prompt_tokens,
                "prompt_tps": round(prompt_tps, 3), "generation_tokens": len(self.tokens),
                "generation_tps": round(generation_tps, 3), "peak_memory": round(self.peak_memory, 3),
                "finish_reason": self.finish_reason, "speculative": spec.to_dict() if spec is not None else None,
                **({"speculative_off": self.off_reason} if spec is None else {}),
                **({"distributed": self.distributed} if self.distributed else {})}

    def stats_line(self) -> str:
        prompt_tps, generation_tps = self.speeds()
        line = (f"[mlx-spec] prompt {self.prompt_tokens} tokens, {prompt_tps:.1f} tok/s; generation "
                f"{len(self.tokens)} tokens, {generation_tps:.1f} tok/s; peak memory {self.peak_memory:.3f} GB")
        if self.distributed:
            line += f"; sharded over {self.distributed['ranks']} ranks ({self.distributed['backend']})"
        if self.finish_reason == INTERRUPTED:
            line += "; interrupted"
        spec = self.speculative
        if spec is None:
            return line + f"; speculative off ({self.off_reason}): every token from a plain step"
        line += (f"; speculative {spec.kind}: {spec.rounds} rounds, tau {spec.mean_acceptance_length:.2f}, "
                 f"acceptance {spec.acceptance_rate:.0%}")
        plain = spec.plain_tokens
        if plain.total:
            why = []
            if plain.paused:
                why.append(f"adaptive decoding paused speculation for {plain.paused} ({spec.pause_reason})")
            if plain.fallback:
                why.append(f"{plain.fallback} after the drafter failed ({spec.fallback})")
            if plain.other:
                why.append(f"{plain.other} from the prefill or with nothing left to draft")
            line += f"; {plain.total} of {spec.generated} tokens from plain steps: " + "; ".join(why)
        elif spec.fallback:
            line += f", fell back: {spec.fallback}"
        return line
