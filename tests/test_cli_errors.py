"""Every command turns a config or input mistake into one line on stderr and exit status 2:
`marinrl train: <file>:<line>:<col>: <what is wrong>`; `--debug` adds the traceback."""

from __future__ import annotations

import pathlib
import re

import pytest
from factories import make_batch

from marinrl.cli import main
from marinrl.storage.rollouts import RolloutWriter

QUICKSTART = (pathlib.Path(__file__).parents[1] / "experiments" / "quickstart.yaml").read_text()


def _config(tmp_path, old: str | None = None, new: str = "", text: str | None = None) -> str:
    """The quickstart config writing under tmp_path, with one line `old` replaced by `new`."""
    text = QUICKSTART.replace("run_root: runs", f"run_root: {tmp_path}/runs") if text is None else text
    if old is not None:
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    path = tmp_path / "job.yaml"
    path.write_text(text)
    return str(path)


def _fails(argv: list[str], capsys) -> str:
    """Runs the CLI, checks exit status 2 and returns its stderr (one or two lines, no traceback)."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and 1 <= len(err.strip().splitlines()) <= 2, err
    return err.strip()


def _line_col(path: str, needle: str) -> str:
    """`line:col` (1-based) of the first occurrence of `needle` in the file."""
    for n, line in enumerate(pathlib.Path(path).read_text().splitlines(), 1):
        if needle in line:
            return f"{n}:{line.index(needle) + 1}"
    raise AssertionError(needle)


def test_an_unknown_key_names_its_line_column_and_the_closest_field(tmp_path, capsys):
    path = _config(tmp_path, "max_staleness: 1", "max_stalenes: 1")
    err = _fails(["train", path], capsys)
    assert err == (f"marinrl train: {path}:{_line_col(path, 'max_stalenes')}: RLJobConfig.max_stalenes: unknown field "
                   "of RLJobConfig; did you mean `max_staleness`?")


def test_an_unknown_nested_key_without_a_close_match_lists_the_valid_ones(tmp_path, capsys):
    path = _config(tmp_path, "loss: {kl_beta: 0.04}", "loss: {kl_beta: 0.04, zzz: 1}")
    err = _fails(["train", path], capsys)
    assert err.startswith(f"marinrl train: {path}:{_line_col(path, 'zzz')}: RLJobConfig.loss.zzz: unknown field of "
                          "LossConfig; valid fields: objective, ratio_level")


def test_a_wrong_type_names_the_value(tmp_path, capsys):
    path = _config(tmp_path, "groups_per_step: 32", "groups_per_step: lots")
    err = _fails(["train", path], capsys)
    assert err == (f"marinrl train: {path}:{_line_col(path, 'lots')}: "
                   "RLJobConfig.groups_per_step: Couldn't parse 'lots' into an int")


def test_a_missing_config_file(tmp_path, capsys):
    err = _fails(["train", str(tmp_path / "nope.yaml")], capsys)
    assert err == f"marinrl train: {tmp_path}/nope.yaml: config file not found"


def test_invalid_yaml_gives_the_parser_line_and_column(tmp_path, capsys):
    path = _config(tmp_path, "loss: {kl_beta: 0.04}", "loss: {kl_beta: 0.04")
    err = _fails(["train", path], capsys)
    next_key = _line_col(path, "eval_every")
    assert re.fullmatch(rf"marinrl train: {re.escape(path)}:{next_key.split(':')[0]}:\d+: "
                        r"invalid YAML: expected ',' or '}', but got ':' "
                        rf"\(while parsing a flow mapping at {_line_col(path, '{kl_beta')}\)", err), err
    assert "TextIOWrapper" not in err


@pytest.mark.parametrize(
    "dependency, reason",
    [("nope", r"lesson 'echo' depends on unknown lesson 'nope'; known: \['echo'\]"),
     ("echo", "lesson dependencies form a cycle: echo -> echo")],
)
def test_a_missing_or_cyclic_dependency_gives_the_reason_first(tmp_path, capsys, dependency, reason):
    path = _config(tmp_path, "      graduate_at: null",
                   f"      graduate_at: null\n      dependencies: [{{lesson_id: {dependency}}}]")
    err = _fails(["train", path], capsys)
    assert re.fullmatch(rf"marinrl train: {re.escape(path)}:\d+:\d+: RLJobConfig.curriculum: {reason}", err), err


def test_a_lesson_field_check_points_at_the_lesson(tmp_path, capsys):
    path = _config(tmp_path, "      max_tokens: 1", "      max_tokens: 0")
    err = _fails(["train", path], capsys)
    assert err == (f"marinrl train: {path}:{_line_col(path, 'lesson_id: echo')}: RLJobConfig.curriculum.lessons[0]: "
                   "lesson 'echo': max_tokens must be >= 1, got 0")


@pytest.mark.parametrize(
    "old, new, needle, message",
    [
        ("holdout: 0.2}}", "holdout: 0.2, frobnicate: 3}}", "{alphabet_size",
         r"RLJobConfig.curriculum.lessons\[echo\].env.args: environment 'echo' rejected args .*'frobnicate'"),
        ("alphabet_size: 10,", "alphabet_size: 99,", "{alphabet_size",
         r"RLJobConfig.curriculum.lessons\[echo\].env.args: echo: alphabet_size must be in \[2, 26\], got 99"),
        ("{name: echo,", "{name: nope,", "nope",
         r"RLJobConfig.curriculum.lessons\[echo\].env.name: unknown environment 'nope'"),
        ("learning_rate: 0.001}", "learning_rate: -1}", "-1",
         r"RLJobConfig.optimizer.learning_rate: must be finite and > 0"),
        ("n_generations: 16", "n_generations: 1", "1",
         r"RLJobConfig.n_generations: 1 sample per prompt .* every advantage 0"),
        ("eval_every: 10", "eval_every: 10\ncheckpoint_every: -1", "-1",
         r"RLJobConfig.checkpoint_every: must be >= 0, got -1"),
    ],
)
def test_a_preflight_failure_points_at_its_field(tmp_path, capsys, old, new, needle, message):
    path = _config(tmp_path, old, new)
    line = _line_col(path, new.splitlines()[-1]).split(":")[0]
    col = pathlib.Path(path).read_text().splitlines()[int(line) - 1].index(needle) + 1
    err = _fails(["train", path], capsys)
    assert re.fullmatch(rf"marinrl train: {re.escape(path)}:{line}:{col}: {message}.*", err), err


def test_a_preflight_failure_of_a_default_names_the_file_and_field(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    path = _config(tmp_path, f"run_root: {tmp_path}/runs", "# run_root: runs")  # run_root left at its default ...
    err = _fails(["train", path, "--run_root", str(blocker)], capsys)  # ... and set by a flag
    assert err.startswith(f"marinrl train: --run_root {blocker}: RLJobConfig.run_root: cannot write under {blocker}/")


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["--max_staleness", "x"], "--max_staleness x: RLJobConfig.max_staleness: Couldn't parse 'x' into an int"),
        (["--max_stalenes", "2"], "--max_stalenes 2: unknown flag; did you mean --max_staleness?"),
        (["--loss.kl_beta=-1"],
         "--loss.kl_beta -1: RLJobConfig.loss: LossConfig.kl_beta: must be finite and >= 0, got -1.0"),
        (["--optimizer.learning_rate", "-3"],
         "--optimizer.learning_rate -3: RLJobConfig.optimizer.learning_rate: must be finite and > 0, got -3.0"),
        # a scalar where a mapping or a list of them goes: what the field takes, not draccus' AttributeError
        (["--curriculum.lessons", "x"],
         "--curriculum.lessons x: RLJobConfig.curriculum.lessons: expected a list of LessonConfig mappings "
         "(field: value), got x"),
        (["--curriculum", "x"], "--curriculum x: RLJobConfig.curriculum: expected a CurriculumConfig mapping "
                                "(field: value), got 'x'"),
        (["--model", "3"], "--model 3: RLJobConfig.model: expected a ModelConfig mapping (field: value), got 3"),
        (["--optimizer", "x"], "--optimizer x: RLJobConfig.optimizer: expected a mapping with its `type:` and fields"),
        (["--trainer.tracker", "x"], "--trainer.tracker x: RLJobConfig.trainer.tracker: expected a mapping with its "
                                     "`type:` and fields (or a list of them), got 'x'"),
    ],
)
def test_a_bad_override_names_the_flag(tmp_path, capsys, overrides, message):
    err = _fails(["train", _config(tmp_path), *overrides], capsys)
    assert err.startswith(f"marinrl train: {message}"), err


def test_debug_shows_the_traceback(tmp_path, capsys):
    path = _config(tmp_path, "groups_per_step: 32", "groups_per_step: lots")
    with pytest.raises(SystemExit) as e:
        main(["train", path, "--debug"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and "DecodingError" in err
    assert err.strip().splitlines()[-1].startswith(f"marinrl train: {path}:")


# ------------------------------------------------------------------------- inspect, eval, report


def test_inspect_of_a_missing_path_is_an_error(tmp_path, capsys):
    err = _fails(["inspect", str(tmp_path / "nope")], capsys)
    assert err == f"marinrl inspect: {tmp_path}/nope: no such rollout root"


def test_inspect_of_a_run_folder_names_the_rollout_root_to_inspect(tmp_path, capsys):
    RolloutWriter(str(tmp_path / "run" / "rollouts")).write(make_batch(n_groups=1, group_size=2, weight_step=0))
    (tmp_path / "run" / "checkpoints").mkdir()
    err = _fails(["inspect", str(tmp_path / "run")], capsys)
    assert err == (f"marinrl inspect: {tmp_path}/run is a run folder, not a rollout root: "
                   f"inspect {tmp_path}/run/rollouts")
    assert main(["inspect", str(tmp_path / "run" / "rollouts")]) == 0
    assert "1 files, 2 rollouts" in capsys.readouterr().out


def test_inspect_of_an_existing_empty_root_is_fine(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert main(["inspect", str(tmp_path / "empty")]) == 0
    assert "0 files, 0 rollouts" in capsys.readouterr().out


def test_eval_and_report_input_errors_exit_2(tmp_path, capsys):
    err = _fails(["eval", "--checkpoint", str(tmp_path / "nope"), "--lessons", "echo"], capsys)
    assert err.startswith("marinrl eval: checkpoint not found")
    err = _fails(["report", str(tmp_path / "nope")], capsys)
    assert err.startswith("marinrl report: ") and "nope" in err


@pytest.mark.parametrize("tag", ["!!python/name:os.system", "!!python/object/apply:os.system ['true']", "!custom x"])
def test_a_yaml_tag_is_refused_naming_it_and_its_line(tmp_path, capsys, tag):
    """A tag would make a loader build an object or run code: refused before any loader reads the file."""
    path = _config(tmp_path, "run_id: quickstart", f"run_id: {tag}")
    err = _fails(["train", path], capsys)
    shown = tag.split()[0]
    assert err.startswith(f"marinrl train: {path}:{_line_col(path, shown)}: the tag {shown} is refused: a config is "
                          "plain YAML")


def test_a_config_error_answers_before_jax_is_imported(tmp_path):
    """The config layer alone checks ranges: a fresh `marinrl train` with a bad range never imports JAX,
    Levanter or Ray (docs/architecture.md, "Layers")."""
    import json
    import subprocess
    import sys

    path = _config(tmp_path)
    script = ("import json, sys\nfrom marinrl.cli import main\ntry:\n"
              f"    main(['train', {path!r}, '--groups_per_step', '0'])\n"
              "except SystemExit as e:\n    code = e.code\n"
              "print(json.dumps(dict(code=code, loaded=[m for m in ('jax', 'levanter', 'ray', 'torch', 'transformers') "
              "if m in sys.modules])))")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == {"code": 2, "loaded": []}
    assert "RLJobConfig.groups_per_step: must be >= 1, got 0" in out.stderr


def test_a_placement_no_node_can_hold_is_one_line_after_ray_starts(tmp_path, capsys):
    """Checked against the cluster Ray found (here a local one without GPUs): still one line and status 2."""
    path = _config(tmp_path)
    err = _fails(["train", path, "--ray.trainer.num_gpus", "1"], capsys)
    assert err.startswith("marinrl train: --ray.trainer.num_gpus 1: RLJobConfig.ray.trainer.num_gpus: 1 GPUs per "
                          "trainer, but no node has more than 0 GPUs")


# ----------------------------------------------------------------------------- issue 33: every input in one line


@pytest.mark.parametrize("old, new, needle, message", [
    ("type: llama", "type: lama", "lama",
     r"RLJobConfig.model.model.type: unknown type 'lama'; the types are llama, qwen3"),
    ("optimizer: {learning_rate: 0.001}", "optimizer: {type: adamx, learning_rate: 0.001}", "adamx",
     r"RLJobConfig.optimizer.type: unknown type 'adamx'; the types are adam, rl_adam"),
    ("num_train_steps: 200", "num_train_steps: 1000000000000000000000000000000", "1000",
     r"RLJobConfig.num_train_steps: must be <= 1_000_000_000, got 1_000_000_000_000_000_000_000_000_000_000: "),
    ("groups_per_step: 32", "groups_per_step: 100000000000", "1000",
     r"RLJobConfig.groups_per_step: must be <= 1_000_000, got 100_000_000_000: "),
])
def test_a_choice_or_a_count_that_cannot_be_meant_is_one_line(tmp_path, capsys, old, new, needle, message):
    path = _config(tmp_path, old, new)
    line = _line_col(path, new).split(":")[0]
    col = pathlib.Path(path).read_text().splitlines()[int(line) - 1].index(needle) + 1
    err = _fails(["train", path], capsys)
    assert re.fullmatch(rf"marinrl train: {re.escape(path)}:{line}:{col}: {message}.*", err), err


def test_a_duplicate_key_names_both_lines(tmp_path, capsys):
    path = _config(tmp_path, "max_staleness: 1", "max_staleness: 1\nmax_staleness: 0")
    first = _line_col(path, "max_staleness: 1").split(":")[0]
    second = _line_col(path, "max_staleness: 0")
    err = _fails(["train", path], capsys)
    assert err == (f"marinrl train: {path}:{second}: duplicate key 'max_staleness' (first at line {first}): YAML "
                   "would keep only this one; delete one of them")


def test_a_mixed_precision_key_given_twice_is_refused(tmp_path, capsys):
    err = _fails(["train", _config(tmp_path), "--trainer.mp", "p=f32,c=bf16,c=f32"], capsys)
    assert "compute is given twice in 'p=f32,c=bf16,c=f32'" in err


def test_an_empty_or_non_utf8_config_is_one_line(tmp_path, capsys):
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    assert _fails(["train", str(empty)], capsys) == (
        f"marinrl train: {empty}: the file is empty: a config is a YAML mapping of field: value "
        "(experiments/quickstart.yaml is one)")
    latin = tmp_path / "latin.yaml"
    latin.write_bytes(b"run_id: demo\nrun_root: caf\xe9\n")
    assert _fails(["train", str(latin)], capsys) == (
        f"marinrl train: {latin}:2:14: not UTF-8 text (byte 0xe9): save the file as UTF-8")


def test_train_help_points_at_the_docs_the_exit_codes_and_debug(capsys):
    with pytest.raises(SystemExit) as e:
        main(["train", "--help"])
    assert e.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "docs/configuration.md" in text and "docs/troubleshooting.md" in text
    assert "Exit status: 0 done; 2 an input error" in text and "--debug" in text


@pytest.fixture
def no_gcs_credentials(tmp_path, monkeypatch):
    """google.auth finds no credentials: a key file that does not exist, no gcloud config, no emulator."""
    monkeypatch.delenv("STORAGE_EMULATOR_HOST", raising=False)
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(tmp_path / "missing-key.json"))
    monkeypatch.setenv("CLOUDSDK_CONFIG", str(tmp_path / "gcloud"))


def test_a_gs_path_without_credentials_is_one_line_before_any_storage_call(tmp_path, capsys, no_gcs_credentials):
    path = _config(tmp_path, f"run_root: {tmp_path}/runs", "run_root: gs://no-such-bucket/runs")
    err = _fails(["train", path], capsys)
    assert err.startswith(f"marinrl train: {path}:{_line_col(path, 'gs://')}: RLJobConfig.run_root: "
                          "gs://no-such-bucket/runs: no Google Cloud credentials (")
    err = _fails(["inspect", "gs://no-such-bucket/runs/rollouts"], capsys)
    assert err.startswith("marinrl inspect: gs://no-such-bucket/runs/rollouts: no Google Cloud credentials (")
    for command in ("check", "show"):  # the run lock's tool: tests/test_run_lock.py
        err = _fails(["lock", command, "gs://no-such-bucket/runs/demo"], capsys)
        assert err.startswith(f"marinrl lock {command}: gs://no-such-bucket/runs/demo: no Google Cloud credentials (")


def test_report_of_a_folder_that_is_not_a_run_writes_nothing(tmp_path, capsys):
    runs = tmp_path / "runs"
    (runs / "demo" / "logs").mkdir(parents=True)
    err = _fails(["report", str(runs)], capsys)
    assert err == (f"marinrl report: {runs} is not a run folder (it has none of rollouts/, tensorboard/, logs/, "
                   "checkpoints/); the runs in it: demo")
    assert sorted(p.name for p in runs.iterdir()) == ["demo"]  # no report/ written into it


def test_an_unreachable_ray_address_is_refused_before_ray(tmp_path):
    from conftest import free_port

    from marinrl.config.errors import ConfigError
    from marinrl.job.preflight import check_ray_address

    address = f"127.0.0.1:{free_port()}"
    for given in (address, f"ray://{address}"):
        with pytest.raises(ConfigError, match=rf"^RLJobConfig.ray.address: nothing answers at {re.escape(given)} "
                                              r"\(Connection refused\): start the Ray cluster there"):
            check_ray_address(given)
    check_ray_address("auto")  # left to Ray


def test_a_finished_run_says_so_instead_of_checkpoint_none():
    from marinrl.cli.train import summary_line

    train = {"first_step": 30, "final_step": 30, "checkpoint": None, "resumed_from": "runs/q/checkpoints/step-29"}
    assert summary_line("q", train, 3.0, 0) == ("[marinrl] q: already at step 30 (checkpoint runs/q/checkpoints/"
                                                "step-29): nothing to train; raise num_train_steps to train further")
