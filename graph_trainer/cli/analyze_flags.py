"""``analyze``'s command line: its own flags taken out, then one validated job config per compared
variant (``parse_command_line``; the flags are described in ``cli.analyze``'s docstring)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from graph_trainer.analysis.devices import DeviceModel
from graph_trainer.cli.device_flags import take_device_flags
from graph_trainer.config import JobConfig
from graph_trainer.config_loading import load_config, normalize_pass_list, take_flag
from graph_trainer.errors import ConfigError
from graph_trainer.loop.preflight import check_writable_folder
from graph_trainer.validation import validate_config


def parse_pass_lists(spec: str) -> list[list[str]]:
    """'none;a;a,b' -> [[], ['a'], ['a', 'b']]."""
    lists = []
    for item in spec.split(";"):
        passes = normalize_pass_list([item])
        lists.append([] if passes in ([], ["none"]) else passes)
    return lists


@dataclass
class CommandLine:
    """The command line read: this command's own flags and the jobs to analyze, one config per pass
    list, activation-checkpointing mode and pipeline schedule compared (``labels``: what each row
    calls its job)."""

    world_size: int
    device_name: str
    device: DeviceModel
    ranks_per_node: int
    trace_out: str | None
    json_out: str | None
    """Where ``--json`` writes the tables (None: not written)."""
    memory_limit: int | None
    """Bytes of device memory a rank's peak is warned against (None: no warning)."""
    cfg: JobConfig
    """The job as given, before the comparisons replace its passes, mode and schedule."""
    configs: list[JobConfig]
    labels: list[str]
    rank: int = 0
    """The global rank traced (``--rank``)."""


def parse_command_line(argv: list[str]) -> CommandLine:
    """Take this command's flags out of ``argv``, read the job's config from the rest and build
    (and validate) one config per compared variant; raises ``ConfigError`` on a wrong flag or job."""
    argv, world_size = take_flag(argv, "--world_size", 8, int)
    argv, rank = take_flag(argv, "--rank", 0, int)
    argv, d = take_device_flags(argv)  # --device, --attention, --device_memory_gib
    argv, ranks_per_node = take_flag(argv, "--ranks_per_node", 8, int)
    argv, trace_out = take_flag(argv, "--trace_out", None)
    argv, compare = take_flag(argv, "--compare", None)
    argv, ac_modes = take_flag(argv, "--ac_modes", None)
    argv, pp_schedules = take_flag(argv, "--pp_schedules", None)
    argv, json_out = take_flag(argv, "--json", None)
    if json_out is not None:
        check_json_path(json_out)
    if ranks_per_node < 1:
        raise ConfigError(f"--ranks_per_node {ranks_per_node} must be >= 1 (GPUs per node)")
    if not 0 <= rank < world_size:
        raise ConfigError(f"--rank {rank} must be one of the {world_size} ranks: 0 to {world_size - 1}")
    cfg = load_config(argv)
    pass_lists = parse_pass_lists(compare) if compare is not None else [cfg.compile.passes]
    modes = _comma_list(ac_modes) if ac_modes is not None else [cfg.activation_checkpoint.mode]
    schedules = _comma_list(pp_schedules) if pp_schedules is not None else [cfg.parallelism.pp_schedule]
    if pp_schedules is not None and cfg.parallelism.pp == 1:
        raise ConfigError("--pp_schedules compares pipeline schedules: it needs --parallelism.pp > 1")
    configs = _job_variants(argv, world_size, pass_lists, modes, schedules)
    labels = [
        (",".join(c.compile.passes) or "none") + (f" ac={c.activation_checkpoint.mode}" if ac_modes is not None else "")
        for c in configs
    ]
    args = (world_size, d.name, d.model, ranks_per_node, trace_out, json_out, d.memory_limit, cfg, configs, labels)
    return CommandLine(*args, rank=rank)


def check_json_path(path: str) -> None:
    """``--json``'s file can be written: not a folder, in a folder this process can write in
    (made if missing); else a one-line ``ConfigError``."""
    if os.path.isdir(path):
        raise ConfigError(f"--json {path!r} is a folder; give a file name, e.g. {os.path.join(path, 'analyze.json')}")
    check_writable_folder(os.path.dirname(os.path.abspath(path)), "the folder of --json")


def _comma_list(spec: str) -> list[str]:
    """'a, b,' -> ['a', 'b']."""
    return [x.strip() for x in spec.split(",") if x.strip()]


def _job_variants(
    argv: list[str], world_size: int, pass_lists: list[list[str]], modes: list[str], schedules: list[str]
) -> list[JobConfig]:
    """The job read from ``argv`` once per (pass list, activation-checkpointing mode, pipeline
    schedule), in that nesting, each validated at ``world_size``."""
    configs = []
    for passes in pass_lists:
        for mode in modes:
            for schedule in schedules:
                c = load_config(argv)
                c.compile.passes = passes
                c.activation_checkpoint.mode = mode
                c.parallelism.pp_schedule = schedule
                validate_config(c, world_size)
                configs.append(c)
    return configs


__all__ = ["CommandLine", "check_json_path", "parse_command_line", "parse_pass_lists"]
