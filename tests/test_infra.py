"""infra/: every Ray cluster config passes Ray's own schema and `ray up`'s offline checks, its GCP node
configs agree with the hardware, and it can hold marinrl's trainer and rollout workers (infra/check.py).
Offline: no GCP, no cluster, no network; a misspelled field anywhere must fail."""

from __future__ import annotations

import copy
import importlib.util
import pathlib
import re
import runpy
import subprocess

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

    from marinrl.config.placement import PlacementConfig
    from marinrl.job.placement import ray_options
    from marinrl.job.rl_job import RLJobConfig

    placement = _config(path.name)["metadata"]["marinrl"]
    args = ["--ray.address", "auto"]
    for role in check.ROLES:
        args += check.placement_flags(role, placement[role])
    job = draccus.parse(RLJobConfig, config_path=str(REPO / "experiments" / "quickstart.yaml"), args=args)
    for role in check.ROLES:
        assert getattr(job.ray, role) == PlacementConfig(**placement[role])
        options = ray_options(getattr(job.ray, role))
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
    "top-level field": ("tpu-v5e.yaml", lambda c: _rename(c, "setup_commands", "setup_command"),
                        "'setup_command' was unexpected"),
    "node type field": ("tpu-v5p-multihost.yaml",
                        lambda c: _rename(_node(c, "trainer_v5p_64"), "min_workers", "min_worker"),
                        "available_node_types.trainer_v5p_64: Additional properties are not allowed ('min_worker'"),
    "TPU node_config field": ("tpu-v5p-multihost.yaml",
                              lambda c: _rename(_node(c, "rollout_v5p_8", "node_config"),
                                                "runtimeVersion", "runtimeVerison"),
                              "available_node_types.rollout_v5p_8.node_config.runtimeVerison: "
                              "not a field of a GCP TPU VM"),
    "Compute node_config field": ("gpu.yaml",
                                  lambda c: _rename(_node(c, "rollout_a100", "node_config"),
                                                    "scheduling", "schedulling"),
                                  "available_node_types.rollout_a100.node_config.schedulling: "
                                  "not a field of a GCP Compute VM"),
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
    "gVNIC on A3": ("gpu.yaml", lambda c: _node(c, "trainer_h100x8", "node_config").pop("networkInterfaces"),
                    "trainer_h100x8.node_config.networkInterfaces: machine type a3-highgpu-8g takes only gVNIC"),
    "GPU image": ("gpu.yaml",
                  lambda c: _node(c, "rollout_a100", "node_config")["disks"][0]["initializeParams"].update(
                      sourceImage="projects/ubuntu-os-cloud/global/images/family/ubuntu-2204-lts"),
                  "rollout_a100.node_config.disks[boot].initializeParams.sourceImage: a GPU VM needs the NVIDIA "
                  "driver of CUDA 12.8+"),
    "GPU image older than jax's CUDA": ("gpu.yaml",
                                       lambda c: _node(c, "trainer_h100x8", "node_config")["disks"][0][
                                           "initializeParams"].update(sourceImage="projects/deeplearning-platform-"
                                                                      "release/global/images/family/common-cu124-"
                                                                      "ubuntu-2204-py310"),
                                       "trainer_h100x8.node_config.disks[boot].initializeParams.sourceImage: a GPU VM "
                                       "needs the NVIDIA driver of CUDA 12.8+"),
    "worker storage scope": ("gpu.yaml", lambda c: _node(c, "rollout_a100", "node_config").pop("serviceAccounts"),
                             "rollout_a100.node_config.serviceAccounts: a worker writes the run to gs://"),
    "read-only scope": ("gpu.yaml",
                        lambda c: _node(c, "trainer_h100x8", "node_config").update(serviceAccounts=[
                            {"email": "default",
                             "scopes": ["https://www.googleapis.com/auth/devstorage.read_only"]}]),
                        "trainer_h100x8.node_config.serviceAccounts: a worker writes the run to gs://"),
    "slice capacity": ("tpu-v5p-multihost.yaml",
                       lambda c: _node(c, "trainer_v5p_64", "node_config").pop("schedulingConfig"),
                       "trainer_v5p_64.node_config.schedulingConfig: a v5p-64 slice (8 hosts) on demand is rarely "
                       "available"),
    "GPU driver on first boot": ("gpu.yaml", lambda c: _node(c, "rollout_a100", "node_config").pop("metadata"),
                                 "rollout_a100.node_config.metadata.items: a Deep Learning VM installs its NVIDIA "
                                 "driver on first boot only with"),
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


# ------------------------------------------------------------------ infra/README.md's commands

PATHS = ("One TPU VM", "One GPU node", "A v5p-64 slice plus rollout hosts")
"""The paths from nothing to a running job that infra/README.md documents, each under a `### ` heading."""


def _readme_blocks() -> dict[str, list[str]]:
    """infra/README.md's ```bash blocks by the heading they are under (dedented)."""
    blocks: dict[str, list[str]] = {}
    heading, block = "", None
    for line in (INFRA / "README.md").read_text().splitlines():
        if block is None and line.startswith("#"):
            heading = line.lstrip("#").strip()
        elif block is None and line.strip() == "```bash":
            block, indent = [], len(line) - len(line.lstrip())
        elif block is not None and line.strip() == "```":
            blocks.setdefault(heading, []).append("\n".join(block))
            block = None
        elif block is not None:
            block.append(line[indent:])
    return blocks


def _commands(block: str) -> list[list[str]]:
    """Each command of a bash block as words: continuation lines joined, comments dropped, split at
    `&&`, `;` and `&`."""
    import shlex

    commands = []
    for line in block.replace("\\\n", " ").splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars="&;")
        lexer.whitespace_split, lexer.commenters = True, "#"
        words: list[str] = []
        for word in lexer:
            if word in ("&&", "&", ";"):
                commands.append(words)
                words = []
            else:
                words.append(word)
        commands.append(words)
    return [c for c in commands if c]


def _options(words: list[str]) -> dict[str, str]:
    return dict(w[2:].split("=", 1) for w in words if w.startswith("--") and "=" in w)


def _check_command(words: list[str]):
    """Checks one command offline; returns what kind of step it is and, for a job, its config; for a VM,
    the resources Ray would list for it."""
    import draccus

    from marinrl.job.rl_job import RLJobConfig
    from marinrl.recipe import parse_recipe

    if words[:3] == ["ray", "job", "submit"]:
        return _check_command(words[words.index("--") + 1:])
    if words[0] == "marinrl" and words[1] == "train":
        flags = words[3:]
        config = draccus.parse(RLJobConfig, config_path=str(REPO / words[2]), args=flags)
        config.validate()
        return "job", config
    if words[0] == "python" and words[1].startswith("experiments/"):
        config = parse_recipe(runpy.run_path(str(REPO / words[1]), run_name="recipe")["RECIPE"], words[2:])
        config.validate()
        return "job", config
    if words[0] == "bash" and words[1].endswith("infra/setup-node.sh"):
        accepted = re.search(r'case "\$accelerator" in(.*?)esac', (INFRA / "setup-node.sh").read_text(), re.S)
        assert words[2] in re.findall(r"^\s*(\w+)\)", accepted.group(1), re.M), words
        return f"setup {words[2]}", None
    configs = [w for w in words if w.startswith("infra/") and w.endswith(".yaml")]
    for config in configs:
        check.check_file(REPO / config)
    if words[:2] == ["ray", "up"]:
        return "cluster", None
    if words[:5] == ["gcloud", "compute", "tpus", "tpu-vm", "create"]:  # its version: test_readme_tpu_vm_types…
        accelerator = _options(words)["accelerator-type"]
        from marinrl.config.placement import tpu_chips_per_host, tpu_head_resource

        return "tpu vm", {"CPU": 96, "TPU": tpu_chips_per_host(accelerator), tpu_head_resource(accelerator): 1}
    if words[:4] == ["gcloud", "compute", "instances", "create"]:
        options = _options(words)
        _check_gpu_vm(options)
        return "gpu vm", {"CPU": 96, "GPU": check.GPU_MACHINE_TYPES[options["machine-type"]][1]}
    return "other", None


def _check_gpu_vm(options: dict[str, str]) -> None:
    """`gcloud compute instances create`'s flags as the node_config `ray up` would send, through the checks
    of `gpu.yaml`'s node types, with the image family of gpu.yaml's trainer."""
    nic = dict(kv.split("=", 1) for kv in options["network-interface"].split(","))
    image = f"projects/{options['image-project']}/global/images/family/{options['image-family']}"
    node_config = {
        "machineType": options["machine-type"], "networkInterfaces": [{"nicType": nic.get("nic-type")}],
        "scheduling": {"onHostMaintenance": options.get("maintenance-policy")},
        "disks": [{"boot": True, "initializeParams": {"sourceImage": image}}],
        "metadata": {"items": [dict(zip(("key", "value"), kv.split("=", 1)))
                               for kv in options.get("metadata", "").split(",") if kv]}}
    gpus = check.GPU_MACHINE_TYPES[options["machine-type"]][1]
    errors: list[str] = []
    check._node_type_errors("readme", {"resources": {"GPU": gpus}, "node_config": node_config}, errors)
    assert not errors, errors
    trainer = _config("gpu.yaml")["available_node_types"]["trainer_h100x8"]["node_config"]
    assert options["image-family"] == check.gpu_image_family(trainer)


def test_readme_commands_parse_and_check():
    """Each path's commands: bash parses every block, and what can be checked offline is (the cluster
    configs they name, the setup script's argument, the VM flags, every job command line)."""
    blocks = _readme_blocks()
    for heading, texts in blocks.items():
        for text in texts:
            syntax = subprocess.run(["bash", "-n"], input=text, capture_output=True, text=True)
            assert syntax.returncode == 0, f"{heading}: {syntax.stderr}\n{text}"
    from marinrl.job.placement import placement_problem

    steps = {heading: [_check_command(c) for text in blocks.get(heading, []) for c in _commands(text)]
             for heading in [*PATHS, "Any cluster config here"]}
    kinds = {heading: {kind for kind, _ in found} for heading, found in steps.items()}
    assert {"tpu vm", "setup tpu", "job"} <= kinds["One TPU VM"], kinds
    assert {"gpu vm", "setup cuda12", "job"} <= kinds["One GPU node"], kinds
    assert {"cluster", "job"} <= kinds["A v5p-64 slice plus rollout hosts"], kinds
    assert "job" in kinds["Any cluster config here"]
    for heading, vm in (("One TPU VM", "tpu vm"), ("One GPU node", "gpu vm")):  # each job fits the machine made
        (host,) = [detail for kind, detail in steps[heading] if kind == vm]
        for config in [detail for kind, detail in steps[heading] if kind == "job"]:
            assert config.ray.address is None  # its own Ray on the machine
            node = {"NodeManagerAddress": heading, "Alive": True, "Resources": host}
            problem = placement_problem(config.ray.trainer, config.ray.rollout, config.n_rollout_workers, [node])
            assert problem is None, f"{heading}: {problem}"


def test_readme_tpu_vm_types_are_the_configs():
    """Every `--accelerator-type=… --version=…` in infra/README.md (commands and prose) is a TPU type Ray
    knows with the runtime version the cluster configs give that generation."""
    from ray._private.accelerators import tpu

    versions = {}
    for path in CONFIGS:
        for node_type in _config(path.name)["available_node_types"].values():
            nc = node_type["node_config"]
            if "acceleratorType" in nc:
                versions[nc["acceleratorType"].rpartition("-")[0]] = nc["runtimeVersion"]
    pairs = re.findall(r"--accelerator-type=(\S+) --version=([\w.-]+)", (INFRA / "README.md").read_text())
    assert {t for t, _ in pairs} >= {"v5litepod-8", "v6e-8"}, pairs
    for accelerator, version in pairs:
        errors: list[str] = []
        assert check._tpu_host({"acceleratorType": accelerator, "runtimeVersion": version}, "readme", errors)
        assert not errors and tpu.get_num_tpu_visible_chips_per_host(accelerator) == 8
        assert version == versions[accelerator.rpartition("-")[0]], (accelerator, version, versions)


def test_readme_says_no_stale_thing():
    """What infra/ once said and is no longer true: the v5p-64 trainer refused, the runtime-env cache tip."""
    for path in [INFRA / "README.md", *CONFIGS, REPO / "experiments" / "grpo_math_llama3_8b_v5p.py"]:
        text = " ".join(path.read_text().split())
        assert "refuses `ray.trainer.tpu: v5p-64`" not in text, path
        assert "until the multi-host trainer lands" not in text, path
        assert "--runtime-env-json '{\"env_vars\": {\"JAX_COMPILATION_CACHE_DIR\"" not in text, path
