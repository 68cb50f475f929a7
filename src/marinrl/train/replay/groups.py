"""The replay buffer's group records: a group while it waits in the buffer, and as handed to the trainer."""

from __future__ import annotations

import collections
import dataclasses

import numpy as np

from marinrl.config.batching import BatchingConfig
from marinrl.train.advantages import token_advantages
from marinrl.train.batching import TrainingBatch, pack_rollouts
from marinrl.types import Rollout, RolloutGroup, version_spread_metrics


@dataclasses.dataclass(eq=False)
class BufferedGroup:
    """One group in the buffer. Sampling strategies read it; only the buffer changes it."""

    group: RolloutGroup
    advantages: np.ndarray  # float32 [len(group)]
    advantage_scale: float  # advantages.advantage_scale of `rewards`: per-turn credit divides by it
    rewards: np.ndarray  # float64 [len(group)]: after reward_fn, what advantages and filters saw
    trainable: np.ndarray  # bool [len(group)]: False for rollouts whose tokens are not trained
    env_name: str
    weight_step: int  # the step staleness counts: ReplayConfig.token_version_reduction over its tokens
    created_at: float  # earliest created_at of its rollouts
    seq: int  # ingestion order in this buffer
    source: str | None  # "step=XXXXXXXX/<file>.parquet" (or the caller's source), None when unknown
    uses: int = 0
    newest_step: int | None = None  # newest step of any of its tokens (None: weight_step)

    def __post_init__(self):
        if self.newest_step is None:
            self.newest_step = self.weight_step

    @property
    def group_id(self) -> str:
        return self.group.group_id


@dataclasses.dataclass(frozen=True)
class SampledGroup:
    """A group as handed to the trainer for one step."""

    group: RolloutGroup
    advantages: np.ndarray  # float32 [len(group)]
    advantage_scale: float
    trainable: np.ndarray  # bool [len(group)]
    env_name: str
    weight_step: int
    staleness: int
    use: int  # 1 the first time the group is trained on, 2 the second time, ...
    source: str | None


@dataclasses.dataclass(frozen=True)
class ReplaySample:
    """The groups of one optimizer step, in batch order."""

    step: int
    groups: tuple[SampledGroup, ...]

    @property
    def rollouts(self) -> list[Rollout]:
        return [r for g in self.groups for r in g.group.rollouts]

    @property
    def advantages(self) -> np.ndarray:
        return np.concatenate([g.advantages for g in self.groups]).astype(np.float32)

    def token_advantages(self) -> list[np.ndarray]:
        """Per rollout, the advantage of each response token (`advantages.token_advantages`): the
        rollout's advantage, less the rewards its earlier turns already earned."""
        return [token_advantages(float(a), r.token_rewards, g.advantage_scale)
                for g in self.groups for a, r in zip(g.advantages, g.group.rollouts)]

    @property
    def trainable(self) -> np.ndarray:
        return np.concatenate([g.trainable for g in self.groups])

    def training_batch(self, *, batch_size: int, config: BatchingConfig, row_multiple: int = 1,
                       microbatch_rows: int | None = None) -> TrainingBatch:
        """This step's `TrainingBatch`: `batch_size` rollout slots (n_groups × n_generations; trimmed groups
        leave empty slots), rollouts in group order, rows aligned as batching.py says."""
        return TrainingBatch.from_numpy(self.packed(batch_size=batch_size, config=config, row_multiple=row_multiple,
                                                    microbatch_rows=microbatch_rows))

    def packed(self, *, batch_size: int, config: BatchingConfig, row_multiple: int = 1,
               microbatch_rows: int | None = None, min_shape: tuple[int, int] = (0, 0)) -> dict[str, np.ndarray]:
        """`training_batch`'s NumPy arrays (`batching.pack_rollouts`), at least `min_shape` (rows, positions)."""
        return pack_rollouts(self.rollouts, self.token_advantages(), batch_size=batch_size, config=config,
                             trainable=self.trainable, row_multiple=row_multiple, microbatch_rows=microbatch_rows,
                             min_shape=min_shape)

    def metrics(self) -> dict[str, float]:
        """Per-step numbers for the tracker: staleness, uses, rewards and the env mix of this batch."""
        staleness = np.array([g.staleness for g in self.groups], dtype=np.float64)
        uses = np.array([g.use for g in self.groups], dtype=np.float64)
        rewards = np.array([r.episode_reward for r in self.rollouts], dtype=np.float64)
        out = {
            "batch/groups": float(len(self.groups)),
            "batch/rollouts": float(rewards.size),
            "batch/staleness_mean": float(staleness.mean()),
            "batch/staleness_max": float(staleness.max()),
            "batch/use_mean": float(uses.mean()),
            "batch/reward_mean": float(rewards.mean()),
        }
        out.update(version_spread_metrics(self.rollouts, "batch"))
        token_staleness = np.concatenate([self.step - r.token_weight_steps[r.loss_mask] for r in self.rollouts])
        if token_staleness.size:  # staleness of each trained token, by the weights that sampled it
            out["batch/token_staleness_mean"] = float(token_staleness.mean())
            out["batch/token_staleness_max"] = float(token_staleness.max())
        for env, n in collections.Counter(g.env_name for g in self.groups).items():
            out[f"batch/groups/{env}"] = float(n)
        by_policy: dict[str, list[float]] = collections.defaultdict(list)
        by_agent: dict[tuple[str, str], list[float]] = collections.defaultdict(list)
        for r in self.rollouts:  # multi-agent systems: what each policy and each of its agents trained on
            by_policy[r.policy_name].append(r.episode_reward)
            by_agent[(r.policy_name, r.agent_name)].append(r.episode_reward)
        for policy, rewards_of in by_policy.items():
            out[f"batch/rollouts/policy/{policy}"] = float(len(rewards_of))
            out[f"batch/reward_mean/policy/{policy}"] = float(np.mean(rewards_of))
        for (policy, agent), rewards_of in by_agent.items():
            out[f"batch/reward_mean/agent/{policy}/{agent}"] = float(np.mean(rewards_of))
        return out

