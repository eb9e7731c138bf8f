"""graph_trainer/cli/lockstep.py: two runs of one job stepped together, freely or from the same state."""

import torch

from graph_trainer.cli.lockstep import copy_state, lockstep, main
from graph_trainer.config_loading import load_config
from graph_trainer.trainer import Trainer
from graph_trainer.validation import validate_config
from suites import CPU_BLOCKS, debug_job

JOB = [*debug_job(), *CPU_BLOCKS, "--training.steps", "3"]
OTHER_EPS = ["--training.eps", "1e-3"]  # B differs from A only in its updates, not in a step's gradients


def _config(tmp_path, name: str, *flags: str):
    cfg = load_config([*JOB, "--job.dump_folder", str(tmp_path / name), *flags])
    validate_config(cfg)
    return cfg


def test_free_runs_part_after_the_first_update_and_runs_from_the_same_state_never_do(tmp_path):
    free = lockstep(_config(tmp_path, "a"), _config(tmp_path, "b", *OTHER_EPS))
    assert free[0].loss_dev == free[0].grad_dev == 0 and free[0].param_dist > 0
    assert all(d.loss_dev > 0 and d.grad_dev > 0 for d in free[1:])
    same = lockstep(_config(tmp_path, "a2"), _config(tmp_path, "b2", *OTHER_EPS), from_same_state=True)
    # Every step starts from A's parameters, buffers and AdamW state: its loss and gradients are A's bit for bit,
    # only its update (another eps) differs, so the distance is one update's and stays below the free runs'.
    assert all(d.loss_dev == 0 and d.grad_dev == 0 and d.param_dist > 0 for d in same)
    assert [d.loss_a for d in same] == [d.loss_a for d in free]
    assert same[-1].param_dist < free[-1].param_dist


def test_copy_state_makes_every_tensor_of_the_state_equal(tmp_path):
    a, b = Trainer(_config(tmp_path, "a")), Trainer(_config(tmp_path, "b", *OTHER_EPS))
    batches = iter(a.dataloader)
    for trainer in (a, b, a):  # different states: A two steps on two batches, B one step
        trainer.step += 1
        trainer.train_step([next(batches)])
    copy_state(a, b)
    for (name, x), (_, y) in zip(
        [*a.model.named_parameters(), *a.model.named_buffers()],
        [*b.model.named_parameters(), *b.model.named_buffers()],
        strict=True,
    ):
        assert torch.equal(x, y), name
    for pa, pb in zip(a.params, b.params, strict=True):
        sa, sb = a.optimizer.state[pa], b.optimizer.state[pb]
        assert sa.keys() == sb.keys()
        assert all(torch.equal(sa[k], sb[k]) for k in sa)


def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    assert main([*JOB]) == 2
    assert capsys.readouterr().err.strip() == (
        "error: --b is required: the flags that make run B differ from run A, in one quoted string"
    )
    assert main([*JOB, "--from_same_state", "--b", "--model.n_layers 1"]) == 2
    assert capsys.readouterr().err.strip() == (
        "error: --from_same_state needs the same model in both runs; --b changed model.n_layers"
    )
