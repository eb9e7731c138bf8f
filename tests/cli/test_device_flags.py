"""graph_trainer.cli.device_flags: every device and attention kernel is reachable from analyze's flags."""

import pytest

from graph_trainer.analysis.devices import ATTENTION_KERNELS, DEVICES, with_attention
from graph_trainer.analysis.memory import DEVICE_MEMORY_BYTES
from graph_trainer.cli import analyze
from graph_trainer.cli.device_flags import take_device_flags
from graph_trainer.errors import ConfigError

JOB = ["--world_size", "2", "--job.config_file", "configs/llama3_debug.toml", "--training.local_batch_size", "2"]


@pytest.mark.parametrize("name", list(DEVICES))
def test_every_device_is_reachable(name):
    rest, choice = take_device_flags(["--device", name, "--x.y", "1"])
    assert rest == ["--x.y", "1"]
    assert (choice.name, choice.model, choice.memory_limit) == (name, DEVICES[name], DEVICE_MEMORY_BYTES.get(name))
    command = analyze.parse_command_line([*JOB, "--device", name])
    assert (command.device_name, command.device) == (name, DEVICES[name])


@pytest.mark.parametrize("name", ["h100", "h200", "h100_hbm2e_500w"])
@pytest.mark.parametrize("kernel", list(ATTENTION_KERNELS))
def test_every_attention_kernel_is_reachable_on_the_gpus(name, kernel):
    command = analyze.parse_command_line([*JOB, "--device", name, "--attention", kernel])
    assert command.device == with_attention(DEVICES[name], kernel)


def test_defaults_and_memory_flag():
    rest, choice = take_device_flags(["--device_memory_gib", "2"])
    assert rest == [] and choice.name == "h100" and choice.model == DEVICES["h100"]
    assert choice.memory_limit == 2 << 30


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--device", "a100"], "unknown --device 'a100'; choose from h100, h200, h100_hbm2e_500w, cpu"),
        (["--attention", "fa4"], "--attention fa4: unknown attention kernel 'fa4'; choose from cudnn, fa2, fa3"),
        (["--device", "cpu", "--attention", "fa2"], "--attention fa2: CPU 2-core runs no fused attention kernel"),
    ],
)
def test_bad_flags_are_one_line(flags, message, capsys):
    with pytest.raises(ConfigError, match=message):
        take_device_flags(flags)
    assert analyze.main([*JOB, *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {message}") and err.count("\n") == 1


def test_analyze_simulates_on_the_chosen_device_and_kernel(capsys):
    assert analyze.main([*JOB, "--device", "h100_hbm2e_500w", "--attention", "fa2"]) == 0
    header = capsys.readouterr().out.splitlines()[0]
    assert "simulated on H100 96GB HBM2e, 500 W, FlashAttention-2 attention (8 ranks/node)" in header
