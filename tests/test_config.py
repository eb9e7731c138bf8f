"""Config loading (TOML + command line) and validation errors; the parallel layout's own checks are
tests/test_validation_parallelism.py's."""

import os
import subprocess
import sys

import pytest

from graph_trainer.config import JobConfig
from graph_trainer.config_loading import changed_fields, config_to_toml, load_config, take_flag
from graph_trainer.errors import ConfigError
from graph_trainer.validation import validate_config
from tests.conftest import ROOT

DEBUG_TOML = os.path.join(ROOT, "configs", "llama3_debug.toml")


def test_toml_then_cli_override():
    cfg = load_config(["--job.config_file", DEBUG_TOML, "--training.steps", "3", "--compile.mode", "eager"])
    assert cfg.model.flavor == "debugmodel"
    assert cfg.training.steps == 3  # the command line wins over the file's value
    assert cfg.compile.mode == "eager"
    assert cfg.training.seq_len == 128  # from the file
    validate_config(cfg)


def test_pass_list_accepts_commas_and_spaces(tmp_path):
    cfg = load_config(["--compile.passes", "a,b", "c"])
    assert cfg.compile.passes == ["a", "b", "c"]
    toml = tmp_path / "j.toml"
    toml.write_text('[compile]\npasses = "x,y"\n')
    assert load_config(["--job.config_file", str(toml)]).compile.passes == ["x", "y"]


@pytest.mark.parametrize(
    "toml_text, message",
    [
        ("[training]\nstepz = 3\n", "unknown key 'stepz' in section [training]"),
        ("[trainin]\nsteps = 3\n", "unknown section [trainin]"),
        ("[training]\nsteps = 'many'\n", "wrong type"),
        ("[training\n", "is not valid TOML"),
    ],
)
def test_bad_toml(tmp_path, toml_text, message):
    path = tmp_path / "bad.toml"
    path.write_text(toml_text)
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load_config(["--job.config_file", str(path)])


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("training.steps", "-1", "training.steps = -1 must be >= 1"),
        ("model.flavor", "9B", "model.flavor (for llama3) = '9B' is not allowed"),
        ("model.name", "gpt2", "model.name = 'gpt2' is not allowed"),
        ("compile.passes", "no_such_pass", "unknown pass 'no_such_pass'"),
        ("compile.mode", "jit", "compile.mode = 'jit' is not allowed"),
        ("training.seq_len", "100000", "training.seq_len = 100000 must be between"),
        ("training.mixed_precision_param", "fp8", "training.mixed_precision_param = 'fp8'"),
    ],
)
def test_validation_messages(field, value, message):
    with pytest.raises(ConfigError) as info:  # from loading (types, choices) or from validation
        validate_config(load_config([f"--{field}", value]))
    assert message in str(info.value)


def test_reshard_mode_is_checked():
    with pytest.raises(ConfigError, match="fsdp_reshard_after_forward = 'sometimes' is not allowed"):
        load_config(["--parallelism.fsdp_reshard_after_forward", "sometimes"])


def _run_train(*args):
    return subprocess.run(
        [sys.executable, os.path.join(ROOT, "train.py"), *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )


def _main(capsys, monkeypatch, *args) -> tuple[int, list[str]]:
    """``train.main`` in this process (what ``python train.py ARGS`` runs): its exit code and stderr lines."""
    import train

    monkeypatch.chdir(ROOT)
    code = train.main(list(args))
    return code, capsys.readouterr().err.strip().splitlines()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--compile.passes", "warp_speed"], "unknown pass 'warp_speed'"),
        (["--job.config_file", "configs/does_not_exist.toml"], "does not exist"),
        (["--training.steps", "-1"], "training.steps = -1 must be >= 1"),
        (["--training.steps", "abc"], "training.steps = 'abc' is not a whole number"),
        (["--trainng.steps", "3"], "unknown flag --trainng.steps"),
        (["--compile.backend", "tvm"], "compile.backend = 'tvm' is not allowed"),
        (
            ["--compile.backend", "inductor", "--compile.inductor_scope", "partial"],
            "compile.inductor_scope = 'partial' is not allowed",
        ),
        (
            ["--compile.backend", "inductor", "--compile.mode", "eager"],
            "compile.backend = 'inductor' needs compile.mode = 'graph'",
        ),
        (["--compile.inductor_scope", "full"], "compile.inductor_scope = 'full' needs compile.backend = 'inductor'"),
        (["--training.global_batch_size", "12"], "training.global_batch_size = 12 must be a positive multiple of"),
        (["--validation.enable", "True", "--validation.steps", "0"], "validation.steps = 0 must be >= 1"),
        (["--float8.recipe_name", "mxfp8"], "float8.recipe_name = 'mxfp8' is not allowed"),
        (["--float8.filter_fqns", "output"], "float8.filter_fqns = ['output'] means something only with float8"),
        (["--float8.recipe_name", "rowwise", "--float8.convert_router"], "float8.convert_router: llama3"),
        (
            ["--float8.recipe_name", "rowwise_with_gw_hp", "--float8.convert_routed_experts"],
            "float8.convert_routed_experts: llama3 (debugmodel) has no routed experts",
        ),
        (
            ["--job.config_file", "configs/deepseek_v3_debug.toml"]
            + ["--float8.recipe_name", "rowwise", "--float8.convert_routed_experts"],
            "needs float8.recipe_name 'rowwise_with_gw_hp' (it is 'rowwise')",
        ),
        (["--float8.convert_routed_experts"], "float8.convert_routed_experts = True means something only with"),
        (
            ["--job.config_file", "configs/deepseek_v3_debug.toml", "--float8.recipe_name", "rowwise_with_gw_hp"]
            + ["--float8.dispatch_in_float8"],
            "float8.dispatch_in_float8 = True means something only with float8.convert_routed_experts",
        ),
        (
            ["--job.config_file", "configs/deepseek_v3_debug.toml", "--float8.recipe_name", "rowwise_with_gw_hp"]
            + ["--float8.convert_routed_experts", "--float8.dispatch_in_float8"],
            "float8.dispatch_in_float8 sends expert parallel's tokens in float8: it needs parallelism.ep > 1 (it is 1",
        ),
        (
            ["--float8.recipe_name", "tensorwise", "--float8.filter_fqns", "wq,attention.wz"],
            "float8.filter_fqns: 'attention.wz' matches no linear of the model",
        ),
    ],
)
def test_train_main_exits_2_with_one_line(capsys, monkeypatch, args, message):
    code, lines = _main(capsys, monkeypatch, *args)
    assert code == 2, lines
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], lines


def test_train_py_script_exits_2_with_one_line():
    """The script itself (not only ``main``): exit code 2 and one line, no traceback, from a fresh interpreter."""
    result = _run_train("--training.steps", "abc")
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert lines == ["error: training.steps = 'abc' is not a whole number"], result.stderr


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has CUDA")
def test_cuda_without_cuda_is_one_line_exit_2(capsys, monkeypatch):
    code, lines = _main(capsys, monkeypatch, "--job.device", "cuda")
    assert code == 2, lines
    assert len(lines) == 1 and lines[0].startswith("error: job.device = 'cuda' but "), lines
    assert lines[0].endswith("; use --job.device cpu"), lines


def test_more_local_processes_than_gpus_is_one_line_error(monkeypatch):
    import torch

    from graph_trainer.validation import check_device, resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    for device in ("cuda", "auto"):  # auto picks cuda when it is there
        with pytest.raises(ConfigError) as info:
            check_device(device)
        assert str(info.value) == (
            "2 processes on this node need 2 CUDA devices, 1 visible; use --job.device cpu or fewer processes"
        )
    check_device("cpu")  # gloo: any number of processes
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    check_device("cuda")
    assert resolve_device("auto") == "cuda"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == "cpu"


def test_n_layers_cuts_a_flavor_and_is_validated():
    from models.registry import model_args

    cfg = load_config(["--model.flavor", "8B", "--model.n_layers", "4"])
    validate_config(cfg)
    args = model_args(cfg)
    assert (args.n_layers, args.dim, args.vocab_size) == (4, 4096, 128256)
    assert model_args(load_config(["--model.flavor", "8B"])).n_layers == 32
    with pytest.raises(ConfigError, match="model.n_layers = -1 must be >= 0"):
        validate_config(load_config(["--model.n_layers", "-1"]))
    deepseek = ["--job.config_file", os.path.join(ROOT, "configs", "deepseek_v3_16b.toml"), "--parallelism.ep", "1"]
    validate_config(load_config([*deepseek, "--model.n_layers", "4"]), world_size=8)
    with pytest.raises(ConfigError) as info:  # 16B's first layer is dense: one layer leaves no MoE for ep
        validate_config(load_config([*deepseek, "--model.n_layers", "1", "--parallelism.ep", "8"]), world_size=8)
    assert "parallelism.ep > 1 needs MoE layers" in str(info.value)


def test_train_py_unknown_toml_key(tmp_path, capsys, monkeypatch):
    path = tmp_path / "bad.toml"
    path.write_text("[model]\nflavour = '8B'\n")
    code, lines = _main(capsys, monkeypatch, "--job.config_file", str(path))
    assert code == 2
    assert len(lines) == 1 and "unknown key 'flavour' in section [model]" in lines[0], lines


CONFIG_WORLD_SIZES = {
    "llama3_debug.toml": 1,
    "llama3_8b.toml": 8,
    "llama3_405b.toml": 512,
    "deepseek_v3_debug.toml": 1,
    "deepseek_v3_16b.toml": 8,
    "deepseek_v3_671b.toml": 256,
    "qwen3_debug.toml": 1,
    "qwen3_moe_debug.toml": 1,
    "qwen3_32b.toml": 64,
    "qwen3_235b_a22b.toml": 256,
}
"""Every shipped job config and the world size it is meant for."""


def test_every_shipped_config_validates():
    shipped = sorted(os.listdir(os.path.join(ROOT, "configs")))
    assert shipped == sorted(CONFIG_WORLD_SIZES), "add new configs to CONFIG_WORLD_SIZES"
    for name, world_size in CONFIG_WORLD_SIZES.items():
        cfg = load_config(["--job.config_file", os.path.join(ROOT, "configs", name)])
        validate_config(cfg, world_size=world_size)


def test_take_flag_takes_either_spelling_and_refuses_a_missing_or_bad_value():
    assert take_flag(["--a", "--world-size", "4", "--b"], "--world_size", 8, int) == (["--a", "--b"], 4)
    assert take_flag(["--world_size=2"], "--world_size", 8, int) == ([], 2)
    assert take_flag(["--other", "1"], "--world_size", 8, int) == (["--other", "1"], 8)
    with pytest.raises(ConfigError, match="^--world_size needs a value$"):
        take_flag(["--world_size"], "--world_size", 8, int)
    with pytest.raises(ConfigError, match="^--world_size 'two' is not a whole number$"):
        take_flag(["--world_size", "two"], "--world_size", 8, int)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--training.steps", "abc"], "training.steps = 'abc' is not a whole number"),
        (["--training.lr", "fast"], "training.lr = 'fast' is not a number"),
        (["--training.stepz", "3"], "unknown flag --training.stepz; python train.py --help lists every flag"),
        (
            ["--compile.ep_overlap.reorder", "no"],
            "compile.ep_overlap.reorder = 'no' is not allowed; choose one of: True, False",
        ),
        (
            ["--training.decay_type=cosin"],
            "training.decay_type = 'cosin' is not allowed; choose one of: linear, sqrt, cosine, constant",
        ),
        (["--training.seed"], "--training.seed needs a value"),
    ],
)
def test_command_line_values_are_checked_against_their_field_types(args, message):
    with pytest.raises(ConfigError) as info:
        load_config(args)
    assert str(info.value) == message


def test_toml_choice_fields_are_checked_and_configs_built_in_code_too(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text('[compile]\nbackend = "tvm"\n')
    with pytest.raises(
        ConfigError,
        match=r"\[compile\] backend in .* = 'tvm' is not allowed; choose one of: none, "
        "inductor",
    ):
        load_config(["--job.config_file", str(path)])
    cfg = JobConfig()
    cfg.activation_checkpoint.mode = "some"  # not through a parser: validation checks every Literal field
    with pytest.raises(
        ConfigError, match="activation_checkpoint.mode = 'some' is not allowed; choose one of: none, selective, full"
    ):
        validate_config(cfg)


def test_model_names_are_the_registry_and_help_lists_choices(capsys):
    import typing

    from graph_trainer.config import ModelName
    from models.registry import MODEL_SPECS

    assert typing.get_args(ModelName) == tuple(MODEL_SPECS)
    with pytest.raises(SystemExit) as info:  # tyro prints the help and exits 0
        load_config(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "{none,inductor}" in out and "{graph,eager}" in out, out[:2000]


def test_simulated_devices_are_the_analysis_devices():
    import typing

    from graph_trainer.analysis.devices import DEVICES
    from graph_trainer.config import SimulatedDevice

    assert typing.get_args(SimulatedDevice) == ("none", *DEVICES)
    with pytest.raises(ConfigError, match="metrics.simulate_device .*'a100' is not allowed; choose one of: none, h100"):
        load_config(["--metrics.simulate_device", "a100"])


def test_a_bare_bool_flag_means_true_and_no_means_false():
    cfg = load_config(["--checkpoint.move_aside", "--training.steps", "3", "--metrics.no-enable-tensorboard"])
    assert (cfg.checkpoint.move_aside, cfg.training.steps, cfg.metrics.enable_tensorboard) == (True, 3, False)
    assert load_config(["--debug.deterministic"]).debug.deterministic is True
    assert load_config(["--checkpoint.move_aside", "False"]).checkpoint.move_aside is False
    assert load_config(["--compile.ep_overlap.no_reorder"]).compile.ep_overlap.reorder is False
    with pytest.raises(ConfigError, match=r"^--checkpoint.no_move_aside takes no value: it means"):
        load_config(["--checkpoint.no_move_aside", "True"])
    with pytest.raises(ConfigError, match=r"^unknown flag --training.no_steps"):
        load_config(["--training.no_steps"])  # (steps is no bool)


@pytest.mark.parametrize("false, true", [("false", "true"), ("FALSE", "TRUE"), ("False", "True")])
def test_a_bool_flag_takes_tomls_spelling_and_any_case(false, true):
    assert load_config(["--compile.ep_overlap.reorder", false]).compile.ep_overlap.reorder is False
    assert load_config([f"--compile.ep_overlap.reorder={false}"]).compile.ep_overlap.reorder is False
    assert load_config(["--checkpoint.move_aside", true, "--training.steps", "3"]).checkpoint.move_aside is True
    assert load_config([f"--checkpoint.move-aside={true}"]).checkpoint.move_aside is True


def test_a_bool_flag_refuses_other_words():
    with pytest.raises(ConfigError, match=r"checkpoint.move_aside = 'yes' is not allowed; choose one of: True, False"):
        load_config(["--checkpoint.move_aside", "yes"])
    with pytest.raises(ConfigError, match=r"^--checkpoint.no_move_aside takes no value"):
        load_config(["--checkpoint.no_move_aside", "false"])


@pytest.mark.parametrize("config", [None, *sorted(os.listdir(os.path.join(ROOT, "configs")))])
def test_the_written_config_reads_back_as_the_same_config(tmp_path, config):
    flags = ["--training.lr", "2.5e-05", "--compile.passes", "auto_bucketing", "--compile.ep_overlap.chunk_dim", "seq"]
    argv = ([] if config is None else ["--job.config_file", os.path.join(ROOT, "configs", config)]) + flags
    cfg = load_config(argv)
    path = tmp_path / "config.toml"
    path.write_text(config_to_toml(cfg))
    again = load_config(["--job.config_file", str(path)])
    assert again.job.config_file == str(path)
    again.job.config_file = cfg.job.config_file
    assert again == cfg
    changed = changed_fields(cfg)
    assert "training.lr=2.5e-05" in changed and 'compile.passes=["auto_bucketing"]' in changed
    assert not [c for c in changed if c.startswith("training.beta1=")]  # a default is not listed


_IGNORED = "it would be ignored; leave it out or set that too"


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--parallelism.pp_stage_blocks", "3,3"], "parallelism.pp_stage_blocks = '3,3' means something only with "),
        (["--parallelism.pp_schedule", "GPipe"], "parallelism.pp_schedule = 'GPipe' means something only with "),
        (["--compile.cache_dir", "/tmp/c"], "compile.cache_dir = '/tmp/c' means something only with "),
        (["--compile.once_per_node", "False"], "compile.once_per_node = False means something only with "),
        (
            ["--activation_checkpoint.selective_ops", "mm"],
            "activation_checkpoint.selective_ops = ['mm'] means something only with ",
        ),
        (["--compile.ep_overlap.chunk_dim", "seq"], "compile.ep_overlap.chunk_dim = 'seq' means something only with "),
        (["--profiling.profile_freq", "5"], "profiling.profile_freq = 5 means something only with "),
        (["--profiling.save_traces_folder", "t"], "profiling.save_traces_folder = 't' means something only with "),
        (
            ["--profiling.save_memory_snapshot_folder", "m"],
            "profiling.save_memory_snapshot_folder = 'm' means something only with ",
        ),
        (["--validation.freq", "5"], "validation.freq = 5 means something only with "),
        (
            ["--parallelism.sequence_parallel", "False"],
            "parallelism.sequence_parallel = False means something only with ",
        ),
        (["--checkpoint.async_mode", "async"], "checkpoint.async_mode = 'async' means something only with "),
        (["--checkpoint.keep_latest_k", "3"], "checkpoint.keep_latest_k = 3 means something only with "),
        (
            ["--checkpoint.finish_timeout_seconds", "60", "--checkpoint.interval", "5"],
            "checkpoint.finish_timeout_seconds = 60.0 means something only with ",
        ),
        (
            ["--training.decay_ratio", "0.2", "--training.decay_type", "constant"],
            "training.decay_ratio = 0.2 means something only with ",
        ),
        (
            ["--training.min_lr_ratio", "0.1", "--training.decay_type", "constant"],
            "training.min_lr_ratio = 0.1 means something only with ",
        ),
        (["--validation.split", "test"], "validation.split = 'test' means something only with "),
        (["--validation.dataset_subset", "en"], "validation.dataset_subset = 'en' means something only with "),
        (["--training.dataset_subset", "en"], "training.dataset_subset = 'en' means something only with "),
        (["--training.dataset_streaming"], "training.dataset_streaming = True means something only with "),
    ],
)
def test_a_setting_that_would_be_ignored_is_refused(flags, message):
    with pytest.raises(ConfigError) as info:
        validate_config(load_config(flags))
    needs = {
        "parallelism": "parallelism.pp > 1 (it is 1)",
        "parallelism.sequence_parallel": "parallelism.tp > 1 (it is 1)",
        "compile.cache_dir": "compile.backend 'inductor' (it is 'none')",
        "compile.once_per_node": "compile.backend 'inductor' (it is 'none')",
        "activation_checkpoint": "activation_checkpoint.mode 'selective' (it is 'none')",
        "compile.ep_overlap": "'ep_overlap' in compile.passes",
        "profiling.profile_freq": "profiling.enable_profiling or profiling.enable_memory_snapshot",
        "profiling.save_traces_folder": "profiling.enable_profiling",
        "profiling.save_memory_snapshot_folder": "profiling.enable_memory_snapshot",
        "validation": "validation.enable",
        "checkpoint.": "checkpoint.interval > 0 (it is 0)",
        "checkpoint.finish_timeout_seconds": (
            "checkpoint.async_mode 'async' (it is 'disabled') and checkpoint.interval > 0"
        ),
        "training.decay_ratio": "training.decay_type other than 'constant' (it is 'constant')",
        "training.min_lr_ratio": "training.decay_type other than 'constant' (it is 'constant')",
        "validation.dataset_subset": "validation.enable and validation.dataset",
        "training.dataset_": "training.dataset other than 'synthetic' (generated)",
    }
    what = needs[max((k for k in needs if flags[0][2:].startswith(k)), key=len)]
    assert str(info.value) == f"{message}{what}: {_IGNORED}"


def test_a_background_save_gets_a_positive_time_to_finish():
    flags = ["--checkpoint.interval", "5", "--checkpoint.async_mode", "async", "--checkpoint.finish_timeout_seconds"]
    with pytest.raises(ConfigError, match=r"^checkpoint.finish_timeout_seconds = 0.0 must be > 0$"):
        validate_config(load_config([*flags, "0"]))
    validate_config(load_config([*flags, "0.5"]))


@pytest.mark.parametrize("profiling", ["--profiling.enable_profiling", "--profiling.enable_memory_snapshot"])
def test_a_profile_freq_beyond_the_last_step_is_refused(profiling):
    """Every profile_freq-th step is profiled: with fewer steps, none would be."""
    flags = [profiling, "--training.steps", "10", "--profiling.profile_freq"]
    with pytest.raises(ConfigError) as info:
        validate_config(load_config([*flags, "11"]))
    assert str(info.value) == (
        "profiling.profile_freq = 11 is more than training.steps = 10: every profile_freq-th step is profiled, "
        "so none would be; set it to at most 10"
    )
    validate_config(load_config([*flags, "10"]))


def test_sequence_parallel_needs_a_sequence_length_tp_divides(monkeypatch):
    tp2 = ["--parallelism.tp", "2", "--training.seq_len", "63"]
    monkeypatch.setenv("WORLD_SIZE", "2")  # (what torchrun sets: the check runs before any process group)
    result = _run_train(*tp2)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and lines == [
        "error: training.seq_len = 63 must be a multiple of parallelism.tp = 2 under sequence parallel (each tp "
        "rank holds an equal piece of the sequence); change one, or set parallelism.sequence_parallel false"
    ], lines
    validate_config(load_config([*tp2, "--parallelism.no_sequence_parallel"]), world_size=2)
