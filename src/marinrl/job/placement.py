"""Placement → Ray: the one place that turns a role's `PlacementConfig` (config/placement.py) into what Ray and
the actor's process need — its resource request and `.options(...)`, a placement group's bundles, the
environment variables of a process on part of a TPU host — and checks, before any actor starts, that the
cluster holds every actor (`check_cluster`).

To add an accelerator kind: give `PlacementConfig` its field and check (config/placement.py), then teach
`request`, `ray_options` and `actor_env` here what it asks of Ray and of the process; `placement_problem`
names the field when no node holds it. Nothing else reads placement fields.

A request Ray cannot satisfy leaves the actor pending forever; `check_cluster` turns that into one error naming
the field and what the cluster has, from `ray.nodes()`: the trainer must fit one node (one bundle per host, each
host on its own node on a cluster) and the rollout workers the capacity left beside it.
"""

from __future__ import annotations

import math
import os
import time
from typing import Any, Callable, Optional

from marinrl import program_audit
from marinrl.config.errors import ConfigError
from marinrl.config.placement import PlacementConfig, tpu_chips_per_host, tpu_head_resource

_UNITS = {"GPU": "GPUs", "CPU": "CPUs", "TPU": "TPU chips"}
_LABEL_AMOUNT = 0.001
"""What `accelerator_type=` asks of the `accelerator_type:<label>` resource (Ray's own convention)."""

TPU_CHIP_BOUNDS = {1: "1,1,1", 2: "1,2,1", 4: "2,2,1", 8: "2,4,1"}
"""`tpu_chips` → the chips' shape (x,y,z) libtpu is told a process holds (what JAX's multi-process tests
use: 4 chips are a 2x2 block, 8 the 2x4 of a v5e-8 / v6e-8 host)."""
SUBHOST_TPU_PORT = 8490
"""The libtpu port of the first actor on part of a TPU host; actor `slot` takes this + slot (libtpu's
own defaults, 8471 and 8476, and JAX's coordinator, 8482, stay below it)."""


def request(placement: PlacementConfig, head: bool = True) -> dict[str, float]:
    """Ray resource name → amount, as the actor's `.options(**ray_options())` asks for them (`head`:
    with the TPU slice's head resource, which only the first host of a slice has)."""
    request: dict[str, float] = {"CPU": float(placement.num_cpus)}
    if placement.num_gpus:
        request["GPU"] = float(placement.num_gpus)
    if placement.tpu is not None:
        request["TPU"] = float(tpu_chips_per_host(placement.tpu))
        if head:
            request[tpu_head_resource(placement.tpu)] = 1.0
    if placement.tpu_chips is not None:
        request["TPU"] = float(placement.tpu_chips)
    if placement.accelerator_type:
        request[f"accelerator_type:{placement.accelerator_type}"] = _LABEL_AMOUNT
    request.update({k: float(v) for k, v in placement.resources.items()})
    return {k: v for k, v in request.items() if v > 0}

def ray_options(placement: PlacementConfig, head: bool = True) -> dict[str, Any]:
    """Keyword arguments of `ActorClass.options(...)` (`head`: as in `request`)."""
    resources = dict(placement.resources)
    if placement.tpu is not None:
        resources["TPU"] = tpu_chips_per_host(placement.tpu)
        if head:
            resources[tpu_head_resource(placement.tpu)] = 1
    if placement.tpu_chips is not None:
        resources["TPU"] = placement.tpu_chips
    options: dict[str, Any] = {"num_cpus": placement.num_cpus, "num_gpus": placement.num_gpus,
                               "resources": resources or None}
    if placement.accelerator_type:
        options["accelerator_type"] = placement.accelerator_type
    return options

def bundles(placement: PlacementConfig) -> list[dict[str, float]]:
    """One placement-group bundle per host: the per-host request, the slice head resource on the first."""
    return [request(placement, head=i == 0) for i in range(placement.hosts())]

def actor_env(placement: PlacementConfig, slot: int) -> dict[str, str]:
    """Environment variables one actor of this role needs beyond the job's (`slot`: the actor's number
    among the job's actors that may share a host, which picks its libtpu port).

    `tpu_chips`: a process on part of a TPU host is a one-process slice of its chips' shape
    (`TPU_CHIPS_PER_PROCESS_BOUNDS`, `TPU_PROCESS_BOUNDS=1,1,1`, under both the current and the older
    `*_HOST_BOUNDS` names; Ray sets the chips, and the bounds only for 1 or 2 of them), with a libtpu
    port of its own and libtpu's one-process-per-host lock lifted (`ALLOW_MULTIPLE_LIBTPU_LOAD`), as
    JAX's own multi-process tests run processes on one host (jax/_src/test_multiprocess.py).
    `TPU_PROCESS_ADDRESSES` stays unset: JAX would take it for a multi-host GKE slice.

    `memory_fraction` without GPUs of the actor's own (the shared mode): the share of the shared GPU, and that
    GPU alone (`shared_gpu`)."""
    env: dict[str, str] = {}
    if placement.tpu_chips is not None:
        bounds, port = TPU_CHIP_BOUNDS[placement.tpu_chips], str(SUBHOST_TPU_PORT + slot)
        env.update(TPU_CHIPS_PER_PROCESS_BOUNDS=bounds, TPU_CHIPS_PER_HOST_BOUNDS=bounds,
                   TPU_PROCESS_BOUNDS="1,1,1", TPU_HOST_BOUNDS="1,1,1", TPU_PROCESS_PORT=port,
                   TPU_MESH_CONTROLLER_ADDRESS=f"localhost:{port}", TPU_MESH_CONTROLLER_PORT=port,
                   ALLOW_MULTIPLE_LIBTPU_LOAD="1")
    if placement.memory_fraction is not None:
        env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{placement.memory_fraction:g}"
        if not placement.num_gpus and placement.tpu is None and placement.tpu_chips is None:
            env["CUDA_VISIBLE_DEVICES"] = shared_gpu()
    return env


def shared_gpu() -> str:
    """The GPU that roles in the shared mode (`num_gpus: 0` with `memory_fraction`) share: the node's first, or
    the first of the driver's own `CUDA_VISIBLE_DEVICES`. Ray gives an actor that asks for no GPU every GPU of
    its node, so without this each role's JAX would spread its mesh over all of them, each taking its fraction
    of every one."""
    visible = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    return visible[0] if visible else "0"


def actor_options(placement: PlacementConfig, slot: int, *, head: bool = True) -> dict:
    """`ActorClass.options(...)` for one actor of a role: its resources, and the environment it needs beyond
    the job's (Ray merges an actor's `env_vars` into the job's): its share of a host's accelerators
    (`actor_env`; `slot` numbers the job's trainers, then its rollout workers), and the program audit's
    switch when the driver has it (`marinrl.program_audit`: on a Ray the job did not start, the actors'
    environment is the cluster's, so the switch travels per actor). `head`: as in `request`."""
    options = ray_options(placement, head)
    env = actor_env(placement, slot)
    if program_audit.auditing():
        env[program_audit.AUDIT_ENV] = os.environ[program_audit.AUDIT_ENV]
    return {**options, "runtime_env": {"env_vars": env}} if env else options


def device_problem(placement: PlacementConfig, field: str, devices: list) -> Optional[str]:
    """Why the accelerators one process of a role sees are not what its placement asked for, in one line, or None:
    their count, and on part of a TPU host that its chips form the block libtpu is told it holds
    (`TPU_CHIP_BOUNDS`: 2×2 for 4 chips). Ray hands an actor `tpu_chips` chips by number (`TPU_VISIBLE_CHIPS`);
    on a host whose chips lie 4×2, chips 0-3 are a row, which the 2×2 bounds do not describe. A process whose
    JAX found no accelerator at all is left to Levanter's `require_accelerator` (and to the CPU tests that
    play a TPU host with Ray's resources)."""
    want = placement.devices()
    accelerators = [d for d in devices if getattr(d, "platform", "cpu") != "cpu"]
    if want is None or placement.hosts() != 1 or not accelerators:
        return None
    kind = placement.accelerator_field.split("=")[0]
    if len(accelerators) != want:
        return (f"{field}.{kind}: asked for {want} device(s) per process, JAX sees {len(accelerators)} "
                f"({', '.join(_device_name(d) for d in accelerators)}); visible: {_visible_accelerators()}")
    coords = [tuple(d.coords) for d in accelerators if getattr(d, "coords", None) is not None]
    if placement.tpu_chips is None or len(coords) != len(accelerators):
        return None
    extent = tuple(max(c[i] for c in coords) - min(c[i] for c in coords) + 1 for i in range(len(coords[0])))
    bounds = tuple(int(b) for b in TPU_CHIP_BOUNDS[placement.tpu_chips].split(","))
    if math.prod(extent) == len(set(coords)) == len(coords) and sorted(extent) == sorted(bounds):
        return None
    return (f"{field}.tpu_chips: the {len(coords)} chips this process got lie at {sorted(coords)}, spanning "
            f"{'x'.join(map(str, extent))}, not the {'x'.join(map(str, bounds))} block libtpu is told it holds "
            f"(TPU_CHIPS_PER_PROCESS_BOUNDS={TPU_CHIP_BOUNDS[placement.tpu_chips]}): this host lays out its chips "
            f"otherwise; give one role the whole host, or split it so each part is a block; visible: "
            f"{_visible_accelerators()}")


def _device_name(device) -> str:
    coords = getattr(device, "coords", None)
    return f"{getattr(device, 'device_kind', device)}:{device.id}" + (f"@{tuple(coords)}" if coords else "")


def _visible_accelerators() -> str:
    names = ("TPU_VISIBLE_CHIPS", "CUDA_VISIBLE_DEVICES", "TPU_CHIPS_PER_PROCESS_BOUNDS")
    return ", ".join(f"{n}={os.environ[n]}" for n in names if n in os.environ) or "no accelerator variables set"


def cpus(placement: PlacementConfig) -> float:
    """CPUs one actor of the role holds over all its hosts."""
    return placement.num_cpus * placement.hosts()


def slice_selectors(placement: PlacementConfig, hosts: int, timeout_s: float) -> Optional[list[dict[str, str]]]:
    """A multi-host trainer's placement-group label selectors: every host on the slice whose head resource a
    probe task takes, host i on its TPU worker i (the `TPU` chips alone could come from hosts of several
    slices). None when the role is not a TPU slice."""
    if placement.tpu is None:
        return None
    import ray
    from ray._raylet import RAY_NODE_TPU_SLICE_NAME_KEY

    head = tpu_head_resource(placement.tpu)
    name = ray.get(ray.remote(num_cpus=0)(_tpu_slice_name).options(resources={head: 1}).remote(), timeout=timeout_s)
    if not name:
        raise RuntimeError(f"the node holding {head} reports no TPU slice name: cannot keep the trainer's "
                           f"{hosts} hosts on one slice")
    return [{RAY_NODE_TPU_SLICE_NAME_KEY: name, "ray.io/tpu-worker-id": str(i)} for i in range(hosts)]


def _tpu_slice_name() -> Optional[str]:
    from ray._private.accelerators.tpu import TPUAcceleratorManager

    return TPUAcceleratorManager.get_current_node_tpu_name()


# ------------------------------------------------------------------------------------ the cluster


def _alive_nodes(nodes: list[dict]) -> list[dict]:
    return [n for n in nodes if n.get("Alive", True)]


def _describe(nodes: list[dict]) -> str:
    parts = []
    for node in nodes:
        res = node.get("Resources", {})
        shown = {k: v for k, v in sorted(res.items())
                 if k in ("CPU", "GPU", "TPU") or not (k.startswith("node:") or k in ("memory", "object_store_memory"))}
        text = ", ".join(f"{k} {v:g}" for k, v in shown.items())
        parts.append(f"{node.get('NodeManagerAddress', '?')}: {text or 'nothing'}")
    return "; ".join(parts) if parts else "none alive"


def _field_of(role: str, key: str, placement: PlacementConfig) -> str:
    if key == "CPU":
        return f"ray.{role}.num_cpus"
    if key == "GPU":
        return f"ray.{role}.num_gpus"
    if key == "TPU" and placement.tpu_chips is not None:
        return f"ray.{role}.tpu_chips"
    if key == "TPU" or (placement.tpu and key == tpu_head_resource(placement.tpu)):
        return f"ray.{role}.tpu"
    if key.startswith("accelerator_type:"):
        return f"ray.{role}.accelerator_type"
    return f"ray.{role}.resources.{key}"


def _what(key: str, amount: float, role: str, placement: PlacementConfig) -> str:
    per = f"per {role}" if role == "trainer" else "per rollout worker"
    if key == "GPU":
        return f"{amount:g} GPUs {per}"
    if key == "CPU":
        return f"{amount:g} CPUs {per}"
    if key == "TPU" and placement.tpu_chips is not None:
        return f"{amount:g} TPU chips {per} (part of one host)"
    if key == "TPU":
        return f"{amount:g} TPU chips {per} (one host of a {placement.tpu})"
    if placement.tpu and key == tpu_head_resource(placement.tpu):
        return f"a {placement.tpu} slice {per} (its head resource {key})"
    if key.startswith("accelerator_type:"):
        return f"a node labelled {key} {per}"
    return f"{key}: {amount:g} {per}"


def _copies(request: dict[str, float], available: dict[str, float]) -> int:
    """How many actors of `request` fit in `available` (one node)."""
    counts = [math.floor(available.get(k, 0.0) / v + 1e-9) for k, v in request.items() if v > 0]
    return min(counts) if counts else 1 << 30


def placement_problem(trainer: PlacementConfig, rollout: PlacementConfig, n_rollout_workers: int,
                      nodes: list[dict], *, spread: bool = True) -> Optional[ConfigError]:
    """None if the trainer's hosts fit `nodes` (as `ray.nodes()` lists them; `spread`: each host on its own
    node, as STRICT_SPREAD places them) and `n_rollout_workers` rollout workers fit the capacity left; else
    the error naming the field to change. Every node that holds the trainer's first host is tried; its
    other hosts go to the nodes that hold the fewest rollout workers first (exact for one host and for
    clusters whose trainer and rollout nodes differ)."""
    alive = _alive_nodes(nodes)
    capacity = [{k: float(v) for k, v in n.get("Resources", {}).items()} for n in alive]
    described = _describe(alive)
    hosts = bundles(trainer)
    r_request = request(rollout)
    for role, placement, ask in (("trainer", trainer, hosts[0]), ("rollout", rollout, r_request)):
        for key, amount in ask.items():  # a resource no node has enough of: the field is clear
            best = max((c.get(key, 0.0) for c in capacity), default=0.0)
            if best < amount:
                have = f"no node has more than {best:g} {_UNITS.get(key, key)}"
                return ConfigError(_field_of(role, key, placement),
                                   f"{_what(key, amount, role, placement)}, but {have} (nodes: {described})")
        if not any(_copies(ask, c) for c in capacity):
            return ConfigError(f"ray.{role}", f"no single node has all of {_fmt(ask)} (nodes: {described})")
    best, placed = 0, False
    for i, node in enumerate(capacity):
        if not _copies(hosts[0], node):
            continue
        left = [dict(c) for c in capacity]
        _take(left[i], hosts[0])
        used = {i}
        for bundle in hosts[1:]:
            fits = [j for j in range(len(left)) if (not spread or j not in used) and _copies(bundle, left[j])]
            if not fits:
                break
            j = min(fits, key=lambda j: _copies(r_request, left[j]))
            _take(left[j], bundle)
            used.add(j)
        else:
            placed = True
            best = max(best, sum(_copies(r_request, c) for c in left))
            if best >= n_rollout_workers:
                return None
    if not placed:
        holding = sum(1 for c in capacity if _copies(hosts[-1], c))
        where = "each on its own node" if spread else "together"
        return ConfigError(f"ray.trainer.{trainer.hosts_field}",
                           f"{len(hosts)} trainer hosts of {_fmt(hosts[-1])} each ({_fmt(hosts[0])} for the first), "
                           f"{where}, but {holding} nodes hold one (nodes: {described})")
    return ConfigError("n_rollout_workers", f"{n_rollout_workers} rollout workers of {_fmt(r_request)} each do not fit "
                                            f"beside the trainer's {_trainer_fmt(hosts)}: at most {best} do (nodes: "
                                            f"{described})")


def _take(node: dict[str, float], request: dict[str, float]) -> None:
    for k, v in request.items():
        node[k] = node.get(k, 0.0) - v


def _trainer_fmt(bundles: list[dict[str, float]]) -> str:
    return _fmt(bundles[0]) if len(bundles) == 1 else f"{len(bundles)} hosts of {_fmt(bundles[-1])}"


def _fmt(request: dict[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in request.items()) + "}"


class AutoscalerRequest:
    """The job's standing request to the cluster's autoscaler (`ray.autoscaler.sdk.request_resources`),
    made while the cluster lacks the nodes the job needs. Ray keeps a request until another replaces it,
    and the autoscaler keeps nodes up for it after the job is gone: `clear` replaces it with an empty one
    when the job ends (idle nodes then go after the cluster's `idle_timeout_minutes`)."""

    def __init__(self):
        self.bundles: Optional[list[dict[str, float]]] = None
        """What this job asked for, while its request stands; None: none."""

    def make(self, bundles: list[dict[str, float]]) -> None:
        from ray.autoscaler.sdk import request_resources

        request_resources(bundles=bundles)
        self.bundles = bundles

    def clear(self) -> None:
        """Withdraws this job's request (nothing if it made none: another job's request stays)."""
        if self.bundles is None:
            return
        from ray.autoscaler.sdk import request_resources

        request_resources(bundles=[])
        self.bundles = None


def check_cluster(trainer: PlacementConfig, rollout: PlacementConfig, n_rollout_workers: int, *,
                  wait_s: float = 0.0, nodes: Optional[Callable[[], list[dict]]] = None,
                  spread: bool = True, autoscaler: Optional[AutoscalerRequest] = None) -> None:
    """Raises the ConfigError of `placement_problem` against the connected Ray's nodes. With `wait_s`
    > 0 (a cluster with an autoscaler) it first asks the autoscaler for the actors' resources (through
    `autoscaler`, which the caller clears when its job ends) and waits that long for nodes that hold them."""
    import ray

    list_nodes = nodes or ray.nodes

    def problem_now():
        return placement_problem(trainer, rollout, n_rollout_workers, list_nodes(), spread=spread)

    problem = problem_now()
    if problem is None or wait_s <= 0:
        if problem is not None:
            raise problem
        return
    (autoscaler or AutoscalerRequest()).make(bundles(trainer) + [request(rollout)] * n_rollout_workers)
    deadline = time.monotonic() + wait_s
    while problem is not None and time.monotonic() < deadline:
        time.sleep(min(5.0, max(0.0, deadline - time.monotonic())))
        problem = problem_now()
    if problem is not None:
        raise ConfigError(problem.field, f"{problem.problem}; waited {wait_s:g} s (ray.placement_timeout_s) for the "
                                         "autoscaler to add nodes that hold it")
