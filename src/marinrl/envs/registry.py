"""The environment registry: which class a lesson's `env: {name, args}` names, and building it.

A built-in environment registers itself with `@register_env("name")` when its module is imported; `BUILTIN_ENVS`
says which module that is, so a process imports only the environments its config names. A class outside the
package needs no registration: a lesson names it by its dotted path (`package.module.Class` or
`package.module:Class`).
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
from typing import TYPE_CHECKING, Any, Callable, Mapping

from marinrl.config.env import EnvConfig

if TYPE_CHECKING:
    from marinrl.envs.base import Env

logger = logging.getLogger(__name__)

_REGISTRY: dict[str, type] = {}


def register_env(name: str) -> Callable[[type], type]:
    """Class decorator: make an environment constructible as `EnvConfig(name=..., args={...})`."""
    if not name or "." in name or ":" in name:
        raise ValueError(f"register_env: name must be non-empty, without '.' or ':', got {name!r}")

    def add(cls: type) -> type:
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ValueError(f"register_env: {name!r} is already registered to {_REGISTRY[name].__qualname__}")
        if not callable(getattr(cls, "sample", None)):
            raise TypeError(f"register_env: {cls.__qualname__} has no sample() method")
        _REGISTRY[name] = cls
        return cls

    return add


BUILTIN_ENVS: dict[str, str] = {
    "echo": "toy", "parity": "toy", "arithmetic": "math", "math": "math", "add_sub": "add_sub", "guess": "games",
    "calculator": "games",
    "solve_check": "multiagent", "roles": "multiagent", "openai_agent": "openai_env", "openenv": "openenv_env",
    "reasoning_gym": "reasoning_gym_env", "textarena": "textarena_env", "verifiers": "verifiers_env",
}
"""Each built-in environment's module in marinrl.envs, imported (and so registered) when a config names it:
a process builds only the environments it uses and imports only their modules (`openai_env` alone is 0.5 s)."""


def registered_envs() -> dict[str, type]:
    """Short name -> class of every registered environment (the built-ins included)."""
    for module in sorted(set(BUILTIN_ENVS.values())):
        importlib.import_module(f"marinrl.envs.{module}")
    return dict(_REGISTRY)


def _resolve(name: str) -> type:
    if name in BUILTIN_ENVS:
        importlib.import_module(f"marinrl.envs.{BUILTIN_ENVS[name]}")
    elif name not in _REGISTRY and "." not in name and ":" not in name:
        registered_envs()  # an unknown short name: the error lists every registered one
    if name in _REGISTRY:
        return _REGISTRY[name]
    if "." not in name and ":" not in name:
        raise ValueError(f"unknown environment {name!r}; registered: {sorted(_REGISTRY)}, "
                         "or give a dotted class path such as 'my_package.my_module.MyEnv'")
    module_name, sep, attr = name.partition(":") if ":" in name else name.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"environment path {name!r} must look like 'package.module.Class' or 'package.module:Class'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"environment {name!r}: cannot import module {module_name!r}: {e}") from e
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"environment {name!r}: module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not isinstance(obj, type) or not callable(getattr(obj, "sample", None)):
        raise TypeError(f"environment {name!r} is not a class with a sample() method")
    return obj


def optional_package(module: str, env_name: str, distribution: str, extra: str):
    """`module` of an optional extra, or an ImportError naming the environment and the extra to install:
    adapters import their package only when a lesson builds them (docs/environments.md)."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(f"environment {env_name!r} needs the {distribution} package: "
                          f"pip install 'marinrl[{extra}]'") from e


def needs_endpoint(config: EnvConfig) -> bool:
    """Whether the environment talks to the OpenAI-compatible endpoint (class attribute `needs_endpoint`),
    so the server that runs it must serve HTTP."""
    return bool(getattr(_resolve(config.name), "needs_endpoint", False))


def with_endpoint_if_needed(inference, envs):
    """`inference` (an InferenceServerConfig) with `serve_http` turned on when one of `envs` (EnvConfigs)
    drives the OpenAI endpoint: a lesson of such an environment never fails for a missing flag."""
    if inference.serve_http or not any(needs_endpoint(env) for env in envs):
        return inference
    logger.info("serving the OpenAI endpoint: a lesson's environment drives it")
    return dataclasses.replace(inference, serve_http=True)


def make_env(config: EnvConfig) -> Env:
    """The environment `config` names, constructed with `config.args`. Errors name the environment."""
    if not isinstance(config.args, Mapping):
        raise TypeError(f"EnvConfig.args of {config.name!r} must be a mapping, got {type(config.args).__name__}")
    cls = _resolve(config.name)
    try:
        return cls(**dict(config.args))
    except TypeError as e:
        raise ValueError(f"environment {config.name!r} rejected args {dict(config.args)!r}: {e}") from e
