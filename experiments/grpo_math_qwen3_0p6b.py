"""GRPO on GSM8K with Qwen3-0.6B: the trainer on one TPU host (v5e-8 / v6e-8) or GPUs, rollouts on
their own hosts.

    python experiments/grpo_math_qwen3_0p6b.py --dry_run          # on a laptop: shapes, memory, FLOPs
    python experiments/grpo_math_qwen3_0p6b.py --run_root gs://MY_BUCKET/runs \
        --model.hf_checkpoint gs://MY_BUCKET/models/Qwen3-0.6B \
        --curriculum.lessons '[...]'                               # or edit RECIPE below

Submitted to the cluster of `infra/tpu-v5e.yaml` (trainer `v5litepod-8`, rollout `v5litepod-4`
hosts): `ray job submit --working-dir . -- python experiments/grpo_math_qwen3_0p6b.py --run_root
gs://MY_BUCKET/runs ...` (infra/README.md). On `infra/tpu-v6e.yaml`: `--ray.trainer.tpu v6e-8
--ray.rollout.tpu v6e-4`. On GPUs (`infra/gpu.yaml`, or one machine with 2+ GPUs and `--ray.address
null`): `--ray.trainer.tpu null --ray.trainer.num_gpus 1 --ray.rollout.tpu null --ray.rollout.num_gpus 1
--n_rollout_workers 1` (one H100 holds either role: `--dry_run` with those flags and
`--ray.trainer.accelerator_type H100` says `auto` takes 16-row microbatches without gradient checkpointing,
44 GiB predicted with the flash attention `auto` runs on a GPU, and 32 GiB for a rollout worker, 28 of them the
engine's page cache).

Why Qwen3-0.6B and not Qwen2.5-0.5B-Instruct: marinrl samples Llama-family models only (the scan
sampler and Levanter's engine decode both need `LlamaLMHeadModel`, docs/models.md), and Levanter's
Qwen2 is not one; Qwen3 is (q/k norms, no q/k/v bias), and 0.6B is its smallest instruct model.

Inputs (nothing downloads at run time: actors run with HF_HUB_OFFLINE=1), copied to your bucket once:
- the model: `huggingface-cli download Qwen/Qwen3-0.6B --local-dir Qwen3-0.6B && gcloud storage cp -r
  Qwen3-0.6B gs://MY_BUCKET/models/` (config.json, safetensors, tokenizer; its config.json decides the
  architecture at run time, `model.model` below is what the dry run lowers and must match it);
- GSM8K as JSONL (`{"question", "answer": "... #### 72"}`): `python -c "import datasets;
  d = datasets.load_dataset('openai/gsm8k', 'main'); d['train'].to_json('train.jsonl');
  d['test'].to_json('test.jsonl')"`, then `gcloud storage cp *.jsonl gs://MY_BUCKET/data/gsm8k/`.

The settings this scale needs: bf16 compute over f32 parameters and optimizer state (`trainer.mp`),
bf16 rollouts and weight versions (`inference.dtype`: 1.2 GB a version instead of 2.4 GB) with TIS
correcting the sampler/trainer mismatch (`loss.ratio_anchor: recomputed`, `loss.correction: tis`),
FSDP over the host's 8 chips (Levanter's default mesh: `model_axis_size: 1`, the rest data/FSDP),
gradient checkpointing only where the update does not fit without it (`auto`: off on a v5e chip, 9.3 of
its 16 GiB predicted without it), 512 rows per step in microbatches of 4 rows per chip (8 accumulation steps),
rollouts tensor-parallel over each rollout host's 4 chips with the engine backend, wandb + JSON logs.
"""

from marinrl.dry_run import DryRunShapes
from marinrl.recipe import GRPO_AT_SCALE, recipe_yaml, run_job, run_recipe

RECIPE = recipe_yaml(GRPO_AT_SCALE, """
run_id: grpo-math-qwen3-0.6b
run_root: gs://MY_BUCKET/runs
model:
  hf_checkpoint: gs://MY_BUCKET/models/Qwen3-0.6B
  vocab_size: 151936              # the dry run's vocabulary (the checkpoint's own at run time)
  model:                          # Qwen3-0.6B's config.json, for the dry run; only gradient_checkpointing
                                  # (GRPO_AT_SCALE) is read at run time
    type: qwen3
    seq_len: 2048
    hidden_dim: 1024
    intermediate_dim: 3072
    num_layers: 28
    num_heads: 16
    num_kv_heads: 8
    head_dim: 128
    tie_word_embeddings: true
    layer_norm_epsilon: 1.0e-6
    rope: {type: default, theta: 1000000}
curriculum:
  lessons:
    - lesson_id: gsm8k
      env:
        name: math
        args: {path: gs://MY_BUCKET/data/gsm8k/train.jsonl, eval_path: gs://MY_BUCKET/data/gsm8k/test.jsonl}
      temperature: 1.0
      max_tokens: 768
      graduate_at: null
num_train_steps: 500
groups_per_step: 32
n_generations: 16
n_rollout_workers: 2
eval_every: 25
eval_examples: 256
checkpoint_every: 50
batching: {max_length: 1024}
trainer:
  tracker: [{type: json_logger}, {type: wandb, project: marinrl, tags: [grpo, gsm8k, qwen3-0.6b]}]
inference:
  model_axis_size: null           # all 4 chips of a rollout host
  engine: {max_seqs: 256, max_seq_len: 1024, max_prefill_tokens: 4096}
ray:
  trainer: {tpu: v5litepod-8, resources: {trainer: 1}}
  rollout: {tpu: v5litepod-4, resources: {rollout: 1}}
""")

DRY_RUN = DryRunShapes(prompt_tokens=256, layers=1)


if __name__ == "__main__":
    run_recipe(run_job, RECIPE, dry_run_defaults=DRY_RUN)
