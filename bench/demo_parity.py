"""The demo's drafters where they trained: the training core's offline tau against decoding's tau on the
same greedy sequences, next to the held-out prompts' figures (issue 15).

    python bench/demo_parity.py --demo-dir demo --prompts 16 --json bench/results/demo/cpu-parity.json

The sequences are made as train-drafter makes its held-out ones: a prompt of --prompt-tokens tokens
(here the first tokens of each held-out prompt with its reference) continued greedily by the target to
--seq-len tokens. For each kind, ``offline`` is drafters/training/loop.evaluate on them (the figure the
build's logs report), ``decoding`` is the host's round loop from the same prompts for the rest of the
sequence at the same fixed block (its tokens must be the sequence's: ``same``). tests/test_train_drafter.py
checks the two agree on tiny models; this shows it on the shipped demo, and how far its prompts
(prompts.json: whole lines, ~190 tokens) are from the 64-token prompts the drafters trained on. With
--heldout-tokens N the held-out prompts themselves are scored offline too (``heldout_offline``): whole
prompt as context, and the same continuation with the context cut to the last --prompt-tokens tokens
(does a longer context than the training prompts' cost acceptance?). CPU, float32.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
import demo_acceptance as da  # noqa: E402

from mlx_speculative.drafters.training import data as tdata  # noqa: E402
from mlx_speculative.drafters.training import loop  # noqa: E402
from mlx_speculative.drafters.training.spec import TrainOptions  # noqa: E402
from mlx_speculative.hooks import taps  # noqa: E402
from mlx_speculative.hooks.host import Host  # noqa: E402
from mlx_speculative.hooks.manager import make_plugin_manager  # noqa: E402
from mlx_speculative.hooks.state import HostConfig  # noqa: E402
from mlx_speculative.plugin import hookimpls  # noqa: E402

KINDS = tuple(k for k in da.KINDS if k != "ngram")  # the families train-drafter trains


def block_of(demo: Path, kind: str) -> int:
    """The acceptance script's block for ``kind`` (the MTP head: its checkpoint's)."""
    return da.DEFAULT_BLOCKS[kind] or int(json.loads((demo / kind / "config.json").read_text())["block_size"])


def trained(kind: str, demo: Path, block: int, seq_len: int, prompt_tokens: int, rows: int, work: Path) -> Tuple[Any, ...]:
    """(options, the family's trainer, the fp32 target with the family's layers tapped, the demo's drafter)
    as train-drafter sets them up for an evaluation of ``rows`` sequences of ``seq_len`` tokens."""
    o = TrainOptions(target=str(demo / "target"), kind=kind, out=str(work / kind), init=str(demo / kind), steps=1,
                     batch_size=8, seq_len=seq_len, prompt_tokens=prompt_tokens, heldout_sequences=rows,
                     dtype="float32", block_size=block)
    trainer = loop.check_options(o, True)(o)
    target = loop.load_target(o.target)
    target.model.set_dtype(mx.float32)
    model = trainer.build(target)
    taps.install_taps(target.model, trainer.capture_layers())
    return o, trainer, target, model


def offline(kind: str, demo: Path, block: int, sequences: np.ndarray, prompt_tokens: int, work: Path) -> Dict[str, Any]:
    o, trainer, target, model = trained(kind, demo, block, sequences.shape[1], prompt_tokens, len(sequences), work)
    data = tdata.Data(sequences[:1], sequences, prompt_tokens - 1, {"prompt_tokens": prompt_tokens})
    trainer.data_ready(data.train, data.first)
    ev = loop.evaluate(trainer, model, target, data, o)
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in ev.items()}


def heldout(kind: str, demo: Path, block: int, prompts: List[List[int]], max_tokens: int, cut: int,
            work: Path) -> Dict[str, Any]:
    """The held-out prompts themselves (each its own length, continued greedily by ``max_tokens``): the
    training core's per-anchor acceptance with the whole prompt as context and with the prompt cut to its
    last ``cut`` tokens (same continuation), and greedy decoding's rounds over the whole-context figures."""
    _, trainer, target, model = trained(kind, demo, block, cut + max_tokens, cut, 1, work)
    full: List[np.ndarray] = []
    cut_acc: List[np.ndarray] = []
    rounds = accepted = 0
    for ids in prompts:
        P = len(ids)
        seq = tdata.continue_prompts(target.model, np.array([ids], np.int32), P + max_tokens, 0.0, 0, 1, lambda s: None)
        for drop, out in ((0, full), (max(P - cut, 0), cut_acc)):  # a prompt of fewer tokens stays whole
            s = seq[:, drop:]
            first = P - drop - 1  # the prompt's last token: the first generated one is pending there
            trainer.data_ready(s, first)
            batch = loop.make_batch(trainer, target, s, first)
            out.append(loop.accepted_at(trainer, model, batch, s, np.arange(first, s.shape[1] - block + 1))[0])
        r, n = loop.greedy_rounds(full[-1], P - 1, P, P + max_tokens - block)
        rounds, accepted = rounds + r, accepted + n
    f, c = np.concatenate(full), np.concatenate(cut_acc)
    return {"prompts": len(prompts), "max_tokens": max_tokens, "tau": round(1 + accepted / max(rounds, 1), 4),
            "rounds": rounds, "tau_all_anchors": round(1 + float(f.mean()), 4),
            f"tau_all_anchors_context_cut_to_{cut}": round(1 + float(c.mean()), 4),
            "first_draft_token_accepted_all_anchors": round(float((f >= 1).mean()), 4)}


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--demo-dir", default="demo")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--prompt-tokens", type=int, default=64, help="as the build's train-drafter runs (64)")
    p.add_argument("--seq-len", type=int, default=256, help="as the build's train-drafter runs (256)")
    p.add_argument("--kinds", default=",".join(KINDS))
    p.add_argument("--heldout-tokens", type=int, default=0,
                   help="also the held-out prompts themselves continued by this many tokens (offline only; 0: not)")
    p.add_argument("--work", default="/tmp/demo-parity")
    p.add_argument("--json")
    a = p.parse_args(argv)
    if a.heldout_tokens < 0:
        p.error(f"--heldout-tokens: got {a.heldout_tokens}; allowed: 0 (off) or a positive number of tokens")
    mx.set_default_device(mx.cpu)
    t0 = time.perf_counter()
    demo = Path(a.demo_dir)
    every = json.loads((demo / "prompts.json").read_text())["prompts"]
    items = every[: a.prompts]
    target = da.load_target(demo, "float32")
    tok = target.tokenizer
    prompt_lens = [len(da.encode_prompt(tok, it["prompt"], chat=False)) for it in every]
    firsts = [tok.encode(it["prompt"] + it["reference"], add_special_tokens=False)[: a.prompt_tokens] for it in items]
    if any(len(f) < a.prompt_tokens for f in firsts):
        raise SystemExit(f"--prompt-tokens {a.prompt_tokens}: a prompt with its reference is shorter")
    sequences = tdata.continue_prompts(target.model, np.array(firsts, np.int32), a.seq_len, 0.0, 0, 64, lambda s: None)
    host = Host(HostConfig(), pm=make_plugin_manager(load_entry_points=False, plugins=[hookimpls]))
    kinds: Dict[str, Any] = {}
    for kind in [k for k in KINDS if k in a.kinds.split(",")]:
        if not (demo / kind / "config.json").exists():
            continue
        print(f"[parity] {kind}", file=sys.stderr)
        block = block_of(demo, kind)
        off = offline(kind, demo, block, sequences, a.prompt_tokens, Path(a.work))
        runs = da.decode(host, da.attach(target, kind, demo / kind, block), [list(map(int, f)) for f in firsts],
                         a.seq_len - a.prompt_tokens, len(firsts))
        same = sum(list(map(int, sequences[i, a.prompt_tokens:])) == tokens for i, (tokens, _) in enumerate(runs))
        kinds[kind] = {"block": block, "offline": off, "decoding": da.summarize(kind, runs), "same": same,
                       "of": len(runs)}
        if a.heldout_tokens:
            prompts = [da.encode_prompt(tok, it["prompt"], chat=False) for it in items]
            kinds[kind]["heldout_offline"] = heldout(kind, demo, block, prompts, a.heldout_tokens, a.prompt_tokens,
                                                     Path(a.work))
            print(f"{kind:<12} held-out prompts: {kinds[kind]['heldout_offline']}")
        print(f"{kind:<12} b{block:<3} offline tau {off['tau']:.2f}  decoding tau {kinds[kind]['decoding']['tau']:.2f}"
              f"  same {same}/{len(runs)}")
    report = {"command": "python bench/demo_parity.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "sequences": {"count": len(firsts), "prompt_tokens": a.prompt_tokens, "seq_len": a.seq_len,
                            "rule": "each held-out prompt's first --prompt-tokens tokens (prompt + reference), "
                                    "continued greedily by the target"},
              "heldout_prompt_tokens": {"prompts": len(every), "min": min(prompt_lens), "mean": round(float(np.mean(prompt_lens)), 1),
                                        "max": max(prompt_lens)},
              "kinds": kinds, "machine": da.machine(), "wall_seconds": round(time.perf_counter() - t0, 1)}
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
