"""Where the trainer and the rollout workers run: what each asks of a Ray node, and whether the
cluster has it, checked before any actor starts.

Each role declares its needs as a `PlacementConfig` (`RayJobConfig.trainer`, `RayJobConfig.rollout`):
CPUs, GPUs, a single-host TPU slice (Ray's TPU resources: the slice's head resource
`TPU-<type>-head` and its host's `TPU` chips), Ray's accelerator label, custom resources. An actor
that asks for no GPU or TPU may still see every accelerator of its node (Ray narrows
`CUDA_VISIBLE_DEVICES` / `TPU_VISIBLE_CHIPS` only for actors that ask for them), so on an accelerator
node each role should ask for its accelerators. Colocated placement (the trainer and the rollout
workers taking turns on the same accelerators) is not supported.

A request Ray cannot satisfy leaves the actor pending forever; `check_cluster` turns that into one
error naming the field and what the cluster has, from `ray.nodes()`: the trainer must fit one node
and the rollout workers the capacity left beside it.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Callable, Optional

from marinrl.preflight import ConfigError

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
    """A TPU slice type (e.g. `v5litepod-8`, `v6e-4`, `v5p-8`): the actor takes the slice's head resource
    `TPU-<type>-head` and every chip of its host (`TPU`). RLJob refuses a multi-host slice (one process
    per host is the multi-host trainer, issue 10 §3)."""
    accelerator_type: Optional[str] = None
    """Ray's accelerator label of the node (e.g. `H100`, `A100`, `TPU-V6E`); None: any."""
    resources: dict = dataclasses.field(default_factory=dict)
    """Custom Ray resources (e.g. {"trainer": 1}), for clusters whose node types declare one per role."""

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
        for name, amount in self.resources.items():
            if not isinstance(name, str) or not isinstance(amount, (int, float)) or not amount > 0:
                raise ConfigError(f"{field}.resources", f"must map resource names to amounts > 0, got "
                                                        f"{self.resources!r}")
            if name in ("CPU", "GPU", "TPU", "memory"):
                raise ConfigError(f"{field}.resources.{name}", f"use {field}.{_FIELD_OF.get(name, 'num_cpus')} "
                                                               f"for {name}")

    def request(self) -> dict[str, float]:
        """Ray resource name → amount, as the actor's `.options(**ray_options())` asks for them."""
        request: dict[str, float] = {"CPU": float(self.num_cpus)}
        if self.num_gpus:
            request["GPU"] = float(self.num_gpus)
        if self.tpu is not None:
            request["TPU"] = float(tpu_chips_per_host(self.tpu))
            request[tpu_head_resource(self.tpu)] = 1.0
        if self.accelerator_type:
            request[f"accelerator_type:{self.accelerator_type}"] = _LABEL_AMOUNT
        request.update({k: float(v) for k, v in self.resources.items()})
        return {k: v for k, v in request.items() if v > 0}

    def ray_options(self) -> dict[str, Any]:
        """Keyword arguments of `ActorClass.options(...)`."""
        resources = dict(self.resources)
        if self.tpu is not None:
            resources["TPU"] = tpu_chips_per_host(self.tpu)
            resources[tpu_head_resource(self.tpu)] = 1
        options: dict[str, Any] = {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus,
                                   "resources": resources or None}
        if self.accelerator_type:
            options["accelerator_type"] = self.accelerator_type
        return options

    def hosts(self) -> int:
        """Hosts of the TPU slice (1 without a TPU)."""
        return tpu_hosts(self.tpu) if self.tpu is not None else 1

    @property
    def has_accelerator(self) -> bool:
        return bool(self.num_gpus or self.tpu)

    def devices(self) -> Optional[int]:
        """JAX devices the actor will see, when the placement fixes them (None on CPU)."""
        if self.num_gpus:
            return self.num_gpus
        if self.tpu is not None:
            from ray._private.accelerators import tpu

            cores = tpu.get_tpu_cores_per_chip(self.tpu)  # v2/v3: one JAX device per core; v4 on: per chip
            return tpu_chips_per_host(self.tpu) * (cores if self.tpu.startswith(("v2", "v3")) else 1)
        return None


_FIELD_OF = {"GPU": "num_gpus", "TPU": "tpu", "CPU": "num_cpus"}
_UNITS = {"GPU": "GPUs", "CPU": "CPUs", "TPU": "TPU chips"}


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
                      nodes: list[dict]) -> Optional[ConfigError]:
    """None if the trainer fits one of `nodes` (as `ray.nodes()` lists them) and `n_rollout_workers`
    rollout workers fit the capacity left; else the error naming the field to change. Exact: the
    trainer is tried on every node that holds it, the identical rollout workers counted per node."""
    alive = _alive_nodes(nodes)
    capacity = [{k: float(v) for k, v in n.get("Resources", {}).items()} for n in alive]
    described = _describe(alive)
    for role, placement, count in (("trainer", trainer, 1), ("rollout", rollout, n_rollout_workers)):
        request = placement.request()
        for key, amount in request.items():  # a resource no node has enough of: the field is clear
            best = max((c.get(key, 0.0) for c in capacity), default=0.0)
            if best < amount:
                have = f"no node has more than {best:g} {_UNITS.get(key, key)}"
                return ConfigError(_field_of(role, key, placement),
                                   f"{_what(key, amount, role, placement)}, but {have} (nodes: {described})")
        if not any(_copies(request, c) for c in capacity):
            return ConfigError(f"ray.{role}", f"no single node has all of {_fmt(request)} (nodes: {described})")
    t_request, r_request = trainer.request(), rollout.request()
    best = 0
    for i, node in enumerate(capacity):
        if not _copies(t_request, node):
            continue
        left = dict(node)
        for k, v in t_request.items():
            left[k] = left.get(k, 0.0) - v
        best = max(best, sum(_copies(r_request, left if j == i else c) for j, c in enumerate(capacity)))
        if best >= n_rollout_workers:
            return None
    return ConfigError("n_rollout_workers", f"{n_rollout_workers} rollout workers of {_fmt(r_request)} each do not fit "
                                            f"beside the trainer's {_fmt(t_request)}: at most {best} do (nodes: "
                                            f"{described})")


def _fmt(request: dict[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in request.items()) + "}"


def check_cluster(trainer: PlacementConfig, rollout: PlacementConfig, n_rollout_workers: int, *,
                  wait_s: float = 0.0, nodes: Optional[Callable[[], list[dict]]] = None) -> None:
    """Raises the ConfigError of `placement_problem` against the connected Ray's nodes. With `wait_s`
    > 0 (a cluster with an autoscaler) it first asks the autoscaler for the actors' resources and
    waits that long for nodes that hold them."""
    import ray

    list_nodes = nodes or ray.nodes
    problem = placement_problem(trainer, rollout, n_rollout_workers, list_nodes())
    if problem is None or wait_s <= 0:
        if problem is not None:
            raise problem
        return
    from ray.autoscaler.sdk import request_resources

    request_resources(bundles=[trainer.request()] + [rollout.request()] * n_rollout_workers)
    deadline = time.monotonic() + wait_s
    while problem is not None and time.monotonic() < deadline:
        time.sleep(min(5.0, max(0.0, deadline - time.monotonic())))
        problem = placement_problem(trainer, rollout, n_rollout_workers, list_nodes())
    if problem is not None:
        raise ConfigError(problem.field, f"{problem.problem}; waited {wait_s:g} s (ray.placement_timeout_s) for the "
                                         "autoscaler to add nodes that hold it")
