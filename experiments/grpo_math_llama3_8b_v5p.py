"""GRPO on MATH-style problems with Llama-3.1-8B-Instruct: the trainer on a multi-host TPU v5p-64
slice (8 hosts × 4 chips, one trainer process per host, docs/multihost.md), rollouts on v5p-8 hosts.

    python experiments/grpo_math_llama3_8b_v5p.py --dry_run       # on a laptop: 32 fake devices
    ray job submit --working-dir . -- python experiments/grpo_math_llama3_8b_v5p.py \
        --run_root gs://MY_BUCKET/runs --model.hf_checkpoint gs://MY_BUCKET/models/Llama-3.1-8B-Instruct

The cluster is `infra/tpu-v5p-multihost.yaml` (trainer `v5p-64` with `{"trainer": 1}` on each host,
rollout `v5p-8` hosts with `{"rollout": 1}`; the commands from nothing to this job: infra/README.md, "A
v5p-64 slice plus rollout hosts"). The job reserves the slice through its head resource and starts one
trainer actor per host, 8 processes in one JAX mesh (docs/multihost.md).

Inputs (nothing downloads at run time), copied to your bucket once:
- the model (gated: accept Meta's license on Hugging Face first): `huggingface-cli download
  meta-llama/Llama-3.1-8B-Instruct --local-dir Llama-3.1-8B-Instruct --exclude 'original/*'`, then
  `gcloud storage cp -r Llama-3.1-8B-Instruct gs://MY_BUCKET/models/`; `model.model` below is its
  config.json, for the dry run (the checkpoint's own decides at run time);
- MATH-style problems as JSONL with `problem` and `answer` fields (the final answer only, e.g. the
  `\\boxed{}` content of MATH's solutions), train and test, under `gs://MY_BUCKET/data/math/`.

The settings this scale needs: bf16 compute over f32 parameters and AdamW state (8B: 32 GB of parameters,
32 GB of gradients and 32 GB of their accumulator, 64 GB of moments: 4.7 GiB per chip over 32 chips of
FSDP; `--dry_run` prints it), bf16 rollouts and weight versions (`inference.dtype`: 16 GB a version instead
of 32 GB) with TIS correcting the sampler/trainer mismatch, gradient checkpointing only where the update
does not fit without it (`auto`: off, 37 of a v5p chip's 95 GiB predicted without it), 1024 rows per step
in microbatches of 2 rows per chip (16 accumulation steps), rollouts tensor-parallel over each v5p-8 host's
4 chips with the engine backend, no KL term (a reference would add 32 GB of f32 weights, 1 GB per chip),
wandb + JSON logs.
"""

from marinrl.dry_run import DryRunShapes
from marinrl.recipe import GRPO_AT_SCALE, recipe_yaml, run_job, run_recipe

RECIPE = recipe_yaml(GRPO_AT_SCALE, """
run_id: grpo-math-llama3.1-8b
run_root: gs://MY_BUCKET/runs
model:
  hf_checkpoint: gs://MY_BUCKET/models/Llama-3.1-8B-Instruct
  vocab_size: 128256
  model:                          # Llama-3.1-8B's config.json, for the dry run
    type: llama
    seq_len: 4096
    hidden_dim: 4096
    intermediate_dim: 14336
    num_layers: 32
    num_heads: 32
    num_kv_heads: 8
    layer_norm_epsilon: 1.0e-5
    tie_word_embeddings: false
    rope: {type: llama3, theta: 500000, factor: 8.0, low_freq_factor: 1.0, high_freq_factor: 4.0,
           original_max_position_embeddings: 8192}
curriculum:
  lessons:
    - lesson_id: math
      env:
        name: math
        args: {path: gs://MY_BUCKET/data/math/train.jsonl, eval_path: gs://MY_BUCKET/data/math/test.jsonl,
               question_field: problem, answer_field: answer}
      temperature: 1.0
      max_tokens: 1536
      graduate_at: null
num_train_steps: 300
groups_per_step: 64
n_generations: 16
n_rollout_workers: 4
eval_every: 20
eval_examples: 500
checkpoint_every: 20
batching: {max_length: 2048}
trainer:
  per_device_parallelism: 2
  tracker: [{type: json_logger}, {type: wandb, project: marinrl, tags: [grpo, math, llama3.1-8b, v5p-64]}]
inference:
  model_axis_size: 4              # the 4 chips of a v5p-8 host
  engine: {max_seqs: 256, max_seq_len: 2048, max_prefill_tokens: 8192}
ray:
  trainer: {tpu: v5p-64, resources: {trainer: 1}}
  rollout: {tpu: v5p-8, resources: {rollout: 1}}
""")

DRY_RUN = DryRunShapes(prompt_tokens=256, layers=1)


if __name__ == "__main__":
    run_recipe(run_job, RECIPE, dry_run_defaults=DRY_RUN)
