"""Offline check of the Ray cluster configs in infra/, before `ray up` spends money on them.

    python infra/check.py infra/*.yaml

What `ray up` itself checks before it calls GCP runs first, with Ray's own code: the JSON schema that
ships in the ray package (`ray/autoscaler/ray-schema.json`, so a misspelled field anywhere Ray knows
the fields fails), then `prepare_config` + `validate_config`. Ray leaves `node_config` free-form, so
the GCP part is checked here: the fields each node kind accepts (a Compute VM or a TPU VM), TPU types
and chips per host from Ray's own TPU tables, GPUs per machine type, that the `resources` a node
type declares are what the hardware has, a GPU VM's network interface (gVNIC on A3) and image (a
Deep Learning VM family of CUDA 12.8+, its driver installed on first boot), a worker VM's storage write scope,
and a multi-host TPU slice's capacity (a reservation or spot). Last, the placement marinrl asks for
(`metadata.marinrl`: `RLJobConfig.ray.trainer` / `.rollout`, marinrl/config/placement.py) must fit a node type with an
accelerator, and the trainer and the rollout workers on different node types.

Nothing here reaches the network; GCP quota, zones, images and runtime versions are not checked.
"""

from __future__ import annotations

import copy
import json
import pathlib
import re
import sys
from typing import Any

import yaml

ROLES = ("trainer", "rollout")

# Top-level fields of the bodies Ray sends to GCP for each node kind (Ray passes node_config through).
# Compute Engine: https://cloud.google.com/compute/docs/reference/rest/v1/instances/insert
COMPUTE_FIELDS = frozenset({
    "machineType", "disks", "guestAccelerators", "metadata", "scheduling", "serviceAccounts",
    "networkInterfaces", "labels", "tags", "minCpuPlatform", "shieldedInstanceConfig",
    "reservationAffinity", "advancedMachineFeatures", "confidentialInstanceConfig", "description",
    "canIpForward", "resourcePolicies", "networkPerformanceConfig",
})
# Cloud TPU VM (v2alpha1 Node, what Ray's GCP provider creates): https://cloud.google.com/tpu/docs/reference/rest
TPU_FIELDS = frozenset({
    "acceleratorType", "acceleratorConfig", "runtimeVersion", "networkConfig", "serviceAccount",
    "serviceAccounts", "schedulingConfig", "metadata", "labels", "tags", "dataDisks",
    "shieldedInstanceConfig", "description", "cidrBlock", "bootDiskConfig",
})

# GPUs that come with the machine type itself (A2/A3/G2 families: no guestAccelerators).
# https://cloud.google.com/compute/docs/gpus
GPU_MACHINE_TYPES = {
    **{f"a2-highgpu-{n}g": ("A100", n) for n in (1, 2, 4, 8)},
    "a2-megagpu-16g": ("A100", 16),
    **{f"a2-ultragpu-{n}g": ("A100", n) for n in (1, 2, 4, 8)},
    **{f"a3-highgpu-{n}g": ("H100", n) for n in (1, 2, 4, 8)},
    "a3-megagpu-8g": ("H100", 8),
    "a3-ultragpu-8g": ("H200", 8),
}
# GPU machine families whose VMs take only gVNIC network interfaces (Ray's default interface has no
# nicType: GCP then picks VIRTIO_NET, which these refuse). https://cloud.google.com/compute/docs/gpus
GVNIC_ONLY_PREFIXES = ("a3-",)
# Where a GPU VM's NVIDIA driver comes from: a Deep Learning VM image that installs it on first boot
# (metadata install-nvidia-driver). `jax[cuda12]` 0.10.2 (infra/setup-node.sh) brings CUDA 12.8 or later from pip
# (its nvidia-*-cu12 wheels), whose compiler needs a 570 or newer driver: the family must be CUDA 12.8+
# (`common-cu128-ubuntu-2204-nvidia-570`; `common-cu124-*` ships driver 550).
DLVM_IMAGES = "projects/deeplearning-platform-release/global/images/family/"
DLVM_MIN_CUDA = (12, 8)
DLVM_FAMILY_EXAMPLE = "common-cu128-ubuntu-2204-nvidia-570"
# A worker that writes the run's files to gs:// needs a storage scope: GCP gives a VM created without
# serviceAccounts the default account with read-only storage, and Ray sets serviceAccounts on the head only.
WRITE_SCOPES = frozenset({"https://www.googleapis.com/auth/cloud-platform",
                          "https://www.googleapis.com/auth/devstorage.read_write",
                          "https://www.googleapis.com/auth/devstorage.full_control"})
# guestAccelerators types on N1 machines → Ray's accelerator_type name.
GUEST_GPU_TYPES = {"nvidia-tesla-t4": "T4", "nvidia-tesla-v100": "V100", "nvidia-tesla-p100": "P100",
                   "nvidia-tesla-p4": "P4", "nvidia-tesla-a100": "A100", "nvidia-a100-80gb": "A100"}


class ClusterConfigError(ValueError):
    """A cluster config `ray up` would reject or that cannot run marinrl; one line per problem."""


def _where(path) -> str:
    return ".".join(str(p) for p in path) or "<top level>"


def _ray_schema_errors(config: dict) -> list[str]:
    import jsonschema
    import ray.autoscaler

    schema_path = pathlib.Path(ray.autoscaler.__file__).parent / "ray-schema.json"
    validator = jsonschema.Draft7Validator(json.loads(schema_path.read_text()))
    return [f"{_where(e.absolute_path)}: {e.message} (Ray's cluster schema, {schema_path.name})"
            for e in sorted(validator.iter_errors(config), key=lambda e: list(map(str, e.absolute_path)))]


def _ray_up_errors(config: dict) -> list[str]:
    """What `ray up` runs on the config before it talks to the cloud (ray.autoscaler._private.commands)."""
    import logging

    from ray.autoscaler._private.util import prepare_config, validate_config

    logging.getLogger("ray.autoscaler._private.util").setLevel(logging.WARNING)  # its "setting max workers" lines
    try:
        validate_config(prepare_config(copy.deepcopy(config)))
    except Exception as e:  # Ray raises ValueError, RuntimeError or jsonschema's error
        return [f"ray up would fail: {type(e).__name__}: {e}"]
    return []


def _tpu_host(node_config: dict, where: str, errors: list[str]) -> dict | None:
    """Chips per host and the resources Ray gives a TPU slice, from Ray's own TPU tables."""
    from ray._private.accelerators import tpu

    if "acceleratorConfig" in node_config:
        errors.append(f"{where}.acceleratorConfig: use acceleratorType (e.g. v5p-64) in these configs")
        return None
    accelerator = node_config.get("acceleratorType")
    generation, _, size = str(accelerator).rpartition("-")
    if generation not in tpu.VALID_TPU_TYPES or not size.isdigit():
        errors.append(f"{where}.acceleratorType: {accelerator!r} is not a TPU type Ray knows "
                      f"(<generation>-<size> with generation in {list(tpu.VALID_TPU_TYPES)}, e.g. v5litepod-8, v5p-64)")
        return None
    chips, remainder = divmod(int(size), tpu.get_tpu_cores_per_chip(accelerator))
    valid_chips = {_product(t) for t in tpu.VALID_TPU_TOPOLOGY[generation]}
    if remainder or chips not in valid_chips:
        errors.append(f"{where}.acceleratorType: {accelerator!r} is no {generation} slice "
                      f"(valid sizes: {sorted(c * tpu.get_tpu_cores_per_chip(accelerator) for c in valid_chips)})")
        return None
    if not node_config.get("runtimeVersion"):
        errors.append(f"{where}.runtimeVersion: a TPU VM needs its software version (e.g. v2-alpha-tpuv5)")
    per_host = tpu.get_num_tpu_visible_chips_per_host(accelerator)
    return {"accelerator": accelerator, "chips_per_host": per_host, "head_resource": f"TPU-{accelerator}-head",
            "accelerator_label": f"TPU-{generation.upper()}", "hosts": max(1, chips // per_host)}


def _product(topology: str) -> int:
    n = 1
    for dim in topology.split("x"):
        n *= int(dim)
    return n


def _gpus(node_config: dict, where: str, errors: list[str]) -> tuple[str, int] | None:
    machine = node_config["machineType"]
    if machine in GPU_MACHINE_TYPES:
        return GPU_MACHINE_TYPES[machine]
    guests = node_config.get("guestAccelerators") or []
    if not guests:
        return None
    kinds = {GUEST_GPU_TYPES.get(g.get("acceleratorType"), g.get("acceleratorType")) for g in guests}
    if len(kinds) != 1:
        errors.append(f"{where}.guestAccelerators: one GPU type per node type, got {sorted(map(str, kinds))}")
        return None
    return kinds.pop(), sum(int(g.get("acceleratorCount", 0)) for g in guests)


def _node_type_errors(name: str, node_type: dict, errors: list[str]) -> dict:
    """Checks one node type's GCP node_config against its declared resources; returns what it offers."""
    where = f"available_node_types.{name}.node_config"
    node_config = node_type.get("node_config")
    node_config = node_config if isinstance(node_config, dict) else {}  # the schema reported it already
    declared = node_type.get("resources")
    declared = dict(declared) if isinstance(declared, dict) else {}
    offered = dict(declared)
    is_tpu = "machineType" not in node_config and ("acceleratorType" in node_config
                                                   or "acceleratorConfig" in node_config)
    if not is_tpu and "machineType" not in node_config:
        errors.append(f"{where}: needs machineType (a Compute VM) or acceleratorType (a TPU VM); "
                      f"got {sorted(node_config)}")
        return offered
    allowed = TPU_FIELDS if is_tpu else COMPUTE_FIELDS
    for key in sorted(set(node_config) - allowed):
        errors.append(f"{where}.{key}: not a field of a GCP {'TPU VM' if is_tpu else 'Compute VM'} "
                      f"(known: {', '.join(sorted(allowed))})")
    res = f"available_node_types.{name}.resources"
    if is_tpu:
        host = _tpu_host(node_config, where, errors)
        if host is None:
            return offered
        if declared.get("TPU") != host["chips_per_host"]:
            errors.append(f"{res}.TPU: a {host['accelerator']} host has {host['chips_per_host']} chips, "
                          f"the config says {declared.get('TPU')}")
        for key in declared:
            if key.startswith("TPU-") and key.endswith("-head") and key != host["head_resource"]:
                errors.append(f"{res}.{key}: the slice head resource of a {host['accelerator']} "
                              f"is {host['head_resource']}")
            if key.startswith("accelerator_type:") and key != f"accelerator_type:{host['accelerator_label']}":
                errors.append(f"{res}.{key}: Ray labels a {host['accelerator']} host "
                              f"accelerator_type:{host['accelerator_label']}")
        # Ray's GCP provider adds it (GCPNodeProvider.fillout_available_node_types_resources)
        offered[host["head_resource"]] = 1
        slice_capacity_errors(node_config, host, where, errors)
    else:
        gpus = _gpus(node_config, where, errors)
        if gpus is None:
            if declared.get("GPU"):
                errors.append(f"{res}.GPU: machine type {node_config['machineType']} has no GPU, "
                              f"the config says {declared['GPU']}")
        else:
            kind, count = gpus
            if declared.get("GPU") != count:
                errors.append(f"{res}.GPU: machine type {node_config['machineType']} has {count} {kind} GPU(s), "
                              f"the config says {declared.get('GPU')}")
            for key in declared:
                if key.startswith("accelerator_type:") and key != f"accelerator_type:{kind}":
                    errors.append(f"{res}.{key}: Ray labels a {node_config['machineType']} accelerator_type:{kind}")
            scheduling = node_config.get("scheduling")
            if not isinstance(scheduling, dict) or scheduling.get("onHostMaintenance") != "TERMINATE":
                errors.append(f"{where}.scheduling.onHostMaintenance: GCP requires TERMINATE on a VM with GPUs "
                              f"(got {scheduling!r})")
            _gpu_vm_errors(node_config, where, errors)
    return offered


def gpu_image_family(node_config: dict) -> str | None:
    """The Deep Learning VM image family of a Compute VM's boot disk (None: another image, or none)."""
    for disk in node_config.get("disks") or []:
        if isinstance(disk, dict) and disk.get("boot"):
            image = str((disk.get("initializeParams") or {}).get("sourceImage", ""))
            return image.removeprefix(DLVM_IMAGES) if image.startswith(DLVM_IMAGES) else None
    return None


def image_family_cuda(family: str | None) -> tuple[int, int] | None:
    """(major, minor) CUDA of a Deep Learning VM family named `common-cu<major><minor>-…` (cu128: 12.8)."""
    match = re.match(r"common-cu(\d\d)(\d+)-", family or "")
    return (int(match.group(1)), int(match.group(2))) if match else None


def write_scope_errors(node_config: dict, where: str, errors: list[str]) -> None:
    """A Compute VM worker must be able to write gs:// (the run's rollouts, weights and checkpoints)."""
    accounts = node_config.get("serviceAccounts")
    scopes = {scope for account in accounts or [] if isinstance(account, dict) for scope in account.get("scopes") or []}
    if not scopes & WRITE_SCOPES:
        errors.append(f"{where}.serviceAccounts: a worker writes the run to gs:// and GCP gives a VM without "
                      "serviceAccounts read-only storage (403 on the first write): add serviceAccounts: [{email: "
                      "default, scopes: [https://www.googleapis.com/auth/cloud-platform]}]"
                      + (f" (got scopes {sorted(scopes)})" if scopes else ""))


def slice_capacity_errors(node_config: dict, host: dict, where: str, errors: list[str]) -> None:
    """A multi-host slice on demand is rarely there to be had: the config must say where it comes from."""
    if host["hosts"] <= 1:
        return
    scheduling = node_config.get("schedulingConfig")
    scheduling = scheduling if isinstance(scheduling, dict) else {}
    if not any(scheduling.get(k) is True for k in ("reserved", "spot", "preemptible")):
        errors.append(f"{where}.schedulingConfig: a {host['accelerator']} slice ({host['hosts']} hosts) on demand is "
                      "rarely available: set schedulingConfig: {reserved: true} (your project's reservation) or "
                      f"{{spot: true}} (got {node_config.get('schedulingConfig')!r})")


def _gpu_vm_errors(node_config: dict, where: str, errors: list[str]) -> None:
    """What a GPU VM needs beyond its GPUs: its machine family's network interface, and an image whose
    NVIDIA driver runs the CUDA that `jax[cuda12]` installs."""
    machine = node_config["machineType"]
    if machine.startswith(GVNIC_ONLY_PREFIXES):
        interfaces = node_config.get("networkInterfaces")
        if not isinstance(interfaces, list) or not interfaces or not all(
                isinstance(i, dict) and i.get("nicType") == "GVNIC" for i in interfaces):
            errors.append(f"{where}.networkInterfaces: machine type {machine} takes only gVNIC interfaces: give each "
                          f"interface nicType: GVNIC (got {interfaces!r}; Ray's default interface is not gVNIC)")
    family = gpu_image_family(node_config)
    cuda = image_family_cuda(family)
    if cuda is None or cuda[0] != DLVM_MIN_CUDA[0] or cuda < DLVM_MIN_CUDA:
        errors.append(f"{where}.disks[boot].initializeParams.sourceImage: a GPU VM needs the NVIDIA driver of CUDA "
                      f"{DLVM_MIN_CUDA[0]}.{DLVM_MIN_CUDA[1]}+ (what jax[cuda12] installs): use a Deep Learning VM "
                      f"image family like {DLVM_IMAGES}{DLVM_FAMILY_EXAMPLE} (got family {family!r})")
    items = ((node_config.get("metadata") or {}).get("items") or [])
    if not any(isinstance(i, dict) and i.get("key") == "install-nvidia-driver" and str(i.get("value")).lower() == "true"
               for i in items):
        errors.append(f"{where}.metadata.items: a Deep Learning VM installs its NVIDIA driver on first boot only "
                      "with {key: install-nvidia-driver, value: 'True'}")


def _fits(request: dict, offered: dict) -> bool:
    def amount(value) -> float:
        return value if isinstance(value, (int, float)) else 0  # the schema reported a non-number already
    return all(amount(offered.get(key, 0)) >= need for key, need in request.items())


def placement_flags(role: str, placement: dict) -> list[str]:
    """`metadata.marinrl.<role>` as the `marinrl train` flags that set it (`--ray.<role>.<field> <value>`)."""
    flags = []
    for key, value in placement.items():
        flags += [f"--ray.{role}.{key}", json.dumps(value) if isinstance(value, (dict, list)) else str(value)]
    return flags


def _parse_placement(raw: Any, field: str, errors: list[str]):
    """`metadata.marinrl.<role>` as marinrl's PlacementConfig (draccus, as `marinrl train` decodes it)."""
    import draccus

    from marinrl.config.errors import ConfigError
    from marinrl.config.placement import PlacementConfig

    if not isinstance(raw, dict) or not raw:
        errors.append(f"{field}: must be a mapping of RLJobConfig.ray.{field.rsplit('.', 1)[-1]}'s fields "
                      f"(num_cpus, num_gpus, tpu, accelerator_type, resources), got {raw!r}")
        return None
    try:
        placement = draccus.decode(PlacementConfig, raw)
        placement.errors(field)
    except ConfigError as e:
        errors.append(str(e).removeprefix("RLJobConfig."))
        return None
    except Exception as e:  # draccus: an unknown field or a value of the wrong type
        errors.append(f"{field}: {type(e).__name__}: {e}")
        return None
    return placement


def _placement_errors(config: dict, offered: dict[str, dict], errors: list[str]) -> None:
    from marinrl.job.placement import _fmt, request

    metadata = config.get("metadata")
    marinrl = metadata.get("marinrl") if isinstance(metadata, dict) else None
    if not isinstance(marinrl, dict):
        errors.append("metadata.marinrl: missing; it names what marinrl places on the cluster "
                      "({trainer: {num_gpus | tpu, resources: {...}}, rollout: {...}})")
        return
    head = config.get("head_node_type")
    homes: dict[str, set[str]] = {}
    for role in ROLES:
        field = f"metadata.marinrl.{role}"
        placement = _parse_placement(marinrl.get(role), field, errors)
        if placement is None:
            continue
        asked = request(placement)
        homes[role] = {name for name, res in offered.items() if _fits(asked, res)}
        if not homes[role]:
            errors.append(f"{field}: no node type offers {_fmt(asked)} (the {role} actor's request); "
                          f"node types offer: {json.dumps(offered)}")
        for name in sorted(homes[role]):
            if not (offered[name].get("TPU") or offered[name].get("GPU")):
                errors.append(f"{field}: {_fmt(asked)} fits node type {name}"
                              f"{' (the head)' if name == head else ''}, which has no TPU or GPU")
    shared = homes.get("trainer", set()) & homes.get("rollout", set())
    if shared:
        errors.append(f"metadata.marinrl: the trainer and the rollout workers both fit node type(s) {sorted(shared)}; "
                      "colocating them on one accelerator is not supported: give each role its own resource")


def check_cluster_config(config: Any, name: str = "<config>") -> dict:
    """Returns the config if `ray up` would accept it and marinrl can be placed on it; else raises
    ClusterConfigError naming `name` and every bad field."""
    if not isinstance(config, dict):
        raise ClusterConfigError(f"{name}: a cluster config is a YAML mapping, got {type(config).__name__}")
    errors = _ray_schema_errors(config)
    if not errors:  # Ray's own checks assume a config that passed its schema
        errors = _ray_up_errors(config)
    provider = config.get("provider")
    if not isinstance(provider, dict) or provider.get("type") != "gcp":
        got = provider.get("type") if isinstance(provider, dict) else provider
        errors.append(f"provider.type: these configs are for GCP (the node_config checks are GCP's), got {got!r}")
    node_types = config.get("available_node_types")
    if not isinstance(node_types, dict) or not all(isinstance(t, dict) for t in node_types.values()):
        errors.append("available_node_types: a mapping of node type name to {resources, node_config, ...} is required")
    else:
        offered = {name_: _node_type_errors(name_, node_type, errors) for name_, node_type in node_types.items()}
        for name_, node_type in node_types.items():
            node_config = node_type.get("node_config")
            if name_ != config.get("head_node_type") and isinstance(node_config, dict) and "machineType" in node_config:
                write_scope_errors(node_config, f"available_node_types.{name_}.node_config", errors)
        _placement_errors(config, offered, errors)
    if errors:
        raise ClusterConfigError(f"{name}: {len(errors)} problem(s):\n" + "\n".join(f"  {name}: {e}" for e in errors))
    return config


def check_file(path) -> dict:
    path = pathlib.Path(path)
    try:
        config = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise ClusterConfigError(f"{path}: cannot read it as YAML: {e}") from e
    return check_cluster_config(config, str(path))


def main(paths: list[str]) -> int:
    if not paths:
        paths = sorted(str(p) for p in pathlib.Path(__file__).parent.glob("*.yaml"))
    failed = 0
    for path in paths:
        try:
            config = check_file(path)
        except ClusterConfigError as e:
            print(e, file=sys.stderr)
            failed += 1
            continue
        placement = config["metadata"]["marinrl"]
        flags = [f"'{f}'" if f.startswith("{") else f for role in ROLES for f in placement_flags(role, placement[role])]
        print(f"ok: {path}: {' '.join(flags)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
