"""The package's layers (docs/architecture.md, "Layers"): no import cycle anywhere and no import from a layer
up to a higher one (function-level imports count: one still ties two modules together), and the config layer
parses and checks a job config without JAX, Levanter, Ray, torch or transformers. The config layer mirrors
the Levanter configs a job sets (model architecture, trainer, trackers, AdamW); every mirrored field must
exist in Levanter's class with Levanter's default unless marinrl's own is declared, and convert to the
object Levanter builds."""

from __future__ import annotations

import ast
import dataclasses
import json
import pathlib
import subprocess
import sys
import textwrap

import jmp
import pytest

import marinrl
from marinrl.config.model import DefaultRope, Llama3Rope, LlamaArchitecture, Qwen3Architecture, YarnRope
from marinrl.config.trainer import (
    MARINRL_TRAINER_DEFAULTS,
    JobAdamConfig,
    JobTrainerConfig,
    JsonLoggerTracker,
    NoopTracker,
    RLAdamConfig,
    TensorboardTracker,
    WandbTracker,
    parse_mp,
)
from marinrl.levanter_configs import to_levanter

PACKAGE = pathlib.Path(marinrl.__file__).parent
QUICKSTART = pathlib.Path(__file__).parents[1] / "experiments" / "quickstart.yaml"
HEAVY = ("jax", "levanter", "ray", "torch", "transformers", "haliax", "equinox", "fastapi", "openai", "optax")


def _module_name(path: pathlib.Path, package: pathlib.Path) -> str:
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking_lines(tree: ast.Module) -> set[int]:
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                lines.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return lines


def import_graph(package: pathlib.Path = PACKAGE) -> dict[str, set[str]]:
    """Module -> the package's modules it imports anywhere in its body (type-checking-only imports aside)."""
    modules = {_module_name(p, package): p for p in package.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        skip = _type_checking_lines(tree)
        edges = set()
        for node in ast.walk(tree):
            if getattr(node, "lineno", None) in skip:
                continue
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            edges.update(t for t in targets if t in modules and t != name)
        graph[name] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_package_has_no_import_cycle():
    graph = import_graph()
    assert len(graph) > 50 and "marinrl.job.rl_job" in graph  # the walk found the package
    assert cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle_through_a_function_level_import(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.b import f\n")
    (pkg / "b.py").write_text("def f():\n    from pkg import a\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import a\n")
    assert cycles(import_graph(pkg)) == [["pkg.a", "pkg.b"]]


def test_a_job_config_parses_and_checks_without_jax_levanter_ray_or_torch(tmp_path):
    """What `marinrl train` does before anything heavy: parse the YAML, check every range and the placement
    arithmetic. Run in a fresh interpreter: this process imported everything long ago."""
    script = textwrap.dedent(f"""
        import json, sys
        from marinrl.config.errors import load_job_config
        from marinrl.config.job import RLJobConfig
        from marinrl.config.rollout_worker import RolloutWorkerConfig
        job = load_job_config(RLJobConfig, {str(QUICKSTART)!r}, ["--ray.trainer.num_gpus", "8",
                                                                 "--trainer.model_axis_size", "3"])
        try:
            job.validate()
            error = None
        except Exception as e:
            error = str(e)
        print(json.dumps(dict(error=error, loaded=[m for m in {HEAVY!r} if m in sys.modules])))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, cwd=tmp_path)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["error"].startswith("RLJobConfig.trainer.model_axis_size: model_axis_size=3")
    assert got["loaded"] == []


# ----------------------------------------------------------------------------- mirrors of Levanter's configs


def _levanter_defaults(cls) -> dict:
    out = {}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
    return out


MIRRORS = [  # (mirror, fields whose default is marinrl's)
    (LlamaArchitecture, ("attn_backend",)),  # `auto`: a backend per device (config/model.attention_backend_on)
    (Qwen3Architecture, ("attn_backend",)),
    (DefaultRope, ()),
    (Llama3Rope, ()),
    (YarnRope, ()),
    (JobTrainerConfig, MARINRL_TRAINER_DEFAULTS + ("require_accelerator",)),
    (JobAdamConfig, ()),
    (JsonLoggerTracker, ()),
    (TensorboardTracker, ()),
    (WandbTracker, ()),
    (NoopTracker, ()),
]


@pytest.mark.parametrize("mirror, ours", MIRRORS, ids=[m.__name__ for m, _ in MIRRORS])
def test_a_mirror_has_levanters_fields_and_defaults(mirror, ours):
    levanter = type(to_levanter(mirror()))
    theirs = _levanter_defaults(levanter)
    mine = to_levanter(mirror())
    for f in dataclasses.fields(mirror):
        assert f.name in theirs, f"{mirror.__name__}.{f.name} is not a field of {levanter.__name__}"
        if f.name not in ours:
            assert getattr(mine, f.name) == theirs[f.name], (
                f"{mirror.__name__}.{f.name}: default differs from Levanter's")


def test_marinrls_adam_and_trainer_convert_to_levanters_objects():
    adam = to_levanter(RLAdamConfig(learning_rate=3e-4, warmup=10))
    assert type(adam).__name__ == "AdamConfig" and adam.learning_rate == 3e-4 and adam.warmup == 10
    assert (adam.beta2, adam.weight_decay, adam.lr_schedule) == (0.999, 0.0, "constant")
    trainer = to_levanter(JobTrainerConfig(mp="p=f32,c=bfloat16", tracker=(WandbTracker(project="p", mode="offline"),),
                                           axis_resources={"mlp": ["data", "model"]}))
    assert trainer.mp == jmp.get_policy("p=f32,c=bfloat16")
    (wandb,) = trainer.tracker
    assert type(wandb).__name__ == "WandbConfig" and (wandb.project, wandb.mode) == ("p", "offline")
    assert trainer.axis_resources == {"mlp": ("data", "model")}
    llama = to_levanter(LlamaArchitecture(hidden_dim=64, num_heads=4, num_kv_heads=2, activation_function="gelu"))
    assert type(llama).__name__ == "LlamaConfig" and llama.hidden_dim == 64
    assert llama.activation_function.value == "gelu"


@pytest.mark.parametrize("mp", ["f32", "bf16", "p=f32,c=bfloat16", "c=f16", "params=float32,compute=bf16,output=f32",
                                "p=bf16"])
def test_parse_mp_reads_a_policy_as_jmp_does(mp):
    policy = jmp.get_policy(mp)
    import numpy as np

    assert parse_mp(mp) == {"params": np.dtype(policy.param_dtype).name, "compute": np.dtype(policy.compute_dtype).name,
                            "output": np.dtype(policy.output_dtype).name}


@pytest.mark.parametrize("mp, problem", [("p=f33", "unknown dtype 'f33'"), ("x=f32", "unknown key 'x'"),
                                         ("half", "unknown dtype 'half'")])
def test_parse_mp_names_what_it_cannot_read(mp, problem):
    with pytest.raises(ValueError, match=problem):
        parse_mp(mp)


def test_the_schedules_marinrl_accepts_are_levanters():
    from levanter.optim.config import LrSchedule

    from marinrl.config.trainer import LR_SCHEDULES

    assert sorted(LR_SCHEDULES) == sorted(LrSchedule.get_known_choices())


def test_the_driver_checks_the_quickstart_without_jax_levanter_or_transformers(tmp_path):
    """`RLJob(config)` is the driver's preflight (environments built, the model's config and tokenizer,
    the run directory): for a model built from scratch with the byte-level tokenizer none of it needs JAX,
    Levanter or transformers, which only the actors import (the driver's memory, docs/performance.md)."""
    script = textwrap.dedent(f"""
        import json, sys
        from marinrl.config.errors import load_job_config
        from marinrl.job.rl_job import RLJob, RLJobConfig
        RLJob(load_job_config(RLJobConfig, {str(QUICKSTART)!r}, ["--run_root", {str(tmp_path)!r}]))
        print(json.dumps([m for m in ("jax", "levanter", "transformers", "torch", "haliax") if m in sys.modules]))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, cwd=tmp_path)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


# ----------------------------------------------------------------------------- the tree


LAYERS = {  # docs/architecture.md, "Layers", top to bottom: a top-level module or folder of the package -> its layer
    "cli": "entrypoints",
    **dict.fromkeys(["job", "dry_run", "eval", "serve", "recipe", "report"], "orchestration"),
    **dict.fromkeys(["rollout", "train", "inference", "transfer", "envs", "curriculum", "models", "storage", "data",
                     "multihost", "levanter_configs", "logs", "startup", "program_audit"], "runtime"),
    **dict.fromkeys(["config", "types"], "configs and types"),
}
ORDER = ["entrypoints", "orchestration", "runtime", "configs and types"]
NEVER = [  # (importers, imported) within the runtime: the lower runtime never reaches the roles that use it
    ({"storage", "models", "transfer", "inference"}, {"envs", "rollout", "train"}),
    ({"envs"}, {"rollout", "train"}),
    ({"rollout"}, {"train"}),
    ({"train"}, {"rollout"}),
]


def _part(module: str) -> str | None:
    """The top-level module or folder of `module` (`marinrl.train.replay.buffer` -> `train`); None for the root."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def arrows_back_up(graph: dict[str, set[str]]) -> list[str]:
    """Every import that breaks the order of the layers: one to a higher layer (function-level imports count),
    one the `NEVER` table refuses, and a module no layer holds."""
    wrong = []
    for module, edges in sorted(graph.items()):
        part = _part(module)
        if part is None:
            continue
        if part not in LAYERS:
            wrong.append(f"{module} is in no layer (place it in LAYERS and docs/architecture.md)")
            continue
        for edge in sorted(edges):
            other = _part(edge)
            if other is None or other == part or other not in LAYERS:
                continue
            if ORDER.index(LAYERS[other]) < ORDER.index(LAYERS[part]):
                wrong.append(f"{module} ({LAYERS[part]}) imports {edge} ({LAYERS[other]})")
            elif any(part in importers and other in imported for importers, imported in NEVER):
                wrong.append(f"{module} imports {edge} ({part}/ never imports {other}/)")
    return wrong


def test_imports_run_down_the_layers():
    """Config and types at the bottom (they import only each other); the runtime never imports the job or any
    orchestration; storage, models, transfer and inference never import envs, rollout or train, envs never
    imports rollout or train, and rollout and train never import each other."""
    assert arrows_back_up(import_graph()) == []


def test_the_layer_check_finds_an_arrow_back_up_through_a_function_level_import(tmp_path):
    pkg = tmp_path / "marinrl"
    for folder in ("config", "train", "rollout", "inference", "job"):
        (pkg / folder).mkdir(parents=True)
        (pkg / folder / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "config" / "loss.py").write_text("def f():\n    import marinrl.train.advantages\n")
    (pkg / "train" / "advantages.py").write_text("from marinrl.config import loss\n")
    (pkg / "inference" / "context.py").write_text("import marinrl.rollout.router\n")
    (pkg / "rollout" / "router.py").write_text("from marinrl.train.advantages import f\n")
    (pkg / "job" / "plan.py").write_text("from marinrl.rollout import router\n")
    (pkg / "stray.py").write_text("from marinrl.job import plan\n")
    assert arrows_back_up(import_graph(pkg)) == [
        "marinrl.config.loss (configs and types) imports marinrl.train.advantages (runtime)",
        "marinrl.inference.context imports marinrl.rollout.router (inference/ never imports rollout/)",
        "marinrl.rollout.router imports marinrl.train.advantages (rollout/ never imports train/)",
        "marinrl.stray is in no layer (place it in LAYERS and docs/architecture.md)",
    ]


def test_the_package_root_holds_at_most_twelve_modules():
    root = sorted(p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py")
    assert len(root) <= 12, root


PLACEMENT_FIELDS = {"num_gpus", "tpu", "tpu_chips", "memory_fraction", "accelerator_type", "num_hosts"}


def test_only_the_placement_modules_read_placement_fields():
    """A new accelerator kind has one place to go (job/placement.py's docstring says how): every other module
    asks `PlacementConfig`'s methods or job/placement.py's functions."""
    seam = {PACKAGE / "config" / "placement.py", PACKAGE / "job" / "placement.py"}
    readers = []
    for path in PACKAGE.rglob("*.py"):
        if path in seam:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in PLACEMENT_FIELDS:
                readers.append(f"{path.relative_to(PACKAGE)}:{node.lineno} .{node.attr}")
    assert readers == []


def test_the_job_package_loads_ray_only_when_rljob_is_asked_for(tmp_path):
    """`from marinrl.job import RLJob, RLJobConfig` is the public form; a submodule such as the run lock's
    (`marinrl lock`'s) must not pay for Ray."""
    script = textwrap.dedent("""
        import json, sys
        import marinrl.job.run_lock
        before = "ray" in sys.modules
        from marinrl.job import RLJob, RLJobConfig
        print(json.dumps([before, "ray" in sys.modules, RLJob.__module__, RLJobConfig.__module__]))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, cwd=tmp_path)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [False, True, "marinrl.job.rl_job", "marinrl.config.job"]
