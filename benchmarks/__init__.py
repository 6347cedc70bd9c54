"""``mlx-spec bench``: how fast speculative decoding is here, against plain decoding, in one process."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path
from typing import Any, List, Optional


def _floats(text: str) -> List[Optional[float]]:
    out: List[Optional[float]] = []
    for part in text.split(","):
        part = part.strip()
        if part in ("none", "real", ""):
            out.append(None)
            continue
        try:
            out.append(float(part))
        except ValueError:
            raise argparse.ArgumentTypeError(f"got {part!r}; expected numbers separated by commas (e.g. 6.5,3,1)") from None
    return out


def _ints(text: str) -> List[int]:
    try:
        return [int(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"got {text!r}; expected integers separated by commas (e.g. 128,512,1024)") from None


def _cost_keys(text: Optional[str]) -> Optional[List[int]]:
    """``--cost-keys``: None (the backend's default), [] for 'none', else positive key lengths."""
    if text is None:
        return None
    if text.strip().lower() == "none":
        return []
    parts = [p.strip() for p in text.split(",")]
    if not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"--cost-keys: got {text!r}; expected the key lengths of the bare forward costs; allowed: "
                         "positive integers separated by commas (e.g. 8192,16384), or 'none'")
    return [int(p) for p in parts]


def add_command(subparsers: Any) -> None:
    p = subparsers.add_parser("bench", help="benchmark plain vs speculative decoding (mlx-lm and this plugin)")
    src = p.add_argument_group("models")
    src.add_argument("--model", help="target checkpoint: path or HF repo id")
    src.add_argument("--synthetic-target", help="build a random target in memory instead: llama-8b, llama-1b, llama-150m (float32), tiny")
    src.add_argument("--draft-model", help="draft LM for the draft_model kind and mlx-lm's speculative loop")
    src.add_argument("--drafter", action="append", default=[], metavar="PATH[@B]",
                     help="a real drafter checkpoint (repeat the flag for several; one per kind), loaded as "
                          "mlx-spec generate --draft-model PATH loads it, its kind read from the checkpoint; each runs "
                          "as 'plugin <kind> b<B>' with its own proposals, at block size B if @B is given, else at "
                          "every --block-sizes, else at its checkpoint's default block. Needs --model; with it, "
                          "--kind is auto (only these) or ngram (adds the n-gram drafter), and a draft_model "
                          "checkpoint here also drives mlx-lm's speculative loop")
    src.add_argument("--kind", default="auto", choices=["auto", "dflash", "eagle3", "draft_model", "ngram"],
                     help="drafter kind(s) to run (auto: dflash when available, and draft_model; eagle3: a synthetic "
                          "EAGLE-3-shape drafter, one layer at the target's width, a 32k draft vocabulary)")
    src.add_argument("--draft-layers", type=int, default=2, help="layers of the synthetic draft LM (default 2)")
    src.add_argument("--dflash-layers", type=int, default=5, help="layers of the synthetic DFlash drafter (default 5)")
    run = p.add_argument_group("what to run")
    run.add_argument("--oracle-acceptance", type=_floats, default=None, metavar="TAU[,TAU...]",
                     help="replace proposals by the target's greedy continuation with errors injected so that the "
                          "mean acceptance length is TAU, from 1 to the smallest block size (the drafter still "
                          "runs; 'real' = its own proposals; default: real). The plugin's dflash, eagle3 and ngram kinds "
                          "run every TAU at every block size; draft_model (unless --kind draft_model) and mlx-lm's "
                          "speculative_generate_step run only the first TAU (mlx-lm at the largest block size)")
    run.add_argument("--adaptive-at", type=_floats, default=[], metavar="TAU[,TAU...]",
                     help="also run these oracle taus with the adaptive block size (at the largest block size)")
    run.add_argument("--block-sizes", type=_ints, default=None, metavar="B[,B...]",
                     help="block sizes (default 16; with --drafter: each drafter's own default block)")
    run.add_argument("--prompts-file", metavar="FILE",
                     help="real text prompts instead of random tokens (needs --model): a JSON list of strings, a JSON "
                          "object {\"prompts\": [{\"prompt\": \"...\", \"chat\": false}, ...]}, or plain text with one "
                          "prompt per blank-line-separated paragraph; tokenized by the target's tokenizer, through "
                          "its chat template where \"chat\" is true. "
                          "Every method decodes every prompt (fresh: the first pass, methods in an order rotated "
                          "from prompt to prompt; warm: replayed), so the fresh regime's rule below does not hold")
    run.add_argument("--max-prompts", type=int, default=None, metavar="N", help="use the first N prompts of --prompts-file")
    run.add_argument("--prompt-lengths", type=_ints, default=None, metavar="L[,L...]",
                     help="base prompt lengths (default 128,512,1024). The fresh regime gives every method its own "
                          "length at or above each base, so that no method meets a key length another ran: a "
                          "method's prompt can be up to (methods x bases - 1) x (max-tokens + 2 x largest block + 9) "
                          "tokens longer than its base (the report's prompt_lengths.per_method lists them); the warm "
                          "regime replays the same lengths")
    run.add_argument("--max-tokens", type=int, default=256, help="new tokens per request (default 256)")
    run.add_argument("--padded-cache", default="auto", choices=["auto", "on", "off"],
                     help="shape-stable padded KV caches (auto: on for CUDA only)")
    run.add_argument("--bucket", type=int, default=256, help="padded key-length bucket (default 256)")
    run.add_argument("--kernel", default="auto", choices=["auto", "on", "off"],
                     help="the short-query attention kernel for 2-32-query forwards of this project's host "
                          "(plugin/cuda/attention.py; auto: on where MLX runs on CUDA; on elsewhere is an error). "
                          "The JSON's attention section and rows record which path each call took; "
                          "kernel_costs then also time the bare forwards with MLX's attention")
    run.add_argument("--projection-kernel", default="auto", choices=["auto", "on", "off"],
                     help="the verify-width matmul kernel for this project's host's 2-32-row projections "
                          "(plugin/cuda/projections.py; auto: on where MLX runs on CUDA; on elsewhere is an error); "
                          "kernel_costs' *_kernel_off figures then use MLX's matmuls too")
    run.add_argument("--compiled-forward", default="auto", choices=["auto", "on", "off"],
                     help="compiled verify forwards (plugin/cuda/compiled.py: the target's own forward through mx.compile, "
                          "padded caches; auto: on where MLX runs on CUDA); kernel_costs' *_kernel_off figures are plain")
    run.add_argument("--compiled-widths", type=_ints, default=[2, 4, 8, 16, 32], metavar="W[,W...]",
                     help="the input widths the compiled forwards take (default: the verify widths 2,4,8,16,32; "
                          "add 1 for the host's one-token plain steps too)")
    run.add_argument("--draft-ahead", default="on", metavar="MODE[,MODE...]",
                     help="what rounds queue before the host reads their outcome, where the drafter can (plugin/round.py; "
                          "DFlash over compiled calls): on (the next block), verify (the block and the verify over it), "
                          "off; several joined by commas: each fixed-tau speculative method also runs as a twin per "
                          "further mode in the same process ('draft-ahead', 'verify-ahead', 'no-ahead'); both: on,off")
    run.add_argument("--cost-keys", default=None, metavar="L[,L...]|none",
                     help="also time the bare forwards (kernel_costs in the JSON) at these key lengths, besides each "
                          "prompt's key length at mid-decode (prompt + max-tokens/2, rounded up to 256), e.g. 8192,16384 (default: 8192,16384 on CUDA, none elsewhere; "
                          "'none': none)")
    src.add_argument("--quantize-target", type=int, default=None, choices=[4, 8], metavar="BITS",
                     help="quantize the target's weights after loading (4 or 8 bits, group size 64)")
    run.add_argument("--paired", nargs="?", type=int, const=1, default=0, metavar="N",
                     help="a third regime, paired: every method on the same prompt (the base length), after the "
                          "fresh and warm ones, the order rotating from prompt to prompt: ratios between methods "
                          "compare like with like. N > 1: the paired regime N times, its order rotated once more each "
                          "time, and 'paired median': each method's middle run per prompt (an odd N)")
    run.add_argument("--no-mlx-lm-spec", action="store_true", help="skip mlx-lm's speculative_generate_step")
    run.add_argument("--cpu", action="store_true", help="run on the CPU")
    run.add_argument("--seed", type=int, default=0)
    dist = p.add_argument_group("a target sharded over several ranks (under mlx.launch; docs/distributed.md)")
    dist.add_argument("--distributed", metavar="BACKEND", help="shard the target over the ranks mlx.launch started "
                      "(ring, mpi, nccl, jaccl, any), as mlx-spec generate does; every rank runs the bench in "
                      "lockstep and rank 0 alone prints and writes the report")
    dist.add_argument("--distributed-drafter", metavar="WHERE", help="replicated (default: every rank drafts) or "
                      "rank0 (rank 0 drafts and broadcasts its proposals)")
    dist.add_argument("--compare-unsharded", metavar="JSON", help="the JSON of the same bench run without mlx.launch "
                      "and --distributed: the report gains the ratios sharded / unsharded and whether the outputs match")
    out = p.add_argument_group("output")
    out.add_argument("--json", metavar="PATH", help="write the full report as JSON")
    out.add_argument("--plot", metavar="PATH", help="write a PNG (speed-up vs block size and vs tau; needs matplotlib)")
    p.set_defaults(func=cmd_bench)


def cmd_bench(args: argparse.Namespace) -> int:
    from ..plugin.cuda.compiled import check_widths
    from ..plugin.draft import ahead_modes
    from .core import BenchSettings, run_bench
    from .report import format_table, plot, write_json

    if args.prompts_file and args.prompt_lengths is not None:
        raise ValueError("--prompt-lengths: not used with --prompts-file (the prompts' own token lengths are)")
    if args.max_prompts is not None and args.max_prompts < 1:
        raise ValueError(f"--max-prompts: got {args.max_prompts}; expected at least 1")
    if args.prompt_lengths is None:
        args.prompt_lengths = [] if args.prompts_file else [128, 512, 1024]
    if args.block_sizes is None:
        args.block_sizes = [] if args.drafter else [16]
    if args.max_tokens < 2:
        raise ValueError(f"--max-tokens: got {args.max_tokens}; expected at least 2")
    extra_keys = _cost_keys(args.cost_keys)
    ahead_modes(args.draft_ahead)
    check_widths(args.compiled_widths, "--compiled-widths")
    if args.paired < 0:
        raise ValueError(f"--paired: got {args.paired}; expected the number of paired regimes (0: none)")
    for b in args.block_sizes:
        if not 2 <= b <= 128:
            raise ValueError(f"--block-sizes: got {b}; allowed: 2 to 128")
    if not args.block_sizes and not args.drafter:
        raise ValueError("--block-sizes: got none; allowed: integers from 2 to 128 separated by commas")
    if not args.prompts_file and (not args.prompt_lengths or min(args.prompt_lengths) < 1):
        raise ValueError(f"--prompt-lengths: got {args.prompt_lengths}; allowed: integers >= 1 separated by commas")
    # Checked before anything loads: every TAU runs with every block size (alpha_for_tau's range).
    from .real import check, parse_drafter

    fixed = [b for b in [parse_drafter(d).block for d in args.drafter] + args.block_sizes if b]
    for flag, values, cap in (("--oracle-acceptance", args.oracle_acceptance or [], min(fixed, default=128)),
                              ("--adaptive-at", args.adaptive_at, max(fixed, default=128))):
        for tau in values:
            if tau is not None and not 1.0 <= tau <= cap:
                given = [f"--block-sizes {','.join(map(str, args.block_sizes))}"] if args.block_sizes else []
                given += [f"--drafter {d}" for d in args.drafter if parse_drafter(d).block]
                raise ValueError(f"{flag}: got tau {tau:g}; allowed: 1 to the block size ({cap}; {', '.join(given)})")
    taus = args.oracle_acceptance if args.oracle_acceptance is not None else [None]
    if args.plot:  # fail before the run, not after
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise ValueError("--plot needs matplotlib: pip install 'mlx-speculative[bench]'") from None
    settings = BenchSettings(
        synthetic_target=args.synthetic_target, model=args.model, draft_model=args.draft_model, kind=args.kind,
        block_sizes=args.block_sizes, taus=taus, adaptive_taus=[t for t in args.adaptive_at if t is not None],
        prompt_lengths=args.prompt_lengths, max_tokens=args.max_tokens, padded=args.padded_cache, bucket=args.bucket,
        kernel=args.kernel, projection_kernel=args.projection_kernel, compiled_forward=args.compiled_forward,
        compiled_widths=tuple(args.compiled_widths),
        quantize_bits=args.quantize_target,
        mlx_lm_spec=not args.no_mlx_lm_spec, draft_layers=args.draft_layers, dflash_layers=args.dflash_layers,
        seed=args.seed, cpu=args.cpu, drafters=args.drafter, prompts_file=args.prompts_file,
        max_prompts=args.max_prompts, cost_keys=extra_keys, paired=args.paired, draft_ahead=args.draft_ahead,
    )
    check(settings)  # refused combinations, before anything loads
    from ..hooks.api import distributed

    if args.compare_unsharded and not args.distributed:
        raise ValueError("--compare-unsharded: given without --distributed; expected it on the sharded run "
                         "(mlx.launch ... mlx-spec bench --distributed ring ... --compare-unsharded whole.json)")
    cluster = distributed.start(args, None)
    try:
        if args.compare_unsharded and cluster.primary and not Path(args.compare_unsharded).is_file():
            raise ValueError(f"--compare-unsharded: no file {args.compare_unsharded!r}; expected the JSON of the "
                             "same bench run without --distributed")
        report = run_bench(settings, cluster=cluster)
        if cluster is not None and cluster.primary and args.compare_unsharded:
            from .sharded import compare

            report["distributed"]["compared"] = compare(report, args.compare_unsharded)
    except Exception as e:  # noqa: BLE001 - on several ranks: one clear line, and every rank ends
        if cluster is None:
            raise
        distributed.failed(cluster, e)
    if cluster is not None and not cluster.primary:
        return 0
    launched = f"mlx.launch (backend {cluster.config.backend}, {cluster.size} ranks) -- " if cluster is not None else ""
    report["command"] = launched + shlex.join(["mlx-spec", *sys.argv[1:]])
    print(report["target"])
    for kind, desc in report["drafters"].items():
        print(f"drafter {kind}: {desc}")
    if "prompts" in report:
        print(f"prompts: {report['prompts']['count']} from {report['prompts']['file']} "
              f"(token lengths {report['prompts']['token_lengths']})")
        for regime, text in report["regimes"].items():
            print(f"{regime}: {text}")
    print(format_table(report))
    if "distributed" in report:
        from .sharded import summary

        print(summary(report["distributed"]))
    if args.json:
        write_json(report, args.json)
        print(f"[bench] wrote {args.json}", file=sys.stderr)
    if args.plot:
        plot(report, args.plot)
        print(f"[bench] wrote {args.plot}", file=sys.stderr)
    return 0
