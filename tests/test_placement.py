"""Placement: what the trainer and the rollout workers ask of Ray, checked against a real Ray's nodes
before any actor starts (a request no node holds would leave its actor pending forever)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import textwrap

import pytest
import ray
from test_job import job_config

from marinrl.config.placement import PlacementConfig
from marinrl.job.placement import bundles, check_cluster, placement_problem, ray_options, request
from marinrl.job.rl_job import ConfigError, RLJob


def _actor_ids() -> set:
    return set(ray._private.state.actors())


@pytest.mark.parametrize(
    "placement, message",
    [
        (dict(trainer=PlacementConfig(num_gpus=8)),
         r"^RLJobConfig\.ray\.trainer\.num_gpus: 8 GPUs per trainer, but no node has more than 0 GPUs \(nodes: "
         r"[^:]+: CPU 4"),
        (dict(rollout=PlacementConfig(tpu="v5litepod-4")),
         r"^RLJobConfig\.ray\.rollout\.tpu: 4 TPU chips per rollout worker \(one host of a v5litepod-4\), but no node "
         r"has more than 0 TPU chips"),
        (dict(trainer=PlacementConfig(resources={"trainer": 1})),
         r"^RLJobConfig\.ray\.trainer\.resources\.trainer: trainer: 1 per trainer, "
         r"but no node has more than 0 trainer"),
        (dict(trainer=PlacementConfig(accelerator_type="H100")),
         r"^RLJobConfig\.ray\.trainer\.accelerator_type: a node labelled accelerator_type:H100 per trainer"),
        (dict(trainer=PlacementConfig(num_cpus=3), rollout=PlacementConfig(num_cpus=1)),
         r"^RLJobConfig\.n_rollout_workers: 2 rollout workers of \{CPU: 1\} each do not fit beside the trainer's "
         r"\{CPU: 3\}: at most 1 do"),
    ],
)
def test_a_request_the_cluster_cannot_hold_fails_before_any_actor_starts(tmp_path, ray_session, placement, message):
    config = job_config(tmp_path, n_rollout_workers=2)  # the session Ray: one node, 4 CPUs, no GPU or TPU
    config = dataclasses.replace(config, ray=dataclasses.replace(config.ray, **placement))
    job = RLJob(config)
    before = _actor_ids()
    with pytest.raises(ConfigError, match=message):
        job.run()
    assert _actor_ids() == before  # not even the curriculum actor
    assert ray_session.is_initialized()


def test_the_default_placement_fits_the_session_ray(ray_session):
    check_cluster(PlacementConfig(), PlacementConfig(), 3)  # 1 + 3 CPUs of 4


def test_custom_resources_on_a_real_ray():
    """A Ray started with the infra configs' role resources holds what asks for them, and refuses what
    does not fit, naming the field (its own process: the session Ray has no custom resources)."""
    script = textwrap.dedent("""
        import ray
        from marinrl.config.placement import PlacementConfig
        from marinrl.job.placement import check_cluster, placement_problem
        from marinrl.config.errors import ConfigError

        ray.init(num_cpus=4, resources={"trainer": 1, "rollout": 2}, include_dashboard=False, log_to_driver=False)
        trainer = PlacementConfig(resources={"trainer": 1})
        rollout = PlacementConfig(resources={"rollout": 1})
        check_cluster(trainer, rollout, 2)
        for args in [(trainer, rollout, 3), (PlacementConfig(resources={"trainer": 2}), rollout, 1),
                     (trainer, PlacementConfig(num_gpus=1, resources={"rollout": 1}), 1)]:
            try:
                check_cluster(*args)
            except ConfigError as e:
                print(e)
            else:
                print("no error")
        ray.shutdown()
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 3, out.stdout
    assert lines[0].startswith("RLJobConfig.n_rollout_workers: 3 rollout workers of {CPU: 1, rollout: 1} each do not "
                               "fit beside the trainer's {CPU: 1, trainer: 1}: at most 2 do (nodes: ")
    assert "rollout 2" in lines[0] and "trainer 1" in lines[0]  # what the cluster has
    assert lines[1].startswith("RLJobConfig.ray.trainer.resources.trainer: trainer: 2 per trainer, but no node has "
                               "more than 1 trainer")
    assert lines[2].startswith("RLJobConfig.ray.rollout.num_gpus: 1 GPUs per rollout worker, but no node has more "
                               "than 0 GPUs")


def test_what_each_placement_asks_ray_for():
    assert ray_options(PlacementConfig()) == {"num_cpus": 1, "num_gpus": 0, "resources": None}
    gpu = PlacementConfig(num_gpus=8, accelerator_type="H100", resources={"trainer": 1})
    assert ray_options(gpu) == {"num_cpus": 1, "num_gpus": 8, "resources": {"trainer": 1}, "accelerator_type": "H100"}
    assert request(gpu) == {"CPU": 1, "GPU": 8, "accelerator_type:H100": 0.001, "trainer": 1}
    assert gpu.devices() == 8
    tpu = PlacementConfig(tpu="v5litepod-8")  # one host, 8 chips; the head resource pins a whole slice
    assert ray_options(tpu)["resources"] == {"TPU": 8, "TPU-v5litepod-8-head": 1}
    assert (tpu.hosts(), tpu.devices()) == (1, 8)
    assert request(PlacementConfig(tpu="v5p-8")) == {"CPU": 1, "TPU": 4, "TPU-v5p-8-head": 1}  # 4 chips, 1 host
    assert PlacementConfig(tpu="v5p-64").hosts() == 8
    assert PlacementConfig(tpu="v3-8").devices() == 8  # 4 chips, 2 JAX devices (cores) each


@pytest.mark.parametrize(
    "overrides, field, problem",
    [
        (dict(rollout=PlacementConfig(tpu="v5p-64")), "ray.rollout.tpu",
         "'v5p-64' spans 8 hosts, but a rollout worker is one process on one host"),
        (dict(rollout=PlacementConfig(num_hosts=2)), "ray.rollout.num_hosts",
         "2 spans 2 hosts, but a rollout worker is one process on one host"),
        (dict(trainer=PlacementConfig(tpu="v5p-64", num_hosts=4)), "ray.trainer.num_hosts",
         "4 hosts, but a v5p-64 slice has 8: leave num_hosts unset with a tpu"),
        (dict(trainer=PlacementConfig(num_hosts=0)), "ray.trainer.num_hosts", "must be a whole number >= 1 or null"),
        (dict(rollout=PlacementConfig(tpu="v7-8x")), "ray.rollout.tpu", "'v7-8x' is not a TPU slice type Ray knows"),
        (dict(trainer=PlacementConfig(num_gpus=0.5)), "ray.trainer.num_gpus", "must be a whole number >= 0, got 0.5"),
        (dict(trainer=PlacementConfig(num_gpus=1, tpu="v6e-8")), "ray.trainer.tpu",
         "'v6e-8' and num_gpus=1: ask for one kind of accelerator"),
        (dict(rollout=PlacementConfig(resources={"GPU": 1})), "ray.rollout.resources.GPU", "use ray.rollout.num_gpus"),
        (dict(rollout=PlacementConfig(resources={"rollout": 0})), "ray.rollout.resources",
         "must map resource names to amounts > 0, got {'rollout': 0}"),
        (dict(placement_timeout_s=-1.0), "ray.placement_timeout_s", "must be >= 0"),
    ],
)
def test_a_bad_placement_is_refused_before_ray_starts(tmp_path, overrides, field, problem):
    config = job_config(tmp_path)
    config = dataclasses.replace(config, ray=dataclasses.replace(config.ray, **overrides))
    with pytest.raises(ConfigError, match=rf"^RLJobConfig\.{field.replace('.', '[.]')}: {problem}"):
        RLJob(config)


def _node(ip: str, **resources) -> dict:
    return {"NodeManagerAddress": ip, "Alive": True, "Resources": resources}


def test_a_multi_host_trainer_asks_one_bundle_per_host_and_needs_that_many_nodes():
    """A v5p-64 trainer is 8 hosts of 4 chips, the slice head resource on the first only; with STRICT_SPREAD
    each host needs a node of its own, and the rollout workers fit the capacity left."""
    trainer = PlacementConfig(tpu="v5p-64")
    hosts = bundles(trainer)
    assert hosts[0] == {"CPU": 1, "TPU": 4, "TPU-v5p-64-head": 1}
    assert hosts[1:] == [{"CPU": 1, "TPU": 4}] * 7
    assert ray_options(trainer, head=False)["resources"] == {"TPU": 4}
    rollout = PlacementConfig(num_gpus=1)
    slice_hosts = [_node("10.0.0.1", CPU=8, TPU=4, **{"TPU-v5p-64-head": 1})]
    slice_hosts += [_node(f"10.0.0.{i}", CPU=8, TPU=4) for i in range(2, 9)]
    rollout_hosts = [_node(f"10.0.1.{i}", CPU=8, GPU=1) for i in range(2)]
    assert placement_problem(trainer, rollout, 2, slice_hosts + rollout_hosts) is None

    problem = placement_problem(trainer, rollout, 2, slice_hosts[:7] + rollout_hosts)
    assert problem.field == "ray.trainer.tpu"
    assert problem.problem.startswith("8 trainer hosts of {CPU: 1, TPU: 4} each ({CPU: 1, TPU: 4, TPU-v5p-64-head: 1} "
                                      "for the first), each on its own node, but 7 nodes hold one"), problem.problem
    problem = placement_problem(trainer, rollout, 3, slice_hosts + rollout_hosts)
    assert problem.field == "n_rollout_workers" and "beside the trainer's 8 hosts of {CPU: 1, TPU: 4}: at most 2 do" \
        in problem.problem


def test_a_multi_host_cpu_trainer_packs_on_one_node_only_when_asked():
    trainer, rollout = PlacementConfig(num_hosts=2), PlacementConfig()
    one_node = [_node("127.0.0.1", CPU=4)]
    problem = placement_problem(trainer, rollout, 1, one_node)  # STRICT_SPREAD: a node per host
    assert problem.field == "ray.trainer.num_hosts" and "each on its own node, but 1 nodes hold one" in problem.problem
    assert placement_problem(trainer, rollout, 1, one_node, spread=False) is None
    problem = placement_problem(trainer, rollout, 3, one_node, spread=False)
    assert problem.field == "n_rollout_workers" and "at most 2 do" in problem.problem


@pytest.mark.parametrize("accelerator", ["v2-8", "v3-32", "v4-8", "v4-16", "v4-128", "v5p-8", "v5p-64", "v5p-1024",
                                         "v5litepod-1", "v5litepod-4", "v5litepod-8", "v5litepod-16",
                                         "v5litepod-256", "v6e-1", "v6e-8", "v6e-16", "v6e-64", "v7x-8", "v7x-16"])
def test_the_tpu_table_is_rays_arithmetic(accelerator):
    """The config layer's own table of slice types (no Ray import in `marinrl plan`) gives Ray's chips, chips per
    host and cores per chip for every generation Ray knows."""
    from ray._private.accelerators import tpu

    from marinrl.config import placement

    assert set(placement.TPU_GENERATIONS) == set(tpu.VALID_TPU_TYPES)
    assert tuple(placement.TPU_VALID_CHIP_OPTIONS) == tuple(tpu.TPU_VALID_CHIP_OPTIONS)
    assert placement.tpu_cores_per_chip(accelerator) == tpu.get_tpu_cores_per_chip(accelerator)
    assert placement.tpu_total_chips(accelerator) == tpu.get_total_chips_from_accelerator_type(accelerator)
    assert placement.tpu_chips_per_host(accelerator) == min(tpu.get_num_tpu_visible_chips_per_host(accelerator),
                                                            tpu.get_total_chips_from_accelerator_type(accelerator))
