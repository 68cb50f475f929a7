"""infra/: every Ray cluster config passes Ray's own schema and `ray up`'s offline checks, its GCP node
configs agree with the hardware, and it can hold marinrl's trainer and rollout workers (infra/check.py).
Offline: no GCP, no cluster, no network; a misspelled field anywhere must fail."""

from __future__ import annotations

import copy
import importlib.util
import pathlib

import pytest
import yaml

REPO = pathlib.Path(__file__).resolve().parents[1]
INFRA = REPO / "infra"
CONFIGS = sorted(INFRA.glob("*.yaml"))


def _load_check():
    spec = importlib.util.spec_from_file_location("infra_check", INFRA / "check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


check = _load_check()


def _config(name: str) -> dict:
    return yaml.safe_load((INFRA / name).read_text())


def test_infra_has_the_promised_clusters():
    kinds = {}
    for path in CONFIGS:
        for node_type in _config(path.name)["available_node_types"].values():
            node_config = node_type["node_config"]
            kinds.setdefault(node_config.get("acceleratorType") or node_config["machineType"], path.name)
    assert {"v5litepod-8", "v6e-8", "v5p-64", "a3-highgpu-8g", "a2-highgpu-1g"} <= set(kinds), kinds


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_cluster_config_passes_ray_and_gcp_checks(path):
    check.check_file(path)


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_placement_is_what_marinrl_train_parses(path):
    """The flags `infra/check.py` prints for a config (`marinrl train experiments/quickstart.yaml
    --ray.trainer.tpu v5litepod-8 --ray.trainer.resources '{"trainer": 1}' ...`, parsed by draccus as
    `marinrl train` parses them) become exactly the config's placement, and RLJob asks Ray for it."""
    import draccus

    from marinrl.job import RLJobConfig
    from marinrl.placement import PlacementConfig

    placement = _config(path.name)["metadata"]["marinrl"]
    args = ["--ray.address", "auto"]
    for role in check.ROLES:
        args += check.placement_flags(role, placement[role])
    job = draccus.parse(RLJobConfig, config_path=str(REPO / "experiments" / "quickstart.yaml"), args=args)
    for role in check.ROLES:
        assert getattr(job.ray, role) == PlacementConfig(**placement[role])
        options = getattr(job.ray, role).ray_options()
        assert {k: v for k, v in placement[role]["resources"].items()}.items() <= options["resources"].items()
        assert bool(options["num_gpus"] or "TPU" in options["resources"])  # every role asks for its accelerators


def test_readme_covers_every_config():
    readme = (INFRA / "README.md").read_text()
    missing = [p.name for p in CONFIGS if f"infra/{p.name}" not in readme]
    assert not missing, f"infra/README.md does not mention {missing}"


def _rename(mapping: dict, old: str, new: str) -> None:
    mapping[new] = mapping.pop(old)


def _node(config: dict, node_type: str, part: str | None = None) -> dict:
    """`available_node_types.<node_type>` of a cluster config, or its `part` (resources, node_config)."""
    node = config["available_node_types"][node_type]
    return node if part is None else node[part]


def _roles(config: dict) -> dict:
    """The placement of each marinrl role (`metadata.marinrl`)."""
    return config["metadata"]["marinrl"]


# Each: (config, how to break it, what the error must name).
BREAKAGES = {
    "top-level field": ("tpu-v5e.yaml", lambda c: _rename(c, "setup_commands", "setup_command"), "'setup_command' was unexpected"),
    "node type field": ("tpu-v5p-multihost.yaml",
                        lambda c: _rename(_node(c, "trainer_v5p_64"), "min_workers", "min_worker"),
                        "available_node_types.trainer_v5p_64: Additional properties are not allowed ('min_worker'"),
    "TPU node_config field": ("tpu-v5p-multihost.yaml",
                              lambda c: _rename(_node(c, "rollout_v5p_8", "node_config"),
                                                "runtimeVersion", "runtimeVerison"),
                              "available_node_types.rollout_v5p_8.node_config.runtimeVerison: not a field of a GCP TPU VM"),
    "Compute node_config field": ("gpu.yaml",
                                  lambda c: _rename(_node(c, "rollout_a100", "node_config"),
                                                    "scheduling", "schedulling"),
                                  "available_node_types.rollout_a100.node_config.schedulling: not a field of a GCP Compute VM"),
    "TPU type": ("tpu-v6e.yaml",
                 lambda c: _node(c, "trainer_v6e_8", "node_config").update(acceleratorType="v6-8"),
                 "trainer_v6e_8.node_config.acceleratorType: 'v6-8' is not a TPU type Ray knows"),
    "chips per host": ("tpu-v5p-multihost.yaml",
                       lambda c: _node(c, "trainer_v5p_64", "resources").update(TPU=8),
                       "trainer_v5p_64.resources.TPU: a v5p-64 host has 4 chips, the config says 8"),
    "slice head resource": ("tpu-v5p-multihost.yaml",
                            lambda c: _rename(_node(c, "trainer_v5p_64", "resources"),
                                              "TPU-v5p-64-head", "TPU-v5p-32-head"),
                            "the slice head resource of a v5p-64 is TPU-v5p-64-head"),
    "GPU count": ("gpu.yaml", lambda c: _node(c, "trainer_h100x8", "resources").update(GPU=4),
                  "trainer_h100x8.resources.GPU: machine type a3-highgpu-8g has 8 H100 GPU(s), the config says 4"),
    "role resource on the node": ("gpu.yaml",
                                  lambda c: _rename(_node(c, "rollout_a100", "resources"),
                                                    "rollout", "rollouts"),
                                  "metadata.marinrl.rollout: no node type offers {CPU: 1, GPU: 1, rollout: 1}"),
    "more GPUs than a node has": ("gpu.yaml", lambda c: _roles(c)["rollout"].update(num_gpus=2),
                                  "metadata.marinrl.rollout: no node type offers {CPU: 1, GPU: 2, rollout: 1}"),
    "a placement field": ("tpu-v6e.yaml", lambda c: _roles(c)["trainer"].update(tpu="v6e-9000x"),
                          "metadata.marinrl.trainer.tpu: 'v6e-9000x' is not a TPU slice type Ray knows"),
    "colocated roles": ("tpu-v5e.yaml",
                        lambda c: _roles(c).update(rollout={"tpu": "v5litepod-8"}),
                        "the trainer and the rollout workers both fit node type(s) ['trainer_v5e_8']"),
    "role on the CPU head": ("tpu-v5e.yaml",
                             lambda c: (_node(c, "head", "resources").update(trainer=1),
                                        _roles(c)["trainer"].pop("tpu")),
                             "metadata.marinrl.trainer: {CPU: 1, trainer: 1} fits node type head (the head), "
                             "which has no TPU or GPU"),
}


@pytest.mark.parametrize("case", BREAKAGES)
def test_a_broken_config_fails_naming_the_field(case):
    name, breakage, expected = BREAKAGES[case]
    config = _config(name)
    check.check_cluster_config(copy.deepcopy(config), name)  # the intact config passes
    breakage(config)
    with pytest.raises(check.ClusterConfigError) as raised:
        check.check_cluster_config(config, name)
    assert expected in str(raised.value)
    assert str(raised.value).startswith(f"{name}: ")


def test_a_role_on_a_node_without_accelerators_fails():
    config = _config("gpu.yaml")
    _roles(config)["rollout"] = {"resources": {"rollout": 1}}  # asks for no GPU
    config["available_node_types"]["cpu_pool"] = {
        "min_workers": 0, "max_workers": 2, "resources": {"CPU": 8, "rollout": 1},
        "node_config": {"machineType": "n2-standard-8"}}
    with pytest.raises(check.ClusterConfigError, match=r"fits node type cpu_pool, which has no TPU or GPU"):
        check.check_cluster_config(config, "gpu.yaml")


def test_check_script_exit_status(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    config = _config("tpu-v5e.yaml")
    _rename(_node(config, "rollout_v5e_4"), "max_workers", "max_worker")
    bad.write_text(yaml.safe_dump(config))
    assert check.main([str(INFRA / "tpu-v5e.yaml")]) == 0
    assert check.main([str(bad)]) == 1
    assert f"{bad}: available_node_types.rollout_v5e_4: Additional properties" in capsys.readouterr().err
