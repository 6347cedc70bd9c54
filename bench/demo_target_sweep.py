"""Which demo target to build (issue 15): bits per byte of target variants on text none of them trained on.

    python bench/demo_target_sweep.py --pin demo/manifest.json --json out.json \
        --variant steps=1000 --variant steps=2000 --variant steps=4000

The demo's target (demo/pretrain.py) memorised its 2.6M training tokens at 4,000 steps (26 epochs; the
build before 2026-12-01); this sweep chose the 1,400 steps the build now takes
(bench/results/demo/h200-demo-target-sweep{,-2}.json). Each
``--variant`` (TargetOptions fields, e.g. ``steps=1500,hidden_size=320``) trains from scratch on the
demo's training files less a validation split (every ``--validation-every``-th training file, by the
manifest's order), with the shipped tokenizer, and reports bits per byte on the validation split (the
figure to choose by) and on the held-out files (the prompts' files: reported, not chosen by), with its
seconds. Variants run one after another in one process; ``--max-time`` stops between variants.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, fields, replace
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mlx_speculative import demo  # noqa: E402
from mlx_speculative.demo import build, corpus, pretrain  # noqa: E402


def variant(text: str, base: pretrain.TargetOptions) -> pretrain.TargetOptions:
    """``key=value,...`` over ``base``; the fields and their types are TargetOptions'."""
    types = {f.name: type(getattr(base, f.name)) for f in fields(base)}
    over: Dict[str, Any] = {}
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        if key not in types or not value:
            raise SystemExit(f"--variant: got {item!r}; expected key=value with a key among {', '.join(types)}")
        try:
            over[key] = types[key](value)
        except ValueError:
            raise SystemExit(f"--variant: {key} got {value!r}; expected a {types[key].__name__}") from None
    return replace(base, **over)


def split(found: Dict[str, Any], every: int) -> Tuple[List[List[str]], List[List[str]]]:
    """(training files less the validation split, the validation split): every ``every``-th training file."""
    train = found["train"]
    return ([f for i, f in enumerate(train) if i % every != every - 1],
            [f for i, f in enumerate(train) if i % every == every - 1])


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variant", action="append", default=[], help="TargetOptions overrides, key=value,... (repeatable)")
    p.add_argument("--validation-every", type=int, default=16, help="every N-th training file validates (default 16)")
    p.add_argument("--tokenizer", default=str(demo.HERE / "target"), help="tokenizer folder (default: the shipped one)")
    p.add_argument("--pin", help="a manifest.json whose corpus must match (demo/manifest.json)")
    p.add_argument("--stdlib", help="the standard library to read (default: this Python's)")
    p.add_argument("--work", default="/tmp/demo-sweep", help="training state of each variant")
    p.add_argument("--tiny", action="store_true", help="tiny sizes and few files (tests)")
    p.add_argument("--max-time", type=float, help="start no variant after this many seconds")
    p.add_argument("--cpu", action="store_true")
    p.add_argument("--json", help="write the results here")
    a = p.parse_args(argv)
    if a.validation_every < 2:
        raise SystemExit(f"--validation-every: got {a.validation_every}; allowed: 2 or more")
    if a.cpu:
        mx.set_default_device(mx.cpu)
    from tokenizers import Tokenizer

    tok = Path(a.tokenizer)
    vocab = Tokenizer.from_file(str(tok / "tokenizer.json")).get_vocab_size()  # the target's vocabulary is the tokenizer's
    base = replace(build.TINY_TARGET if a.tiny else pretrain.TargetOptions(), vocab_size=vocab)
    variants = [variant(v, base) for v in a.variant] or [base]
    root = Path(a.stdlib) if a.stdlib else corpus.stdlib_dir()
    found = corpus.collect(root, max_files=24 if a.tiny else 0)
    if a.pin:
        corpus.check_pin(found, json.loads(Path(a.pin).read_text())["corpus"])
    train_files, valid_files = split(found, a.validation_every)
    texts = {name: corpus.read(root, files) for name, files in
             (("train", train_files), ("validation", valid_files), ("heldout", found["heldout"]))}
    streams = {name: pretrain.encode(tok, t) for name, t in texts.items()}
    n_bytes = {name: len("\n".join(t).encode()) for name, t in texts.items()}
    began, results = time.perf_counter(), []
    for i, o in enumerate(variants):
        if a.max_time is not None and time.perf_counter() - began > a.max_time:
            print(f"[sweep] --max-time: variants {i + 1}.. not run", flush=True)
            break
        t = time.perf_counter()
        model = pretrain.train(o, streams["train"], Path(a.work) / f"variant-{i}", log=lambda s: print(s, flush=True))
        assert model is not None  # no deadline: every step runs
        row = {"options": asdict(o), "seconds": round(time.perf_counter() - t, 1),
               "epochs": round(o.steps * o.batch_size * o.seq_len / len(streams["train"]), 2),
               **{f"{name}_bits_per_byte": round(pretrain.bits_per_byte(model, streams[name], n_bytes[name], o.seq_len), 4)
                  for name in ("validation", "heldout")}}
        results.append(row)
        print(json.dumps(row), flush=True)
    report = {"command": "python bench/demo_target_sweep.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "device": str(mx.default_device()), "mlx": mx.__version__, "python": found["python"],
              "files": {"train": len(train_files), "validation": len(valid_files), "heldout": len(found["heldout"])},
              "tokens": {name: int(len(s)) for name, s in streams.items()}, "results": results}
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
