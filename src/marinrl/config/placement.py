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
actor its own GPUs or chips; `job/placement.actor_env` adds what libtpu needs to run a process on part of a host.
Colocated placement (the trainer and the rollout workers taking turns on the same accelerators) is
not supported.

This module is the data and its checks; `marinrl/job/placement.py` turns it into Ray's requests and each
actor's environment, and checks the cluster holds the job, before any actor starts.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

from marinrl.config.errors import ConfigError

ROLES = ("trainer", "rollout")
CURRICULUM_CPUS = 0
"""The curriculum actor asks for nothing: it is placed anywhere."""


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
            if self.tpu is not None or self.num_gpus:
                other = f"tpu={self.tpu!r}" if self.tpu else f"num_gpus={self.num_gpus}"
                raise ConfigError(f"{field}.tpu_chips", f"{self.tpu_chips} chips of one host and {other}: "
                                                        "ask for one kind of accelerator")
            if self.tpu_chips not in TPU_VALID_CHIP_OPTIONS or isinstance(self.tpu_chips, bool):
                raise ConfigError(f"{field}.tpu_chips", f"must be one of {list(TPU_VALID_CHIP_OPTIONS)} (the chip "
                                                        f"counts Ray gives a TPU actor), got {self.tpu_chips!r}")
            if self.num_hosts not in (None, 1):
                raise ConfigError(f"{field}.num_hosts", f"{self.num_hosts} hosts with tpu_chips: a trainer over "
                                                        "several TPU hosts takes whole hosts (set tpu to the "
                                                        "slice type)")
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

    def hosts(self) -> int:
        """Processes of this role's one actor, one per host: `num_hosts`, else the TPU slice's hosts, else 1."""
        if self.num_hosts is not None:
            return self.num_hosts
        return tpu_hosts(self.tpu) if self.tpu is not None else 1

    @property
    def hosts_field(self) -> str:
        """The field that sets `hosts()`."""
        return "tpu" if self.tpu is not None and self.num_hosts is None else "num_hosts"

    @property
    def hosts_setting(self):
        """The value of `hosts_field` (for messages)."""
        return self.tpu if self.hosts_field == "tpu" else self.num_hosts

    @property
    def has_accelerator(self) -> bool:
        return bool(self.num_gpus or self.tpu or self.tpu_chips)

    @property
    def tpu_generation(self) -> Optional[str]:
        """`v5litepod` of `tpu: v5litepod-4`, or of `accelerator_type: TPU-V5LITEPOD`; None if neither says."""
        if self.tpu:
            return self.tpu.rpartition("-")[0]
        label = (self.accelerator_type or "").lower()
        return label.removeprefix("tpu-") if label.startswith("tpu-") else None

    @property
    def device(self) -> tuple[str, Optional[str], Optional[float]]:
        """(kind: `cpu`, `gpu` or `tpu`; the device's name: a GPU's `accelerator_type` or a TPU's generation,
        None where none is named; the share of a GPU's memory this role may use, None for the default): what
        the dry run sizes an engine's cache by."""
        if not self.has_accelerator:
            return "cpu", None, None
        if self.num_gpus:
            return "gpu", self.accelerator_type, self.memory_fraction
        return "tpu", self.tpu_generation, None

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
            cores = tpu_cores_per_chip(self.tpu)  # v2/v3: one JAX device per core; v4 on: per chip
            return tpu_chips_per_host(self.tpu) * (cores if self.tpu.startswith(("v2", "v3")) else 1)
        return None


_FIELD_OF = {"GPU": "num_gpus", "TPU": "tpu", "CPU": "num_cpus"}


# ------------------------------------------------------------------------------------ TPU slices


TPU_GENERATIONS = ("v2", "v3", "v4", "v5p", "v5litepod", "v6e", "v7x")
"""The slice generations Ray schedules (`ray._private.accelerators.tpu.VALID_TPU_TYPES`). This module keeps
Ray's arithmetic of a slice type as a table of its own, so that the config layer (and `marinrl plan`) never
imports Ray; tests/test_placement.py holds every function below equal to Ray's."""
TPU_ONE_CORE_PER_CHIP = ("v5litepod", "v6e")
"""Generations whose slice size counts chips; the others count TensorCores, two a chip."""
TPU_CHIPS_PER_HOST = 4
"""Chips a host of a multi-host slice holds (a v5litepod or v6e slice of at most 8 chips is one host of all)."""
TPU_VALID_CHIP_OPTIONS = (1, 2, 4, 8)
"""The chip counts Ray gives one TPU actor (`tpu_chips`)."""


def _check_tpu_type(accelerator: str, field: str) -> None:
    generation, _, size = str(accelerator).rpartition("-")
    if generation not in TPU_GENERATIONS or not size.isdigit() or int(size) < 1:
        raise ConfigError(field, f"{accelerator!r} is not a TPU slice type Ray knows (<generation>-<size> with "
                                 f"generation in {list(TPU_GENERATIONS)}, e.g. v5litepod-8, v6e-4, v5p-8)")


def tpu_cores_per_chip(accelerator: str) -> int:
    return 1 if accelerator.startswith(TPU_ONE_CORE_PER_CHIP) else 2


def tpu_total_chips(accelerator: str) -> int:
    """The chips of a slice type (`v5p-64`: 32 chips of two cores; `v6e-16`: 16)."""
    return int(accelerator.rpartition("-")[2]) // tpu_cores_per_chip(accelerator)


def tpu_chips_per_host(accelerator: str) -> int:
    total = tpu_total_chips(accelerator)
    if accelerator.startswith(TPU_ONE_CORE_PER_CHIP) and total <= 8:
        return total
    return min(TPU_CHIPS_PER_HOST, total)


def tpu_hosts(accelerator: str, field: str = "tpu") -> int:
    _check_tpu_type(accelerator, field)
    total = tpu_total_chips(accelerator)
    if total < 1:
        raise ConfigError(field, f"{accelerator!r} has no whole chip")
    return max(1, math.ceil(total / tpu_chips_per_host(accelerator)))


def tpu_head_resource(accelerator: str) -> str:
    """The resource Ray puts on host 0 of every slice of this type (one per slice)."""
    return f"TPU-{accelerator}-head"
