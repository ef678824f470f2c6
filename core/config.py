"""Typed configuration: the shared base of every config schema, and loading them.

Each schema lives beside the code that reads it (ModelConfig in core/model/config.py, LoRAConfig
in core/lora/config.py, ParallelConfig in core/parallel/config.py, OptimConfig in core/optim.py,
DataConfig in core/data/config.py, CheckpointConfig / ReliabilityConfig / TrackingConfig beside
the checkpoint, reliability and tracking code, LauncherConfig in stages/launch/config.py, the
stage configs in stages/config.py, PipelineConfig in flows/config.py; docs/architecture.md has
the map). One schema serves the CLI, Prefect's run form and the torchrun spec. This module holds
what they share:

    ConfigModel     the pydantic base: unknown keys refused, values validated on assignment,
                    no NaN/inf, no NUL bytes or lone surrogates in text
    load_config     defaults < YAML/JSON file < `--set a.b.c=value` overrides (YAML 1.2 scalars)
    ConfigError     what any of that raises, naming the file (or the --set item) and the dotted key
    dump_config / to_json_file / from_json_file     the spec a torchrun entry point gets

Every module here is torch-free, so the flow process can load every schema.
"""

from __future__ import annotations

import inspect
import json
import os
import re
import types
from pathlib import Path
from typing import Annotated, Any, Literal, Sequence, TypeVar, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from posttrain.core.titles import field_title, model_title

Dtype = Literal["float32", "bfloat16", "float16"]
C = TypeVar("C", bound=BaseModel)


class ConfigError(ValueError):
    """An invalid config file, override or value; the message names the file and the dotted key."""


class ConfigModel(BaseModel):
    # Field descriptions land in the JSON schema, which Prefect renders as its run form.
    # inf/nan pass pydantic's gt/ge checks (nan compares false, inf is "greater"); no knob wants them.
    # Titles there are human ("SFT teacher", "Learning rate", "Tensor parallel (tp)"): core/titles.py.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False,
                              field_title_generator=field_title, model_title_generator=model_title)

    @field_validator("*")
    @classmethod
    def _text(cls, v: Any) -> Any:
        # No path, argv entry, env value or URL can hold a NUL, and a lone surrogate (YAML's
        # "\ud800") cannot even be written to the JSON spec: refuse them here, not deep in a stage.
        if (why := _bad_text(v)) is not None:
            raise ValueError(why)
        return v


_BAD_TEXT = re.compile("[\x00\ud800-\udfff]")


def _bad_text(v: Any) -> str | None:
    if isinstance(v, str):
        m = _BAD_TEXT.search(v)
        return None if m is None else "contains a NUL byte" if m.group() == "\x00" else \
            "is not valid Unicode (a lone surrogate)"
    if isinstance(v, (list, tuple)):
        return next((w for x in v if (w := _bad_text(x))), None)
    if isinstance(v, dict):
        return next((w for k, x in v.items() if (w := _bad_text(k) or _bad_text(x))), None)
    return None


def ensure_within(base: str | Path, path: str | Path) -> Path:
    """`path` (relative paths taken from `base`) normalized; ValueError if it escapes `base`.

    Lexical on purpose: a symlink in the workspace to scratch storage is fine, a `..` out is not.
    """
    base_abs = os.path.abspath(base)
    full = os.path.abspath(os.path.join(base_abs, path))
    if os.path.commonpath([base_abs, full]) != base_abs:
        raise ValueError(f"path {str(path)!r} escapes {str(base)!r}")
    return Path(os.path.normpath(os.path.join(base, os.path.relpath(full, base_abs))))


# ---------------------------------------------------------------------------------- loading

class _Yaml12Loader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2 scalars: `1e-4` is a float, `no`/`on` and `4:00:00` stay strings;
    a key given twice in one mapping is an error (YAML says so; PyYAML keeps the last silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: set[str] = set()
        for key_node, _ in node.value:
            if isinstance(key_node, yaml.ScalarNode) and key_node.tag != "tag:yaml.org,2002:merge":
                if key_node.value in seen:
                    raise yaml.constructor.ConstructorError(
                        "while constructing a mapping", node.start_mark,
                        f"found duplicate key {key_node.value!r}", key_node.start_mark)
                seen.add(key_node.value)
        return super().construct_mapping(node, deep)


_Yaml12Loader.yaml_implicit_resolvers = {
    ch: [(tag, rx) for tag, rx in rs if tag.rsplit(":", 1)[-1] not in ("bool", "int", "float", "timestamp")]
    for ch, rs in yaml.SafeLoader.yaml_implicit_resolvers.items()}
for _tag, _rx, _first in (
        ("bool", r"^(?:true|True|TRUE|false|False|FALSE)$", "tTfF"),
        ("int", r"^(?:[-+]?(?:0|[1-9][0-9_]*)|0x[0-9a-fA-F_]+)$", "-+0123456789"),
        ("float", r"^(?:[-+]?(?:[0-9][0-9_]*\.[0-9_]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?"
                  r"|[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$",
         "-+0123456789.")):
    _Yaml12Loader.add_implicit_resolver(f"tag:yaml.org,2002:{_tag}", re.compile(_rx), list(_first))


def _model_of(ann: Any) -> type[BaseModel] | None:
    if get_origin(ann) in (Union, types.UnionType):
        args = [a for a in get_args(ann) if a is not type(None)]
        return _model_of(args[0]) if len(args) == 1 else None
    return ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None


def _free_form(ann: Any) -> bool:
    if get_origin(ann) in (Union, types.UnionType):
        return any(_free_form(a) for a in get_args(ann))
    return get_origin(ann) is dict or ann is dict


def _keys_at(cls: type[BaseModel], parts: list[str]) -> list[str]:
    """Valid keys of the section at `parts`; ConfigError naming the path if it is not one."""
    model: type[BaseModel] | None = cls
    for i, part in enumerate(parts):
        assert model is not None
        if part not in model.model_fields:
            where = f"at {'.'.join(parts[:i])!r}" if i else "at the top level"
            raise ConfigError(f"unknown key {'.'.join(parts[:i + 1])!r}; valid keys {where}: "
                              f"{', '.join(model.model_fields)}")
        ann = model.model_fields[part].annotation
        if _free_form(ann):
            return []  # keys under a dict field (model.overrides.n_layers) are not ours to check
        if (model := _model_of(ann)) is None and i < len(parts) - 1:
            raise ConfigError(f"cannot set {'.'.join(parts)!r}: "
                              f"{'.'.join(parts[:i + 1])!r} is a value, not a section")
    return list(model.model_fields) if model is not None else []


def _section_model(ann: Any, data: Any) -> type[BaseModel] | None:
    """The model a value of type `ann` holding `data` validates as: the model itself, an optional
    one, or the member of a discriminated union that `data`'s discriminator (`kind`) picks."""
    meta: list[Any] = []
    if get_origin(ann) is Annotated:
        ann, *meta = get_args(ann)
    if (model := _model_of(ann)) is not None:
        return model
    disc = next((d for m in meta if (d := getattr(m, "discriminator", None))), None)
    if isinstance(disc, str) and isinstance(data, dict) and get_origin(ann) in (Union, types.UnionType):
        for m in get_args(ann):
            field = getattr(m, "model_fields", {}).get(disc)
            if field is not None and data.get(disc) in get_args(field.annotation):
                return m
    return None


def _expand_shorthand(model: type[BaseModel], field: str, value: Any) -> Any:
    """`value` of `model.field` as the field's one-argument before-validators pass it on:
    `model: student` is {name_or_path: student}, so `--set ...model.kernels=torch` keeps the name."""
    for dec in model.__pydantic_decorators__.field_validators.values():
        if dec.info.mode == "before" and field in dec.info.fields:
            try:
                if len(inspect.signature(dec.func).parameters) == 1:
                    value = dec.func(value)
            except (TypeError, ValueError):
                pass
    return value


_MAX_NODES, _MAX_DEPTH = 100_000, 64


def _check_size(data: Any, where: str) -> None:
    """ConfigError for a document too deep or too big once YAML aliases are expanded (a "billion
    laughs" document is small on disk; everything that walks it would not be)."""
    stack, count = [(data, 0)], 0
    while stack:
        node, depth = stack.pop()
        count += 1
        if count > _MAX_NODES:
            raise ConfigError(f"{where}: more than {_MAX_NODES} values (with YAML aliases expanded); not a config")
        if depth > _MAX_DEPTH:
            raise ConfigError(f"{where}: nested more than {_MAX_DEPTH} levels deep; not a config")
        if isinstance(node, dict):
            stack.extend((v, depth + 1) for v in node.values())
        elif isinstance(node, (list, tuple, set)):
            stack.extend((v, depth + 1) for v in node)


def _merge(base: dict, update: dict) -> dict:
    out = dict(base)
    for k, v in update.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _read(path: Path) -> dict:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"cannot read config {str(path)!r}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text (byte {e.start})") from None
    try:
        if path.suffix == ".json":
            data = json.loads(text)
        elif path.suffix in (".yaml", ".yml"):
            data = yaml.load(text, Loader=_Yaml12Loader) or {}
        else:
            raise ConfigError(f"{path}: unknown config extension {path.suffix!r} (use .yaml, .yml, .json)")
    # ValueError: an integer of more than 4300 digits; RecursionError: thousands of nested brackets.
    except (yaml.YAMLError, ValueError, RecursionError) as e:
        raise ConfigError(f"{path}: not valid {'JSON' if path.suffix == '.json' else 'YAML'}: {e}") from None
    _check_size(data, str(path))
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping, got {type(data).__name__}")
    return data


def _origin(key: str, where: str, sets: list[tuple[str, str]]) -> str:
    """` (from --set k=v)` when an override set `key` (or a section around or under it), else `where`."""
    return next((f" (from --set {k}={raw})" for k, raw in sets
                 if key and (key == k or key.startswith(k + ".") or k.startswith(key + "."))), where)


def _format(cls: type[BaseModel], err: ValidationError, where: str, sets: list[tuple[str, str]],
            prefix: str = "") -> str:
    """One line per error: `key.path: problem (got value)` and where it came from. `prefix` goes in
    front of every key path (a section validated on its own: `nodes.kd`)."""
    lines = []
    for e in err.errors(include_url=False):
        loc = e["loc"]
        if not loc and "\n" not in e["msg"] \
                and (m := re.match(r"([A-Za-z_][\w.]*\w): ", e["msg"].removeprefix("Value error, "))) \
                and m.group(1).split(".")[0] in cls.model_fields:  # a whole-model check naming its key:
            loc = tuple(m.group(1).split("."))                       # `parallel: ...`, `parallel.pp: ...`
            e = {**e, "msg": e["msg"].removeprefix("Value error, ")[m.end():]}
        key = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" if i else str(p) for i, p in enumerate(loc))
        if prefix:
            key = f"{prefix}{'' if key.startswith('[') else '.'}{key}" if key else prefix
        if e["type"] == "extra_forbidden":
            try:
                valid = _keys_at(cls, [p for p in loc[:-1] if isinstance(p, str)])
            except ConfigError:  # e.g. a location inside a free-form dict
                valid = []
            msg = f"unknown key; valid keys here: {', '.join(valid)}" if valid else "unknown key"
        else:
            msg = e["msg"].removeprefix("Value error, ")
            if e["type"] != "missing" and loc and not isinstance(e.get("input"), dict):
                got = repr(e.get("input"))
                msg += f" (got {got if len(got) <= 60 else got[:57] + '...'})"
        if key:
            lines.append(f"{key}: {msg}{_origin(key, where, sets)}")
        else:  # a check of the whole document (PipelineConfig's nodes): each line names its own key path
            lines.extend(f"{line}{_origin(line.partition(': ')[0] if ': ' in line else '', where, sets)}"
                         for line in msg.split("\n"))
    return "\n".join(lines)


def load_config(cls: type[C], path: str | Path | None = None, overrides: Sequence[str] = ()) -> C:
    """Defaults, then the YAML/JSON file at `path`, then `a.b.c=value` overrides (YAML values).

    Sections merge key by key, so `dpo: {lora: {rank: 8}}` keeps DPO's other LoRA defaults.
    Raises ConfigError naming the dotted key, the problem and the file (or the `--set` item).
    """
    where = f" in {path}" if path is not None else ""
    try:
        data = cls().model_dump(mode="json")
    except ValidationError:  # a schema with required fields has no defaults to start from
        data = {}
    data = _merge(data, _read(Path(path)) if path is not None else {})
    sets = []
    for item in [overrides] if isinstance(overrides, str) else overrides:
        key, eq, raw = item.partition("=")
        parts = key.strip().split(".")
        if not eq or not all(parts):
            raise ConfigError(f"override {item!r} is not of the form a.b.c=value")
        try:
            _keys_at(cls, parts)
        except ConfigError as e:
            raise ConfigError(f"--set {item}: {e}") from None
        try:
            value = yaml.load(raw, Loader=_Yaml12Loader)
        except (yaml.YAMLError, ValueError, RecursionError) as e:
            raise ConfigError(f"--set {item}: value is not valid YAML: {e}") from None
        _check_size(value, f"--set {item}")
        node, ann = data, cls
        for i, p in enumerate(parts):
            if (model := _section_model(ann, node)) is not None:
                ann = model.model_fields[p].annotation if p in model.model_fields else None
                if p in node:  # a shorthand (`model: student`) written out before a key of it is set
                    node[p] = _expand_shorthand(model, p, node[p])
            else:  # a mapping: free-form (model.overrides) or of sections (nodes: name -> node)
                args = get_args(ann) if get_origin(ann) is dict else ()
                ann = args[1] if len(args) == 2 else None
            if i == len(parts) - 1:
                break
            if node.get(p) is None:  # e.g. a `launcher: null` section being filled in
                node[p] = {}
            elif not isinstance(node[p], dict):
                got = repr(node[p])
                raise ConfigError(f"--set {item}: cannot set {'.'.join(parts)!r}: {'.'.join(parts[:i + 1])!r} is a "
                                  f"value ({got if len(got) <= 60 else got[:57] + '...'}), not a section")
            node = node[p]
        old = node.get(parts[-1])
        node[parts[-1]] = _merge(old, value) if isinstance(value, dict) and isinstance(old, dict) else value
        sets.append((".".join(parts), raw))
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format(cls, e, where, sets)) from None


def dump_config(cfg: BaseModel) -> dict[str, Any]:
    """The config as plain JSON-able data (what Prefect stores and load_config reads back)."""
    return cfg.model_dump(mode="json")


def spec_text(cfg: BaseModel) -> str:
    """The config as the JSON text a torchrun entry point reads (`--config spec.json`): stable
    (sorted keys), so it can also be hashed. A launch serializes its spec once, into this."""
    return json.dumps(dump_config(cfg), indent=2, sort_keys=True) + "\n"


def to_json_file(cfg: BaseModel, path: str | Path) -> Path:
    """Write `cfg` as JSON atomically, for a torchrun entry point's --config. Readable by its owner
    only: it holds launcher.env, where tokens go."""
    from posttrain.core.atomic import write_text_atomic

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    return write_text_atomic(path, spec_text(cfg), mode=0o600)


def from_json_file(cls: type[C], path: str | Path) -> C:
    """Read a spec written by to_json_file (errors name the file and key, like load_config)."""
    return load_config(cls, path)
