import json
import pathlib
import subprocess
import sys

from factories import make_batch

from marinrl.cli import main
from marinrl.storage.rollouts import RolloutWriter


def test_inspect_prints_a_table_and_json(tmp_path, capsys):
    writer = RolloutWriter(str(tmp_path))
    writer.write(make_batch(n_groups=2, group_size=4, weight_step=3, env_name="math"))
    (tmp_path / "step=00000003" / "zz-broken.parquet").write_bytes(b"nope")
    (tmp_path / "step=00000003" / "zz-folder.parquet").mkdir()  # listed like a file, cannot be read as one
    assert main(["inspect", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "1 files, 8 rollouts, 2 groups, 0 quarantined, 2 unreadable" in out
    assert "math" in out and "stop=8" in out and "zz-broken.parquet" in out
    assert "zz-folder.parquet: cannot be read (IsADirectoryError" in out
    assert main(["inspect", f"file://{tmp_path}", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["steps"]["3"]["rollouts"] == 8 and summary["totals"]["unreadable"] == 2
    assert (tmp_path / "step=00000003" / "zz-broken.parquet").exists()  # inspect changes nothing


def test_console_script_is_installed(tmp_path):
    script = pathlib.Path(sys.executable).parent / "marinrl"
    (tmp_path / "empty").mkdir()  # a rollout root that does not exist is an error
    result = subprocess.run([str(script), "inspect", str(tmp_path / "empty"), "--json"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["totals"]["files"] == 0


def test_bad_storage_option_is_a_clear_error(tmp_path):
    try:
        main(["inspect", str(tmp_path), "-o", "token"])
    except SystemExit as e:
        assert "KEY=VALUE" in str(e)
    else:
        raise AssertionError("expected SystemExit")
