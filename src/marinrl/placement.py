"""Where the trainer and the rollout workers run: what each asks of a Ray node, and whether the
cluster has it, checked before any actor starts.

Each role declares its needs as a `PlacementConfig` (`RayJobConfig.trainer`, `RayJobConfig.rollout`):
CPUs, GPUs, a TPU slice (Ray's TPU resources: the slice's head resource `TPU-<type>-head` and each
host's `TPU` chips) or some chips of one TPU host (`tpu_chips`), Ray's accelerator label, custom
resources, and for the trainer how many hosts it spans (one process per host: `num_hosts`, or a
multi-host `tpu` slice's hosts). An actor that asks for no GPU or TPU may still see every accelerator
of its node (Ray narrows `CUDA_VISIBLE_DEVICES` / `TPU_VISIBLE_CHIPS` only for actors that ask for
them), so on an accelerator node each role should ask for its accelerators.

One host split between the roles (docs/scaling.md, "One host"): `num_gpus` per role on one GPU node, or
`tpu_chips` per role on one TPU VM (no slice head resource, so both roles fit the host). Ray gives each
actor its own GPUs or chips; `actor_env` adds what libtpu needs to run a process on part of a host.
Colocated placement (the trainer and the rollout workers taking turns on the same accelerators) is
not supported.

A request Ray cannot satisfy leaves the actor pending forever; `check_cluster` turns that into one
error naming the field and what the cluster has, from `ray.nodes()`: the trainer must fit one node
(one bundle per host, each host on its own node on a cluster) and the rollout workers the capacity
left beside it.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Callable, Optional

from marinrl.config_errors import ConfigError

ROLES = ("trainer", "rollout")
CURRICULUM_CPUS = 0
"""The curriculum actor asks for nothing: it is placed anywhere."""
_LABEL_AMOUNT = 0.001
"""What `accelerator_type=` asks of the `accelerator_type:<label>` resource (Ray's own convention)."""


@dataclasses.dataclass(frozen=True)
class PlacementConfig:
    """What one actor of a role needs from one Ray node."""

    num_cpus: float = 1
    """Logical CPUs."""
    num_gpus: int = 0
    """GPUs; Ray gives the actor that many (`CUDA_VISIBLE_DEVICES`) and its JAX uses all of them."""
    tpu: Optional[str] = None
    """A TPU slice type (e.g. `v5litepod-8`, `v6e-4`, `v5p-8`, `v5p-64`): each host's process takes every
    chip of its host (`TPU`), the first also the slice's head resource `TPU-<type>-head`. A multi-host
    slice (`v5p-64`: 8 hosts) is a trainer of one process per host (docs/multihost.md); a rollout worker
    is one host."""
    tpu_chips: Optional[int] = None
    """Some chips of one TPU host, without the slice head resource, so that the roles share a host
    (e.g. trainer 4 + rollout 4 on one v5e-8 / v6e-8): 1, 2, 4 or 8, the counts Ray gives a TPU actor.
    Ray picks the chips (`TPU_VISIBLE_CHIPS`); the actor also gets the process bounds and a libtpu port
    of its own (`actor_env`). One JAX device per chip (v4 and later)."""
    memory_fraction: Optional[float] = None
    """`XLA_PYTHON_CLIENT_MEM_FRACTION` for this role's actors: the share of each visible GPU's memory
    JAX preallocates (JAX's default 0.75). Set it where roles share a GPU (e.g. one GPU and `num_gpus`
    0: trainer 0.5, rollout 0.3); None: JAX's default."""
    accelerator_type: Optional[str] = None
    """Ray's accelerator label of the node (e.g. `H100`, `A100`, `TPU-V6E`); None: any."""
    resources: dict = dataclasses.field(default_factory=dict)
    """Custom Ray resources (e.g. {"trainer": 1}), for clusters whose node types declare one per role."""
    num_hosts: Optional[int] = None
    """Trainer only: processes, one per host, that form one global mesh (docs/multihost.md); every field
    above is per host. None: the hosts of the `tpu` slice (`v5p-64`: 8), else 1."""

    def errors(self, field: str) -> None:
        """Raises ConfigError naming the first bad field under `field` (e.g. `ray.trainer`)."""
        if not (math.isfinite(self.num_cpus) and self.num_cpus >= 0):
            raise ConfigError(f"{field}.num_cpus", f"must be >= 0, got {self.num_cpus}")
        if not isinstance(self.num_gpus, int) or self.num_gpus < 0:
            raise ConfigError(f"{field}.num_gpus", f"must be a whole number >= 0, got {self.num_gpus!r} (a "
                                                   "fraction of a GPU would share it with another JAX process, "
                                                   "each preallocating most of its memory)")
        if self.tpu is not None:
            if self.num_gpus:
                raise ConfigError(f"{field}.tpu", f"{self.tpu!r} and num_gpus={self.num_gpus}: ask for one kind "
                                                  "of accelerator")
            tpu_hosts(self.tpu, f"{field}.tpu")
        if self.tpu_chips is not None:
            from ray._private.accelerators.tpu import TPU_VALID_CHIP_OPTIONS

            if self.tpu is not None or self.num_gpus:
                raise ConfigError(f"{field}.tpu_chips", f"{self.tpu_chips} chips of one host and "
                                                        f"{'tpu=' + repr(self.tpu) if self.tpu else f'num_gpus={self.num_gpus}'}: "
                                                        "ask for one kind of accelerator")
            if self.tpu_chips not in TPU_VALID_CHIP_OPTIONS or isinstance(self.tpu_chips, bool):
                raise ConfigError(f"{field}.tpu_chips", f"must be one of {list(TPU_VALID_CHIP_OPTIONS)} (the chip "
                                                        f"counts Ray gives a TPU actor), got {self.tpu_chips!r}")
            if self.num_hosts not in (None, 1):
                raise ConfigError(f"{field}.num_hosts", f"{self.num_hosts} hosts with tpu_chips: a trainer over "
                                                        "several TPU hosts takes whole hosts (set tpu to the slice type)")
        if self.memory_fraction is not None and not 0 < self.memory_fraction <= 1:
            raise ConfigError(f"{field}.memory_fraction", f"must be in (0, 1] or null, got {self.memory_fraction}")
        if self.num_hosts is not None:
            if not isinstance(self.num_hosts, int) or self.num_hosts < 1:
                raise ConfigError(f"{field}.num_hosts", f"must be a whole number >= 1 or null, got {self.num_hosts!r}")
            if self.tpu is not None and self.num_hosts != tpu_hosts(self.tpu):
                raise ConfigError(f"{field}.num_hosts", f"{self.num_hosts} hosts, but a {self.tpu} slice has "
                                                        f"{tpu_hosts(self.tpu)}: leave num_hosts unset with a tpu")
        for name, amount in self.resources.items():
            if not isinstance(name, str) or not isinstance(amount, (int, float)) or not amount > 0:
                raise ConfigError(f"{field}.resources", f"must map resource names to amounts > 0, got "
                                                        f"{self.resources!r}")
            if name in ("CPU", "GPU", "TPU", "memory"):
                raise ConfigError(f"{field}.resources.{name}", f"use {field}.{_FIELD_OF.get(name, 'num_cpus')} "
                                                               f"for {name}")

    def request(self, head: bool = True) -> dict[str, float]:
        """Ray resource name → amount, as the actor's `.options(**ray_options())` asks for them (`head`:
        with the TPU slice's head resource, which only the first host of a slice has)."""
        request: dict[str, float] = {"CPU": float(self.num_cpus)}
        if self.num_gpus:
            request["GPU"] = float(self.num_gpus)
        if self.tpu is not None:
            request["TPU"] = float(tpu_chips_per_host(self.tpu))
            if head:
                request[tpu_head_resource(self.tpu)] = 1.0
        if self.tpu_chips is not None:
            request["TPU"] = float(self.tpu_chips)
        if self.accelerator_type:
            request[f"accelerator_type:{self.accelerator_type}"] = _LABEL_AMOUNT
        request.update({k: float(v) for k, v in self.resources.items()})
        return {k: v for k, v in request.items() if v > 0}

    def ray_options(self, head: bool = True) -> dict[str, Any]:
        """Keyword arguments of `ActorClass.options(...)` (`head`: as in `request`)."""
        resources = dict(self.resources)
        if self.tpu is not None:
            resources["TPU"] = tpu_chips_per_host(self.tpu)
            if head:
                resources[tpu_head_resource(self.tpu)] = 1
        if self.tpu_chips is not None:
            resources["TPU"] = self.tpu_chips
        options: dict[str, Any] = {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus,
                                   "resources": resources or None}
        if self.accelerator_type:
            options["accelerator_type"] = self.accelerator_type
        return options

    def hosts(self) -> int:
        """Processes of this role's one actor, one per host: `num_hosts`, else the TPU slice's hosts, else 1."""
        if self.num_hosts is not None:
            return self.num_hosts
        return tpu_hosts(self.tpu) if self.tpu is not None else 1

    def bundles(self) -> list[dict[str, float]]:
        """One placement-group bundle per host: the per-host request, the slice head resource on the first."""
        return [self.request(head=i == 0) for i in range(self.hosts())]

    def actor_env(self, slot: int) -> dict[str, str]:
        """Environment variables one actor of this role needs beyond the job's (`slot`: the actor's number
        among the job's actors that may share a host, which picks its libtpu port).

        `tpu_chips`: a process on part of a TPU host is a one-process slice of its chips' shape
        (`TPU_CHIPS_PER_PROCESS_BOUNDS`, `TPU_PROCESS_BOUNDS=1,1,1`, under both the current and the older
        `*_HOST_BOUNDS` names; Ray sets the chips, and the bounds only for 1 or 2 of them), with a libtpu
        port of its own and libtpu's one-process-per-host lock lifted (`ALLOW_MULTIPLE_LIBTPU_LOAD`), as
        JAX's own multi-process tests run processes on one host (jax/_src/test_multiprocess.py).
        `TPU_PROCESS_ADDRESSES` stays unset: JAX would take it for a multi-host GKE slice."""
        env: dict[str, str] = {}
        if self.tpu_chips is not None:
            bounds, port = TPU_CHIP_BOUNDS[self.tpu_chips], str(SUBHOST_TPU_PORT + slot)
            env.update(TPU_CHIPS_PER_PROCESS_BOUNDS=bounds, TPU_CHIPS_PER_HOST_BOUNDS=bounds,
                       TPU_PROCESS_BOUNDS="1,1,1", TPU_HOST_BOUNDS="1,1,1", TPU_PROCESS_PORT=port,
                       TPU_MESH_CONTROLLER_ADDRESS=f"localhost:{port}", TPU_MESH_CONTROLLER_PORT=port,
                       ALLOW_MULTIPLE_LIBTPU_LOAD="1")
        if self.memory_fraction is not None:
            env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{self.memory_fraction:g}"
        return env

    @property
    def hosts_field(self) -> str:
        """The field that sets `hosts()`."""
        return "tpu" if self.tpu is not None and self.num_hosts is None else "num_hosts"

    @property
    def has_accelerator(self) -> bool:
        return bool(self.num_gpus or self.tpu or self.tpu_chips)

    @property
    def accelerator_field(self) -> str:
        """The field that sets this role's accelerators, as `field=value` (for messages)."""
        if self.tpu_chips is not None:
            return f"tpu_chips={self.tpu_chips}"
        return f"num_gpus={self.num_gpus}" if self.num_gpus else f"tpu={self.tpu}"

    def devices(self) -> Optional[int]:
        """JAX devices one host's process will see, when the placement fixes them (None on CPU)."""
        if self.num_gpus:
            return self.num_gpus
        if self.tpu_chips is not None:
            return self.tpu_chips
        if self.tpu is not None:
            from ray._private.accelerators import tpu

            cores = tpu.get_tpu_cores_per_chip(self.tpu)  # v2/v3: one JAX device per core; v4 on: per chip
            return tpu_chips_per_host(self.tpu) * (cores if self.tpu.startswith(("v2", "v3")) else 1)
        return None


_FIELD_OF = {"GPU": "num_gpus", "TPU": "tpu", "CPU": "num_cpus"}
_UNITS = {"GPU": "GPUs", "CPU": "CPUs", "TPU": "TPU chips"}
TPU_CHIP_BOUNDS = {1: "1,1,1", 2: "1,2,1", 4: "2,2,1", 8: "2,4,1"}
"""`tpu_chips` → the chips' shape (x,y,z) libtpu is told a process holds (what JAX's multi-process tests
use: 4 chips are a 2x2 block, 8 the 2x4 of a v5e-8 / v6e-8 host)."""
SUBHOST_TPU_PORT = 8490
"""The libtpu port of the first actor on part of a TPU host; actor `slot` takes this + slot (libtpu's
own defaults, 8471 and 8476, and JAX's coordinator, 8482, stay below it)."""


# ------------------------------------------------------------------------------------ TPU slices


def _check_tpu_type(accelerator: str, field: str) -> None:
    from ray._private.accelerators import tpu

    generation, _, size = str(accelerator).rpartition("-")
    if generation not in tpu.VALID_TPU_TYPES or not size.isdigit() or int(size) < 1:
        raise ConfigError(field, f"{accelerator!r} is not a TPU slice type Ray knows (<generation>-<size> with "
                                 f"generation in {list(tpu.VALID_TPU_TYPES)}, e.g. v5litepod-8, v6e-4, v5p-8)")


def tpu_chips_per_host(accelerator: str) -> int:
    from ray._private.accelerators import tpu

    return min(tpu.get_num_tpu_visible_chips_per_host(accelerator),
               tpu.get_total_chips_from_accelerator_type(accelerator))


def tpu_hosts(accelerator: str, field: str = "tpu") -> int:
    from ray._private.accelerators import tpu

    _check_tpu_type(accelerator, field)
    total = tpu.get_total_chips_from_accelerator_type(accelerator)
    if total < 1:
        raise ConfigError(field, f"{accelerator!r} has no whole chip")
    return max(1, math.ceil(total / tpu_chips_per_host(accelerator)))


def tpu_head_resource(accelerator: str) -> str:
    """The resource Ray puts on host 0 of every slice of this type (one per slice)."""
    return f"TPU-{accelerator}-head"


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
    bundles = trainer.bundles()
    for role, placement, request in (("trainer", trainer, bundles[0]), ("rollout", rollout, rollout.request())):
        for key, amount in request.items():  # a resource no node has enough of: the field is clear
            best = max((c.get(key, 0.0) for c in capacity), default=0.0)
            if best < amount:
                have = f"no node has more than {best:g} {_UNITS.get(key, key)}"
                return ConfigError(_field_of(role, key, placement),
                                   f"{_what(key, amount, role, placement)}, but {have} (nodes: {described})")
        if not any(_copies(request, c) for c in capacity):
            return ConfigError(f"ray.{role}", f"no single node has all of {_fmt(request)} (nodes: {described})")
    r_request = rollout.request()
    best, placed = 0, False
    for i, node in enumerate(capacity):
        if not _copies(bundles[0], node):
            continue
        left = [dict(c) for c in capacity]
        _take(left[i], bundles[0])
        used = {i}
        for bundle in bundles[1:]:
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
        hosts = len(bundles)
        holding = sum(1 for c in capacity if _copies(bundles[-1], c))
        where = "each on its own node" if spread else "together"
        return ConfigError(f"ray.trainer.{trainer.hosts_field}",
                           f"{hosts} trainer hosts of {_fmt(bundles[-1])} each ({_fmt(bundles[0])} for the first), "
                           f"{where}, but {holding} nodes hold one (nodes: {described})")
    return ConfigError("n_rollout_workers", f"{n_rollout_workers} rollout workers of {_fmt(r_request)} each do not fit "
                                            f"beside the trainer's {_trainer_fmt(bundles)}: at most {best} do (nodes: "
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
    (autoscaler or AutoscalerRequest()).make(trainer.bundles() + [rollout.request()] * n_rollout_workers)
    deadline = time.monotonic() + wait_s
    while problem is not None and time.monotonic() < deadline:
        time.sleep(min(5.0, max(0.0, deadline - time.monotonic())))
        problem = problem_now()
    if problem is not None:
        raise ConfigError(problem.field, f"{problem.problem}; waited {wait_s:g} s (ray.placement_timeout_s) for the "
                                         "autoscaler to add nodes that hold it")
