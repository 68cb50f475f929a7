"""The dry run of a job config: what its programs are, what each role holds per device, and how many
FLOPs a step takes, at the config's real shapes on a laptop (fake CPU devices, no weights: the model,
the optimizer state and the engine's cache are abstract, `eqx.filter_eval_shape`), so an 8B recipe checks
before a TPU is rented. What breaks first on a pod is a mesh that does not divide the model, a batch
that does not divide the mesh, a program that does not compile, or a state that does not fit a chip.

- `programs.py`: the trainer's step (lowered) and the rollout backend the job runs (`inference.backend`),
  lowered and compiled: for `engine`, Levanter's `_run_prefill` and `_run_generation_loop` over its paged
  KV cache; for `scan`, the scan sampler. With `DryRunShapes.layers` layers, on the trainer's and a
  rollout worker's meshes.
- `memory.py`: `predicted_memory(job, role, n_devices) -> MemoryPlan`, per device by component (exact from
  shapes and shardings, except activations and the rollout working set, estimates), and its peak; the update's
  `auto` gradient checkpointing and microbatch, chosen from it (`choose_update_memory`).
- `meshes.py`: the roles' meshes from the job's placements and mesh settings (device counts, the trainer's FSDP
  mesh, the rollout's tensor-parallel axis).
- `working_set.py`: the estimated parts of that memory, from shapes: a trainer microbatch's activations and LM-head
  buffers, a rollout step's working set.
- `engine_cache.py`: the engine's KV cache as a rollout worker's engine sizes it (its pages on the role's
  device kind), from shapes.
- `shapes.py`: the model as abstract arrays, and the bytes of a pytree's shard on a mesh.
- `flops.py`: train FLOPs twice (model: 6·N·T + attention; executed: with the gradient-checkpointing
  recompute) and generation FLOPs of a whole batch (every prompt's prefill and every decode step of
  every row), from shapes, one rule for every recipe.

The devices are the trainer's: `ray.trainer` fixes their number (`tpu: v5p-64` → 32), the process must
have that many (`XLA_FLAGS=--xla_force_host_platform_device_count=N`, set before JAX loads: see
`marinrl.recipe`). A rollout worker's mesh takes the first `ray.rollout.devices()` of them.

The fleet planner (`fleet.py`, and what a config gives it: `fleet_inputs.py`; `marinrl plan`) and `flops.py` are
pure arithmetic that imports nothing heavy, so the names below (JAX, Levanter) load only when one is asked for:
importing `marinrl.dry_run.fleet` loads neither.
"""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from marinrl.dry_run.memory import MemoryPlan, predicted_memory
    from marinrl.dry_run.meshes import rollout_devices, trainer_devices
    from marinrl.dry_run.report import DryRunReport, DryRunShapes, dry_run

__all__ = ["DryRunReport", "DryRunShapes", "MemoryPlan", "dry_run", "predicted_memory", "rollout_devices",
           "trainer_devices"]


def __getattr__(name: str):
    if name in ("MemoryPlan", "predicted_memory"):
        from marinrl.dry_run import memory

        return getattr(memory, name)
    if name in ("rollout_devices", "trainer_devices"):
        from marinrl.dry_run import meshes

        return getattr(meshes, name)
    if name in ("DryRunReport", "DryRunShapes", "dry_run"):
        from marinrl.dry_run import report

        return getattr(report, name)
    raise AttributeError(f"module 'marinrl.dry_run' has no attribute {name!r}")
