"""Environments: the `Env` protocol and its registry (`base`), toy tasks a tiny model learns on a CPU
(`toy`), math with verifiable answers (`math`), multi-turn episodes (`episode`, games in `games`),
multi-agent systems (`multiagent`), agent code over the OpenAI protocol (`openai_env`), and adapters
to the ecosystem's environments (`reasoning_gym_env`, `textarena_env`, `openenv_env`), whose packages
load only when a lesson builds one. Importing this package registers the built-ins."""

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
from marinrl.envs.episode import Feedback, MultiTurnEnv
from marinrl.envs.games import CalculatorEnv, GuessEnv
from marinrl.envs.math import ArithmeticEnv, MathDatasetEnv
from marinrl.envs.openai_env import OpenAIAgentEnv
from marinrl.envs.openenv_env import OpenEnvEnv
from marinrl.envs.reasoning_gym_env import ReasoningGymEnv
from marinrl.envs.textarena_env import TextArenaEnv
from marinrl.envs.multiagent import Agent, MultiAgentEnv
from marinrl.envs.toy import EchoEnv, ParityEnv

__all__ = [
    "MODES", "UNSTAMPED", "UNSTAMPED_LESSON", "Env", "EnvConfig", "Grade", "Mode", "Problem", "SingleTurnEnv",
    "completion_text", "encode_prompt", "make_env", "make_rollout", "new_group_id", "register_env",
    "registered_envs", "safe_sample", "ArithmeticEnv", "MathDatasetEnv", "EchoEnv", "ParityEnv",
    "Feedback", "MultiTurnEnv", "CalculatorEnv", "GuessEnv", "Agent", "MultiAgentEnv", "OpenAIAgentEnv",
    "ReasoningGymEnv", "TextArenaEnv", "OpenEnvEnv",
]
