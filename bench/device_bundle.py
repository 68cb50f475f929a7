"""Builds the dependency bundle a lent GPU machine needs to run bench/device_check.py: `.device/site.tar.xz`.

The lent GPU machines of our workplace reach no package index, and their image (Python 3.12) has JAX, NumPy,
PyTorch, transformers and most of the scientific stack, but not Levanter, Haliax, draccus, Ray and what those
need. So what the image lacks travels as one archive of installed packages: on the machine it is unpacked and
put first on `PYTHONPATH`, beside `src/` (marinrl itself) and `bench/device_compat/` (the shim for an image
whose JAX is newer than our pin). docs/device_check.md, "Running it on a lent GPU machine", has the command.

What goes in: the distributions that the check's processes import (`PATH_DISTRIBUTIONS`: the check, its
sections, the quickstart's driver, Ray's head processes and the job's actors), less those the image has
(`IMAGE_PACKAGES`: the image keeps its own versions, e.g. jax 0.11.2 and transformers 5.17), each at the
version `constraints.txt` pins. They are downloaded as CPython 3.12 manylinux x86_64 wheels (pure-Python
wheels match too) with `pip download --no-deps`, installed with `pip install --no-deps --target`, then
Ray's parts our path never imports are removed (`PRUNE`: its Java jars, RLlib, Tune, Serve, Data, Train, the
dashboard's web client...), and the folder is packed with `tar cJ`. Ray runs in its minimal mode there
(without the `ray[default]` extras: no dashboard, which the job never starts).

`PATH_DISTRIBUTIONS` was found by importing for real: every Python process of a CPU run of the check's
`env,two_processes,train_step,generation` sections and of experiments/quickstart.py recorded the files of
its modules (a `sitecustomize` on `PYTHONPATH`, which Ray's processes inherit), mapped to distributions by
their RECORD files. `--verify PYTHON` unpacks the archive and imports the path with that interpreter (one
with only the image's packages), then runs the check's `--plan`.

    python bench/device_bundle.py                       # -> .device/site.tar.xz
    python bench/device_bundle.py --list                # what would be shipped, nothing downloaded
    python bench/device_bundle.py --verify /tmp/img312/bin/python
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile

_REPO = pathlib.Path(__file__).resolve().parent.parent

IMAGE_PACKAGES = frozenset("""
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core cuda-pathfinder
cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock flatbuffers flax fonttools
formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna
imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver
lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe
matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals
networkx ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime
nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13
nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript
opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy
peft pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments
pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist
python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image
scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six
sortedcontainers statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile
tiktoken timm tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm
transformers treescope triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel
wrapt xarray xxhash yarl zipp
""".split())
"""The Python packages of the lent GPU machines' image ('cuda'), as the workplace's list of its kinds gives them:
never shipped, whatever `PATH_DISTRIBUTIONS` says (the image's version is the one that runs)."""

PATH_DISTRIBUTIONS = tuple("""
absl-py aiohappyeyeballs aiohttp aiosignal annotated-doc annotated-types anyio aqtp async-lru attrs
backports.tarfile braceexpand brotli cachebox certifi charset-normalizer chex click cloudpickle cycler
dataclasses-json datasets deepdiff defusedxml dill draccus email-validator equinox etils fastapi filelock flax
fonttools frozenlist fsspec gitdb GitPython grpcio haliax httpx httpx2 huggingface_hub humanfriendly jax jaxlib
jaxtyping Jinja2 jmp jsonschema jsonschema-specifications kiwisolver levanter MarkupSafe marshmallow matplotlib
mergedeep ml_dtypes msgpack multidict multiprocess mypy_extensions numpy openai opentelemetry-api opt_einsum optax
orderly-set orjson packaging pandas pillow propcache protobuf psutil pyarrow pydantic pydantic_core Pygments
pyparsing python-dateutil python-multipart pytimeparse pytz PyYAML ray referencing regex requests rich rpds-py
safetensors setuptools simplejson six smmap sniffio starlette tblib tensorboardX tensorstore tokenizers toolz tqdm
tqdm-loggable transformers typing-inspect typing-inspection typing_extensions urllib3 uvicorn uvloop wadler_lindig
watchfiles xxhash yarl zstandard
""".split())
"""The distributions the check's processes import (the image's among them), by their names in constraints.txt.
Left out though imported where installed: `ray[default]`'s dashboard extras (aiohttp-cors, colorful, opencensus,
OpenTelemetry's SDK and exporters: without them Ray runs minimal) and the Google Cloud clients (with
cryptography), which tensorboardX and etils import only if present and marinrl only for gs:// paths."""

PRUNE = ("ray/jars", "ray/rllib", "ray/tune", "ray/serve", "ray/data", "ray/train", "ray/air", "ray/llm",
         "ray/workflow", "ray/dashboard/client")
"""Paths under the installed folder that our path never imports, removed before packing: Ray's Java jars, its
libraries for other workloads, and the dashboard's web client (the job starts no dashboard)."""

PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64")
"""The wheel platforms the image's glibc runs (pip matches a manylinux_2_N tag exactly, so each is named)."""


def canonical(name: str) -> str:
    """A distribution's name as pip compares it (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def read_constraints(path: pathlib.Path) -> dict[str, tuple[str, str]]:
    """constraints.txt's `name==version` lines, by canonical name."""
    pins = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        name, sep, version = line.partition("==")
        if not sep or not name.strip() or not version.strip():
            raise SystemExit(f"{path}:{number}: {line!r} is not name==version")
        pins[canonical(name.strip())] = (name.strip(), version.strip())
    return pins


def to_ship(pins: dict[str, tuple[str, str]], extra: tuple[str, ...] = ()) -> list[tuple[str, str]]:
    """(name, version) of each distribution the path needs and the image lacks, at its pinned version."""
    shipped, missing = [], []
    for name in (*PATH_DISTRIBUTIONS, *extra):
        key = canonical(name)
        if key in IMAGE_PACKAGES or any(key == canonical(n) for n, _ in shipped):
            continue
        if key not in pins:
            missing.append(name)
            continue
        shipped.append(pins[key])
    if missing:
        raise SystemExit(f"not pinned in constraints.txt: {', '.join(missing)}")
    return sorted(shipped, key=lambda nv: canonical(nv[0]))


def _target_flags(python_version: str) -> list[str]:
    flags = ["--only-binary=:all:", "--python-version", python_version, "--implementation", "cp"]
    for platform in PLATFORMS:
        flags += ["--platform", platform]
    return flags


def download(packages: list[tuple[str, str]], wheels: pathlib.Path, python_version: str) -> list[pathlib.Path]:
    """One wheel per package into `wheels` (kept between builds when `--work` names a folder)."""
    wheels.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", *_target_flags(python_version),
                    "--dest", str(wheels), *[f"{n}=={v}" for n, v in packages]], check=True)
    found = []
    for name, version in packages:
        stem = canonical(name).replace("-", "_")
        hits = [w for w in wheels.glob("*.whl")
                if canonical(w.name.split("-")[0]).replace("-", "_") == stem and w.name.split("-")[1] == version]
        if len(hits) != 1:
            raise SystemExit(f"{name}=={version}: {len(hits)} wheels in {wheels}, want one")
        found.append(hits[0])
    return found


def install(wheel_files: list[pathlib.Path], site: pathlib.Path, python_version: str) -> None:
    """The wheels into `site`, as the image's Python would import them (no byte-code: the image writes its own)."""
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", "--no-compile",
                    "--target", str(site), *_target_flags(python_version), *map(str, wheel_files)], check=True)


def prune(site: pathlib.Path) -> list[str]:
    """Removes `PRUNE`'s paths, the console scripts (their shebang is this machine's Python) and byte-code."""
    removed = []
    for rel in (*PRUNE, "bin"):
        path = site / rel
        if path.is_dir():
            shutil.rmtree(path)
            removed.append(rel)
        elif path.exists():
            path.unlink()
            removed.append(rel)
    for cache in site.rglob("__pycache__"):
        shutil.rmtree(cache, ignore_errors=True)
    for source_map in site.rglob("*.js.map"):
        source_map.unlink()
    if (site / "sitecustomize.py").exists():  # it would shadow bench/device_compat's shim
        raise SystemExit(f"{site}/sitecustomize.py: a shipped package brings one; it would hide the JAX shim")
    return removed


def pack(site: pathlib.Path, archive: pathlib.Path) -> int:
    """`tar cJ` of the folder's contents (sorted, so the same wheels give the same archive); its size in bytes."""
    archive.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "XZ_OPT": "-9 -T0"}
    subprocess.run(["tar", "--sort=name", "--owner=0", "--group=0", "--numeric-owner", "-cJf", str(archive),
                    "-C", str(site), "."], check=True, env=env)
    return archive.stat().st_size


def largest(site: pathlib.Path, count: int = 8) -> list[tuple[str, int]]:
    """The folder's largest top-level entries, bytes unpacked: what to prune when the archive is over budget."""
    sizes = []
    for entry in site.iterdir():
        files = [entry] if entry.is_file() else [f for f in entry.rglob("*") if f.is_file()]
        sizes.append((entry.name, sum(f.stat().st_size for f in files)))
    return sorted(sizes, key=lambda s: -s[1])[:count]


VERIFY_IMPORTS = ("ray", "levanter", "haliax", "draccus", "tensorboardX", "jmp", "marinrl.job.rl_job",
                  "marinrl.train.worker", "marinrl.inference.server", "marinrl.levanter_configs")
"""What `--verify` imports with the image's interpreter: the modules each section starts from."""


def verify(archive: pathlib.Path, python: str) -> dict:
    """Unpacks `archive` and, with `python` (the image's packages only) and the device's `PYTHONPATH`, imports
    `VERIFY_IMPORTS` and runs the check's `--plan`: the line of each, and whether it passed."""
    with tempfile.TemporaryDirectory(prefix="device-site-") as tmp:
        subprocess.run(["tar", "xJf", str(archive), "-C", tmp], check=True)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([tmp, str(_REPO / "src"), str(_REPO / "bench" /
                                                                                           "device_compat")]),
               "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu"), "USE_TORCH": "0"}
        code = "import importlib, sys\nfor m in sys.argv[1:]:\n    importlib.import_module(m)\nprint('imported')"
        imported = subprocess.run([python, "-c", code, *VERIFY_IMPORTS], capture_output=True, text=True, env=env,
                                  cwd=_REPO)
        planned = subprocess.run([python, str(_REPO / "bench" / "device_check.py"), "--plan"], capture_output=True,
                                 text=True, env=env, cwd=_REPO)
    plan_line = (planned.stdout.strip().splitlines() or [""])[-1]
    return {"imports_ok": imported.returncode == 0,
            "imports": imported.stdout.strip()[-300:] if imported.returncode == 0 else imported.stderr[-1500:],
            "plan_ok": planned.returncode == 0, "plan": plan_line or planned.stderr[-1500:]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--constraints", default=str(_REPO / "constraints.txt"), help="the pins (name==version)")
    p.add_argument("--out", default=str(_REPO / ".device" / "site.tar.xz"), help="the archive to write")
    p.add_argument("--work", default=None,
                   help="a folder for the wheels and the installed tree, kept (and its wheels reused); "
                        "default: a temporary one, removed")
    p.add_argument("--python_version", default="3.12", help="the device image's Python (major.minor)")
    p.add_argument("--extra", action="append", default=[], metavar="NAME",
                   help="also ship this pinned distribution (repeatable)")
    p.add_argument("--max_mib", type=float, default=45.0,
                   help="fail when the archive is larger (the carried tree must stay under 64 MiB)")
    p.add_argument("--list", action="store_true", help="print what would be shipped and stop")
    p.add_argument("--verify", default=None, metavar="PYTHON",
                   help="after building (or on the existing --out), import the path with this interpreter")
    p.add_argument("--no_build", action="store_true", help="with --verify: verify the existing archive only")
    args = p.parse_args(argv)
    if not re.fullmatch(r"3\.\d+", args.python_version):
        p.error(f"--python_version {args.python_version!r}: want major.minor, e.g. 3.12")
    if args.no_build and not args.verify:
        p.error("--no_build: only with --verify")
    archive = pathlib.Path(args.out)
    packages = to_ship(read_constraints(pathlib.Path(args.constraints)), tuple(args.extra))
    if args.list:
        print("\n".join(f"{n}=={v}" for n, v in packages))
        return 0
    report: dict = {"archive": str(archive)}
    if not args.no_build:
        work = pathlib.Path(args.work) if args.work else pathlib.Path(tempfile.mkdtemp(prefix="device-bundle-"))
        try:
            site = work / "site"
            if site.exists():
                shutil.rmtree(site)
            install(download(packages, work / "wheels", args.python_version), site, args.python_version)
            removed = prune(site)
            (site / "DEVICE_BUNDLE.json").write_text(json.dumps(
                {"python": args.python_version, "packages": dict(packages), "pruned": removed}, indent=1) + "\n")
            size = pack(site, archive)
            report.update(packages=len(packages), mib=round(size / 2**20, 1), pruned=removed)
            if size > args.max_mib * 2**20:
                report["largest_mib"] = {n: round(b / 2**20, 1) for n, b in largest(site)}
                print(json.dumps(report))
                print(f"{archive}: {size / 2**20:.1f} MiB, over --max_mib {args.max_mib:g}", file=sys.stderr)
                return 1
        finally:
            if not args.work:
                shutil.rmtree(work, ignore_errors=True)
    if args.verify:
        if not archive.exists():
            p.error(f"--verify: {archive} does not exist")
        report["verify"] = verify(archive, args.verify)
    print(json.dumps(report))
    return 0 if report.get("verify", {}).get("imports_ok", True) and report.get("verify", {}).get("plan_ok", True) \
        else 1


if __name__ == "__main__":
    sys.exit(main())
