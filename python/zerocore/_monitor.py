"""DeepSpeed's monitors: the ``tensorboard``, ``csv_monitor`` and ``wandb`` sections, and ``engine.monitor``.

Note [Monitors]
---------------
DeepSpeed's engine logs every accumulation boundary's learning rate (and fp16's loss scale) to the enabled
monitors, keyed by ``global_samples``, as ``Train/Samples/lr`` and ``Train/Samples/loss_scale``, from rank 0
only; scripts log their own events through ``engine.monitor.write_events([(name, value, step), ...])`` (rank 0
writes, the other ranks do nothing). zerocore does the same:

* ``csv_monitor``: one file per event name in ``output_path/job_name`` ("/" and spaces made "_", ".csv"), with a
  ``step,<the name's last part>`` header when this process first writes the file, then a row per event,
  appended to what an earlier run left, as DeepSpeed's;
* ``tensorboard``: a ``torch.utils.tensorboard.SummaryWriter`` logging to ``output_path/job_name``, a scalar per
  event, flushed after each call (it needs the ``tensorboard`` package);
* ``wandb``: ``wandb.init(project=, group=, entity=team)`` on rank 0 when the engine is built, then
  ``wandb.log({name: value}, step=step)`` per event (it needs ``wandb``).

A monitor that cannot start (its package missing, its directory not writable) fails ``initialize`` on every
rank with rank 0's reason, before anything else is built: never one rank raising while the others go on into a
collective. ``comet`` is accepted disabled only. The events are written after the step, so ``global_samples``
counts it, as in DeepSpeed; a write that fails then (a full disk) is a warning, not an error on rank 0 alone.
"""

from __future__ import annotations

import csv
import dataclasses
import importlib.util
import os
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ._config_values import as_bool, fail


@dataclass(frozen=True)
class _LogDirMonitorConfig:
    """A monitor writing under ``output_path/job_name`` (DeepSpeed's defaults: the working directory,
    ``"DeepSpeedJobName"``)."""

    enabled: bool = False
    output_path: str = ""
    job_name: str = "DeepSpeedJobName"
    section: ClassVar[str]

    def __post_init__(self) -> None:
        object.__setattr__(self, "enabled", as_bool(self.enabled, f"{self.section}.enabled"))
        for name in ("output_path", "job_name"):
            if not isinstance(getattr(self, name), str):
                fail(f"{self.section}.{name}", f"expected a string, got {getattr(self, name)!r}")

    @property
    def log_dir(self) -> str:
        return os.path.join(self.output_path, self.job_name)


@dataclass(frozen=True)
class TensorBoardConfig(_LogDirMonitorConfig):
    """DeepSpeed ``tensorboard``: scalars for TensorBoard under ``output_path/job_name``."""

    section: ClassVar[str] = "tensorboard"


@dataclass(frozen=True)
class CsvMonitorConfig(_LogDirMonitorConfig):
    """DeepSpeed ``csv_monitor``: a CSV file per event under ``output_path/job_name``."""

    section: ClassVar[str] = "csv_monitor"


@dataclass(frozen=True)
class WandbConfig:
    """DeepSpeed ``wandb``: the run's events logged to Weights & Biases."""

    enabled: bool = False
    group: str | None = None
    team: str | None = None
    project: str = "deepspeed"

    def __post_init__(self) -> None:
        object.__setattr__(self, "enabled", as_bool(self.enabled, "wandb.enabled"))
        for name in ("group", "team", "project"):
            value = getattr(self, name)
            if not (isinstance(value, str) or (value is None and name != "project")):
                fail(f"wandb.{name}", f"expected a string, got {value!r}")


MONITOR_SECTIONS = {"tensorboard": TensorBoardConfig, "csv_monitor": CsvMonitorConfig, "wandb": WandbConfig}
_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb"}  # section -> the package it imports


class Monitor:
    """``engine.monitor`` (Note [Monitors]): ``enabled``, and ``write_events`` on rank 0."""

    def __init__(self, config: Any, rank: int) -> None:
        self._configs = {name: getattr(config, name) for name in MONITOR_SECTIONS}
        self.enabled = any(c.enabled for c in self._configs.values())
        self._rank = rank
        self._writer: Any = None  # tensorboard's SummaryWriter
        self._csv_started: set[str] = set()

    def start(self) -> str | None:
        """Checks every enabled monitor's package (on every rank) and, on rank 0, opens them; returns why one
        cannot start, or None."""
        for name, package in _PACKAGES.items():
            if self._configs[name].enabled and importlib.util.find_spec(package) is None:
                return f"{name}.enabled is true but the {package} package is not installed (pip install {package})"
        if self._rank != 0:
            return None
        try:
            for name in ("tensorboard", "csv_monitor"):
                if self._configs[name].enabled:
                    os.makedirs(self._configs[name].log_dir, exist_ok=True)
                    if not os.access(self._configs[name].log_dir, os.W_OK):
                        return f"{name}: the log directory {self._configs[name].log_dir!r} is not writable"
            if self._configs["tensorboard"].enabled:
                from torch.utils.tensorboard import SummaryWriter

                self._writer = SummaryWriter(log_dir=self._configs["tensorboard"].log_dir)
            if self._configs["wandb"].enabled:
                import wandb

                w = self._configs["wandb"]
                wandb.init(project=w.project, group=w.group, entity=w.team)
        except (OSError, ImportError) as error:
            return f"{type(error).__name__}: {error}"
        return None

    def write_events(self, event_list: Sequence[tuple[str, Any, int]]) -> None:
        """DeepSpeed's: each ``(name, value, step)`` to every enabled monitor, on rank 0 (elsewhere nothing)."""
        if not self.enabled or self._rank != 0:
            return
        events = [(str(name), float(value.item() if isinstance(value, torch.Tensor) else value), int(step))
                  for name, value, step in event_list]
        if self._configs["csv_monitor"].enabled:
            self._write_csv(events)
        if self._writer is not None:
            for name, value, step in events:
                self._writer.add_scalar(name, value, step)
            self._writer.flush()
        if self._configs["wandb"].enabled:
            import wandb

            for name, value, step in events:
                wandb.log({name: value}, step=step)

    def write_step_events(self, event_list: Sequence[tuple[str, Any, int]]) -> None:
        """The engine's own events at a step: a write that fails (a full disk, wandb's connection) is warned
        about, never raised, since only rank 0 writes and a raise there alone would leave the ranks out of
        lockstep for a log line."""
        try:
            self.write_events(event_list)
        except Exception as error:  # noqa: BLE001 (any monitor's failure: the step itself is done)
            warnings.warn(f"zerocore: a monitor could not log this step's events ({type(error).__name__}: {error}); "
                          "training goes on", RuntimeWarning, stacklevel=3)

    def _write_csv(self, events: list[tuple[str, float, int]]) -> None:
        for name, value, step in events:
            filename = name.replace("/", "_").replace(" ", "_")
            path = os.path.join(self._configs["csv_monitor"].log_dir, filename + ".csv")
            with open(path, "a", newline="") as f:
                writer = csv.writer(f)
                if filename not in self._csv_started:
                    self._csv_started.add(filename)
                    writer.writerow(["step", name.rsplit("/", 1)[-1]])
                writer.writerow([step, value])

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def start_monitor(monitor: Monitor, comm: Any, rank: int, device: torch.device) -> None:
    """Starts the enabled monitors, raising on every rank when any rank could not (Note [Monitors]); a
    collective, issued by every rank since every rank has the same config."""
    from ._model_checks import first_failure

    failed = first_failure(comm, monitor.start(), device)
    if failed is not None:
        monitor.close()
        r, problem = failed
        raise RuntimeError(f"a monitor could not start on rank {r} (this is rank {rank}): {problem}; nothing was "
                           "built. Fix it, or disable that section")


def monitor_sections_for_deepspeed(config: Any) -> dict[str, dict[str, Any]]:
    """The monitor sections that differ from DeepSpeed's defaults, for ``to_deepspeed``."""
    return {name: dataclasses.asdict(getattr(config, name)) for name, cls in MONITOR_SECTIONS.items()
            if getattr(config, name) != cls()}
