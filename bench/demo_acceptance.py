"""Issue 15's acceptance on a demo dir: tau, exactness, held-out bits per byte and parse share.

    python bench/demo_acceptance.py --demo-dir DIR --prompts 32 --max-tokens 128 \\
        --json bench/results/demo/cpu-acceptance.json

DIR holds target/ (an mlx-lm checkpoint with its tokenizer), any of dflash/ eagle3/ mtp/
draft_model/ (drafter checkpoints; a missing one is skipped with a note) and prompts.json
({"prompts": [{"file", "line", "prompt", "reference"}, ...]}). Prompts are used raw (no chat
template: the target is a base LM), encoded as ``mlx-spec generate --ignore-chat-template`` does.

1. Greedy: every prompt decoded for --max-tokens tokens (no stop token) through the host's scheduler
   with the speculative plugin attached as ``mlx-spec generate`` attaches it (``hookimpls.attach``:
   the registry resolves and loads the drafter), the block pinned per kind (dflash 16, eagle3 8,
   mtp: its checkpoint's, draft_model 4, ngram 8), all prompts in one batch (--batch); and plain
   decoding (speculative off) of the same prompts in the same batches. Per kind: tau (mean
   acceptance length, the bonus included) and the acceptance rate as plugin/metrics.SpecStats
   defines them, summed over the requests (tau = 1 + accepted / rounds), and the prompts whose
   tokens equal plain decoding's (any mismatch: prompt index, first differing position).
   The target runs in --dtype (default float32: exactness is defined in fp32).
2. Sampling at --temp (default 0.7) with seeds --seed + prompt index (coupled sampling, docs/lossless.md):
   acceptance rate and tau only (its exactness is the tests' business).
3. The target's held-out bits per byte: -log2 p(reference | prompt) summed over all prompts / UTF-8
   bytes scored (``bits_per_byte``).
4. Parse share of the greedy completions (``PARSE_RULE``).
5. Per kind: tau - tau(ngram) and tau / tau(ngram); a table on stdout; --json writes everything.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import math
import platform
import sys
import textwrap
import time
import tokenize
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import mlx.core as mx

from mlx_speculative.hooks.cli import encode_prompt
from mlx_speculative.hooks.host import GenerationParams, Host
from mlx_speculative.hooks.manager import make_plugin_manager
from mlx_speculative.hooks.scheduler import Scheduler
from mlx_speculative.hooks.state import HostConfig, LoadedTarget, SamplingParams
from mlx_speculative.plugin import hookimpls
from mlx_speculative.plugin.metrics import SpecStats
from mlx_speculative.plugin.settings import SpeculativeSettings

KINDS = ("dflash", "eagle3", "mtp", "draft_model", "ngram")
DEFAULT_BLOCKS: Dict[str, Optional[int]] = {"dflash": 16, "eagle3": 8, "mtp": None, "draft_model": 4, "ngram": 8}
PARSE_RULE = ("the prompt read after its preamble (prompts.json: the blocks, brackets and triple-quoted string its "
              "file has open at the prompt's first line, as tokenize leaves them there), followed by the greedy "
              "completion's complete lines (up to its last newline; none: fails), runs through Python's "
              "tokenize.generate_tokens with no error token, every closing bracket matching the last open one, and "
              "no exception but end of input inside a bracket or a triple-quoted string (the completion stops at "
              "--max-tokens wherever it is); an inconsistent dedent (IndentationError) fails. Prompts without a "
              "preamble are read inside one `if 1:` block per 4-space level of their first line's indentation")
STANDALONE_RULE = ("for comparison: the cut completion alone, textwrap.dedent-ed, through tokenize.generate_tokens "
                   "(its first lines may then close blocks the prompt opened: IndentationError counts as failure)")
BPB_RULE = ("prompt + reference tokenized together (the tokenization the model was trained on); scored: every "
            "token whose text ends after the prompt, i.e. the reference's tokens and the one straddling the "
            "boundary (a newline merged with the next line's indentation), each given the tokens before it; "
            "bytes: the UTF-8 bytes those tokens cover (the reference plus the straddling token's prompt part)")


# -- decoding -------------------------------------------------------------------------------------

def load_target(demo_dir: Path, dtype: str) -> LoadedTarget:
    """The target as ``mlx-spec generate`` loads it (hooks/loading.py), cast to ``dtype``."""
    target = Host(HostConfig(), pm=make_plugin_manager(load_entry_points=False)).load(str(demo_dir / "target"))
    if dtype != "native":
        target.model.set_dtype(getattr(mx, dtype))
        mx.eval(target.model.parameters())
    return target


def attach(target: LoadedTarget, kind: str, drafter_dir: Optional[Path], block: Optional[int]) -> LoadedTarget:
    """A copy of ``target`` with the plugin's attachment for ``kind``, the block pinned (None: the drafter's)."""
    settings = SpeculativeSettings(enabled=True, draft_model=str(drafter_dir) if drafter_dir else None, kind=kind,
                                   block_size=block, adaptive=False)
    att = hookimpls.attach(target, settings)
    if att.drafter.kind != kind:
        raise ValueError(f"{drafter_dir}: expected a {kind} drafter, the registry loaded kind {att.drafter.kind!r}")
    spec = dataclasses.replace(target, attachments={hookimpls.NAME: att})
    Host.apply_policy(spec, att.policy)
    return spec


def decode(host: Host, target: LoadedTarget, prompts: Sequence[List[int]], max_tokens: int, batch: int,
           temp: float = 0.0, seed: int = 0) -> List[Tuple[List[int], Optional[SpecStats]]]:
    """Each prompt's tokens (no stop token: exactly ``max_tokens``) and its plugin report, ``batch`` at a time.
    Sampled requests are seeded (seed + index): their tokens do not depend on the batch."""
    out: List[Tuple[List[int], Optional[SpecStats]]] = []
    for start in range(0, len(prompts), batch):
        scheduler = Scheduler(host, target)
        requests = []
        for i, p in enumerate(prompts[start:start + batch], start):
            sampling = SamplingParams(temperature=temp, seed=seed + i) if temp > 0 else SamplingParams()
            requests.append(scheduler.submit(p, GenerationParams(max_tokens=max_tokens, stop_token_ids=[],
                                                                 sampling=sampling)))
        tokens: Dict[int, List[int]] = {r.id: [] for r in requests}
        while not all(r.done for r in requests):
            for request, event in scheduler.step():
                if event.emitted:
                    tokens[request.id].append(event.token)
        for r in requests:
            if r.error is not None:
                raise RuntimeError(f"prompt {start + requests.index(r)}: {r.error}")
            out.append((tokens[r.id], r.state.report.get(hookimpls.NAME)))
    return out


def summarize(kind: str, runs: Sequence[Tuple[List[int], Optional[SpecStats]]]) -> Dict[str, Any]:
    """Rounds, draft and accepted tokens summed over the requests; tau and rate by SpecStats' definitions."""
    total = SpecStats(kind=kind)
    fallbacks = []
    for i, (_, s) in enumerate(runs):
        if s is None:
            continue
        total.rounds += s.rounds
        total.draft_tokens += s.draft_tokens
        total.accepted_tokens += s.accepted_tokens
        if s.fallback:
            fallbacks.append({"prompt": i, "fallback": s.fallback})
    return {"tau": round(total.mean_acceptance_length, 4), "acceptance_rate": round(total.acceptance_rate, 4),
            "rounds": total.rounds, "draft_tokens": total.draft_tokens, "accepted_tokens": total.accepted_tokens,
            "fallbacks": fallbacks}


def compare(runs: Sequence[Tuple[List[int], Any]], plain: Sequence[List[int]]) -> Dict[str, Any]:
    mismatches = []
    for i, ((tokens, _), ref) in enumerate(zip(runs, plain)):
        n = min(len(tokens), len(ref))
        first = next((j for j in range(n) if tokens[j] != ref[j]), None)
        if first is None and len(tokens) != len(ref):
            first = n
        if first is not None:
            mismatches.append({"prompt": i, "first_differing_position": first})
    return {"identical": len(plain) - len(mismatches), "of": len(plain), "mismatches": mismatches}


# -- bits per byte, parse share -------------------------------------------------------------------

def _byte_level_alphabet() -> Dict[str, int]:
    """Byte-level BPE's character for each byte: printable Latin-1 bytes stand for themselves, the
    other bytes take the characters from U+0100 on, in byte order (GPT-2's scheme, used by ``tokenizers``)."""
    keep = [b for b in range(256) if 33 <= b <= 126 or 161 <= b <= 172 or 174 <= b <= 255]
    rest = [b for b in range(256) if b not in keep]
    return {**{chr(b): b for b in keep}, **{chr(256 + i): b for i, b in enumerate(rest)}}


def _byte_spans(target: LoadedTarget, text: str) -> Tuple[List[int], List[Tuple[int, int]]]:
    """Token ids of ``text`` and each token's [start, end) in its UTF-8 bytes.

    Byte-level BPE (the demo's tokenizer): each token's bytes from its vocabulary string, exact.
    Other tokenizers: the tokenizer's character offsets, converted to bytes."""
    hf = target.tokenizer._tokenizer  # the transformers fast tokenizer
    enc = hf(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(enc["input_ids"])
    byte_of = _byte_level_alphabet()
    pieces = hf.convert_ids_to_tokens(ids)
    lengths = [len(p) if all(c in byte_of for c in p) else -1 for p in pieces]
    if -1 not in lengths and sum(lengths) == len(text.encode("utf-8")):
        ends = [sum(lengths[: i + 1]) for i in range(len(lengths))]
        return ids, [(e - n, e) for e, n in zip(ends, lengths)]
    return ids, [(len(text[:a].encode("utf-8")), len(text[:b].encode("utf-8"))) for a, b in enc["offset_mapping"]]


def bits_per_byte(target: LoadedTarget, items: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
    """``BPB_RULE``: -log2 p over the scored tokens / their bytes, summed over all prompts."""
    bits, nbytes, ntokens = 0.0, 0, 0
    for item in [it for it in items if it["reference"]]:
        text = item["prompt"] + item["reference"]
        boundary, total = len(item["prompt"].encode("utf-8")), len(text.encode("utf-8"))
        ids, spans = _byte_spans(target, text)
        first = next(j for j, (_, end) in enumerate(spans) if end > boundary)
        first = max(first, 1)  # the first token has no context to be scored in (prompts are never empty)
        logits = target.model(mx.array(ids[:-1])[None]).astype(mx.float32)  # [1, T-1, V]
        logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        picked = mx.take_along_axis(logp[0, first - 1:], mx.array(ids[first:])[:, None], axis=-1)  # [n, 1]
        bits += float(-mx.sum(picked).item()) / math.log(2.0)
        nbytes += total - min(spans[first][0], boundary)
        ntokens += len(ids) - first
    return {"bits_per_byte": round(bits / nbytes, 4) if nbytes else None, "bits": round(bits, 2),
            "bytes": nbytes, "tokens_scored": ntokens, "rule": BPB_RULE}


def _tokenizes(text: str) -> Optional[str]:
    """None when ``text`` runs through tokenize without an exception, else the error."""
    try:
        for _ in tokenize.generate_tokens(io.StringIO(text).readline):
            pass
    except (tokenize.TokenError, SyntaxError) as e:  # IndentationError is a SyntaxError
        return f"{type(e).__name__}: {e}"
    return None


def _outer_blocks(prompt: str) -> str:
    """`if 1:` openers for the blocks a prompt cut from inside a file sits in (4-space levels, PEP 8)."""
    first = next((line for line in prompt.splitlines() if line.strip()), "")
    depth = (len(first) - len(first.lstrip(" "))) // 4
    return "".join(" " * (4 * i) + "if 1:\n" for i in range(depth))


def _prefix_error(text: str, skip: int = 0) -> Optional[str]:
    """None when ``text`` is a prefix of tokenizable Python (PARSE_RULE), else what is wrong with it (lines
    counted after the first ``skip``: the preamble's)."""
    opened: List[str] = []
    try:
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            if tok.type == tokenize.ERRORTOKEN and tok.string.strip():  # Python < 3.12 yields these
                return f"error token {tok.string!r} at line {tok.start[0] - skip}"
            if tok.type == tokenize.OP and tok.string in "([{":
                opened.append(tok.string)
            elif tok.type == tokenize.OP and tok.string in ")]}":
                if not opened or "([{"[")]}".index(tok.string)] != opened.pop():
                    return f"unmatched {tok.string!r} at line {tok.start[0] - skip}"
    except tokenize.TokenError as e:
        message = str(e.args[0])
        if "EOF in multi-line" in message or "unterminated triple-quoted" in message:  # 3.12: "unexpected EOF ..."
            return None  # cut inside a bracket or a triple-quoted string
        return f"TokenError: {message}"
    except SyntaxError as e:  # IndentationError included
        return f"{type(e).__name__}: {e}"
    return None


def parses(prompt: str, completion: str, preamble: Optional[str] = None) -> Tuple[Optional[str], Optional[str]]:
    """(``PARSE_RULE``'s error, ``STANDALONE_RULE``'s error); None: it parses."""
    cut = completion[: completion.rfind("\n") + 1]
    alone = _tokenizes(textwrap.dedent(cut)) if cut else "no complete line"
    if not cut:
        return "no complete line", alone
    head = _outer_blocks(prompt) if preamble is None else preamble
    return _prefix_error(head + prompt + cut, head.count("\n")), alone


# -- the run --------------------------------------------------------------------------------------

def machine() -> Dict[str, Any]:
    from importlib.metadata import version

    return {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "python": platform.python_version(), "mlx": version("mlx"), "mlx_lm": version("mlx-lm"),
            "device": str(mx.default_device())}


def run(a: argparse.Namespace) -> Dict[str, Any]:
    t0 = time.perf_counter()
    if a.cpu:
        mx.set_default_device(mx.cpu)
    demo = Path(a.demo_dir)
    data = json.loads((demo / "prompts.json").read_text())
    items = data["prompts"][: a.prompts]
    target = load_target(demo, a.dtype)
    prompts = [encode_prompt(target.tokenizer, it["prompt"], chat=False) for it in items]
    blocks = {"dflash": a.dflash_block, "eagle3": a.eagle3_block, "mtp": a.mtp_block, "draft_model": a.draft_block,
              "ngram": a.ngram_block}
    batch = a.batch or len(prompts)
    plain_host = Host(HostConfig(), pm=make_plugin_manager(load_entry_points=False))
    spec_host = Host(HostConfig(), pm=make_plugin_manager(load_entry_points=False, plugins=[hookimpls]))

    print(f"[demo] plain decoding of {len(prompts)} prompts x {a.max_tokens} tokens", file=sys.stderr)
    t = time.perf_counter()
    plain = [tok for tok, _ in decode(plain_host, target, prompts, a.max_tokens, batch)]
    plain_s = time.perf_counter() - t
    kinds: Dict[str, Any] = {}
    notes: List[str] = []
    for kind in [k for k in KINDS if k in a.kinds]:
        drafter_dir = None if kind == "ngram" else demo / kind
        if drafter_dir is not None and not (drafter_dir / "config.json").exists():
            notes.append(f"{kind}: {drafter_dir} has no checkpoint; skipped")
            print(f"[demo] {notes[-1]}", file=sys.stderr)
            continue
        try:
            spec = attach(target, kind, drafter_dir, blocks[kind])
        except Exception as e:  # noqa: BLE001 - one bad checkpoint leaves the other kinds' results
            notes.append(f"{kind}: {drafter_dir} did not load ({type(e).__name__}: {e}); skipped")
            print(f"[demo] {notes[-1]}", file=sys.stderr)
            continue
        block = spec.attachments[hookimpls.NAME].block_size
        print(f"[demo] {kind} (block {block}): greedy", file=sys.stderr)
        t = time.perf_counter()
        greedy = decode(spec_host, spec, prompts, a.max_tokens, batch)
        entry: Dict[str, Any] = {"block": block, "greedy": summarize(kind, greedy), "exact": compare(greedy, plain),
                                 "greedy_seconds": round(time.perf_counter() - t, 3)}
        if a.temp > 0:
            print(f"[demo] {kind}: sampled at temperature {a.temp}", file=sys.stderr)
            t = time.perf_counter()
            sampled = decode(spec_host, spec, prompts[: a.sampled_prompts], a.max_tokens, batch, a.temp, a.seed)
            entry["sampled"] = dict(summarize(kind, sampled), temperature=a.temp, prompts=len(sampled),
                                    seconds=round(time.perf_counter() - t, 3))
        kinds[kind] = entry
    if "ngram" in kinds:
        base = kinds["ngram"]["greedy"]["tau"]
        for entry in kinds.values():
            tau = entry["greedy"]["tau"]
            entry["vs_ngram"] = {"tau_minus_ngram": round(tau - base, 4),
                                 "tau_over_ngram": round(tau / base, 4) if base else None}

    texts = [target.tokenizer.decode(tok) for tok in plain]
    verdicts = [parses(it["prompt"], text, it.get("preamble")) for it, text in zip(items, texts)]
    # the rule's reach: each reference cut to its completion's length in characters (true text: should pass)
    reach = [parses(it["prompt"], it["reference"][:len(text)], it.get("preamble"))[0]
             for it, text in zip(items, texts) if it.get("reference")]
    parse = {"rule": PARSE_RULE, "share": round(sum(v[0] is None for v in verdicts) / len(verdicts), 4),
             "references_share": round(sum(e is None for e in reach) / len(reach), 4) if reach else None,
             "standalone_rule": STANDALONE_RULE,
             "standalone_share": round(sum(v[1] is None for v in verdicts) / len(verdicts), 4),
             "failures": [{"prompt": i, "file": items[i].get("file"), "error": v[0]}
                          for i, v in enumerate(verdicts) if v[0] is not None]}
    print("[demo] held-out bits per byte", file=sys.stderr)
    bpb = bits_per_byte(target, items)
    return {
        "settings": {"demo_dir": str(demo), "prompts": len(prompts), "max_tokens": a.max_tokens, "batch": batch,
                     "dtype": a.dtype, "blocks": blocks, "temperature": a.temp, "sampled_prompts": a.sampled_prompts,
                     "seed": a.seed, "chat_template": False, "python_of_prompts": data.get("python"),
                     "prompt_rule": data.get("rule")},
        "plain": {"seconds": round(plain_s, 3), "completions": texts if a.keep_texts else None},
        "kinds": kinds, "notes": notes, "bits_per_byte": bpb, "parse": parse, "machine": machine(),
        "wall_seconds": round(time.perf_counter() - t0, 3),
    }


def table(r: Dict[str, Any]) -> str:
    rows = [f"{'kind':<12} {'block':>5} {'tau':>6} {'rate':>6} {'rounds':>7} {'exact':>7} {'tau-ng':>7} "
            f"{'tau@T':>6} {'rate@T':>6}"]
    for kind, e in r["kinds"].items():
        g, s, vs, x = e["greedy"], e.get("sampled") or {}, e.get("vs_ngram") or {}, e["exact"]
        rows.append(f"{kind:<12} {e['block']:>5} {g['tau']:>6.2f} {g['acceptance_rate']:>6.1%} {g['rounds']:>7} "
                    f"{x['identical']:>3}/{x['of']:<3} {vs.get('tau_minus_ngram', float('nan')):>+7.2f} "
                    f"{s.get('tau', float('nan')):>6.2f} {s.get('acceptance_rate', float('nan')):>6.1%}")
    rows.append(f"bits per byte {r['bits_per_byte']['bits_per_byte']}, parse share {r['parse']['share']:.0%} "
                f"(standalone {r['parse']['standalone_share']:.0%}), wall {r['wall_seconds']:.1f} s")
    return "\n".join(rows)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--demo-dir", required=True, help="target/, drafter folders, prompts.json")
    p.add_argument("--prompts", type=int, default=32, help="first N prompts of prompts.json (default 32)")
    p.add_argument("--max-tokens", type=int, default=128, help="new tokens per prompt (default 128)")
    p.add_argument("--kinds", default=",".join(KINDS), help=f"drafter kinds to run (default {','.join(KINDS)})")
    p.add_argument("--dflash-block", type=int, default=16)
    p.add_argument("--eagle3-block", type=int, default=8, help="chain depth + 1 (default 8)")
    p.add_argument("--mtp-block", type=int, default=None, help="default: the checkpoint's")
    p.add_argument("--draft-block", type=int, default=4, help="draft_model's block (default 4)")
    p.add_argument("--ngram-block", type=int, default=8)
    p.add_argument("--batch", type=int, default=0, help="prompts decoded together (default: all)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16", "native"],
                   help="the target's weights (default float32, where greedy exactness is defined)")
    p.add_argument("--temp", type=float, default=0.7, help="sampling temperature of the sampled runs (0: none)")
    p.add_argument("--sampled-prompts", type=int, default=32, help="prompts of the sampled runs (default 32)")
    p.add_argument("--seed", type=int, default=0, help="sampled prompt i uses seed + i")
    p.add_argument("--keep-texts", action="store_true", help="put the plain completions in the JSON")
    p.add_argument("--cpu", action="store_true", help="run on the CPU")
    p.add_argument("--json", help="write the results here")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    a = parser().parse_args(argv)
    a.kinds = [k.strip() for k in a.kinds.split(",") if k.strip()]
    unknown = [k for k in a.kinds if k not in KINDS]
    if unknown:
        raise SystemExit(f"--kinds: got {', '.join(unknown)}; allowed: {', '.join(KINDS)}")
    r = run(a)
    print(table(r))
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(r, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
