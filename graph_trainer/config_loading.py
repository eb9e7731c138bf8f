"""Reading a job: a TOML file (tomli) overridden by the command line (tyro).

``load_config(argv)`` reads ``--job.config_file X.toml`` and then applies every other
``--section.key value`` from the command line; the command line wins over the file. A flag may
be spelled with dashes or underscores (``--job.config-file`` is ``--job.config_file``), as
``--help`` shows them. Every value is checked against its field's type here, from the file and
from the command line alike: an unknown section, key or flag, a value of the wrong type, or a
value outside a ``Literal`` field's choices raises ``ConfigError`` with one line naming the
field, the value and what is allowed (``train.py`` prints it and exits with code 2). Checks that
involve several fields are ``graph_trainer.validation``'s. An unknown name that is torchtitan's
(``TORCHTITAN_NAMES``, ``EARLIER_TORCHTITAN_NAMES``: ``--parallelism.data_parallel_shard_degree``,
a ``[lr_scheduler]`` table) is refused naming the setting it is here.

A bool flag given bare means True (``--checkpoint.move_aside``) and ``--section.no_key`` means
``--section.key False``, as tyro's own boolean flags read; ``--section.key True|False`` works too,
in any case (TOML's ``true``/``false`` as well: ``--section.key=false`` alike).

``config_to_toml(cfg)`` writes a whole config (every field, defaults included) as a job file that
``--job.config_file`` reads back into the same config: the trainer leaves it in the dump folder.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import typing
from typing import Any

import tomli
import tyro

from graph_trainer.config import JobConfig
from graph_trainer.errors import ConfigError

TORCHTITAN_NAMES = {
    "dump_folder": "job.dump_folder",
    "dataloader.dataset": "training.dataset",
    "training.steps": "training.steps",
    "training.local_batch_size": "training.local_batch_size",
    "training.global_batch_size": "training.global_batch_size",
    "training.seq_len": "training.seq_len",
    "training.max_norm": "training.max_norm",
    "training.mixed_precision_param": "training.mixed_precision_param",
    "training.mixed_precision_reduce": "training.mixed_precision_reduce",
    "training.gc_freq": "training.gc_freq",
    "debug.seed": "training.seed",
    "debug.deterministic": "debug.deterministic",
    "parallelism.data_parallel_replicate_degree": "parallelism.dp_replicate",
    "parallelism.data_parallel_shard_degree": "parallelism.dp_shard",
    "parallelism.fsdp_reshard_after_forward": "parallelism.fsdp_reshard_after_forward",
    "parallelism.tensor_parallel_degree": "parallelism.tp",
    "parallelism.enable_sequence_parallel": "parallelism.sequence_parallel",
    "parallelism.expert_parallel_degree": "parallelism.ep",
    "parallelism.pipeline_parallel_degree": "parallelism.pp",
    "parallelism.pipeline_parallel_schedule": "parallelism.pp_schedule",
    "parallelism.pipeline_parallel_layers_per_stage": "parallelism.pp_stage_blocks",
    "lr_scheduler.warmup_steps": "training.warmup_steps",
    "lr_scheduler.decay_ratio": "training.decay_ratio",
    "lr_scheduler.decay_type": "training.decay_type",
    "lr_scheduler.min_lr_factor": "training.min_lr_ratio",
    "checkpoint.enable": "checkpoint.interval",
    "checkpoint.interval": "checkpoint.interval",
    "checkpoint.folder": "checkpoint.folder",
    "checkpoint.keep_latest_k": "checkpoint.keep_latest_k",
    "checkpoint.async_mode": "checkpoint.async_mode",
    "checkpoint.load_step": "checkpoint.load_step",
    "checkpoint.initial_load_path": "checkpoint.initial_load_hf",
    "profiler.enable_profiling": "profiling.enable_profiling",
    "profiler.profile_freq": "profiling.profile_freq",
    "profiler.save_traces_folder": "profiling.save_traces_folder",
    "profiler.enable_memory_snapshot": "profiling.enable_memory_snapshot",
    "profiler.save_memory_snapshot_folder": "profiling.save_memory_snapshot_folder",
    "metrics.log_freq": "metrics.log_freq",
    "metrics.enable_tensorboard": "metrics.enable_tensorboard",
    "metrics.enable_wandb": "metrics.enable_wandb",
    "validator.enable": "validation.enable",
    "validator.freq": "validation.freq",
    "validator.steps": "validation.steps",
    "validator.dataloader.dataset": "validation.dataset",
    "comm.init_timeout_seconds": "comm.init_timeout_seconds",
    "comm.train_timeout_seconds": "comm.timeout_seconds",
    "compile.enable": "compile.mode",
    "optimizer.param_groups": "training.lr",
}
"""torchtitan 0.3.0's setting (a field of ``torchtitan.trainer.Trainer.Config``) -> ours: the first
two columns of docs/architecture.md's table "Coming from torchtitan" (``tests/test_docs.py`` holds
the two equal and checks every name against the installed torchtitan)."""

EARLIER_TORCHTITAN_NAMES = {
    "training.batch_size": "training.local_batch_size",
    "training.dataset_path": "training.dataset",
    "training.data_parallel_replicate_degree": "parallelism.dp_replicate",
    "training.data_parallel_shard_degree": "parallelism.dp_shard",
    "training.tensor_parallel_degree": "parallelism.tp",
    "experimental.pipeline_parallel_degree": "parallelism.pp",
    "experimental.pipeline_parallel_schedule": "parallelism.pp_schedule",
    "training.compile": "compile.mode",
    "model.tokenizer_path": "training.tokenizer_path",
    "optimizer.lr": "training.lr",
    "checkpoint.enable_checkpoint": "checkpoint.interval",
    "float8.enable_float8_linear": "float8.recipe_name",
}
"""Settings of torchtitan's earlier argparse configuration (``torchtitan/config_manager.py``, before
the dataclasses) that torchtitan 0.3.0 renamed or moved, and ours."""


def torchtitan_name(name: str) -> str:
    """Ours for the torchtitan setting ``name`` ('section.key'), '' when ``name`` is none of them."""
    return TORCHTITAN_NAMES.get(name) or EARLIER_TORCHTITAN_NAMES.get(name, "")


def _torchtitan_section(section: str) -> str:
    """The sections of ours that hold torchtitan's ``[section]``'s settings ('' when it is not torchtitan's)."""
    ours = {
        target.split(".")[0]
        for name, target in (*TORCHTITAN_NAMES.items(), *EARLIER_TORCHTITAN_NAMES.items())
        if name.startswith(section + ".") and target.split(".")[0] != section
    }
    return ", ".join(f"[{s}]" for s in sorted(ours))


def field_types(section_cls: type) -> dict[str, Any]:
    """Field name -> resolved type of a config dataclass."""
    hints = typing.get_type_hints(section_cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(section_cls)}


def choices(typ: Any) -> tuple | None:
    """The allowed values of a ``Literal`` field type, None for any other type."""
    return typing.get_args(typ) if typing.get_origin(typ) is typing.Literal else None


def not_allowed(name: str, value: Any, allowed: tuple) -> ConfigError:
    return ConfigError(f"{name} = {value!r} is not allowed; choose one of: {', '.join(map(str, allowed))}")


def canonical_flag(arg: str) -> str:
    """``--a-b.c-d[=v]`` -> ``--a_b.c_d[=v]``: the one spelling of a flag; other arguments are returned as they are.

    Dashes and underscores in a flag's name are the same everywhere (tyro shows dashes, the
    dataclasses and TOML use underscores); the value after ``=`` is left alone."""
    if not arg.startswith("--") or len(arg) < 3 or not arg[2].isalpha():
        return arg
    name, eq, value = arg.partition("=")
    return "--" + name[2:].replace("-", "_") + eq + value


def take_flag(argv: list[str], flag: str, default, kind=str):
    """Remove ``--flag value`` (or ``--flag=value``; either spelling, ``canonical_flag``) from
    ``argv``: returns (the rest of argv, the value converted by ``kind``, or ``default`` when the
    flag is absent). For command lines that add their own flags to the job's; a missing or
    unconvertible value is a ``ConfigError``."""
    for i, arg in enumerate(argv):
        arg = canonical_flag(arg)
        if arg == flag:
            if i + 1 >= len(argv):
                raise ConfigError(f"{flag} needs a value")
            rest, value = argv[:i] + argv[i + 2 :], argv[i + 1]
        elif arg.startswith(flag + "="):
            rest, value = argv[:i] + argv[i + 1 :], arg.split("=", 1)[1]
        else:
            continue
        try:
            return rest, kind(value)
        except ValueError:
            what = {int: "a whole number", float: "a number"}.get(kind, f"a valid {kind.__name__}")
            raise ConfigError(f"{flag} {value!r} is not {what}") from None
    return argv, default


def normalize_flags(argv: list[str]) -> list[str]:
    """Every flag of ``argv`` in its one spelling (``canonical_flag``), for parsers that know only one."""
    return [canonical_flag(arg) for arg in argv]


def _config_file_from_argv(argv: list[str]) -> str:
    """The TOML file named on the command line (either spelling); if named twice, the last one (as for any flag)."""
    path = ""
    argv = normalize_flags(argv)
    for i, arg in enumerate(argv):
        if arg == "--job.config_file":
            if i + 1 >= len(argv):
                raise ConfigError("--job.config_file needs a path to a TOML file")
            path = argv[i + 1]
        elif arg.startswith("--job.config_file="):
            path = arg.split("=", 1)[1]
    return path


def _coerce(value: Any, typ: Any, where: str) -> Any:
    """Check a TOML value against a field's type (TOML already gives typed values)."""
    allowed = choices(typ)
    if allowed is not None:
        if value not in allowed or not isinstance(value, str):
            raise not_allowed(where, value, allowed)
        return value
    if typ is bool:
        ok = isinstance(value, bool)
    elif typ is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif typ is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    elif typ is str:
        ok = isinstance(value, str)
    elif typing.get_origin(typ) is list:
        if isinstance(value, str):  # "a,b" is accepted for lists of names
            value = [value]
        ok = isinstance(value, list) and all(isinstance(v, str) for v in value)
    else:  # pragma: no cover - every field type is listed above
        raise TypeError(f"unsupported config field type {typ} at {where}")
    if not ok:
        raise ConfigError(f"{where} = {value!r} has the wrong type; expected {getattr(typ, '__name__', typ)}")
    return value


def config_from_toml(path: str) -> JobConfig:
    """Read a TOML job file into a JobConfig; unknown sections or keys are errors."""
    if not os.path.isfile(path):
        raise ConfigError(f"--job.config_file {path!r} does not exist")
    try:
        with open(path, "rb") as f:
            data = tomli.load(f)
    except tomli.TOMLDecodeError as e:
        raise ConfigError(f"{path} is not valid TOML: {e}") from None
    except UnicodeDecodeError as e:  # TOML is UTF-8; tomli decodes before parsing
        raise ConfigError(f"{path} is not UTF-8 text (byte {e.start}: {e.reason}); TOML files must be UTF-8") from None
    except OSError as e:
        raise ConfigError(f"cannot read --job.config_file {path!r}: {e.strerror or e}") from None
    cfg = JobConfig()
    sections = {f.name: f for f in dataclasses.fields(JobConfig)}
    for section, values in data.items():
        if section not in sections:
            raise _unknown_section(section, values, path, list(sections))
        if not isinstance(values, dict):
            raise ConfigError(f"'{section}' in {path} must be a [{section}] table")
        _fill_section(getattr(cfg, section), values, section, path)
    cfg.job.config_file = path
    return cfg


def _as_table(name: str) -> str:
    """'training.warmup_steps' as a TOML file spells it: '[training] warmup_steps'."""
    section, _, key = name.rpartition(".")
    return f"[{section}] {key}"


def _dotted_keys(values: Any, prefix: str) -> list[str]:
    """The 'section.key' names of a TOML table's values (sub-tables' keys as 'section.sub.key')."""
    if not isinstance(values, dict):
        return [prefix]
    return [name for key, value in values.items() for name in _dotted_keys(value, f"{prefix}.{key}")]


def _unknown_section(section: str, values: Any, path: str, sections: list[str]) -> ConfigError:
    """An unknown ``[section]`` of a job file; a torchtitan one named with where its settings are here."""
    unknown = f"unknown section [{section}] in {path}"
    for name in _dotted_keys(values, section):
        ours = torchtitan_name(name)
        if ours:
            return ConfigError(f"{unknown}; torchtitan's {name} is {_as_table(ours)} here")
    where = _torchtitan_section(section)
    hint = f"; torchtitan's [{section}] settings are in {where} here" if where else ""
    return ConfigError(f"{unknown}; allowed sections: {', '.join(sections)}{hint}")


def _fill_section(obj: Any, values: dict, section: str, path: str) -> None:
    """Set a section's fields from its TOML table; a nested dataclass field is a sub-table."""
    types = field_types(type(obj))
    for key, value in values.items():
        if key not in types:
            unknown = f"unknown key '{key}' in section [{section}] of {path}"
            ours = torchtitan_name(f"{section}.{key}")
            if ours:
                raise ConfigError(f"{unknown}; torchtitan's {section}.{key} is {_as_table(ours)} here")
            raise ConfigError(f"{unknown}; allowed keys: {', '.join(types)}")
        if dataclasses.is_dataclass(types[key]):
            if not isinstance(value, dict):
                raise ConfigError(f"'{section}.{key}' in {path} must be a [{section}.{key}] table")
            _fill_section(getattr(obj, key), value, f"{section}.{key}", path)
        else:
            setattr(obj, key, _coerce(value, types[key], f"[{section}] {key} in {path}"))


def load_config(argv: list[str] | None = None) -> JobConfig:
    """TOML file (if ``--job.config_file`` is given) overridden by the command line."""
    argv = expand_bool_flags(normalize_flags(list(sys.argv[1:] if argv is None else argv)))
    check_command_line(argv)
    path = _config_file_from_argv(argv)
    default = config_from_toml(path) if path else JobConfig()
    cfg = tyro.cli(
        JobConfig,
        default=default,
        args=argv,
        config=(tyro.conf.FlagConversionOff,),
        description="Train a model whose whole training step is one traced FX graph.",
    )
    cfg.compile.passes = normalize_pass_list(cfg.compile.passes)
    cfg.activation_checkpoint.selective_ops = normalize_pass_list(cfg.activation_checkpoint.selective_ops)
    cfg.float8.filter_fqns = normalize_pass_list(cfg.float8.filter_fqns)
    return cfg


def normalize_pass_list(passes: list[str]) -> list[str]:
    """Accept 'a,b c' style lists (passes, op names, FQN filters) from TOML or the command line:
    split on commas, drop blanks."""
    return [p.strip() for item in passes for p in item.split(",") if p.strip()]


_BOOLS = ("True", "False")
"""The spellings tyro accepts for a bool flag's value."""
_BOOL_SPELLINGS = {b.lower(): b for b in _BOOLS}
"""A bool flag's value in any case -> tyro's spelling (``expand_bool_flags``)."""


def _flag_types(cls: type = JobConfig, prefix: str = "") -> dict[str, Any]:
    """``"section.key"`` (nested: ``"compile.ep_overlap.chunk_dim"``) -> field type, for every field."""
    out = {}
    for name, typ in field_types(cls).items():
        if dataclasses.is_dataclass(typ):
            out.update(_flag_types(typ, f"{prefix}{name}."))
        else:
            out[f"{prefix}{name}"] = typ
    return out


def check_command_line(argv: list[str]) -> None:
    """Check every ``--section.key value`` of ``argv`` (canonical spelling) against its field:
    one ``ConfigError`` line for an unknown flag, a missing value, or a value of the wrong type or
    outside a field's choices, before tyro parses (tyro would print a box of its own)."""
    types = _flag_types()
    i = 0
    while i < len(argv):
        arg = argv[i]
        i += 1
        if not arg.startswith("--") or arg in ("--help",):
            continue
        name, has_value, value = arg[2:].partition("=")
        if name not in types:
            ours = torchtitan_name(name)
            hint = f"torchtitan's {name} is --{ours} here (python train.py --help lists every flag)" if ours else ""
            raise ConfigError(f"unknown flag --{name}; {hint or 'python train.py --help lists every flag'}")
        typ = types[name]
        if typing.get_origin(typ) is list:  # any number of values, up to the next flag
            continue
        if not has_value:
            if i >= len(argv) or argv[i].startswith("--"):
                raise ConfigError(f"--{name} needs a value")
            value, i = argv[i], i + 1
        _check_flag_value(name, value, typ)


def _check_flag_value(name: str, value: str, typ: Any) -> None:
    allowed = choices(typ) if typ is not bool else _BOOLS
    if allowed is not None:
        if value not in allowed:
            raise not_allowed(name, value, allowed)
        return
    convert = {int: (int, "a whole number"), float: (float, "a number")}.get(typ)
    if convert is not None:
        try:
            convert[0](value)
        except ValueError:
            raise ConfigError(f"{name} = {value!r} is not {convert[1]}") from None


def expand_bool_flags(argv: list[str]) -> list[str]:
    """``argv`` (canonical spelling) with every bare bool flag (the last argument, or followed by
    another flag) followed by ``True``, every bool flag's value in tyro's spelling (``false``,
    ``FALSE`` -> ``False``), and every ``--section.no_key`` of a bool field replaced by
    ``--section.key False``."""
    types = _flag_types()
    out, i = [], 0
    while i < len(argv):
        arg, i = argv[i], i + 1
        name, equals, value = arg[2:].partition("=") if arg.startswith("--") else ("", "", "")
        section, _, key = name.rpartition(".")
        negated = f"{section}.{key[3:]}" if key.startswith("no_") and name not in types else ""
        if types.get(name) is bool and equals:
            out.append(f"--{name}={_BOOL_SPELLINGS.get(value.lower(), value)}")
        elif types.get(name) is bool and (i >= len(argv) or argv[i].startswith("--")):
            out += [arg, "True"]
        elif types.get(name) is bool:
            out += [arg, _BOOL_SPELLINGS.get(argv[i].lower(), argv[i])]
            i += 1
        elif negated and types.get(negated) is bool and not equals:
            if i < len(argv) and argv[i].lower() in _BOOL_SPELLINGS:
                raise ConfigError(f"--{name} takes no value: it means --{negated} False")
            out += [f"--{negated}", "False"]
        else:
            out.append(arg)
    return out


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)  # (also TOML's spelling of inf, -inf and nan)
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string with ASCII escapes is a TOML basic string
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"no TOML spelling for {type(value).__name__} {value!r}")


def _toml_tables(obj: Any, name: str) -> list[str]:
    """``[name]`` with ``obj``'s plain fields, then a table per nested section."""
    lines, nested = [f"[{name}]"], []
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            nested.append((value, f"{name}.{f.name}"))
        else:
            lines.append(f"{f.name} = {_toml_value(value)}")
    lines.append("")
    for value, table in nested:
        lines += _toml_tables(value, table)
    return lines


def config_to_toml(cfg: JobConfig) -> str:
    """Every field of ``cfg`` as a TOML job file (see the module docstring)."""
    return "\n".join(line for f in dataclasses.fields(cfg) for line in _toml_tables(getattr(cfg, f.name), f.name))


def _changed(obj: Any, default: Any, prefix: str) -> list[str]:
    out = []
    for f in dataclasses.fields(obj):
        value, base = getattr(obj, f.name), getattr(default, f.name)
        if dataclasses.is_dataclass(value):
            out += _changed(value, base, f"{prefix}{f.name}.")
        elif value != base:
            out.append(f"{prefix}{f.name}={_toml_value(value)}")
    return out


def changed_fields(cfg: JobConfig) -> list[str]:
    """``section.key=value`` for every field of ``cfg`` that differs from its default (file and flags)."""
    return _changed(cfg, JobConfig(), "")
