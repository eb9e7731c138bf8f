"""benchmarks/float8_curves.py: each curve's job runs the model's debug config on its global batch
(a two-process recipe halves the local batch), so every curve sees the batches the bf16 one sees."""

from pathlib import Path

from benchmarks.float8_curves import FLAGS, PROCESSES, config_batch, job


def test_a_two_process_curve_keeps_the_one_process_global_batch():
    command = job(Path("/out"), "deepseek_v3", "experts_dispatch", 3)
    assert command[1:6] == ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    local = int(command[command.index("--training.local_batch_size") + 1])
    assert local * PROCESSES["experts_dispatch"] == config_batch("deepseek_v3") == 4
    assert " ".join(FLAGS["experts_dispatch"]) in " ".join(command)


def test_a_one_process_curve_runs_its_config_as_it_is():
    command = job(Path("/out"), "llama3", "rowwise", 3)
    assert "torch.distributed.run" not in command and "--training.local_batch_size" not in command
    assert command[command.index("--float8.recipe_name") + 1] == "rowwise"
