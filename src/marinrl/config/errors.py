"""Config mistakes as one line that points into the file: `<file>:<line>:<col>: <field>: <problem>`.

draccus reports a YAML config's errors as exceptions whose first line is a wrapper ("Could not decode
the value into any of the given types", "Couldn't instantiate class ...") with the reason further
down the chain and no position. `load_job_config` parses a job config and turns every such error,
invalid YAML, a missing file, a wrong command-line override and a preflight `ConfigError` into a
`ConfigInputError` with that one line: the reason first, the key's line and column from
`yaml.compose`'s node marks, the valid keys or the closest one for an unknown key, and the flag
itself (`--max_staleness x`) when an override is what is wrong.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import typing
from typing import Any, Optional, Sequence

import yaml


class ConfigError(ValueError):
    """A job config that cannot run. `field` is the dotted path below RLJobConfig (lessons by id:
    `curriculum.lessons[echo].env`); the message is `RLJobConfig.<field>: <problem>`."""

    def __init__(self, field: str, problem: str):
        self.field = field
        self.problem = problem
        super().__init__(f"RLJobConfig.{field}: {problem}")

    def __reduce__(self):  # picklable across Ray, which re-creates exceptions from their args
        return type(self), (self.field, self.problem)


class ConfigInputError(ValueError):
    """A config or input the user can fix; the message is the whole report (one or two lines)."""


def load_job_config(cls: type, path: str, overrides: Sequence[str]):
    """`draccus.parse(cls, config_path=path, args=overrides)`, with every mistake a ConfigInputError."""
    import draccus
    from draccus.utils import DraccusException

    root = compose_yaml(path)
    try:
        return draccus.parse(cls, config_path=path, args=list(overrides), exit_on_error=False)
    except DraccusException as e:
        raise ConfigInputError(_describe_draccus_error(e, cls, path, root, overrides)) from e
    except Exception as e:  # argparse's own errors (a flag without its value)
        raise ConfigInputError(f"{_one_line(e)}") from e


def compose_yaml(path: str) -> yaml.Node:
    """The YAML node tree of `path` (positions included); a missing file or invalid YAML raises
    ConfigInputError with the parser's line and column."""
    if not os.path.exists(path):
        raise ConfigInputError(f"{path}: config file not found")
    if os.path.isdir(path):
        raise ConfigInputError(f"{path}: is a directory, not a config file")
    with open(path, "rb") as f:
        data = f.read()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b"\n") + 1
        column = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        raise ConfigInputError(f"{path}:{line}:{column}: not UTF-8 text (byte 0x{data[e.start]:02x}): save the file "
                               "as UTF-8") from None
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else path
        context = ""
        if e.context and e.context_mark and e.context_mark is not mark:
            context = f" ({e.context} at {e.context_mark.line + 1}:{e.context_mark.column + 1})"
        raise ConfigInputError(f"{where}: invalid YAML: {e.problem}{context}") from e
    except yaml.YAMLError as e:
        raise ConfigInputError(f"{path}: invalid YAML: {_one_line(e)}") from e
    if root is None:
        raise ConfigInputError(f"{path}: the file is empty: a config is a YAML mapping of field: value "
                               "(experiments/quickstart.yaml is one)")
    if not isinstance(root, yaml.MappingNode):
        raise ConfigInputError(f"{path}:{root.start_mark.line + 1}:{root.start_mark.column + 1}: "
                               f"a config must be a YAML mapping of field: value")
    _refuse_tags(path, root)
    _refuse_duplicate_keys(path, root)
    return root


def _refuse_duplicate_keys(path: str, node: yaml.Node) -> None:
    """YAML loaders keep the last of two equal keys without a word: the first value would be silently
    ignored. Refused, naming both places."""
    stack = [node]
    while stack:
        n = stack.pop()
        if isinstance(n, yaml.MappingNode):
            seen: dict[str, yaml.Node] = {}
            for key, value in n.value:
                if isinstance(key, yaml.ScalarNode) and key.tag != "tag:yaml.org,2002:merge":
                    if key.value in seen:
                        first = seen[key.value].start_mark
                        raise ConfigInputError(f"{path}:{key.start_mark.line + 1}:{key.start_mark.column + 1}: "
                                               f"duplicate key {key.value!r} (first at line {first.line + 1}): "
                                               "YAML would keep only this one; delete one of them")
                    seen[key.value] = key
                stack.append(value)
        elif isinstance(n, yaml.SequenceNode):
            stack.extend(n.value)


_PLAIN_TAGS = {f"tag:yaml.org,2002:{t}" for t in ("str", "int", "float", "bool", "null", "map", "seq", "merge")}


def _refuse_tags(path: str, node: Optional[yaml.Node]) -> None:
    """A tag (`!!python/object:…`, `!custom`) would make a loader build an object or run code: refused,
    naming it and where it is, before any loader sees the file."""
    stack = [node] if node is not None else []
    while stack:
        n = stack.pop()
        if n.tag not in _PLAIN_TAGS:
            tag = n.tag.replace("tag:yaml.org,2002:", "!!")
            raise ConfigInputError(f"{path}:{n.start_mark.line + 1}:{n.start_mark.column + 1}: "
                                   f"the tag {tag} is refused: "
                                   "a config is plain YAML (mappings, lists, strings, numbers, booleans, null), "
                                   "without tags")
        if isinstance(n, yaml.MappingNode):
            stack.extend(x for pair in n.value for x in pair)
        elif isinstance(n, yaml.SequenceNode):
            stack.extend(n.value)


def locate(path: str, root: Optional[yaml.Node], overrides: Sequence[str], field: str, key: bool = False) -> str:
    """Where `field` (dotted, lists as `[i]` or `[lesson_id]`) comes from: the override flag that set it,
    else `<file>:<line>:<col>` of its value (of its key with `key=True`), else the deepest part found."""
    parts = _split_field(field)
    for flag, value in _override_pairs(overrides):
        flag_parts = flag.split(".")
        if parts[:len(flag_parts)] == flag_parts or flag_parts[:len(parts)] == parts:
            return f"--{flag} {value}" if value is not None else f"--{flag}"
    node = _find_node(root, parts, key)
    if node is None:
        return path
    return f"{path}:{node.start_mark.line + 1}:{node.start_mark.column + 1}"


# ------------------------------------------------------------------------------ draccus errors


_UNKNOWN_FIELDS = re.compile(r"^The fields (.*) are not valid for (.*)$", re.S)
_UNDERLYING = re.compile(r'Underlying error is "(.*)"', re.S)
_UNRECOGNIZED = "unrecognized arguments: "


def _describe_draccus_error(error: Exception, cls: type, path: str, root, overrides: Sequence[str]) -> str:
    from draccus.utils import DecodingError, ParsingError

    message = str(error)
    if message.startswith(_UNRECOGNIZED):
        return _unrecognized_flags(message[len(_UNRECOGNIZED):], cls)
    chain = _chain(error)
    decoding = [e for e in chain if isinstance(e, DecodingError)]
    key_path = list(max((e.key_path for e in decoding), key=len, default=()))
    instantiate = next((e for e in chain if type(e) is ParsingError and str(e).startswith("Couldn't instantiate")),
                       None)
    if instantiate is not None and instantiate.__cause__ is not None:  # a __post_init__ said what is wrong
        problem = _one_line(instantiate.__cause__)
        raw = _merged_raw(path, overrides)
        key_path += _failing_subtree(_type_at(cls, key_path, raw), _raw_at(raw, key_path))
        return f"{locate(path, root, overrides, _dotted(key_path))}: {_field_name(cls, key_path)}: {problem}"
    inner = [e for e in decoding if not e.message.startswith("Could not decode the value")] or decoding
    choice = _CHOICE_NOT_MAPPING.search(message)
    if not inner and choice:  # a choice class (optimizer, tracker, ...) given a scalar: find whose value it is
        flag = next((f for f, v in _override_pairs(overrides) if v == choice.group(1)), None)
        where = f"--{flag} {choice.group(1)}: {cls.__name__}.{flag}" if flag else path
        return f"{where}: expected a mapping with its `type:` and fields, got {choice.group(1)!r}"
    if not inner:
        return f"{path}: {_one_line(error)}"
    problem = inner[-1].message
    no_choice = _NO_CHOICE.search(problem)
    if no_choice:  # draccus names the registry's class, not what it holds
        choices = _known_choices(no_choice.group(2))
        field = [*key_path, "type"]
        return (f"{locate(path, root, overrides, _dotted(field))}: {_field_name(cls, field)}: unknown type "
                f"{no_choice.group(1)!r}" + (f"; the types are {', '.join(choices)}" if choices else ""))
    unknown = _UNKNOWN_FIELDS.match(problem)
    if unknown:
        names = re.findall(r"`([^`]+)`", unknown.group(1))
        target = _type_at(cls, key_path, _merged_raw(path, overrides))
        field = _dotted([*key_path, names[0]])
        derived = getattr(cls, "DERIVED_FIELDS", {}).get(field)
        problem = derived.refusal(names[0]) if derived else _unknown_fields_problem(names, target)
        return (f"{locate(path, root, overrides, field, key=True)}: {_field_name(cls, [*key_path, names[0]])}: "
                f"{problem}")
    underlying = _UNDERLYING.search(problem)
    shape = _SHAPE_MISMATCH.search(problem)
    union = _UNION_NOT_MAPPING.search(problem)
    if underlying and shape and underlying.group(1).startswith(("AttributeError", "TypeError")):
        # draccus decoded a value of the wrong shape (a string where a mapping or a list goes): its
        # underlying error names a Python method, not what the field takes
        problem = f"expected {_friendly_type(shape.group(2))}, got {_unquoted(shape.group(1))}"
    elif union:
        got = _raw_at(_merged_raw(path, overrides), key_path)
        problem = f"expected {_friendly_type(union.group(1))}, got {got!r}"
    elif _CHOICE_NOT_MAPPING.search(problem):
        got = _raw_at(_merged_raw(path, overrides), key_path)
        problem = f"expected a mapping with its `type:` and fields (or a list of them), got {got!r}"
    elif underlying:
        problem = underlying.group(1)
    problem = problem.strip().splitlines()[0]
    return f"{locate(path, root, overrides, _dotted(key_path))}: {_field_name(cls, key_path)}: {problem}"


_NO_CHOICE = re.compile(r"Couldn't find a choice class for '(.*?)' in <class '([\w.]+)'>")


def _known_choices(class_path: str) -> list[str]:
    """The registered names of a draccus choice class named by its dotted path."""
    import importlib

    module, _, name = class_path.rpartition(".")
    try:
        return sorted(getattr(importlib.import_module(module), name).get_known_choices())
    except Exception:  # noqa: BLE001 - a hint only
        return []


_SHAPE_MISMATCH = re.compile(r'Failed when parsing value=(.*) into field ".*" of type (.*?)\.\s*\n', re.S)


_UNION_NOT_MAPPING = re.compile(r"^Could not decode the value into any of the given types:\s*\n\s*(\w+): "
                                r"'\w+' object has no attribute 'copy'\s*$")
_CHOICE_NOT_MAPPING = re.compile(r"Expected a dict for a choice class, got (.*?)$", re.M)


def _unquoted(value: str) -> str:
    """draccus quotes the value's repr: `'['x']'` -> `['x']`."""
    return value[1:-1] if len(value) >= 2 and value[0] == value[-1] == "'" else value


def _friendly_type(name: str) -> str:
    """`tuple[marinrl.curriculum.lessons.LessonConfig, ...]` -> `a list of LessonConfig mappings (field: value)`."""
    name = re.sub(r"<class '([\w.]+)'>", r"\1", name)
    name = re.sub(r"\b(?:[a-z_]\w*\.)+([A-Za-z_]\w*)", r"\1", name)  # drop module paths
    listed = re.fullmatch(r"(?:tuple|list|Tuple|List|Sequence)\[(\w+)(?:, \.\.\.)?\]", name)
    if listed:
        item = listed.group(1)
        return f"a list of {item} mappings (field: value)" if item.endswith("Config") else f"a list of {item}"
    if re.fullmatch(r"\w+Config", name):
        return f"a {name} mapping (field: value)"
    return name


def _unknown_fields_problem(names: list[str], target: Optional[type]) -> str:
    also = f" (and {', '.join(names[1:])})" if len(names) > 1 else ""
    if target is None or not dataclasses.is_dataclass(target):
        return f"unknown field{also}"
    valid = [f.name for f in dataclasses.fields(target) if f.init]
    closest = difflib.get_close_matches(names[0], valid, n=1)
    hint = f"did you mean `{closest[0]}`?" if closest else f"valid fields: {', '.join(valid)}"
    return f"unknown field of {target.__name__}{also}; {hint}"


def _unrecognized_flags(flags: str, cls: type) -> str:
    from draccus.argparsing import ArgumentParser

    known = [s for s in ArgumentParser(cls).parser._option_string_actions if s.startswith("--")]
    first = flags.split()[0]
    *path, name = first.lstrip("-").split(".")
    derived = getattr(cls, "DERIVED_FIELDS", {}).get(".".join([*path, name]))
    if derived:
        return f"{flags}: {derived.refusal('.'.join([*path, name]))}"
    closest = difflib.get_close_matches(first, known, n=1)
    hint = f"; did you mean {closest[0]}?" if closest else " (flags are field paths: --loss.kl_beta 0.01)"
    return f"{flags}: unknown flag{'s' if len(flags.split()) > 2 else ''}{hint}"


def _chain(error: BaseException) -> list[BaseException]:
    chain: list[BaseException] = []
    while error is not None and error not in chain:
        chain.append(error)
        error = error.__cause__ or (None if error.__suppress_context__ else error.__context__)
    return chain


def _failing_subtree(cls: Optional[type], raw: Any) -> list[str]:
    """The path below a value that failed to construct to the deepest part that fails on its own."""
    import draccus

    cls = _concrete(cls, raw)
    if cls is None:
        return []
    if _item_type(cls) is not None:
        items = raw if isinstance(raw, list) else []
        for i, item in enumerate(items):
            try:
                draccus.decode(_item_type(cls), item)
            except Exception:
                return [str(i), *_failing_subtree(_item_type(cls), item)]
        return []
    if not (dataclasses.is_dataclass(cls) and isinstance(raw, dict)):
        return []
    hints = _hints(cls)
    for name, value in raw.items():
        if name not in hints or not _holds_dataclass(hints[name]):
            continue
        try:
            draccus.decode(hints[name], value)
        except Exception:
            return [name, *_failing_subtree(hints[name], value)]
    return []


# ------------------------------------------------------------------------------ types and raw values


def _type_at(cls: type, key_path: Sequence[str], raw: Any) -> Optional[type]:
    """The config class at `key_path` below `cls` (choices resolved by the value's `type:`)."""
    t: Any = cls
    for part in key_path:
        t = _concrete(t, raw)
        if t is None:
            return None
        if _item_type(t) is not None:
            t, raw = _item_type(t), (raw[int(part)] if isinstance(raw, list) and part.isdigit()
                                     and int(part) < len(raw) else None)
        elif dataclasses.is_dataclass(t):
            t, raw = _hints(t).get(part), (raw.get(part) if isinstance(raw, dict) else None)
        else:
            return None
    return _concrete(t, raw)


def _concrete(t: Any, raw: Any) -> Optional[type]:
    from draccus.choice_types import ChoiceType

    if typing.get_origin(t) is typing.Union:
        options = [a for a in typing.get_args(t) if a is not type(None) and _holds_dataclass(a)]
        return _concrete(options[0], raw) if len(options) == 1 else None
    if isinstance(t, type) and issubclass(t, ChoiceType):
        try:
            t.get_choice_name(t)
            return t  # a concrete choice already
        except ValueError:
            pass
        name = raw.get("type") if isinstance(raw, dict) else None
        try:
            return t.get_choice_class(name or t.default_choice_name())
        except Exception:
            return None
    return t if (isinstance(t, type) or _item_type(t) is not None) else None


def _item_type(t: Any) -> Optional[type]:
    if typing.get_origin(t) in (tuple, list):
        args = [a for a in typing.get_args(t) if a is not Ellipsis]
        return args[0] if args else None
    return None


def _holds_dataclass(t: Any) -> bool:
    if dataclasses.is_dataclass(t):
        return True
    return any(_holds_dataclass(a) for a in typing.get_args(t))


def _hints(cls: type) -> dict[str, Any]:
    try:
        return typing.get_type_hints(cls)
    except Exception:
        return {f.name: f.type for f in dataclasses.fields(cls)}


def _merged_raw(path: str, overrides: Sequence[str]) -> Any:
    """The config as draccus decodes it: the file's mapping with the overrides merged in."""
    with open(path, encoding="utf-8") as f:
        raw = yaml.safe_load(f) or {}
    for flag, value in _override_pairs(overrides):
        *parents, last = flag.split(".")
        node = raw
        for p in parents:
            node = node.setdefault(p, {}) if isinstance(node, dict) else {}
        if isinstance(node, dict):
            try:
                node[last] = yaml.safe_load(value) if value is not None else None
            except yaml.YAMLError:
                node[last] = value
    return raw


merged_raw = _merged_raw  # public: the CLI reads run_root/run_id from it before the config's imports


def _raw_at(raw: Any, key_path: Sequence[str]) -> Any:
    for part in key_path:
        if isinstance(raw, dict):
            raw = raw.get(part)
        elif isinstance(raw, list) and part.isdigit() and int(part) < len(raw):
            raw = raw[int(part)]
        else:
            return None
    return raw


def _override_pairs(overrides: Sequence[str]) -> list[tuple[str, Optional[str]]]:
    pairs, i = [], 0
    overrides = list(overrides)
    while i < len(overrides):
        arg = overrides[i]
        i += 1
        if not arg.startswith("--"):
            continue
        flag, eq, value = arg[2:].partition("=")
        if not eq:
            value = overrides[i] if i < len(overrides) and not overrides[i].startswith("--") else None
            i += value is not None
        pairs.append((flag, value))
    return pairs


# ------------------------------------------------------------------------------ field paths and nodes


def _dotted(key_path: Sequence[str]) -> str:
    return "".join(f"[{p}]" if p.isdigit() else f".{p}" for p in key_path).lstrip(".")


def _field_name(cls: type, key_path: Sequence[str]) -> str:
    return f"{cls.__name__}.{_dotted(key_path)}" if key_path else cls.__name__


def _split_field(field: str) -> list[str]:
    """`curriculum.lessons[echo].env` -> ["curriculum", "lessons", "[echo]", "env"]; `x.0` as `[0]`."""
    parts = []
    for token in re.findall(r"\[[^\]]*\]|[^.\[\]]+", field):
        parts.append(f"[{token}]" if token.isdigit() else token)
    return parts


def _find_node(root: Optional[yaml.Node], parts: Sequence[str], key: bool) -> Optional[yaml.Node]:
    """The node at `parts` (its key node with `key`), else the deepest one found below the root."""
    node, found = root, None
    for n, part in enumerate(parts):
        last = n == len(parts) - 1
        if isinstance(node, yaml.MappingNode) and not part.startswith("["):
            match = next(((k, v) for k, v in node.value if isinstance(k, yaml.ScalarNode) and k.value == part), None)
            if match is None:
                return found
            found = match[0] if (last and key) else match[1]
            node = match[1]
        elif isinstance(node, yaml.SequenceNode) and part.startswith("["):
            item = _sequence_item(node, part[1:-1])
            if item is None:
                return found
            node = found = item
        else:
            return found
    return found


def _sequence_item(node: yaml.SequenceNode, index: str) -> Optional[yaml.Node]:
    if index.isdigit():
        return node.value[int(index)] if int(index) < len(node.value) else None
    for item in node.value:  # a lesson by its id
        if isinstance(item, yaml.MappingNode) and any(
                isinstance(k, yaml.ScalarNode) and k.value == "lesson_id" and getattr(v, "value", None) == index
                for k, v in item.value):
            return item
    return None


def _one_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
