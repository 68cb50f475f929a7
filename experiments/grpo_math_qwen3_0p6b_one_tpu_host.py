"""GRPO on GSM8K with Qwen3-0.6B on one TPU VM: a v5e-8 (`v5litepod-8`) or v6e-8 host, its 8 chips split
between the trainer (4) and one rollout worker (4). No cluster: the job starts its own Ray on the VM,
which finds the host's chips itself.

    python experiments/grpo_math_qwen3_0p6b_one_tpu_host.py --dry_run     # on a laptop: shapes, memory, FLOPs
    python experiments/grpo_math_qwen3_0p6b_one_tpu_host.py --run_root gs://MY_BUCKET/runs \\
        --model.hf_checkpoint gs://MY_BUCKET/models/Qwen3-0.6B

Everything else is `experiments/grpo_math_qwen3_0p6b.py` (its docstring says where to get the model and
GSM8K; on one host `run_root`, the model and the data may also be local paths). How to get the VM and
install marinrl on it: infra/README.md, "One TPU VM".

What changes from the cluster recipe: `ray.address: null` (a local Ray) and `tpu_chips: 4` per role
(`ray.trainer` / `ray.rollout`): 4 chips each, no slice head resource, so both fit the host; Ray gives
each its own chips and the job tells libtpu each process's share (docs/scaling.md, "One host"). The
trainer shards over 4 chips instead of 8 (twice the parameter, gradient and AdamW bytes per chip: the dry
run predicts 7.8 GiB per chip of a v5e's 16); one rollout worker (`n_rollout_workers: 1`) samples all 32
prompts of a step on the other 4, tensor-parallel as on a `v5litepod-4` rollout host. Other splits: `2`
chips per rollout worker and `--n_rollout_workers 2`; or a trainer of 2 chips.
"""

import pathlib
import runpy

from marinrl.dry_run import DryRunShapes
from marinrl.recipe import recipe_yaml, run_job, run_recipe

_CLUSTER = runpy.run_path(str(pathlib.Path(__file__).with_name("grpo_math_qwen3_0p6b.py")), run_name="recipe")

RECIPE = recipe_yaml(_CLUSTER["RECIPE"], """
run_id: grpo-math-qwen3-0.6b-one-tpu-host
n_rollout_workers: 1
ray:
  address: null                   # the job's own Ray on this VM
  trainer: {tpu_chips: 4}
  rollout: {tpu_chips: 4}
""", replace=("ray",))

DRY_RUN = DryRunShapes(prompt_tokens=256, layers=1)


if __name__ == "__main__":
    run_recipe(run_job, RECIPE, dry_run_defaults=DRY_RUN)
