"""The docs hold what they name: every file, module, name and config field a row of docs/architecture.md's
"Where to add…" table names exists (a row that points at something renamed or gone sends the next engineer to
nothing); every link between the docs lands on a file and a heading there, and every section a source or doc cites
by title (`docs/performance.md, "Rehearsal"`) is a heading of that doc; headings say what a section is: none says
"(issue N)" or carries a date (the history file keeps its dates in the body)."""

from __future__ import annotations

import ast
import dataclasses
import functools
import pathlib
import re
import typing

from marinrl.config.job import RLJobConfig

ROOT = pathlib.Path(__file__).parents[1]
DOCS = ROOT / "docs"
PACKAGE = ROOT / "src" / "marinrl"
MARKDOWN = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
# Where a doc is cited by section title: the package, the benches, the tests, the recipes, the docs themselves.
CITING = [*PACKAGE.rglob("*.py"), *(ROOT / "bench").rglob("*.py"), *(ROOT / "tests").glob("*.py"),
          *(ROOT / "experiments").glob("*"), ROOT / "Makefile", *MARKDOWN]
REPO_FOLDERS = ("tests/", "bench/", "experiments/", "docs/")
DATA_FILES = (".json", ".jsonl", ".yaml", ".yml", ".toml", ".md", ".txt", ".safetensors", ".parquet")


def headings(path: pathlib.Path) -> list[str]:
    """The text of each Markdown heading, outside code fences, without its leading #s."""
    found, fenced = [], False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and re.match(r"#{1,6} ", line):
            found.append(line.lstrip("#").strip())
    return found


def bold_leads(path: pathlib.Path) -> list[str]:
    """The run-in titles of paragraphs (`**Digest.** Once Levanter's save commits, …`), which sources cite too."""
    return re.findall(r"^\*\*([^*\n]+?)\.?\*\*", path.read_text(), flags=re.MULTILINE)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


@functools.cache
def anchors(path: pathlib.Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for heading in headings(path):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def test_slug_follows_github():
    assert slug("Where to add…") == "where-to-add"
    assert slug("Sampler/trainer mismatch") == "samplertrainer-mismatch"
    assert slug("`marinrl serve`") == "marinrl-serve"
    assert slug("Generation on one H100 80GB: Levanter's engine and the scan sampler") == (
        "generation-on-one-h100-80gb-levanters-engine-and-the-scan-sampler")


def test_no_heading_names_an_issue_or_a_date():
    """Every heading says what its section is; dates live in the body (docs/performance_history.md's too)."""
    bad = [f"{path.relative_to(ROOT)}: {heading}"
           for path in MARKDOWN
           for heading in headings(path)
           if re.search(r"\bissues? \d+", heading, re.IGNORECASE) or re.search(r"\b20\d\d-\d\d\b", heading)]
    assert not bad, "headings naming an issue or a date:\n" + "\n".join(bad)


def test_links_between_docs_land_on_a_heading():
    bad = []
    for path in MARKDOWN:
        text = re.sub(r"```.*?```", "", path.read_text(), flags=re.DOTALL)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            file, _, anchor = target.partition("#")
            linked = (path.parent / file).resolve() if file else path
            if not linked.exists():
                bad.append(f"{path.relative_to(ROOT)}: {target}: no such file")
            elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
                bad.append(f"{path.relative_to(ROOT)}: {target}: no heading #{anchor} in {linked.name}")
    assert not bad, "\n".join(bad)


def test_sections_cited_by_title_exist():
    """`docs/training.md, "Checkpoints and resume"` (or `performance.md ("First step", "Memory")`): each title
    begins a heading of that doc or a paragraph's bold title, so a renamed one cannot leave its citations behind."""
    cite = re.compile(r'\b((?:docs/)?[a-z_]+\.md)(?:,| \(| \(docs/[a-z_]+\.md,)\s*((?:"[^"\n]+",?\s*)+)')
    bad = []
    for path in CITING:
        if not path.is_file() or path.suffix not in (".py", ".md", ".yaml", "") or "egg-info" in str(path):
            continue
        for match in cite.finditer(path.read_text()):
            name = match.group(1).removeprefix("docs/")
            doc = DOCS / name if (DOCS / name).exists() else ROOT / name
            if not doc.exists():
                continue  # BENCHMARK.md and other documents kept outside this repository
            titles = [h.replace("`", "") for h in headings(doc) + bold_leads(doc)]
            for title in re.findall(r'"([^"\n]+)"', match.group(2)):
                if not any(t.startswith(title.replace("`", "")) for t in titles):
                    bad.append(f'{path.relative_to(ROOT)}: {match.group(1)}, "{title}": no such heading')
    assert not bad, "\n".join(bad)


# --- docs/architecture.md, "Where to add…" ---------------------------------------------------------------------


def where_to_add_rows(text: str) -> list[list[str]]:
    section = text.split("## Where to add…", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")][2:]  # the header and its rule aside
    return [[cell.strip() for cell in row.strip().strip("|").split(" | ")] for row in rows]


def repo_file(rel: str) -> pathlib.Path:
    rel = rel.removeprefix("marinrl/")
    return ROOT / rel if rel.startswith(REPO_FOLDERS) else PACKAGE / rel


def module_file(module: str) -> pathlib.Path | None:
    """`envs/registry` or `levanter_configs` -> its file, if there is one."""
    for candidate in (repo_file(module + ".py"), repo_file(module) / "__init__.py"):
        if candidate.exists():
            return candidate
    return None


@functools.cache
def defined_names(path: pathlib.Path) -> set[str]:
    """Names a module defines at its top level or in a class body (constants, functions, classes, class attributes
    and methods, names it imports), not the locals of its functions."""
    names: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                names.add(node.name)
            elif isinstance(node, ast.ClassDef):
                names.add(node.name)
                visit(node.body)
            elif isinstance(node, ast.Assign):
                names.update(t.id for target in node.targets for t in ast.walk(target) if isinstance(t, ast.Name))
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names.add(node.target.id)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
            elif isinstance(node, (ast.If, ast.Try, ast.With)):
                visit(node.body)
                visit(getattr(node, "orelse", []) + getattr(node, "finalbody", []))
                for handler in getattr(node, "handlers", []):
                    visit(handler.body)

    visit(ast.parse(path.read_text()).body)
    return names


def config_classes() -> list[type]:
    """RLJobConfig and every dataclass reachable from its fields' types."""
    seen: dict[type, None] = {}
    todo = [RLJobConfig]
    while todo:
        cls = todo.pop()
        if cls in seen:
            continue
        seen[cls] = None
        hints = typing.get_type_hints(cls)
        for field in dataclasses.fields(cls):
            todo.extend(t for t in flat_types(hints.get(field.name)) if dataclasses.is_dataclass(t))
            todo.extend(sub for t in flat_types(hints.get(field.name)) if dataclasses.is_dataclass(t)
                        for sub in all_subclasses(t) if dataclasses.is_dataclass(sub))
    return list(seen)


def flat_types(hint) -> list:
    args = typing.get_args(hint)
    return [hint] if not args else [t for arg in args for t in flat_types(arg)]


def all_subclasses(cls: type) -> list[type]:
    # metaclasses aside: a worker that imported one (an ABCMeta subclass) would hand `type` itself on here
    return [sub for direct in type.__subclasses__(cls) if not issubclass(direct, type)
            for sub in (direct, *all_subclasses(direct))]


def field_types(cls: type, name: str) -> list[type] | None:
    """The dataclass types a field of `cls` may hold (subclasses included), or None when it has no such field."""
    if name not in {f.name for f in dataclasses.fields(cls)}:
        return None
    types = [t for t in flat_types(typing.get_type_hints(cls).get(name)) if isinstance(t, type)]
    return [c for t in types for c in (t, *all_subclasses(t)) if dataclasses.is_dataclass(c)]


def config_path_exists(path: str, classes: list[type]) -> bool:
    """`loss.objective`, `ray.trainer`, `env: {name, args}`: a field path from some config dataclass; the names in
    braces (unless they give values) are fields of what the path holds."""
    dotted, _, braces = path.partition(":")
    parts = dotted.strip().split(".")
    subfields = [] if ":" in braces or "…" in braces else re.findall(r"\w+", braces)
    for cls in classes:
        holders = [cls]
        for part in parts:
            found = [types for holder in holders if (types := field_types(holder, part)) is not None]
            if not found:
                break
            holders = [t for types in found for t in types]
        else:
            if all(any(field_types(holder, sub) is not None for holder in holders) for sub in subfields):
                return True
    return False


def where_to_add_problems(text: str) -> list[str]:
    """What each row of the table names that does not exist: a file, a module, a name in the row's modules, a
    config field."""
    classes = config_classes()
    bad = []
    for row in where_to_add_rows(text):
        what = row[0]
        refs = [ref for cell in row for ref in re.findall(r"`([^`]+)`", cell)]
        modules: list[pathlib.Path] = []
        bare: list[str] = []
        for ref in refs:
            ref = re.sub(r"\(.*\)$", "", ref.removeprefix("@")).strip()
            if ref.endswith(DATA_FILES) and "/" not in ref:
                continue  # a file of the user's (a checkpoint's `config.json`), not of this repository
            if ref.endswith((".py", *DATA_FILES)):
                if repo_file(ref).exists():
                    modules += [repo_file(ref)] if ref.endswith(".py") else []
                else:
                    bad.append(f"{what}: `{ref}`: no such file")
            elif "/" in ref or ("." in ref and ":" not in ref and module_file(ref.split(".")[0])):
                module, _, name = ref.rpartition(".")
                path = module_file(module)
                if path is None:
                    bad.append(f"{what}: `{ref}`: no module {module}")
                    continue
                modules.append(path)
                if name not in defined_names(path):
                    bad.append(f"{what}: `{ref}`: {path.relative_to(ROOT)} defines no {name}")
            else:
                bare.append(ref)
        if not modules:
            bad.append(f"{what}: the row names no file or module")
        for ref in bare:  # a name in one of the row's modules, or a config field
            if not (any(ref in defined_names(m) for m in modules) or config_path_exists(ref, classes)):
                bad.append(f"{what}: `{ref}`: neither defined in {[str(m.relative_to(ROOT)) for m in modules]} "
                           f"nor a config field")
    return bad


def test_where_to_add_rows_name_what_exists():
    text = (DOCS / "architecture.md").read_text()
    rows = where_to_add_rows(text)
    assert len(rows) >= 8, f"'Where to add…' table not found or cut short in docs/architecture.md: {rows}"
    bad = where_to_add_problems(text)
    assert not bad, "docs/architecture.md, 'Where to add…':\n" + "\n".join(bad)


def test_where_to_add_check_fails_on_a_false_row():
    """The check is not vacuous: a row naming a config field, a table, a helper or a file that does not exist fails,
    each by name."""
    text = (DOCS / "architecture.md").read_text()
    false_row = ("| widget | `loss.no_such_field` (`config/loss.py`) | `train/losses.NO_SUCH_TABLE` | "
                 "`no_such_helper`; `train/no_such_module.py` |\n")
    rule = text.index("|---", text.index("## Where to add…"))
    end = text.index("\n\n", rule) + 1
    message = "\n".join(where_to_add_problems(text[:end] + false_row + text[end:]))
    for name in ("`loss.no_such_field`", "NO_SUCH_TABLE", "`no_such_helper`", "train/no_such_module.py"):
        assert name in message
    assert "widget" in message and message.count("widget") == 4
