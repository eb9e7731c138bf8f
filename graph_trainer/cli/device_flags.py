"""The device model ``analyze`` simulates on, read from its command-line flags.

``--device NAME`` picks ``analysis.devices.DEVICES[NAME]`` (default ``h100``); ``--attention
KERNEL`` runs its fused attention with ``devices.ATTENTION_KERNELS[KERNEL]``'s rates (``cudnn``,
``fa2``, ``fa3``; default: the device's own, cuDNN's calibrated rates on the GPUs);
``--device_memory_gib G`` is the memory a rank's peak is warned against (default the device's,
``analysis.memory.DEVICE_MEMORY_BYTES``; none where it holds no entry).
"""

from __future__ import annotations

from dataclasses import dataclass

from graph_trainer.analysis.devices import DEVICES, DeviceModel, with_attention
from graph_trainer.analysis.memory import DEVICE_MEMORY_BYTES
from graph_trainer.config_loading import take_flag
from graph_trainer.errors import ConfigError

GIB = float(1 << 30)


@dataclass(frozen=True)
class DeviceChoice:
    """The device a command simulates on, as its flags chose it."""

    name: str
    """The ``--device`` name (a key of ``DEVICES``)."""
    model: DeviceModel
    """``DEVICES[name]``, with ``--attention``'s kernel rates where given."""
    memory_limit: int | None
    """Bytes of device memory a rank's peak is warned against (None: no warning)."""


def take_device_flags(argv: list[str]) -> tuple[list[str], DeviceChoice]:
    """Take ``--device``, ``--attention`` and ``--device_memory_gib`` out of ``argv``; raises
    ``ConfigError`` (one line) for an unknown device or kernel, or a kernel on a device without
    fused attention."""
    argv, name = take_flag(argv, "--device", "h100")
    argv, attention = take_flag(argv, "--attention", None)
    argv, memory_gib = take_flag(argv, "--device_memory_gib", None, float)
    if name not in DEVICES:
        raise ConfigError(f"unknown --device {name!r}; choose from {', '.join(DEVICES)}")
    model = DEVICES[name]
    if attention is not None:
        try:
            model = with_attention(model, attention)
        except ValueError as e:
            raise ConfigError(f"--attention {attention}: {e}") from None
    limit = round(memory_gib * GIB) if memory_gib is not None else DEVICE_MEMORY_BYTES.get(name)
    return argv, DeviceChoice(name, model, limit)


__all__ = ["DeviceChoice", "take_device_flags"]
