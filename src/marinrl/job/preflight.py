"""Checks of a job config that need no Ray, run by `RLJob.__init__` before anything starts.

A mistake found here costs a second and one line naming the field; found by an actor, it costs a
Ray start, actor restarts, a stalled trainer and thousands of tracebacks. `check_job` runs, in
order: the field ranges (`RLJobConfig.validate`), every lesson's environment (resolved and built
once in the driver, as `marinrl eval` does; a server it talks to answering its handshake), the optimizer's
schedule, the model's config and tokenizer (never its weights), and whether the run directory can be
written. Each failure is a `ConfigError` whose message starts with the field:
`RLJobConfig.curriculum.lessons[echo].env.args: ...`.
"""

from __future__ import annotations

import json
import logging
import os
import re
import tempfile
import uuid
from typing import TYPE_CHECKING, Any, Optional, Sequence

import fsspec

from marinrl.config.errors import ConfigError
from marinrl.envs.base import make_env, needs_endpoint
from marinrl.levanter_configs import to_levanter
from marinrl.models.tokenizers import byte_tokenizer_errors
from marinrl.storage.fs import gcs_credentials_problem

if TYPE_CHECKING:
    from marinrl.config.curriculum import CurriculumConfig
    from marinrl.config.lora import LoraRLConfig
    from marinrl.config.model import ModelConfig
    from marinrl.config.policies import PolicyModel
    from marinrl.config.trainer import JobOptimizerConfig
    from marinrl.job.rl_job import RLJobConfig

logger = logging.getLogger(__name__)

HF_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".safetensors.index.json", ".bin.index.json")


def check_job(config: RLJobConfig) -> None:
    """Everything about `config` that can be known before Ray starts; raises the first ConfigError."""
    from marinrl.config.policies import policy_models, policy_names

    config.validate()
    models = policy_models(config)  # one: the job, with a single policy's model, optimizer, loss, adapters
    check_environments(config.curriculum, policy_names(config))
    for m in models:
        own = config.policies.get(m.name) if len(models) > 1 else None
        try:
            check_policy_model(config, m)
        except ConfigError as e:  # a policy's own model, optimizer or adapters: named under `policies.<name>`
            head = e.field.split(".")[0].split("[")[0]
            if own is None or not (getattr(own, head, None) is not None or head == "lora"):
                raise
            raise ConfigError(f"policies.{m.name}.{e.field}", e.problem) from None
    check_writable(config.run_dir, "run_root")
    if config.ray.address is not None:
        check_ray_address(config.ray.address)


RAY_CONNECT_TIMEOUT_S = 5.0


def check_ray_address(address: str, timeout_s: float = RAY_CONNECT_TIMEOUT_S) -> None:
    """Something must accept a TCP connection at `ray.address` (`host:port` or `ray://host:port`): Ray's own
    client retries an address nobody answers for minutes, printing its C++ warnings, before a 44-line
    traceback. Other forms (`auto`) are left to Ray."""
    import socket

    m = re.fullmatch(r"(?:ray://)?\[?([^\[\]/]+?)\]?:(\d+)/?", address.strip())
    if m is None:
        return
    try:
        socket.create_connection((m.group(1), int(m.group(2))), timeout=timeout_s).close()
    except OSError as e:
        reason = e.strerror or type(e).__name__
        raise ConfigError("ray.address", f"nothing answers at {address} ({reason}): start the Ray cluster there "
                                         "(`ray start --head`), fix the address, or remove ray.address to run on "
                                         "this machine") from None


def check_policy_model(config: RLJobConfig, model: PolicyModel) -> None:
    """The optimizer, model, adapters and row length of one trained model (`marinrl/config/policies.py`)."""
    check_optimizer(model.optimizer, config.num_train_steps)
    seq_len = check_model(model.model)
    if model.lora is not None:
        check_lora(model.model, model.lora)
    if seq_len is not None and config.batching.max_length > seq_len:
        raise ConfigError("batching.max_length", f"{config.batching.max_length} is longer than the model's "
                                                 f"{seq_len} positions (model seq_len); lower it to {seq_len} at most")


def check_optimizer(optimizer: JobOptimizerConfig, num_train_steps: int) -> None:
    """Build the optimizer and its schedule once (no parameters: only the schedule's arithmetic): an
    unknown `lr_schedule` or warmup, decay and cycles that do not fit the steps fail here."""
    if getattr(type(optimizer), "LEVANTER", ""):  # marinrl's AdamW: checked purely (config/trainer.py)
        return
    try:
        to_levanter(optimizer).build(num_train_steps)
    except Exception as e:
        raise ConfigError("optimizer", _one_line(e)) from e


def check_environments(curriculum: CurriculumConfig, policies: Optional[Sequence[str]] = None) -> None:
    """Resolve and construct every lesson's environment once: an unknown name, arguments its
    constructor rejects or a missing data file fail here instead of in every rollout call; so does an
    environment whose agents play a policy not in `policies` (the job's: `marinrl/config/policies.py`)."""
    from marinrl.config.policies import env_policy_names

    for lesson in curriculum.lessons:
        where = f"curriculum.lessons[{lesson.lesson_id}].env"
        try:
            needs_endpoint(lesson.env)  # resolves the name (registered, or an importable class path)
        except Exception as e:
            raise ConfigError(f"{where}.name", _one_line(e)) from e
        try:
            env = make_env(lesson.env)
        except Exception as e:
            problem = _one_line(e)
            if lesson.env.name not in problem:
                problem = f"environment {lesson.env.name!r}: {problem}"
            raise ConfigError(f"{where}.args", problem) from e
        reachable = getattr(env, "check_reachable", None)  # a server the environment talks to (OpenEnv)
        if reachable is not None:
            try:
                reachable()
            except ValueError as e:
                raise ConfigError(f"{where}.args", _one_line(e)) from e
        unknown = sorted(env_policy_names(env) - set(policies)) if policies is not None else []
        if unknown:
            raise ConfigError(f"{where}.args", f"environment {lesson.env.name!r} has agents played by "
                                               f"{'policies' if len(unknown) > 1 else 'policy'} "
                                               f"{', '.join(map(repr, unknown))}, which the job does not define "
                                               f"(it trains {', '.join(map(repr, policies))}): add "
                                               f"{'them' if len(unknown) > 1 else 'it'} under `policies:` "
                                               "(`specialization: shared` trains every shared policy into the one "
                                               "model)")


def check_model(model: ModelConfig) -> Optional[int]:
    """The model's architecture and tokenizer load (its weights are not read). Returns the model's
    number of positions when known (the longest row a training batch may have)."""
    seq_len: Optional[int] = getattr(model.model, "seq_len", None)
    vocab_size = model.vocab_size
    if model.hf_checkpoint:
        seq_len, vocab_size = _check_hf_checkpoint(model.hf_checkpoint)
    elif model.levanter_checkpoint:
        seq_len, vocab_size = _check_levanter_checkpoint(model.levanter_checkpoint, model)
    if not model.tokenizer and not model.hf_checkpoint:  # the byte-level tokenizer: its size is known unbuilt
        problem = byte_tokenizer_errors(model.vocab_size)
        if problem:
            raise ConfigError("model.vocab_size", f"cannot build the byte-level tokenizer: {problem}")
        if vocab_size is not None and model.vocab_size > vocab_size:
            raise ConfigError("model.vocab_size", f"the byte-level tokenizer has {model.vocab_size} tokens but the "
                                                  f"model only {vocab_size} rows of embeddings: token ids past the "
                                                  "table would be sampled and trained")
        return seq_len
    tokenizer = _load_tokenizer(model)
    if vocab_size is not None and len(tokenizer) > vocab_size:
        field = "model.tokenizer" if model.tokenizer else "model.vocab_size"
        raise ConfigError(field, f"the tokenizer has {len(tokenizer)} tokens but the model only {vocab_size} "
                                 "rows of embeddings: token ids past the table would be sampled and trained")
    return seq_len


def check_gcs_credentials(url: str, field: str) -> None:
    """A gs:// URL needs Google Cloud credentials (storage/fs.py `gcs_credentials_problem`)."""
    problem = gcs_credentials_problem(url)
    if problem:
        raise ConfigError(field, problem)


def check_writable(url: str, field: str) -> None:
    """Create `url` (a directory, local or fsspec) and write and delete a probe file in it."""
    check_gcs_credentials(url, field)
    try:
        fs, path = fsspec.core.url_to_fs(url)
        path = path.rstrip("/")
        fs.makedirs(path, exist_ok=True)
        probe = f"{path}/.marinrl-preflight-{uuid.uuid4().hex[:8]}"
        with fs.open(probe, "wb") as f:
            f.write(b"ok")
        fs.rm(probe)
    except Exception as e:
        raise ConfigError(field, f"cannot write under {url}: {_one_line(e)}") from e


# ------------------------------------------------------------------------------------ models


def check_lora(model: ModelConfig, lora: LoraRLConfig) -> None:
    """The LoRA block against the model's architecture (shapes only): its regex must adapt a module."""
    from marinrl.models.lora import check_targets

    if model.hf_checkpoint:
        lm_config, vocab_size = _hf_architecture(model.hf_checkpoint)
    else:
        saved = None
        if model.levanter_checkpoint:
            from levanter.checkpoint import discover_latest_checkpoint

            from marinrl.models.policy_model import _read_model_config

            saved = _read_model_config(discover_latest_checkpoint(model.levanter_checkpoint))
        lm_config, vocab_size = saved or (to_levanter(model.model), model.vocab_size)
    check_targets(lm_config, vocab_size, lora, "lora")


def _hf_architecture(path: str):
    from transformers import AutoConfig

    from marinrl.models.hf_checkpoints import levanter_config

    fs, plain = fsspec.core.url_to_fs(path)
    with tempfile.TemporaryDirectory() as tmp:  # only config.json, as `_check_hf_checkpoint` reads it
        fs.get(f"{plain.rstrip('/')}/config.json", os.path.join(tmp, "config.json"))
        hf_config = AutoConfig.from_pretrained(tmp, local_files_only=True)
        return levanter_config(hf_config, path), hf_config.vocab_size


def _check_hf_checkpoint(path: str) -> tuple[Optional[int], Optional[int]]:
    from levanter.models.lm_model import LmConfig
    from transformers import AutoConfig

    from marinrl.models.hf_checkpoints import HF_TO_LEVANTER, levanter_config

    field = "model.hf_checkpoint"
    fs, plain = fsspec.core.url_to_fs(path)
    plain = plain.rstrip("/")
    if not fs.isdir(plain):
        raise ConfigError(field, f"Hugging Face checkpoint directory not found: {path}")
    names = [os.path.basename(n.rstrip("/")) for n in fs.ls(plain, detail=False)]
    if "config.json" not in names:
        raise ConfigError(field, f"{path} has no config.json: not a Hugging Face checkpoint "
                                 f"({'empty' if not names else 'holds ' + ', '.join(sorted(names)[:5])})")
    if not any(n.endswith(HF_WEIGHT_SUFFIXES) for n in names):
        raise ConfigError(field, f"{path} has no weights (*.safetensors or pytorch_model*.bin)")
    with fs.open(f"{plain}/config.json", "r") as f:
        text = f.read()
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(field, f"{path}/config.json:{e.lineno}:{e.colno}: not valid JSON: {e.msg}") from e
    if not isinstance(raw, dict) or "model_type" not in raw:
        raise ConfigError(field, f"{path}/config.json has no model_type")
    name = HF_TO_LEVANTER.get(raw["model_type"])
    if name is None or name not in LmConfig.get_known_choices():
        raise ConfigError(field, f"Levanter has no model for HF model_type {raw['model_type']!r} "
                                 f"(supported: {sorted(HF_TO_LEVANTER)})")
    with tempfile.TemporaryDirectory() as tmp:  # only config.json: the weights stay where they are
        with open(os.path.join(tmp, "config.json"), "w") as f:
            f.write(text)
        try:
            hf_config = AutoConfig.from_pretrained(tmp, local_files_only=True)
            lev_config = levanter_config(hf_config, path)  # Levanter's from_hf_config + marinrl's fixes and checks
        except Exception as e:
            raise ConfigError(field, f"{path}/config.json does not describe a {raw['model_type']} model: "
                                     f"{_one_line(e)}") from e
    return getattr(lev_config, "seq_len", None), raw.get("vocab_size")


def _check_levanter_checkpoint(path: str, model: ModelConfig) -> tuple[Optional[int], Optional[int]]:
    from levanter.checkpoint import discover_latest_checkpoint

    from marinrl.models.policy_model import _read_model_config

    field = "model.levanter_checkpoint"
    fs, plain = fsspec.core.url_to_fs(path)
    if not fs.exists(plain):
        raise ConfigError(field, f"Levanter checkpoint not found: {path}")
    step_dir = discover_latest_checkpoint(path)
    if step_dir is None:
        raise ConfigError(field, f"no Levanter checkpoint (a directory with metadata.json) under {path}")
    try:
        saved = _read_model_config(step_dir)
    except Exception as e:
        raise ConfigError(field, f"cannot read the model config of {step_dir}: {_one_line(e)}") from e
    if saved is None:  # a Trainer's checkpoint: the architecture is the config's own
        return getattr(model.model, "seq_len", None), model.vocab_size
    lm_config, vocab_size = saved
    return getattr(lm_config, "seq_len", None), vocab_size


def _load_tokenizer(model: ModelConfig) -> Any:
    from marinrl.models.policy_model import build_tokenizer

    field = "model.tokenizer" if model.tokenizer else ("model.hf_checkpoint" if model.hf_checkpoint
                                                      else "model.vocab_size")
    try:
        return build_tokenizer(model)
    except Exception as e:
        raise ConfigError(field, f"cannot load the tokenizer: {_one_line(e)}") from e


def _one_line(e: BaseException) -> str:
    """An exception as one line: its type (for the unexpected kinds) and its message's first line."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else repr(e)
    if isinstance(e, (ValueError, FileNotFoundError)):
        return text
    return f"{type(e).__name__}: {text}"
