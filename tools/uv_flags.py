"""Print the flags that make `uv pip install` see what `pip install` sees on this machine.

`make install` installs with uv (about a minute where pip takes several), but uv reads none of pip's
configuration: a machine whose pip is pointed at a local wheel folder (a CPU build of torch), extra indexes
or global constraints through pip.conf or PIP_* variables would get different wheels from uv. This reads
pip's own view (`pip config list`, files and environment together) and prints the uv flags for it; a local
index or wheel folder that does not exist is left out (pip warns and goes on, uv would stop).

    python tools/uv_flags.py        # e.g. --index-strategy unsafe-best-match --find-links /opt/wheels
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys

FLAGS = {"find-links": "--find-links", "constraint": "-c", "index-url": "--index-url",
         "extra-index-url": "--extra-index-url"}


def pip_settings() -> dict[str, list[str]]:
    """Key → values of pip's configuration, environment variables over files (pip's own order)."""
    out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
    by_scope: dict[str, dict[str, list[str]]] = {}
    for line in out.splitlines():
        name, sep, value = line.partition("=")
        if not sep or "." not in name:
            continue
        scope, key = name.rsplit(".", 1)
        by_scope.setdefault(scope, {})[key] = value.strip().strip("'\"").split()
    settings: dict[str, list[str]] = {}
    for scope in ("global", "install", ":env:"):  # later scopes win, as in pip
        settings.update(by_scope.get(scope, {}))
    return settings


def usable(location: str) -> bool:
    path = location[len("file://"):] if location.startswith("file://") else location
    return "://" in location and not location.startswith("file://") or os.path.exists(path)


def uv_flags() -> list[str]:
    flags = ["--index-strategy", "unsafe-best-match"]  # pip takes the best version over every index
    for key, values in pip_settings().items():
        if key in FLAGS:
            for value in values:
                if usable(value):
                    flags += [FLAGS[key], value]
    return flags


if __name__ == "__main__":
    print(shlex.join(uv_flags()))
