"""One rank of tests/test_distributed.py: runs every case of a JSON file over a target sharded with mx.distributed
and writes what it generated (and the unsharded target's greedy tokens, computed here too) to <out>.rank<N>.json.

python tests/distributed_worker.py cases.json out   (MLX_RANK and MLX_HOSTFILE set, as mlx.launch sets them)
"""

from __future__ import annotations

import json
import random
import sys
import traceback
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Dict, Iterator, List

import mlx.core as mx

mx.set_default_device(mx.cpu)

from mlx_speculative.drafters.base import Proposal  # noqa: E402
from mlx_speculative.drafters.dflash import DFlashBatch  # noqa: E402
from mlx_speculative.hooks import distributed, taps  # noqa: E402
from mlx_speculative.hooks.batch import forward  # noqa: E402
from mlx_speculative.hooks.host import GenerationParams, Host  # noqa: E402
from mlx_speculative.hooks.manager import make_plugin_manager  # noqa: E402
from mlx_speculative.hooks.state import HostConfig, SamplingParams  # noqa: E402


@contextmanager
def oracle(ref: List[int], prompt_len: int, seed: int) -> Iterator[None]:
    """DFlash proposals replaced by the target's greedy continuation, corrupted at a random position in some rounds
    (zero / partial / full acceptance), as tests/test_dflash_greedy.py forces them. With ``drafter: rank0`` only rank
    0 calls it: the other ranks verify what it broadcast."""
    rng, original = random.Random(seed), DFlashBatch.propose

    def propose(batch: DFlashBatch, rows: List[Any], max_drafts: List[int]) -> List[Proposal]:
        out = []
        for state, proposal, m in zip(rows, original(batch, rows, max_drafts), max_drafts):
            g = len(state.tokens) - prompt_len
            drafts = list(ref[g : g + m])
            own = proposal.tokens.tolist() if isinstance(proposal.tokens, mx.array) else list(proposal.tokens)
            drafts += own[len(drafts) :]
            case = rng.choice(["zero", "partial", "full", "full"])
            if case != "full" and drafts:
                j = 0 if case == "zero" else rng.randrange(len(drafts))
                drafts[j] = (drafts[j] + 1) % 384
            out.append(Proposal(drafts, proposal.logprobs))
        return out

    DFlashBatch.propose = propose  # this test process's own drafter class, restored below
    try:
        yield
    finally:
        DFlashBatch.propose = original


@contextmanager
def failing(after: int) -> Iterator[None]:
    """DFlash's propose raises from its ``after``-th call on: rank 0's failure with ``drafter: rank0``."""
    original, calls = DFlashBatch.propose, [0]

    def propose(batch: DFlashBatch, rows: List[Any], max_drafts: List[int]) -> List[Proposal]:
        calls[0] += 1
        if calls[0] > after:
            raise RuntimeError("drafter broke on purpose")
        return original(batch, rows, max_drafts)

    DFlashBatch.propose = propose
    try:
        yield
    finally:
        DFlashBatch.propose = original


def reference(target_dir: str, prompt: List[int], n: int) -> List[int]:
    """mlx-lm's own generate_step on the whole (unsharded) target, greedy."""
    from mlx_lm import load
    from mlx_lm.generate import generate_step

    model, _ = load(target_dir)
    return [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=n)]


def taps_match(cluster: distributed.Cluster, target_dir: str, text: str, layers: List[int]) -> float:
    """The largest difference between the sharded target's hidden-state taps and the whole target's."""
    from mlx_lm.models.cache import make_prompt_cache

    whole = Host(HostConfig(), pm=make_plugin_manager(load_entry_points=False)).load(target_dir)
    part = Host(HostConfig(), pm=make_plugin_manager(load_entry_points=False), cluster=cluster).load(target_dir)
    prompt = list(whole.tokenizer.encode(text, add_special_tokens=False))
    taps.install_taps(whole.model, layers)
    taps.install_taps(part.model, layers)
    _, a = forward(whole.model, [prompt], make_prompt_cache(whole.model), layers)
    _, b = forward(part.model, [prompt], make_prompt_cache(part.model), layers)
    return max(float(mx.abs(a[i] - b[i]).max()) for i in layers)


def run_case(group: Any, case: Dict[str, Any]) -> Dict[str, Any]:
    cluster = distributed.Cluster(group, distributed.DistributedSettings(drafter=case.get("drafter", "replicated")))
    if case.get("taps"):
        return {"name": case["name"], "taps_max_diff": taps_match(cluster, case["target"], case["prompts"][0], case["taps"])}
    host = Host(HostConfig(sections={"speculative": case["speculative"]} if case.get("speculative") else {}),
                pm=make_plugin_manager(load_entry_points=bool(case.get("speculative"))), cluster=cluster)
    target = host.load(case["target"])
    out: Dict[str, Any] = {"name": case["name"], "runs": []}
    for i, text in enumerate(case["prompts"]):
        prompt = cluster.broadcast_tokens(list(target.tokenizer.encode(text, add_special_tokens=False)))
        n = case["max_tokens"]
        sampling = SamplingParams(**case.get("sampling", {}))
        params = GenerationParams(max_tokens=n, stop_token_ids=[], sampling=sampling)
        greedy = sampling.temperature == 0
        ref = reference(case["target"], prompt, n) if greedy else None
        if case.get("oracle"):
            with oracle(ref or [], len(prompt), seed=i):
                result = host.generate(target, prompt, params)
        elif case.get("fail_after") is not None:
            with failing(case["fail_after"]):
                result = host.generate(target, prompt, params)
        else:
            result = host.generate(target, prompt, params)
        cluster.check_same(result.tokens)
        stats = result.report.get("speculative")
        out["runs"].append({"tokens": result.tokens, "reference": ref,
                            "acceptance": stats.rounds_by_acceptance if stats else None,
                            "fallback": stats.fallback if stats else None, "rounds": stats.rounds if stats else 0})
    return out


def main(cases_file: str, out: str) -> int:
    group = distributed.init(distributed.DistributedSettings()).group
    cases = json.loads(Path(cases_file).read_text())
    results = []
    cluster = distributed.Cluster(group, distributed.DistributedSettings())
    try:
        for case in cases:
            results.append(run_case(group, case))
    except Exception as e:  # noqa: BLE001 - as the CLI: one line, and every rank ends
        traceback.print_exc()
        distributed.failed(cluster, e)
    Path(f"{out}.rank{group.rank()}.json").write_text(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
