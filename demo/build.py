"""Makes the embedded demo from scratch: a small llama trained on the Python standard library's source
(its own BPE tokenizer), then its DFlash, EAGLE-3, MTP and draft-LM drafters, each made with
``mlx-spec train-drafter``. Resumable: every stage keeps its state under --work, so running the same
command again after an interruption (or --max-time) continues where it stopped, with the same result.

    python -m mlx_speculative.demo.build --work /tmp/demo-work --out demo --pin demo/manifest.json
    python -m mlx_speculative.demo.build --work /tmp/w --out /tmp/o --tiny --cpu      # a CPU smoke run

On the GPU machine the whole set takes about 13 minutes (bench/h200_demo.sh; manifest.json records
each stage's seconds). Stages: corpus -> tokenizer -> target -> one drafter per kind -> install (--out:
the checkpoints without their training state, manifest.json, prompts.json; at most 16 MB).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Dict, List, Optional

import mlx.core as mx
import numpy as np

from . import corpus, pretrain

KINDS = ("dflash", "eagle3", "draft_model", "mtp")
MAX_BYTES = 16 * 2**20
PROMPTS = 32
# Per kind: train-drafter options beyond the shared ones (below). Blocks: DFlash 16, the EAGLE-3 chain 7
# deep, the MTP head 3 deep, the draft LM's tau estimate at 4 (as the demo decodes them).
DRAFTER_ARGS: Dict[str, List[str]] = {
    "dflash": ["--block-size", "16", "--num-layers", "3", "--target-layers", "0,1,2,3", "--loss-decay-gamma", "7",
               "--steps", "10000", "--batch-size", "32", "--lr", "1.5e-3", "--sequences", "32768",
               "--eval-every", "2500"],
    "eagle3": ["--block-size", "8", "--draft-vocab-size", "1024", "--steps", "3000", "--batch-size", "32",
               "--lr", "1e-3"],
    "mtp": ["--block-size", "4", "--steps", "3000", "--batch-size", "32", "--lr", "1e-3"],
    "draft_model": ["--block-size", "4", "--num-layers", "2", "--hidden-size", "128", "--steps", "3000",
                    "--batch-size", "32", "--lr", "2e-3"],
}
SHARED_ARGS = ["--seq-len", "256", "--prompt-tokens", "64", "--sequences", "16384", "--heldout-sequences", "32",
               "--gen-batch", "2048", "--eval-every", "0", "--checkpoint-every", "250", "--log-every", "100",
               "--dtype", "bfloat16", "--seed", "0"]
TINY_TARGET = pretrain.TargetOptions(vocab_size=384, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, intermediate_size=128, seq_len=64, batch_size=8,
                                     steps=30, warmup=5, checkpoint_every=10)
TINY_DRAFTER = ["--steps", "6", "--batch-size", "4", "--sequences", "16", "--heldout-sequences", "2",
                "--seq-len", "48", "--prompt-tokens", "16", "--gen-batch", "16", "--checkpoint-every", "3",
                "--log-every", "3"]


def log(msg: str) -> None:
    print(f"[demo] {msg}", flush=True)


def _times(work: Path) -> Dict[str, float]:
    f = work / "times.json"
    return json.loads(f.read_text()) if f.exists() else {}


def _add_time(work: Path, stage: str, seconds: float) -> None:
    times = _times(work)
    times[stage] = round(times.get(stage, 0.0) + seconds, 1)
    (work / "times.json").write_text(json.dumps(times, indent=1))


def stage_corpus(args: argparse.Namespace, work: Path) -> Dict[str, Any]:
    manifest_file = work / "corpus" / "manifest.json"
    texts = [work / "corpus" / name for name in ("train.txt", "heldout.txt", "prompts.json")]
    made = json.loads(manifest_file.read_text()) if manifest_file.exists() else None
    if made is not None and all(f.exists() for f in texts):
        return made
    root = Path(args.stdlib) if args.stdlib else corpus.stdlib_dir()
    found = corpus.collect(root, max_files=24 if args.tiny else 0)
    if args.pin or made is not None:  # a work folder moved to another machine reads the same text again
        corpus.check_pin(found, made if made is not None else json.loads(Path(args.pin).read_text())["corpus"])
    elif found["python"].rsplit(".", 1)[0] != corpus.PYTHON and not args.tiny:
        log(f"warning: Python {found['python']}'s stdlib; the demo pins {corpus.PYTHON} (a new manifest is made)")
    out = work / "corpus"
    out.mkdir(parents=True, exist_ok=True)
    (out / "train.txt").write_text("\n".join(corpus.read(root, found["train"])))
    (out / "heldout.txt").write_text("\n".join(corpus.read(root, found["heldout"])))
    (out / "prompts.json").write_text(json.dumps(prompts_json(root, found), indent=1))
    manifest_file.write_text(json.dumps(found, indent=1))
    log(f"corpus: {len(found['train'])} training files, {len(found['heldout'])} held out, Python {found['python']}, "
        f"hash {found['hash'][:16]}")
    return found


def prompts_json(root: Path, found: Dict[str, Any]) -> Dict[str, Any]:
    return {"python": found["python"], "rule": f"{PROMPTS} prompts from the held-out files: whole lines up to a line "
            f"boundary (about {corpus.PROMPT_CHARS} characters), the file's next {corpus.REFERENCE_CHARS} characters as "
            "the reference, the preamble that puts tokenize in the file's state at the prompt's first line",
            "prompts": corpus.prompts(root, found["heldout"], PROMPTS)}


def write_prompts(args: argparse.Namespace) -> None:
    """--prompts FILE: the pinned corpus's prompts alone, made again by the same rule and seed."""
    if not args.pin:
        raise SystemExit("--prompts: give --pin MANIFEST too (the prompts come from its corpus)")
    root = Path(args.stdlib) if args.stdlib else corpus.stdlib_dir()
    found = corpus.collect(root)
    corpus.check_pin(found, json.loads(Path(args.pin).read_text())["corpus"])
    Path(args.prompts).write_text(json.dumps(prompts_json(root, found), indent=1))
    log(f"prompts: {args.prompts}")


def stage_target(args: argparse.Namespace, work: Path, found: Dict[str, Any], deadline: float) -> Optional[Dict[str, Any]]:
    o = TINY_TARGET if args.tiny else pretrain.TargetOptions()
    ckpt = work / "target"
    info_file = work / "target-info.json"
    if info_file.exists():
        return json.loads(info_file.read_text())
    root = Path(found["stdlib"])
    tok_dir = work / "tokenizer"
    if not (tok_dir / "tokenizer.json").exists():
        pretrain.train_tokenizer(corpus.read(root, found["train"]), o.vocab_size, tok_dir)
    streams = work / "tokens.npz"
    if not streams.exists():
        train = pretrain.encode(tok_dir, corpus.read(root, found["train"]))
        held = pretrain.encode(tok_dir, corpus.read(root, found["heldout"]))
        np.savez(streams, train=train, heldout=held)
    data = np.load(streams)
    model = pretrain.train(o, data["train"], work / "target-training", deadline=deadline, log=log)
    if model is None:
        return None
    held_bytes = len("\n".join(corpus.read(root, found["heldout"])).encode())
    bpb = pretrain.bits_per_byte(model, data["heldout"], held_bytes, o.seq_len)
    pretrain.save_checkpoint(model, o, tok_dir, ckpt)
    info = {"options": asdict(o), "heldout_bits_per_byte": round(bpb, 4), "train_tokens": int(len(data["train"])),
            "heldout_tokens": int(len(data["heldout"]))}
    info_file.write_text(json.dumps(info, indent=1))
    log(f"target: held-out bits per byte {bpb:.3f}")
    return info


def stage_drafter(args: argparse.Namespace, work: Path, kind: str, deadline: float) -> Optional[Dict[str, Any]]:
    out = work / kind
    state = out / "training" / "state.json"
    if state.exists() and json.loads(state.read_text()).get("complete"):
        return _drafter_info(out)
    left = deadline - time.perf_counter()
    if left < 20:
        return None
    extra = list(DRAFTER_ARGS[kind])
    if args.tiny and "--target-layers" in extra:  # the tiny target has 2 layers: the family's default spread
        i = extra.index("--target-layers")
        del extra[i:i + 2]
    cmd = [sys.executable, "-m", "mlx_speculative.hooks.cli", "train-drafter", "--target", str(work / "target"),
           "--kind", kind, "--data", str(work / "corpus" / "train.txt"), "--heldout",
           str(work / "corpus" / "heldout.txt"), "--out", str(out), *SHARED_ARGS, *extra,
           *(TINY_DRAFTER + (["--draft-vocab-size", "256"] if kind == "eagle3" else []) if args.tiny else []),
           "--max-time", f"{left:.0f}"]
    if state.exists():
        cmd.append("--resume")
    if args.cpu:
        cmd.append("--cpu")
    log(" ".join(cmd[1:]))
    proc = subprocess.run(cmd)
    if proc.returncode != 0:
        raise SystemExit(f"train-drafter --kind {kind} failed (exit {proc.returncode}); run the build again to resume")
    if not (state.exists() and json.loads(state.read_text()).get("complete")):
        return None
    return _drafter_info(out)


def _drafter_info(out: Path) -> Dict[str, Any]:
    evals = [json.loads(line) for line in (out / "training" / "log.jsonl").read_text().splitlines() if '"eval"' in line]
    return {"offline_tau": evals[-1] if evals else None}


def install(args: argparse.Namespace, work: Path, found: Dict[str, Any], target: Dict[str, Any],
            drafters: Dict[str, Any]) -> None:
    dest = Path(args.out)
    dest.mkdir(parents=True, exist_ok=True)
    for name in ("target", *KINDS):
        shutil.rmtree(dest / name, ignore_errors=True)
        shutil.copytree(work / name, dest / name, ignore=shutil.ignore_patterns("training", ".checkpoint.tmp"))
    shutil.copy(work / "corpus" / "prompts.json", dest / "prompts.json")
    size = sum(f.stat().st_size for name in ("target", *KINDS) for f in (dest / name).rglob("*.safetensors"))
    manifest = {"corpus": found, "target": target, "drafters": drafters, "weights_bytes": size,
                "seconds": _times(work), "command": "python -m mlx_speculative.demo.build " + " ".join(sys.argv[1:]),
                "device": str(mx.default_device()), "mlx": mx.__version__,
                "drafter_args": {k: SHARED_ARGS + DRAFTER_ARGS[k] for k in KINDS}}
    (dest / "manifest.json").write_text(json.dumps(manifest, indent=1))
    log(f"installed in {dest}: weights {size / 2**20:.2f} MB, {sum(manifest['seconds'].values()):.0f} s in all")
    if size > MAX_BYTES:
        raise SystemExit(f"the demo's weights take {size / 2**20:.2f} MB; allowed: at most {MAX_BYTES / 2**20:.0f} MB")


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mlx_speculative.demo.build", description=__doc__.split("\n\n")[0])
    p.add_argument("--work", help="state of every stage (resumable; required unless --prompts)")
    p.add_argument("--out", help="where the finished demo goes (e.g. the repo's demo/; required unless --prompts)")
    p.add_argument("--pin", help="a manifest.json whose corpus (Python version, files, hashes) must match")
    p.add_argument("--stdlib", help="the standard library to read (default: this Python's)")
    p.add_argument("--max-time", type=float, default=None, help="stop after this many seconds (run again to resume)")
    p.add_argument("--tiny", action="store_true", help="tiny sizes and steps (tests)")
    p.add_argument("--cpu", action="store_true", help="run on the CPU")
    p.add_argument("--prompts", metavar="FILE", help="only write the pinned corpus's prompts.json to FILE")
    args = p.parse_args(argv)
    if args.prompts:
        write_prompts(args)
        return 0
    if not (args.work and args.out):
        raise SystemExit("--work and --out are required (or --prompts FILE with --pin)")
    if args.cpu:
        mx.set_default_device(mx.cpu)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    deadline = began + (args.max_time if args.max_time is not None else 1e9)

    def timed(stage: str, fn: Any, *a: Any) -> Any:
        t = time.perf_counter()
        try:
            return fn(*a)
        finally:
            _add_time(work, stage, time.perf_counter() - t)

    found = timed("corpus", stage_corpus, args, work)
    target = timed("target", stage_target, args, work, found, deadline)
    if target is None:
        log("stopped during the target's training; run the same command again to resume")
        return 3
    drafters: Dict[str, Any] = {}
    for kind in KINDS:
        info = timed(kind, stage_drafter, args, work, kind, deadline)
        if info is None:
            log(f"stopped during the {kind} drafter; run the same command again to resume")
            return 3
        drafters[kind] = info
    timed("install", install, args, work, found, target, drafters)
    return 0


if __name__ == "__main__":
    sys.exit(main())
