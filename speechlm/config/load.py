"""Reading a config: YAML and dotted overrides turned into typed sections, input paths made absolute, every
value checked (`load_config`); and back (`to_dict`).

A value is converted to its field's type while it is parsed (`_coerce`: a choice key refuses anything
outside its Literal, a number refuses text), then `check_config` holds it against the key's rule. Every
message names the key, the value, where it was set and the valid values (`KeySpec.advice`).
"""

from __future__ import annotations

import copy
import dataclasses
import os
import types
import typing
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

import yaml

from speechlm.config.experiment import KEYS, ExperimentConfig, check_config, get_key
from speechlm.config.keys import ConfigError
from speechlm.config.overrides import split_override
from speechlm.config.rules import InputList, Text, show

# keys that existed once: a config that still sets one is refused with this advice instead of "unknown key"
REMOVED_KEYS: dict[str, str] = {
    "model.encoder.tensor_parallel": "was removed (issue 21): the audio encoder is never tensor-parallel (FSDP "
    "shards it, CP splits its clips; only the LLM is split over tp), and the key only changed which head counts "
    "the validator checked; delete it from the config",
}

# the top-level keys of a sweep spec (speechlm.sweep.spec): such a file given as a config is named as one
SWEEP_SPEC_KEYS = ("base", "overrides", "grid", "jobs", "gpus_per_job")


def _removed(where: str, key: str) -> ConfigError:
    return ConfigError(f"{where}: {key} {REMOVED_KEYS[key]}")


def _set_key(cfg: Any, key: str, value: Any) -> None:
    *parents, last = key.split(".")
    obj = cfg
    for part in parents:
        obj = getattr(obj, part)
    setattr(obj, last, value)


def _absolute(value: str, base: Path) -> str:
    p = Path(value).expanduser()
    return os.path.normpath(p if p.is_absolute() else base / p)


def _resolve_input_entries(entries: list[Any], base: Path) -> list[Any]:
    """Inline data.input_cfg entries with their `path`s made absolute (groups recursively)."""
    out = []
    for e in entries:
        if isinstance(e, dict):
            e = dict(e)
            if isinstance(e.get("path"), str) and e["path"].strip():
                e["path"] = _absolute(e["path"], base)
            if isinstance(e.get("inputs"), list):
                e["inputs"] = _resolve_input_entries(e["inputs"], base)
        out.append(e)
    return out


def resolve_path_value(key: str, value: Any, base: Path) -> Any:
    """An input path of `key` made absolute against `base`; other keys and values unchanged."""
    spec = KEYS.get(key)
    rule = None if spec is None else spec.rule
    if isinstance(rule, InputList):
        if isinstance(value, list):
            return _resolve_input_entries(value, base)
        rule = Text(path=True)
    if not (isinstance(rule, Text) and rule.path) or not isinstance(value, str) or not value.strip():
        return value
    if value in rule.keywords:
        return value
    return _absolute(value, base)


def resolve_config_paths(cfg: ExperimentConfig, base: Path, keys: Iterable[str] | None = None) -> None:
    """Make the input paths of `cfg` (all, or those in `keys`) absolute against `base`, in place."""
    for key in KEYS if keys is None else keys:
        value = get_key(cfg, key)
        resolved = resolve_path_value(key, value, base)
        if resolved is not value:
            _set_key(cfg, key, resolved)


def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _type_error(where: str, key: str, value: Any, what: str) -> str:
    spec = KEYS.get(key)
    valid = f"; {spec.advice()}" if spec is not None else ""
    return f"{where}: {key}={show(value)} must be {what}{valid}"


def _coerce_choice(value: Any, choices: tuple[Any, ...], key: str, where: str) -> Any:
    """A value of a Literal field: one of `choices` (a number read by YAML matches a string choice such as
    trainer.precision's "32"), or a ConfigError with the key's message (its hints for near misses)."""
    for choice in choices:
        if isinstance(choice, str) and not isinstance(value, (dict, list, bool)) and str(value) == choice:
            return choice
        if not isinstance(choice, str) and type(value) is type(choice) and value == choice:
            return choice
    spec = KEYS.get(key)
    if spec is None:
        raise ConfigError(_type_error(where, key, value, "one of " + ", ".join(show(c) for c in choices)))
    reason = spec.rule.check(value) or "not a valid choice"
    raise ConfigError(f"{where}: {key}={show(value)}: {reason}; {spec.advice()}")


def _coerce(value: Any, tp: Any, key: str, where: str) -> Any:
    """Convert a YAML/override value to the declared type, or raise naming the key."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is Literal:
        return _coerce_choice(value, args, key, where)
    if origin in (typing.Union, types.UnionType):
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            if type(None) in args:
                return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(value, a, key, where)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if errors else f"{where}: bad value {value!r} for '{key}'")
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(_type_error(where, key, value, "a mapping of keys"))
        return from_dict(tp, value, where, prefix=key + ".")  # type: ignore[arg-type]
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on", "false", "0", "no", "off"):
            return value.lower() in ("true", "1", "yes", "on")
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        raise ConfigError(_type_error(where, key, value, "true or false"))
    if tp is int:
        if isinstance(value, bool):
            raise ConfigError(_type_error(where, key, value, "an integer"))
        try:
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            return int(value)
        except (TypeError, ValueError):
            raise ConfigError(_type_error(where, key, value, "an integer")) from None
    if tp is float:
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(_type_error(where, key, value, "a number")) from None
    if tp is str:
        if isinstance(value, (dict, list)):
            raise ConfigError(_type_error(where, key, value, "a string"))
        return str(value)
    if origin in (list, tuple):
        if isinstance(value, str):
            try:
                value = yaml.safe_load(value)
            except yaml.YAMLError:
                raise ConfigError(_type_error(where, key, value, "a list such as [1, 2]")) from None
        if not isinstance(value, (list, tuple)):
            raise ConfigError(_type_error(where, key, value, "a list"))
        inner = args[0] if args else Any
        items = [_coerce(v, inner, key, where) if inner is not Any else v for v in value]
        return tuple(items) if origin is tuple else items
    return value


def from_dict(cls: type, data: dict[str, Any], where: str, prefix: str = "") -> Any:
    """A section `cls` built from a mapping read at `where` (its keys under `prefix`), each value converted to
    its field's type; an unknown or removed key is a ConfigError naming it. Values are not range-checked."""
    types_ = _field_types(cls)
    unknown = sorted(set(data) - set(types_))
    for name in unknown:
        if prefix + name in REMOVED_KEYS:
            raise _removed(where, prefix + name)
    if unknown:
        raise ConfigError(
            f"{where}: unknown key '{prefix}{unknown[0]}'; valid keys under "
            f"'{prefix.rstrip('.') or '<root>'}' are: {', '.join(sorted(types_))}"
        )
    kwargs = {k: _coerce(v, types_[k], prefix + k, where) for k, v in data.items()}
    return cls(**kwargs)


def to_dict(cfg: Any) -> dict[str, Any]:
    out = dataclasses.asdict(cfg)

    def fix(d: Any) -> Any:
        if isinstance(d, dict):
            return {k: fix(v) for k, v in d.items()}
        if isinstance(d, tuple):
            return [fix(v) for v in d]
        return d

    return fix(out)


def clone(cfg: ExperimentConfig) -> ExperimentConfig:
    return copy.deepcopy(cfg)


def apply_override(cfg: ExperimentConfig, override: str, where: str = "command line") -> None:
    """Apply one `a.b.c=value` override in place; the value is parsed as YAML then type-checked."""
    key, raw = split_override(override, where)
    parts = key.split(".")
    obj: Any = cfg
    for i, part in enumerate(parts):
        types_ = _field_types(type(obj))
        if part not in types_:
            if ".".join(parts[: i + 1]) in REMOVED_KEYS:
                raise _removed(where, ".".join(parts[: i + 1]))
            parent = ".".join(parts[:i]) or "<root>"
            raise ConfigError(
                f"{where}: unknown key '{key}'; valid keys under '{parent}' are: {', '.join(sorted(types_))}"
            )
        if i == len(parts) - 1:
            tp = types_[part]
            try:
                value = yaml.safe_load(raw) if raw.strip() else ""
            except yaml.YAMLError as e:
                if tp is not str and str not in typing.get_args(tp):
                    problem = " ".join(str(getattr(e, "problem", None) or e).split())
                    raise ConfigError(_type_error(where, key, raw, f"valid YAML ({problem})")) from None
                value = raw  # a string field takes the text as written
            if tp is str and not isinstance(value, str):
                value = raw  # keep strings such as "32" verbatim
            value = _coerce(value, types_[part], key, where)
            # an input path on the command line resolves against the working directory
            setattr(obj, part, resolve_path_value(key, value, Path.cwd()))
            if dataclasses.is_dataclass(value):  # a whole section: the paths inside it too
                resolve_config_paths(cfg, Path.cwd(), [k for k in KEYS if k.startswith(key + ".")])
        else:
            obj = getattr(obj, part)
            if not dataclasses.is_dataclass(obj):
                raise ConfigError(f"{where}: '{'.'.join(parts[: i + 1])}' is not a section")


def load_config(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> ExperimentConfig:
    """Load a YAML config (or the defaults when `path` is None), apply dotted overrides, check every value.

    Input paths (keys whose rule is a `Text(path=True)`) are stored absolute: those of the file resolve
    against the file's folder, those of overrides against the working directory."""
    cfg = ExperimentConfig()
    origin: dict[str, str] = {}
    if path is not None:
        p = Path(path)
        try:
            text = p.read_text()
        except OSError as e:
            raise ConfigError(f"{p}: cannot read config ({e.strerror or e})") from None
        except UnicodeDecodeError as e:
            raise ConfigError(f"{p}: not a text file ({e.reason} at byte {e.start})") from None
        try:
            data = yaml.safe_load(text) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{p}: not valid YAML ({e})") from None
        if isinstance(data, list) and data and all(isinstance(x, dict) for x in data):
            raise ConfigError(
                f"{p}: this is a data.input_cfg list (datasets with path/weight), not a config; use it as "
                f"data.input_cfg={p} with a config, e.g. `configs/demo.yaml data.train_manifest=null "
                f"data.input_cfg={p}`"
            )
        if not isinstance(data, dict):
            raise ConfigError(f"{p}: the top level must be a mapping of sections")
        if set(data) <= set(SWEEP_SPEC_KEYS) and ("grid" in data or "jobs" in data):
            raise ConfigError(
                f"{p}: this is a sweep spec (base, grid, jobs), not a config; `speechlm sweep init {p} --out DIR` "
                "writes one config per job (docs/sweep.md)"
            )
        cfg = from_dict(ExperimentConfig, data, str(p))
        resolve_config_paths(cfg, p.resolve().parent)
        origin = {key: f"in {p}" for key in _keys_in(data)}
    for ov in overrides:
        apply_override(cfg, ov)
        origin[split_override(ov)[0]] = "on the command line"
    check_config(cfg, origin)
    return cfg


def _keys_in(data: dict[str, Any], prefix: str = "") -> list[str]:
    out = []
    for k, v in data.items():
        if isinstance(v, dict) and f"{prefix}{k}" not in KEYS:
            out += _keys_in(v, f"{prefix}{k}.")
        else:
            out.append(f"{prefix}{k}")
    return out
