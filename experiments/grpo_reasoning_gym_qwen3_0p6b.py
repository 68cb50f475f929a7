"""GRPO with Qwen3-0.6B on a reasoning-gym curriculum instead of GSM8K: arithmetic at rising difficulty,
then countdown, then a logic task (docs/environments.md, "reasoning-gym"). Everything else is the 0.6B
GSM8K recipe (experiments/grpo_math_qwen3_0p6b.py: the model, the hosts, the settings this scale needs,
how to run it on GPUs); the tasks are generated procedurally, so the only input to copy to a bucket is
the model.

    python experiments/grpo_reasoning_gym_qwen3_0p6b.py --dry_run      # on a laptop: shapes, memory, FLOPs
    python experiments/grpo_reasoning_gym_qwen3_0p6b.py --run_root gs://MY_BUCKET/runs \
        --model.hf_checkpoint gs://MY_BUCKET/models/Qwen3-0.6B

The curriculum (docs/curriculum.md, "Levels"): `basic_arithmetic` at reasoning-gym curriculum levels 0,
1 and 2 (more terms, more digits), each level unlocking when the one below reaches 0.8 and no longer
sampled once that level graduates; `countdown` (reach a target with given numbers: a search) once the
last arithmetic level reaches 0.8; `knights_knaves` (who lies?) once countdown reaches 0.5. Answers go in
`<answer>…</answer>` (reasoning-gym's default system prompt), scored by each task's own scorer.
"""

import pathlib
import runpy

from marinrl.recipe import recipe_yaml, run_job, run_recipe

_GSM8K = runpy.run_path(str(pathlib.Path(__file__).with_name("grpo_math_qwen3_0p6b.py")), run_name="recipe")

RECIPE = recipe_yaml(_GSM8K["RECIPE"], """
run_id: grpo-reasoning-gym-qwen3-0.6b
curriculum:
  lessons:
    - lesson_id: arith-l0
      env: {name: reasoning_gym, args: {task: basic_arithmetic, level: 0}}
      max_tokens: 768
      graduate_at: 0.8
    - lesson_id: arith-l1
      env: {name: reasoning_gym, args: {task: basic_arithmetic, level: 1}}
      max_tokens: 768
      graduate_at: 0.8
      dependencies: [{lesson_id: arith-l0, reward_threshold: 0.8}]
    - lesson_id: arith-l2
      env: {name: reasoning_gym, args: {task: basic_arithmetic, level: 2}}
      max_tokens: 768
      graduate_at: 0.8
      dependencies: [{lesson_id: arith-l1, reward_threshold: 0.8}]
    - lesson_id: countdown
      env: {name: reasoning_gym, args: {task: countdown, level: 0}}
      max_tokens: 768
      graduate_at: 0.7
      dependencies: [{lesson_id: arith-l2, reward_threshold: 0.8}]
    - lesson_id: knights-knaves
      env: {name: reasoning_gym, args: {task: knights_knaves, level: 0}}
      max_tokens: 768
      graduate_at: null
      dependencies: [{lesson_id: countdown, reward_threshold: 0.5}]
trainer:
  tracker: [{type: json_logger}, {type: wandb, project: marinrl, tags: [grpo, reasoning-gym, qwen3-0.6b]}]
""")

DRY_RUN = _GSM8K["DRY_RUN"]


if __name__ == "__main__":
    run_recipe(run_job, RECIPE, dry_run_defaults=DRY_RUN)
