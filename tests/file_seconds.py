"""Each test file's seconds in a `make test` run, which tests/conftest.py orders the files by (heaviest first,
so that the last file a worker starts is a short one). Measured as CI runs it, in a fresh clone (a cold compile
cache). Refresh after tests move or grow:

    git clone . /tmp/fresh && cd /tmp/fresh && PYTEST_ADDOPTS=--junitxml=/tmp/junit.xml .ci/run
    python tests/file_seconds.py /tmp/junit.xml   # here

A file missing from the table (a new one) is weighed by its tests instead (conftest.py)."""

from __future__ import annotations

import collections
import json
import pathlib
import sys
import xml.etree.ElementTree as ET

TABLE = pathlib.Path(__file__).with_name("file_seconds.json")


def load() -> dict[str, float]:
    return json.loads(TABLE.read_text()) if TABLE.exists() else {}


def from_junit(path: str) -> dict[str, int]:
    seconds = collections.Counter()
    for case in ET.parse(path).iter("testcase"):
        seconds[case.get("classname").replace(".", "/") + ".py"] += float(case.get("time", 0))
    return {name: round(s) for name, s in sorted(seconds.items())}


if __name__ == "__main__":
    TABLE.write_text(json.dumps(from_junit(sys.argv[1]), indent=0) + "\n")
