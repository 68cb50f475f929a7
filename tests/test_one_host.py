"""One host split between the roles (docs/scaling.md, "One host"): `tpu_chips` / `num_gpus` per role on
one TPU VM or GPU node, the placement arithmetic on a fake host, what Ray and the job give each actor on a
real local Ray with fake `TPU`/`GPU` resources, and a two-role job on one such "host". Beside them, the
cluster glue a job on such a host or a cluster meets: the compile cache every host reads, and the
autoscaler request withdrawn when the job ends."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap

import pytest
from test_job import job_config

from marinrl.config.job import RayJobConfig
from marinrl.config.placement import PlacementConfig
from marinrl.job.actors import compilation_cache_dir
from marinrl.job.placement import TPU_CHIP_BOUNDS, actor_env, placement_problem, ray_options, request
from marinrl.job.rl_job import ConfigError, RLJob

pytestmark = pytest.mark.timeout(1200)  # whole jobs on a local Ray: the suite's job-file limit (pyproject.toml)

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)


def _node(**resources) -> dict:
    return {"NodeManagerAddress": "10.0.0.1", "Alive": True, "Resources": resources}


V5E_8 = _node(CPU=224, TPU=8, **{"TPU-v5litepod-8-head": 1, "accelerator_type:TPU-V5LITEPOD": 1})
"""One v5e-8 TPU VM as Ray lists it (its chips, the slice head resource, Ray's label)."""
H100X8 = _node(CPU=208, GPU=8, **{"accelerator_type:H100": 1})


@pytest.mark.parametrize("trainer, rollout, workers, host", [
    (PlacementConfig(tpu_chips=4), PlacementConfig(tpu_chips=4), 1, V5E_8),
    (PlacementConfig(tpu_chips=4), PlacementConfig(tpu_chips=2), 2, V5E_8),
    (PlacementConfig(tpu_chips=2), PlacementConfig(tpu_chips=2), 3, V5E_8),
    (PlacementConfig(tpu_chips=4, accelerator_type="TPU-V5LITEPOD"), PlacementConfig(tpu_chips=1), 4, V5E_8),
    (PlacementConfig(num_gpus=4), PlacementConfig(num_gpus=4), 1, H100X8),
    (PlacementConfig(num_gpus=4), PlacementConfig(num_gpus=2), 2, H100X8),
])
def test_one_host_holds_both_roles(trainer, rollout, workers, host):
    assert placement_problem(trainer, rollout, workers, [host]) is None


@pytest.mark.parametrize("trainer, rollout, workers, host, field, problem", [
    (PlacementConfig(tpu_chips=4), PlacementConfig(tpu_chips=4), 2, V5E_8, "n_rollout_workers",
     "2 rollout workers of {CPU: 1, TPU: 4} each do not fit beside the trainer's {CPU: 1, TPU: 4}: at most 1 do"),
    (PlacementConfig(tpu_chips=8), PlacementConfig(tpu_chips=1), 1, V5E_8, "n_rollout_workers", "at most 0 do"),
    # a whole slice (`tpu`) takes every chip: nothing is left for the rollout worker
    (PlacementConfig(tpu="v5litepod-8"), PlacementConfig(tpu_chips=4), 1, V5E_8, "n_rollout_workers",
     "beside the trainer's {CPU: 1, TPU: 8, TPU-v5litepod-8-head: 1}: at most 0 do"),
    (PlacementConfig(tpu_chips=8), PlacementConfig(tpu_chips=4), 1, _node(CPU=208, TPU=4), "ray.trainer.tpu_chips",
     "8 TPU chips per trainer (part of one host), but no node has more than 4 TPU chips"),
    (PlacementConfig(num_gpus=4), PlacementConfig(num_gpus=4), 2, H100X8, "n_rollout_workers", "at most 1 do"),
])
def test_one_host_refuses_what_does_not_fit_naming_the_field(trainer, rollout, workers, host, field, problem):
    error = placement_problem(trainer, rollout, workers, [host])
    assert error.field == field and problem in error.problem, error


@pytest.mark.parametrize("placement, field, problem", [
    (dict(trainer=PlacementConfig(tpu_chips=3)), "ray.trainer.tpu_chips",
     r"must be one of \[1, 2, 4, 8\] \(the chip counts Ray gives a TPU actor\), got 3"),
    (dict(rollout=PlacementConfig(tpu_chips=4, tpu="v5litepod-4")), "ray.rollout.tpu_chips",
     "4 chips of one host and tpu='v5litepod-4': ask for one kind of accelerator"),
    (dict(rollout=PlacementConfig(tpu_chips=4, num_gpus=1)), "ray.rollout.tpu_chips",
     "4 chips of one host and num_gpus=1"),
    (dict(trainer=PlacementConfig(tpu_chips=4, num_hosts=2)), "ray.trainer.num_hosts",
     "2 hosts with tpu_chips: a trainer over several TPU hosts takes whole hosts"),
    (dict(rollout=PlacementConfig(memory_fraction=1.5)), "ray.rollout.memory_fraction", r"must be in \(0, 1\]"),
])
def test_a_bad_one_host_placement_is_refused_before_ray_starts(tmp_path, placement, field, problem):
    config = job_config(tmp_path)
    config = dataclasses.replace(config, ray=dataclasses.replace(config.ray, **placement))
    with pytest.raises(ConfigError, match=rf"^RLJobConfig\.{field.replace('.', '[.]')}: {problem}"):
        RLJob(config)


def test_what_a_role_on_part_of_a_host_asks_for():
    part = PlacementConfig(tpu_chips=4)  # no slice head resource: another role fits beside it
    assert request(part) == {"CPU": 1, "TPU": 4}
    assert ray_options(part)["resources"] == {"TPU": 4}
    assert (part.devices(), part.hosts(), part.has_accelerator) == (4, 1, True)
    env = actor_env(part, slot=3)
    assert env["TPU_CHIPS_PER_PROCESS_BOUNDS"] == env["TPU_CHIPS_PER_HOST_BOUNDS"] == "2,2,1"
    assert env["TPU_PROCESS_BOUNDS"] == env["TPU_HOST_BOUNDS"] == "1,1,1"
    assert env["TPU_PROCESS_PORT"] == env["TPU_MESH_CONTROLLER_PORT"] != actor_env(part, slot=4)["TPU_PROCESS_PORT"]
    assert env["ALLOW_MULTIPLE_LIBTPU_LOAD"] == "1" and "TPU_PROCESS_ADDRESSES" not in env
    assert actor_env(PlacementConfig(tpu="v5litepod-8"), 0) == {}  # a whole host needs nothing of this
    assert actor_env(PlacementConfig(num_gpus=1, memory_fraction=0.45), 0) == {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.45"}
    # the shared mode (no GPU of its own) shares one GPU: without the pin Ray would show each role every GPU
    shared = PlacementConfig(num_gpus=0, memory_fraction=0.3)
    assert actor_env(shared, 1)["CUDA_VISIBLE_DEVICES"] == "0"
    # the chip shapes multiply out to the chips
    for chips, bounds in TPU_CHIP_BOUNDS.items():
        x, y, z = map(int, bounds.split(","))
        assert x * y * z == chips


_ENV_SCRIPT = textwrap.dedent("""
    import json, os, sys
    import ray
    from marinrl.job.placement import actor_options
    from marinrl.config.placement import PlacementConfig
    from marinrl.job.placement import check_cluster

    ray.init(num_cpus=4, num_gpus=8, resources={"TPU": 8}, include_dashboard=False, log_to_driver=False)

    @ray.remote
    class Probe:
        def env(self):
            return {k: v for k, v in os.environ.items() if k.startswith(("TPU_", "CUDA_", "XLA_PYTHON", "ALLOW_"))}

    out = {}
    for name, trainer, rollout, workers in [
            ("tpu 4+4", PlacementConfig(num_cpus=0, tpu_chips=4), PlacementConfig(num_cpus=0, tpu_chips=4), 1),
            ("tpu 4+2x2", PlacementConfig(num_cpus=0, tpu_chips=4), PlacementConfig(num_cpus=0, tpu_chips=2), 2),
            ("gpu 4+4", PlacementConfig(num_cpus=0, num_gpus=4, memory_fraction=0.9),
             PlacementConfig(num_cpus=0, num_gpus=4), 1)]:
        check_cluster(trainer, rollout, workers)
        actors = [Probe.options(**actor_options(trainer, 0)).remote()]
        actors += [Probe.options(**actor_options(rollout, 1 + i)).remote() for i in range(workers)]
        out[name] = ray.get([a.env.remote() for a in actors], timeout=120)
        for a in actors:
            ray.kill(a)
    print("RESULT " + json.dumps(out))
    ray.shutdown()
""")


def test_each_actor_on_one_host_gets_its_own_accelerators():
    """A real local Ray with 8 fake TPU chips and 8 fake GPUs: the job's actor options give each role's
    actors disjoint chips (Ray's TPU_VISIBLE_CHIPS) with libtpu's bounds and a port each, or disjoint GPUs
    (CUDA_VISIBLE_DEVICES) with the role's memory fraction."""
    proc = subprocess.run([sys.executable, "-c", _ENV_SCRIPT], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}, cwd=ROOT)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    out = json.loads(lines[-1][len("RESULT "):])

    def chips(env):
        return set(env["TPU_VISIBLE_CHIPS"].split(","))

    trainer, rollout = out["tpu 4+4"]
    assert len(chips(trainer)) == len(chips(rollout)) == 4 and not chips(trainer) & chips(rollout)
    assert trainer["TPU_CHIPS_PER_PROCESS_BOUNDS"] == rollout["TPU_CHIPS_PER_PROCESS_BOUNDS"] == "2,2,1"
    assert trainer["TPU_PROCESS_BOUNDS"] == "1,1,1" and trainer["ALLOW_MULTIPLE_LIBTPU_LOAD"] == "1"
    assert trainer["TPU_PROCESS_PORT"] != rollout["TPU_PROCESS_PORT"]

    trainer, *rollouts = out["tpu 4+2x2"]
    assert [len(chips(e)) for e in (trainer, *rollouts)] == [4, 2, 2]
    assert len(set.union(*map(chips, (trainer, *rollouts)))) == 8  # every chip once
    for env in rollouts:  # Ray's own bounds for two chips and the job's agree
        assert env["TPU_CHIPS_PER_PROCESS_BOUNDS"] == env["TPU_CHIPS_PER_HOST_BOUNDS"] == "1,2,1"
    assert len({e["TPU_PROCESS_PORT"] for e in (trainer, *rollouts)}) == 3

    trainer, rollout = out["gpu 4+4"]
    gpus = [set(e["CUDA_VISIBLE_DEVICES"].split(",")) for e in (trainer, rollout)]
    assert len(gpus[0]) == len(gpus[1]) == 4 and not gpus[0] & gpus[1]
    assert trainer["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.9" and "XLA_PYTHON_CLIENT_MEM_FRACTION" not in rollout
    assert not {"TPU_VISIBLE_CHIPS", "TPU_PROCESS_PORT", "ALLOW_MULTIPLE_LIBTPU_LOAD"} & set(trainer)  # a GPU role


_ONE_HOST_JOB = textwrap.dedent("""
    import dataclasses, json, pathlib, sys
    import ray
    from ray.cluster_utils import Cluster
    sys.path.insert(0, {tests!r})
    from test_job import job_config
    from marinrl.job.rl_job import RLJob, RayJobConfig
    from marinrl.config.placement import PlacementConfig

    # one "TPU VM": 8 chips and the slice head resource, as Ray lists a v5e-8 host
    cluster = Cluster(initialize_head=True, head_node_args=dict(
        num_cpus=3, resources={{"TPU": 8, "TPU-v5litepod-8-head": 1}}, include_dashboard=False,
        object_store_memory=128 * 1024 * 1024))
    try:
        cfg = job_config(pathlib.Path({root!r}), run_id="one-host", num_train_steps=2, eval_every=10,
                         ray=RayJobConfig(address=cluster.address, trainer=PlacementConfig(tpu_chips=4),
                                          rollout=PlacementConfig(tpu_chips=4)))
        # the chips are fake: the trainer's JAX runs on the CPU
        cfg = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, require_accelerator=False))
        result = RLJob(cfg).run()
        print("RESULT " + json.dumps(dict(final_step=result.train["final_step"],
                                          trainer=result.train["accelerators"],
                                          rollouts=[r.get("accelerators") for r in result.rollouts])))
    finally:
        cluster.shutdown()
""")


def test_a_two_role_job_runs_on_one_host(tmp_path):
    """RLJob on a one-node Ray that looks like one v5e-8 TPU VM: the trainer on 4 chips and a rollout
    worker on the other 4, each told its chips' shape, trains to the end."""
    script = _ONE_HOST_JOB.format(tests=TESTS, root=str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=900,
                          env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}, cwd=ROOT)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"rc={proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    out = json.loads(lines[-1][len("RESULT "):])
    assert out["final_step"] == 2
    (rollout,) = out["rollouts"]
    trainer_chips, rollout_chips = (set(e["TPU_VISIBLE_CHIPS"].split(",")) for e in (out["trainer"], rollout))
    assert trainer_chips | rollout_chips == {str(i) for i in range(8)} and not trainer_chips & rollout_chips
    assert out["trainer"]["TPU_CHIPS_PER_PROCESS_BOUNDS"] == rollout["TPU_CHIPS_PER_PROCESS_BOUNDS"] == "2,2,1"
    assert out["trainer"]["TPU_PROCESS_PORT"] != rollout["TPU_PROCESS_PORT"]


# ---------------------------------------------------------------------------------- cluster glue


def test_the_compile_cache_is_shared_storage_on_a_cluster(tmp_path, monkeypatch):
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    local = job_config(tmp_path)
    assert compilation_cache_dir(local) == os.path.abspath(".jax_cache")  # one machine: its own disk
    on_cluster = dataclasses.replace(local, run_root="gs://bucket/runs/", ray=RayJobConfig(address="auto"))
    assert compilation_cache_dir(on_cluster) == "gs://bucket/runs/jax_cache"  # every host reads it
    assert compilation_cache_dir(dataclasses.replace(on_cluster, run_root=str(tmp_path))) == os.path.abspath(
        ".jax_cache")  # a local run_root on a cluster: no shared place to offer
    chosen = dataclasses.replace(on_cluster, trainer=dataclasses.replace(on_cluster.trainer,
                                                                        jax_compilation_cache_dir="gs://other/cache"))
    assert compilation_cache_dir(chosen) == "gs://other/cache"
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", "/driver/cache")
    assert compilation_cache_dir(chosen) == "/driver/cache"  # the driver's environment wins


def test_jax_fills_the_cluster_compile_cache_on_gcs(tmp_path, gcs_root, monkeypatch):
    """The cache a cluster job picks for a `gs://` run_root is one JAX writes to: a JAX process with it
    (as the job's actors get it, `actor_env`) stores its compiled programs in the bucket (the GCS
    emulator, through JAX's own epath/gcsfs path)."""
    import fsspec

    from marinrl.job.actors import actor_env

    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    config = dataclasses.replace(job_config(tmp_path), run_root=f"{gcs_root}/runs", ray=RayJobConfig(address="auto"))
    cache = compilation_cache_dir(config)
    env = {**os.environ, **actor_env(cache), "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}
    code = "import jax, jax.numpy as jnp; print(float(jax.jit(lambda x: jnp.sin(x) * 3)(jnp.ones(7)).sum()))"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    fs = fsspec.filesystem("gcs", token="anon")
    assert cache == f"{gcs_root}/runs/jax_cache"
    assert any(name.rsplit("/", 1)[-1].startswith("jit__lambda-") for name in fs.find(cache)), fs.find(cache)


_AUTOSCALER_SCRIPT = textwrap.dedent("""
    import json, pathlib, sys
    import ray
    from ray.cluster_utils import Cluster
    from ray.experimental.internal_kv import _internal_kv_get
    from ray.autoscaler._private.constants import AUTOSCALER_RESOURCE_REQUEST_CHANNEL
    sys.path.insert(0, {tests!r})
    from test_job import job_config
    from marinrl.job.rl_job import ConfigError, RLJob, RayJobConfig
    from marinrl.config.placement import PlacementConfig
    from marinrl.job.placement import AutoscalerRequest, check_cluster

    cluster = Cluster(initialize_head=True, head_node_args=dict(num_cpus=2, include_dashboard=False,
                                                                object_store_memory=128 * 1024 * 1024))
    try:
        # what the autoscaler is asked for while a job waits (read back from the cluster)
        ray.init(address=cluster.address, log_to_driver=False)
        request = AutoscalerRequest()
        try:
            check_cluster(PlacementConfig(tpu_chips=4), PlacementConfig(), 1, wait_s=0.5, autoscaler=request)
        except ConfigError as e:
            waited = str(e)
        asked = json.loads(_internal_kv_get(AUTOSCALER_RESOURCE_REQUEST_CHANNEL))
        ray.shutdown()

        # a job that waited for nodes and gave up: its request is withdrawn when it ends
        cfg = job_config(pathlib.Path({root!r}), ray=RayJobConfig(
            address=cluster.address, placement_timeout_s=0.5, trainer=PlacementConfig(resources={{"late": 1}})))
        try:
            RLJob(cfg).run()
        except ConfigError as e:
            refused = str(e)
        ray.init(address=cluster.address, log_to_driver=False)
        left = json.loads(_internal_kv_get(AUTOSCALER_RESOURCE_REQUEST_CHANNEL))
        print("RESULT " + json.dumps(dict(waited=waited, asked=asked, refused=refused, left=left)))
        ray.shutdown()
    finally:
        cluster.shutdown()
""")


def test_the_autoscaler_request_is_withdrawn_when_the_job_ends(tmp_path):
    """`request_resources` on a real local cluster (Ray's v1 autoscaler channel in the GCS key-value store,
    which `ray up`'s autoscaler reads; no autoscaler runs here to act on it): while the job waits, the
    request holds its actors' bundles; once the job has ended, an empty request replaced it."""
    script = _AUTOSCALER_SCRIPT.format(tests=TESTS, root=str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}, cwd=ROOT)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"rc={proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    out = json.loads(lines[-1][len("RESULT "):])
    assert out["asked"] == [{"CPU": 1.0, "TPU": 4.0}, {"CPU": 1.0}]
    assert "ray.trainer.tpu_chips" in out["waited"] and "waited 0.5 s" in out["waited"]
    assert out["refused"].startswith("RLJobConfig.ray.trainer.resources.late: ") and "waited 0.5 s" in out["refused"]
    assert out["left"] == []  # withdrawn: the autoscaler may let the extra nodes go


def test_shared_gpu_mode_keeps_the_first_gpu_the_driver_was_given(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3, 5")
    env = actor_env(PlacementConfig(memory_fraction=0.45), 0)
    assert env == {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.45", "CUDA_VISIBLE_DEVICES": "3"}
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert actor_env(PlacementConfig(memory_fraction=0.45), 0)["CUDA_VISIBLE_DEVICES"] == "0"


@pytest.mark.parametrize("placement", [dict(num_gpus=1), dict(tpu_chips=4), dict(tpu="v5litepod-8"), dict()])
def test_levanter_never_joins_jax_distributed_on_its_own(tmp_path, placement):
    """A GPU image with mpi4py looks like a cluster to Levanter's detection (seen on an H100: JAX then asks for
    a coordinator address); a multi-process trainer joins through marinrl.multihost instead."""
    from marinrl.job.plan import trainer_config

    config = job_config(tmp_path)
    config = dataclasses.replace(config, ray=dataclasses.replace(config.ray, trainer=PlacementConfig(**placement)))
    assert trainer_config(config).distributed.initialize_jax_distributed is False


class _Chip:
    """What `device_problem` reads of a JAX device: a TPU chip at its coordinates on the host."""

    platform, device_kind = "tpu", "TPU v5 lite"

    def __init__(self, id, coords):
        self.id, self.coords = id, coords


V5E_4x2 = {i: (i % 4, i // 4, 0) for i in range(8)}  # chips 0-3 are a row on such a host
V5E_2x4 = {i: (i % 2, i // 2, 0) for i in range(8)}  # chips 0-3 are a 2x2 block


def test_a_split_whose_chips_are_no_box_is_refused_naming_the_layout(monkeypatch):
    from marinrl.job.placement import device_problem

    monkeypatch.setenv("TPU_VISIBLE_CHIPS", "0,1,2,3")
    half = PlacementConfig(tpu_chips=4)
    row = [_Chip(i, V5E_4x2[i]) for i in range(4)]
    problem = device_problem(half, "ray.rollout", row)
    assert problem.startswith("ray.rollout.tpu_chips: the 4 chips this process got lie at [(0, 0, 0), (1, 0, 0)")
    assert "spanning 4x1x1, not the 2x2x1 block" in problem and "TPU_VISIBLE_CHIPS=0,1,2,3" in problem
    assert device_problem(half, "ray.rollout", [_Chip(i, V5E_2x4[i]) for i in range(4)]) is None
    assert device_problem(PlacementConfig(tpu_chips=8), "ray.trainer", [_Chip(i, V5E_4x2[i]) for i in range(8)]) is None
    # the wrong number of chips is named too
    problem = device_problem(half, "ray.trainer", row[:2])
    assert problem.startswith("ray.trainer.tpu_chips: asked for 4 device(s) per process, JAX sees 2")


def test_an_actor_that_sees_other_devices_than_it_asked_for_stops_in_one_line(monkeypatch):
    """A role that asked for 2 GPUs and sees one; and through this process's real JAX (CPU devices only), nothing
    is refused: a CPU test that plays an accelerator host with Ray's resources runs as before."""
    from marinrl.job.actors import check_devices
    from marinrl.job.placement import device_problem

    class Gpu:
        platform, device_kind, coords = "gpu", "NVIDIA H100 80GB HBM3", None

        def __init__(self, id):
            self.id = id

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    problem = device_problem(PlacementConfig(num_gpus=2), "ray.trainer", [Gpu(0)])
    assert problem == ("ray.trainer.num_gpus: asked for 2 device(s) per process, JAX sees 1 (NVIDIA H100 80GB HBM3:0); "
                       "visible: CUDA_VISIBLE_DEVICES=0")
    assert device_problem(PlacementConfig(num_gpus=1), "ray.trainer", [Gpu(0)]) is None
    check_devices(PlacementConfig(num_gpus=2), "ray.trainer")  # JAX here has CPU devices only: not refused
