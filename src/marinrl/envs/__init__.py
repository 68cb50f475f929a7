"""Environments: the `Env` protocol (`base`) and its registry (`registry`), toy tasks a tiny model learns on a CPU
(`toy`), math with verifiable answers (`math`), multi-turn episodes (`episode`, games in `games`),
multi-agent systems (`multiagent`), agent code over the OpenAI protocol (`openai_env`), and adapters
to the ecosystem's environments (`reasoning_gym_env`, `textarena_env`, `openenv_env`, `verifiers_env`), whose packages
load only when a lesson builds one. Importing this package imports no task module: an environment's module
is imported when a config names it (`registry.BUILTIN_ENVS`) or its class is first used from here."""

import importlib

from marinrl.envs.base import (
    MODES,
    UNSTAMPED,
    UNSTAMPED_LESSON,
    Env,
    EnvConfig,
    Grade,
    Mode,
    Problem,
    SingleTurnEnv,
    completion_text,
    encode_prompt,
    make_env,
    make_rollout,
    new_group_id,
    register_env,
    registered_envs,
    safe_sample,
)

_LAZY = {
    "Feedback": "episode", "MultiTurnEnv": "episode", "CalculatorEnv": "games", "GuessEnv": "games",
    "ArithmeticEnv": "math", "MathDatasetEnv": "math", "OpenAIAgentEnv": "openai_env", "OpenEnvEnv": "openenv_env",
    "ReasoningGymEnv": "reasoning_gym_env", "TextArenaEnv": "textarena_env", "VerifiersEnv": "verifiers_env",
    "Agent": "multiagent",
    "MultiAgentEnv": "multiagent", "EchoEnv": "toy", "ParityEnv": "toy",
}
"""The task modules' classes, imported on first use: `import marinrl.envs` (and every `marinrl.envs.x`) stays
light, which every actor of a job pays at start (docs/performance.md, "On a quiet machine, warm cache")."""


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f"marinrl.envs.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'marinrl.envs' has no attribute {name!r}")


__all__ = [
    "MODES", "UNSTAMPED", "UNSTAMPED_LESSON", "Env", "EnvConfig", "Grade", "Mode", "Problem", "SingleTurnEnv",
    "completion_text", "encode_prompt", "make_env", "make_rollout", "new_group_id", "register_env",
    "registered_envs", "safe_sample", "ArithmeticEnv", "MathDatasetEnv", "EchoEnv", "ParityEnv",
    "Feedback", "MultiTurnEnv", "CalculatorEnv", "GuessEnv", "Agent", "MultiAgentEnv", "OpenAIAgentEnv",
    "ReasoningGymEnv", "TextArenaEnv", "OpenEnvEnv", "VerifiersEnv",
]
