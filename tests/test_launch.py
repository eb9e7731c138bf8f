"""The forked-rank launcher (tests/forked_ranks.py) against torchrun: the same job gives bitwise
the same losses and gradients, a rank sees torchrun's environment, and a failing rank ends the job."""

from __future__ import annotations

import json
import os
import textwrap

from graph_trainer.loop.grad_record import compare_records, load_record, record_path
from tests.conftest import ROOT
from tests.launch import FAST_ARGS, read_losses, run_forked, run_torchrun

_JOB = [*FAST_ARGS, "--training.steps", "4", "--debug.grad_record_step", "1"]


def test_forked_ranks_train_bitwise_as_torchrun(tmp_path):
    train = os.path.join(ROOT, "train.py")
    for name, launch in (("torchrun", run_torchrun), ("forked", run_forked)):
        launch(2, train, *_JOB, "--job.dump_folder", str(tmp_path / name))
    assert read_losses(tmp_path / "forked") == read_losses(tmp_path / "torchrun")
    forked, torchrun = (load_record(record_path(str(tmp_path / n), 1)) for n in ("forked", "torchrun"))
    assert compare_records(forked, torchrun, rtol=0) == ([], 0.0)


_PROBE = """
    import json, os, sys, time
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    total = torch.tensor([dist.get_rank() + 1.0])
    dist.all_reduce(total)
    names = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK")
    seen = {{"argv": sys.argv[1:], "sum": total.item(), "threads": torch.get_num_threads()}}
    seen.update({{k: os.environ.get(k) for k in names}})
    with open(os.path.join({folder!r}, f"rank{{dist.get_rank()}}.json"), "w") as f:
        json.dump(seen, f)
    dist.barrier()
    if dist.get_rank() == 1:
        sys.exit(3)
    time.sleep(600)  # waits on nothing: only the launcher stopping it ends this rank
"""


def test_a_rank_sees_torchruns_environment_and_a_failing_rank_ends_the_job(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(textwrap.dedent(_PROBE.format(folder=str(tmp_path))))
    result = run_forked(2, str(script), "--flag", "x", timeout=300, check=False)
    assert result.returncode == 3, result.stderr
    for rank in range(2):
        seen = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert seen == {
            "argv": ["--flag", "x"],
            "sum": 3.0,
            "threads": 1,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": "2",
            "LOCAL_WORLD_SIZE": "2",
            "GROUP_RANK": "0",
        }
