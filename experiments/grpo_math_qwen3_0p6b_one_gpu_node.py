"""GRPO on GSM8K with Qwen3-0.6B on one 8-GPU node (e.g. an `a3-highgpu-8g`, 8 × H100): the trainer
on 4 GPUs, two rollout workers on 2 GPUs each. No cluster: the job starts its own Ray on the node, which
finds the GPUs itself.

    python experiments/grpo_math_qwen3_0p6b_one_gpu_node.py --dry_run     # on a laptop: shapes, memory, FLOPs
    python experiments/grpo_math_qwen3_0p6b_one_gpu_node.py --run_root gs://MY_BUCKET/runs \\
        --model.hf_checkpoint gs://MY_BUCKET/models/Qwen3-0.6B

Everything else is `experiments/grpo_math_qwen3_0p6b.py` (its docstring says where to get the model and
GSM8K; on one node `run_root`, the model and the data may also be local paths). How to get the node and
install marinrl on it: infra/README.md, "One GPU node".

What changes from the cluster recipe: the scan sampler instead of Levanter's engine (on a GPU the engine's
paged attention is Levanter's reference loop: 130 tokens/s on an H100 against the scan sampler's 8,000;
docs/device_check.md), `ray.address: null` (a local Ray) and `num_gpus` per role, no role resources: Ray
gives each actor its own GPUs (`CUDA_VISIBLE_DEVICES`), so each JAX process preallocates only its own GPUs'
memory (docs/scaling.md, "One host"). The trainer shards over 4 GPUs in microbatches of 16 rows per GPU (8
accumulation steps of the step's 512 rows); each rollout worker samples 16 of a step's 32 prompts,
tensor-parallel over its 2 GPUs. Other splits: `--ray.trainer.num_gpus 6
--ray.rollout.num_gpus 2 --n_rollout_workers 1`, or 4 + 4 with one rollout worker.
"""

import pathlib
import runpy

from marinrl.dry_run import DryRunShapes
from marinrl.recipe import recipe_yaml, run_job, run_recipe

_CLUSTER = runpy.run_path(str(pathlib.Path(__file__).with_name("grpo_math_qwen3_0p6b.py")), run_name="recipe")

RECIPE = recipe_yaml(_CLUSTER["RECIPE"], """
run_id: grpo-math-qwen3-0.6b-one-gpu-node
n_rollout_workers: 2
inference:
  backend: scan                   # Levanter's engine has no GPU attention kernel: 50x slower (docs/device_check.md)
ray:
  address: null                   # the job's own Ray on this node
  trainer: {num_gpus: 4}
  rollout: {num_gpus: 2}
""", replace=("ray",))

DRY_RUN = DryRunShapes(prompt_tokens=256, layers=1)


if __name__ == "__main__":
    run_recipe(run_job, RECIPE, dry_run_defaults=DRY_RUN)
