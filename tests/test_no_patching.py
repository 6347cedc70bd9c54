"""No process-wide patching (issue 13): speculative rounds on a recurrent target leave mlx, mlx-lm and
every other module as they were, and other models in the process run mlx-lm's own code.

One process loads every drafter family (draft_model, ngram, dflash, eagle3) for a tiny qwen3_5 target and
runs rounds (alone and batched: partial commits of its GatedDeltaNet caches included). Before and
after, every module's globals are compared by identity, and so are the attributes of every class
defined in an ``mlx`` / ``mlx_lm`` module; ``mx.concatenate`` and every function defined in those
modules must be the originals. A second copy of the model, loaded with ``mlx_lm.load`` in the same
process, keeps mlx-lm's layer classes and decodes the same before and after. The scoped layers
(``hooks.recurrent.scope_model``) run mlx-lm's code when no transaction records them. The same holds
with the target's and drafters' attention routed through a policy's dispatcher (``hooks.attention``).
The source says the same: no file outside the tests (bench scripts included) assigns an attribute of a name it
imported.
"""

from __future__ import annotations

import ast
import importlib
import json
import sys
import sysconfig
import types
from pathlib import Path
from typing import Any, Dict, List, Tuple

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.models.cache import ArraysCache, make_prompt_cache

from conftest import greedy_reference, make_host, no_stop
from mlx_speculative.drafters import registry
from mlx_speculative.drafters.dflash import tiny
from mlx_speculative.drafters.eagle3 import tiny as eagle3_tiny
from mlx_speculative.hooks import recurrent
from mlx_speculative.testing import tiny_models as tm
from mlx_speculative.hooks.scheduler import Scheduler
from mlx_speculative.hooks.transaction import CacheTransaction

pytestmark = pytest.mark.integration

FIXTURES = Path(__file__).parent / "fixtures" / "dflash"
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [20, 21, 22, 20, 21, 22, 20, 21], [40, 41, 42, 43, 44]]
MAX_TOKENS = 20
# Imported before the "before" snapshot, so that their globals are compared too (the plugin comes
# in through its entry point; the drafter families and mlx-lm's model modules on first use).
MODULES = [
    "mlx_lm.generate", "mlx_lm.models.qwen3_5", "mlx_lm.models.qwen3_next", "mlx_lm.models.qwen3",
    "mlx_lm.models.gated_delta", "mlx_lm.models.ssm", "mlx_lm.models.mamba2", "mlx_lm.models.falcon_h1",
    "mlx_speculative.plugin.hookimpls", "mlx_speculative.drafters.draft_model", "mlx_speculative.drafters.ngram",
    "mlx_speculative.drafters.dflash", "mlx_speculative.drafters.eagle3",
]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Dict[str, Path]:
    root = tmp_path_factory.mktemp("no_patching")
    target = tm.make_checkpoint(root / "target", tm.qwen3_5_config(), seed=51, tokenizer_dir=tokenizer_dir,
                                logit_scale=3.0, quiet_layers_from=1)
    real = json.loads((FIXTURES / "z-lab__Qwen3.5-4B-DFlash.config.json").read_text())
    dflash = tiny.shrink_config(real, target_layer_ids=[0, 1], mask_token_id=383, num_target_layers=4)
    return {
        "target": target,
        "truncated": tm.make_truncated_drafter(target, root / "truncated", num_layers=2),
        "dflash": tiny.write_checkpoint(root / "dflash", dflash, seed=52),
        "eagle3": eagle3_tiny.write_checkpoint(root / "eagle3", eagle3_tiny.shrink_config(json.loads(
            (FIXTURES.parent / "eagle3" / "speculators-issue-1065__eagle3-qwen3moe.config.json").read_text()),
            layer_ids=[1, 2, 4]), seed=53),
    }


def _ours(name: str) -> bool:
    return name in ("mlx", "mlx_lm") or name.startswith(("mlx.", "mlx_lm."))


def snapshot() -> Tuple[Dict[str, Dict[str, Any]], Dict[str, Dict[str, Any]]]:
    """(module name -> its globals, class -> its attributes for classes defined in mlx / mlx-lm)."""
    modules: Dict[str, Dict[str, Any]] = {}
    for name, module in list(sys.modules.items()):
        if isinstance(module, types.ModuleType):
            try:
                modules[name] = dict(vars(module))
            except TypeError:
                continue
    classes: Dict[str, Dict[str, Any]] = {}
    for name, names in modules.items():
        if _ours(name):
            for value in names.values():
                if isinstance(value, type) and getattr(value, "__module__", None) == name:
                    classes[f"{name}.{value.__qualname__}"] = dict(vars(value))
    return modules, classes


# copyreg caches a class's slot names on the class the first time one of its objects is copied
# (mlx-lm's tokenizer wrapper copies a detokenizer per request).
BENIGN = {"__slotnames__"}
# The one global a load may rebind, in its own module: the runtime settings' snapshot (hooks/knobs.py installs
# the YAML's runtime: section at each load; no other module's names are touched).
OWN_STATE = {"mlx_speculative.hooks.knobs._loaded"}


def rewritten(before: Dict[str, Dict[str, Any]], after: Dict[str, Dict[str, Any]], classes: bool) -> List[str]:
    """Names bound to another object, removed, or (modules) added other than as a submodule."""
    out = []
    for owner, names in before.items():
        now = after.get(owner)
        if now is None:
            out.append(f"{owner}: gone")
            continue
        out += [f"{owner}.{k}" for k, v in names.items()
                if (k not in now or now[k] is not v) and f"{owner}.{k}" not in OWN_STATE]
        for k in set(now) - set(names):
            submodule = isinstance(now[k], types.ModuleType) and now[k].__name__ == f"{owner}.{k}"
            if not (submodule and not classes) and k not in BENIGN:
                out.append(f"{owner}.{k} (added)")
    return out


# Where decorators of installed libraries live (contextlib's, huggingface_hub's validators, ...).
INSTALLED = tuple({sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")})


def not_original(modules: Dict[str, Dict[str, Any]]) -> List[str]:
    """Functions in mlx / mlx-lm modules that are not the function their defining module holds under
    that name, or are not its own code: the code of the innermost function must be that module's
    file, and any wrapper around it (a decorator) must come from an installed library."""
    out = []
    for name, names in modules.items():
        if not _ours(name):
            continue
        for key, fn in names.items():
            if not isinstance(fn, types.FunctionType):
                continue
            home = sys.modules.get(fn.__module__)
            if home is None or not getattr(home, "__file__", None):
                continue
            if fn.__qualname__ == fn.__name__ and vars(home).get(fn.__name__, fn) is not fn:
                out.append(f"{name}.{key}: not {fn.__module__}.{fn.__name__}")
            chain, f = [fn], getattr(fn, "__wrapped__", None)
            while isinstance(f, types.FunctionType) and len(chain) < 8:
                chain.append(f)
                f = getattr(f, "__wrapped__", None)
            wrappers = [w.__code__.co_filename for w in chain[:-1]]
            if chain[-1].__code__.co_filename != home.__file__ or not all(w.startswith(INSTALLED) for w in wrappers):
                out.append(f"{name}.{key}: code from {[w.__code__.co_filename for w in chain]}")
    return out


def original_classes(model: Any) -> List[str]:
    """Modules of ``model`` whose class is not the class its mlx / mlx-lm module defines."""
    out = []
    for m in model.modules():
        cls = type(m)
        home = sys.modules.get(cls.__module__)
        if home is None or getattr(home, cls.__qualname__.split(".")[0], None) is not cls:
            out.append(f"{cls.__module__}.{cls.__qualname__}")
    return out


def rounds(host: Any, target: Any, refs: Dict[tuple, List[int]]) -> Dict[str, int]:
    """Each prompt alone, then all in one batch; greedy tokens equal generate_step's."""
    totals = {"rounds": 0, "partial_or_zero": 0}

    def count(stats: Any) -> None:
        assert stats.fallback is None, stats.fallback
        totals["rounds"] += stats.rounds
        totals["partial_or_zero"] += stats.rounds_by_acceptance["partial"] + stats.rounds_by_acceptance["zero"]

    for p in PROMPTS:
        result = host.generate(target, p, no_stop(MAX_TOKENS))
        assert result.tokens == refs[tuple(p)], p
        count(result.report["speculative"])
    scheduler = Scheduler(host, target)
    requests = [scheduler.submit(p, no_stop(MAX_TOKENS)) for p in PROMPTS]
    got: Dict[int, List[int]] = {r.id: [] for r in requests}
    while scheduler.busy:
        for request, event in scheduler.step():
            got[request.id].append(event.token)
    for r, p in zip(requests, PROMPTS):
        assert got[r.id] == refs[tuple(p)], ("batch", p)
        count(r.state.report["speculative"])
    return totals


def test_rounds_patch_nothing(checkpoints: Dict[str, Path]) -> None:
    import mlx_lm.models.gated_delta as gated_delta
    import mlx_lm.models.qwen3_5 as qwen3_5

    for name in MODULES:
        importlib.import_module(name)
    registry.families()  # the registry's own lazy table of entry points, filled once, as an import would
    other, _ = load(str(checkpoints["target"]))  # the user's own model, in the same process
    assert original_classes(other) == []
    refs = {tuple(p): greedy_reference(other, p, MAX_TOKENS) for p in PROMPTS}
    concatenate = mx.concatenate
    modules, classes = snapshot()
    assert not_original(modules) == []

    for speculative in ({"draft_model": str(checkpoints["truncated"])}, {"kind": "ngram"},
                        {"draft_model": str(checkpoints["dflash"]), "kind": "dflash"},
                        {"draft_model": str(checkpoints["eagle3"]), "kind": "eagle3"}):
        host = make_host(dict(speculative, block_size=5))
        target = host.load(str(checkpoints["target"]))
        assert target.attachments["speculative"].drafter is not None
        # The host scoped this target's recurrent layers: the mechanism is in use in this process.
        scoped = [m for m in target.model.modules() if getattr(type(m), "_spec_recurrent", False)]
        assert len(scoped) == 2 and all(isinstance(m, qwen3_5.GatedDeltaNet) for m in scoped)
        totals = rounds(host, target, refs)
        assert totals["rounds"] > 0 and totals["partial_or_zero"] > 0, (speculative, totals)

    assert mx.concatenate is concatenate and not isinstance(mx.concatenate, types.FunctionType)
    assert qwen3_5.gated_delta_update is gated_delta.gated_delta_update
    modules_after, classes_after = snapshot()
    assert rewritten(modules, modules_after, classes=False) == []
    assert rewritten(classes, classes_after, classes=True) == []
    assert not_original(modules_after) == []  # modules imported since included
    assert recurrent._open == {}

    # The user's model: mlx-lm's classes, the same tokens; and one loaded now as well.
    assert original_classes(other) == []
    assert all(type(m) is qwen3_5.GatedDeltaNet for m in other.modules() if isinstance(m, qwen3_5.GatedDeltaNet))
    assert {tuple(p): greedy_reference(other, p, MAX_TOKENS) for p in PROMPTS} == refs
    fresh, _ = load(str(checkpoints["target"]))
    assert original_classes(fresh) == []
    assert {tuple(p): greedy_reference(fresh, p, MAX_TOKENS) for p in PROMPTS} == refs


def test_routed_attention_patches_nothing(checkpoints: Dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """The attention dispatcher the policy carries (MLX-CUDA's kernel; here a stand-in with its contract,
    thresholds at 0) reaches this target's and its drafters' attention layers only: mlx-lm's function
    stays in every module, a second model keeps mlx-lm's classes and never calls the dispatcher."""
    import mlx_lm.models.base as base
    import mlx_lm.models.qwen3_next as qwen3_next

    from mlx_speculative.hooks import attention as host_attention
    from mlx_speculative.plugin import cuda
    from mlx_speculative.plugin.cuda import attention, backend as cuda_backend, projections
    from test_attention_dispatch import StandIn

    for name in MODULES + ["mlx_lm.models.base", "mlx_speculative.plugin.cuda.attention"]:
        importlib.import_module(name)
    registry.families()
    other, _ = load(str(checkpoints["target"]))
    refs = {tuple(p): greedy_reference(other, p, MAX_TOKENS) for p in PROMPTS}
    kernel = StandIn()
    disp = attention.Dispatcher(attention.Kernel("stand-in", kernel, None, None), min_keys={"mlx-mask": 0, "array": 0})
    proj = projections.stand_in()
    monkeypatch.setattr(cuda, "available", lambda: True)  # as on MLX-CUDA: the plugin asks for a backend
    monkeypatch.setattr(cuda_backend, "dispatcher_for", lambda mode=None, **_: disp)
    monkeypatch.setattr(cuda_backend, "projections_for", lambda mode=None, **_: proj)
    monkeypatch.setenv("MLX_SPEC_PREWARM_TOKENS", "0")
    sdpa = base.scaled_dot_product_attention
    modules, classes = snapshot()

    for padded, speculative in (("on", {"draft_model": str(checkpoints["truncated"])}),
                                ("off", {"draft_model": str(checkpoints["dflash"]), "kind": "dflash"})):
        monkeypatch.setenv(cuda.PADDED_ENV, padded)
        host = make_host(dict(speculative, block_size=5))
        target = host.load(str(checkpoints["target"]))
        assert target.cache_policy.attention is disp
        assert host_attention.routed(target.model) == 2  # the two full-attention layers
        assert host_attention.routed(target.attachments["speculative"].drafter.model) > 0
        assert host_attention.routed_projections(target.model) > 0
        assert host_attention.routed_projections(target.attachments["speculative"].drafter.model) > 0
        totals = rounds(host, target, refs)
        assert totals["rounds"] > 0 and totals["partial_or_zero"] > 0, (speculative, totals)
    assert disp.counts["kernel"] == len(kernel.calls) > 0 and proj.counts["kernel"] > 0

    assert base.scaled_dot_product_attention is sdpa and qwen3_next.scaled_dot_product_attention is sdpa
    modules_after, classes_after = snapshot()
    assert rewritten(modules, modules_after, classes=False) == []
    assert rewritten(classes, classes_after, classes=True) == []
    assert not_original(modules_after) == []
    calls = len(kernel.calls)
    assert original_classes(other) == []
    assert {tuple(p): greedy_reference(other, p, MAX_TOKENS) for p in PROMPTS} == refs
    fresh, _ = load(str(checkpoints["target"]))
    assert original_classes(fresh) == []
    assert greedy_reference(fresh, PROMPTS[0], MAX_TOKENS) == refs[tuple(PROMPTS[0])]
    assert len(kernel.calls) == calls  # neither the other model nor the fresh one reached the dispatcher
    assert host_attention.routed_projections(other) == 0 and host_attention.routed_projections(fresh) == 0


def _feed(model: Any, cache: List[Any]) -> List[mx.array]:
    """A prompt chunk, one-token steps and a block: every logit."""
    out = [model(mx.array([[5, 6, 7, 8, 9, 10, 11]]), cache=cache)]
    out += [model(mx.array([[t]]), cache=cache) for t in (12, 13)]
    out.append(model(mx.array([[14, 15, 16, 17]]), cache=cache))
    return out


def test_scoped_layers_run_the_original_code(checkpoints: Dict[str, Path]) -> None:
    """Outside a transaction a scoped model computes what mlx-lm's does, bit for bit; a recorded
    forward computes the same too (the recording only keeps the inputs)."""
    plain, _ = load(str(checkpoints["target"]))
    scoped, _ = load(str(checkpoints["target"]))
    assert recurrent.scope_model(scoped) == 2
    assert original_classes(plain) == [] and len(original_classes(scoped)) == 2
    attention_only = tm.build_model(tm.llama_config())
    assert recurrent.scope_model(attention_only) == 0 and original_classes(attention_only) == []
    ref_cache, cache = make_prompt_cache(plain), make_prompt_cache(scoped)
    for want, got in zip(_feed(plain, ref_cache), _feed(scoped, cache)):
        assert mx.array_equal(want, got).item()
    assert recurrent._open == {}
    for a, b in zip(ref_cache, cache):
        assert all(mx.array_equal(x, y).item() for x, y in zip(a.state, b.state) if isinstance(x, mx.array))
    # Recorded: the same logits and states as mlx-lm's forward; commit(all) keeps them.
    block = mx.array([[30, 31, 32, 33, 34]])
    want = plain(block, cache=ref_cache)
    with CacheTransaction(cache) as txn:
        assert len(recurrent._open) == sum(isinstance(c, ArraysCache) for c in cache) == 2
        got = scoped(block, cache=cache)
        assert mx.array_equal(want, got).item()
        txn.commit(5)
    assert txn.taped == 0 and txn.replayed == 0 and recurrent._open == {}
    for a, b in zip(ref_cache, cache):
        assert all(mx.array_equal(x, y).item() for x, y in zip(a.state, b.state) if isinstance(x, mx.array))


# The same rule read from the source: no file outside the tests assigns an attribute of a name it imported (a
# module, a class or a function of another module), through ``setattr`` / ``delattr`` or an assignment.
# Registering a module loaded from a file (``sys.modules[name] = module``, importlib's recipe) is not patching.
SOURCE_ROOTS = ("plugin", "hooks", "drafters", "bench", "examples")


def _imported(tree: Any) -> set:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.asname or a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            names |= {a.asname or a.name for a in node.names}
    return names


def assignments_to_imports(source: str) -> List[str]:
    """The statements of ``source`` that assign (or delete) an attribute of a name bound by an import."""
    tree = ast.parse(source)
    names = _imported(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("setattr", "delattr") \
                and node.args and isinstance(node.args[0], ast.Name) and node.args[0].id in names:
            found.append(ast.unparse(node))
        targets = (node.targets if isinstance(node, (ast.Assign, ast.Delete))
                   else [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
        for target in targets:
            while isinstance(target, (ast.Attribute, ast.Subscript)):
                owner = target.value
                if isinstance(target, ast.Attribute) and isinstance(owner, ast.Name) and owner.id in names \
                        and not (owner.id == "sys" and target.attr == "modules"):
                    found.append(ast.unparse(node))
                target = owner
    return found


def test_no_source_file_assigns_to_what_it_imports() -> None:
    root = Path(__file__).resolve().parents[1]
    files = [p for r in SOURCE_ROOTS for p in sorted((root / r).rglob("*.py"))]
    assert len(files) > 50
    found = {str(p.relative_to(root)): got for p in files if (got := assignments_to_imports(p.read_text()))}
    assert not found, found


@pytest.mark.parametrize("source", [
    "from mlx_speculative.plugin import round as rnd\nsetattr(rnd, 'adopt', None)",
    "import mlx.core as mx\nmx.concatenate = None",
    "from mlx_lm.models import llama\nllama.Attention.__call__ = None",
    "import mlx_lm.generate\ndel mlx_lm.generate.stream_generate",
])
def test_the_source_check_finds_patching(source: str) -> None:
    assert assignments_to_imports(source)
