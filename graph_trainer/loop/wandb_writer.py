"""Weights & Biases as a second home of the scalars TensorBoard gets (``--metrics.enable_wandb``).

``WandbWriter`` is what ``loop.metrics.MetricsLogger`` writes to on rank 0 beside the TensorBoard
writer: one W&B run per start of a job, created in ``<dump_folder>/wandb/`` with the job's resolved
config (every field, as ``<dump_folder>/config.toml`` holds it) as the run's config. A logged
step's scalars are one ``log`` call at that step; the one-off setup numbers (trace and compile
times, the memory estimate) go to the run's summary as ``setup/<name>``, since W&B steps only
increase. The project is ``$WANDB_PROJECT`` (default ``graph_trainer``), the run name
``job.description`` (W&B's own when empty); the rest is W&B's environment: ``WANDB_MODE=offline``
writes the run to disk only (``wandb sync`` uploads it later), ``WANDB_API_KEY``, ``WANDB_ENTITY``.

``wandb`` is an optional dependency: a job asking for it without it installed is refused before
anything is built (``loop.preflight``), and so is one whose run ``wandb.init`` would not start, as
far as can be told without the network (``wandb_run_folder``): W&B's settings as wandb reads them
(its settings files, then the ``WANDB_*`` environment) hold a value wandb refuses (a ``WANDB_MODE``
other than its modes); the mode uploads the run ('online', the default) and wandb has no
credentials (``WANDB_API_KEY``, ``WANDB_IDENTITY_TOKEN_FILE``, an ``api_key`` in its settings, or
the ``.netrc`` entry ``wandb login`` writes for its server); or the run folder is not one. What
only ``wandb.init`` finds (a key of the wrong form, one the server rejects, no server) is one line
on every rank, as the run starts (``WandbWriter``; the trainer starts it under ``comm.agree``).
"""

from __future__ import annotations

import netrc
import os
import typing
from typing import Any
from urllib.parse import urlsplit

from graph_trainer.errors import ConfigError, JobError, one_line

DEFAULT_PROJECT = "graph_trainer"
ON_DISK_MODES = ("offline", "dryrun")
"""W&B modes that write the run to disk only (``wandb sync`` uploads it later); 'disabled' writes
nothing; every other mode uploads, which needs credentials."""
WANDB_API_HOST = "api.wandb.ai"
"""W&B's own API server, behind the CoreWeave proxy that is wandb's default server: ``.netrc``
entries ``wandb login`` wrote for the default name it."""


class WandbWriter:
    """One W&B run; ``add_scalars`` per logged step, ``add_setup_scalars`` for one-off numbers."""

    def __init__(self, dump_folder: str, config: dict[str, Any], name: str = ""):
        """Start the run: ``ConfigError`` when wandb refuses its settings or credentials (a malformed
        or rejected API key), ``JobError`` when it cannot reach its server."""
        import wandb
        import wandb.errors

        try:
            self._run = wandb.init(
                project=os.environ.get("WANDB_PROJECT", DEFAULT_PROJECT),
                dir=dump_folder,
                config=config,
                name=name or None,
            )
        except (wandb.errors.AuthenticationError, wandb.errors.UsageError) as e:
            raise ConfigError(f"metrics.enable_wandb: wandb did not start the run: {one_line(e)}") from None
        except wandb.errors.Error as e:
            raise JobError(f"metrics.enable_wandb: wandb did not start the run: {one_line(e)}") from None

    def add_scalars(self, scalars: dict[str, float], step: int) -> None:
        self._run.log(dict(scalars), step=step)

    def add_setup_scalars(self, scalars: dict[str, float]) -> None:
        for tag, value in scalars.items():
            self._run.summary[f"setup/{tag}"] = value

    def close(self) -> None:
        self._run.finish()


def _settings(dump_folder: str):
    """W&B's settings as ``wandb.init`` reads them for a run in ``dump_folder``: its settings files
    (the workspace's ``wandb/settings``, the global ``$WANDB_CONFIG_DIR/settings`` or
    ``~/.config/wandb/settings``), then the ``WANDB_*`` environment; a value wandb refuses is a
    ConfigError."""
    import wandb

    settings = wandb.Settings()
    settings.silent = True  # (no "loading settings from ..." line from every rank)
    config_dir = os.path.expanduser(os.environ.get("WANDB_CONFIG_DIR", "~/.config/wandb"))
    settings.settings_system = os.path.join(config_dir, "settings")
    settings.update_from_system_settings()
    try:
        settings.update_from_env_vars(dict(os.environ))
    except ValueError as e:  # pydantic's ValidationError, one per refused value
        raise ConfigError(_refused_setting(e, settings)) from None
    settings.root_dir = dump_folder
    return settings


def _refused_setting(error: ValueError, settings) -> str:
    """One line for the first value of the environment that wandb's settings refuse."""
    problems = error.errors() if hasattr(error, "errors") else []
    field = str(problems[0]["loc"][0]) if problems and problems[0].get("loc") else ""
    value = problems[0].get("input") if problems else None
    if field == "mode":
        modes = typing.get_args(type(settings).model_fields["mode"].annotation)
        return f"WANDB_MODE = {value!r} is not a W&B mode (metrics.enable_wandb); choose one of: {', '.join(modes)}"
    what = f"WANDB_{field.upper()} = {value!r}" if field else "the WANDB_* environment"
    reason = problems[0].get("msg", str(error)) if problems else str(error).splitlines()[0]
    return f"{what} is refused by wandb (metrics.enable_wandb): {reason}"


def _netrc_path() -> str:
    """The ``.netrc`` file wandb reads: ``$NETRC``, else ``~/.netrc`` (``~/_netrc`` when only it exists)."""
    if os.environ.get("NETRC"):
        return os.path.expanduser(os.environ["NETRC"])
    unix, windows = os.path.expanduser("~/.netrc"), os.path.expanduser("~/_netrc")
    return windows if os.path.exists(windows) and not os.path.exists(unix) else unix


def _netrc_has_key(path: str, base_url: str, default_url: str) -> bool:
    """Whether ``path`` holds an entry with a password (the API key) for W&B's server ``base_url``."""
    hosts = [urlsplit(base_url).netloc] + ([WANDB_API_HOST] if base_url == default_url else [])
    try:
        entries = netrc.netrc(path)
    except (OSError, netrc.NetrcParseError):  # (wandb reads no key from it either)
        return False
    return any((entry := entries.authenticators(host)) and entry[2] for host in hosts)


def wandb_run_folder(dump_folder: str) -> str:
    """The folder ``wandb.init`` will write the run of a job with ``dump_folder`` in ('' when W&B is
    disabled), once W&B's settings are checked (module docstring); ConfigError when they would not
    start a run."""
    settings = _settings(dump_folder)
    if settings.mode == "disabled":
        return ""
    default_url = type(settings).model_fields["base_url"].default
    keyed = settings.api_key or settings.identity_token_file
    if settings.mode not in ON_DISK_MODES and not keyed:
        path = _netrc_path()
        if not _netrc_has_key(path, settings.base_url, default_url):
            raise ConfigError(
                f"metrics.enable_wandb: W&B mode {settings.mode!r} uploads the run, but wandb has no API key "
                f"(WANDB_API_KEY, or the entry `wandb login` writes in {path}); set one, or WANDB_MODE=offline "
                "to write the run to disk only (`wandb sync` uploads it later)"
            )
    return settings.wandb_dir


__all__ = ["DEFAULT_PROJECT", "WandbWriter", "wandb_run_folder"]
