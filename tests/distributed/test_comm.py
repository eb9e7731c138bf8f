"""graph_trainer/distributed/comm.py: ranks taking turns per host (``first_per_node``), and agreeing on a
failure (``agree``)."""

import ast
import os
import time

import pytest
import torch.multiprocessing as mp

from graph_trainer.distributed.comm import leaders


def test_the_lowest_rank_of_each_host_and_key_leads():
    keys = [("h1", "a"), ("h1", "a"), ("h1", "b"), ("h2", "a"), ("h2", "a"), ("h1", "b")]
    assert leaders(keys) == [True, False, True, True, False, False]


def _turns_worker(rank: int, store: str, folder: str) -> None:
    """One of three ranks of one host; ranks 0 and 1 hold key 'a', rank 2 key 'b'."""
    import torch.distributed as dist

    from graph_trainer.distributed.comm import first_per_node
    from graph_trainer.torch_compat import cpu_backend

    dist.init_process_group(cpu_backend(), init_method=f"file://{store}", rank=rank, world_size=3)

    def run():
        seen = sorted(os.listdir(folder))  # what the first wave had finished when this rank started
        time.sleep(0.5)
        with open(os.path.join(folder, f"done{rank}"), "w"):
            pass
        return seen

    seen, first = first_per_node("b" if rank == 2 else "a", run)
    with open(os.path.join(folder, f"report{rank}.txt"), "w") as f:
        f.write(repr({"seen": seen, "first": first}))
    dist.destroy_process_group()


def test_the_others_run_after_the_first_of_their_key_has_finished(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    mp.spawn(_turns_worker, args=(str(tmp_path / "store"), str(work)), nprocs=3, join=True)
    reports = [ast.literal_eval((tmp_path / f"work/report{r}.txt").read_text()) for r in range(3)]
    assert [r["first"] for r in reports] == [[True, False, True]] * 3
    # Ranks 0 and 2 ran side by side in the first wave; rank 1 only after both had finished.
    assert [f for f in reports[0]["seen"] if f.startswith("done")] == []
    assert [f for f in reports[2]["seen"] if f.startswith("done")] == []
    assert [f for f in reports[1]["seen"] if f.startswith("done")] == ["done0", "done2"]


def test_agree_gives_a_config_error_back_as_itself_and_an_io_error_as_a_job_error():
    """One process: what ``fn`` returns, its ConfigError unchanged (exit 2), an I/O error as the
    JobError naming the step (exit 1). Two ranks, one of them refusing a setting: test_wandb."""
    from graph_trainer.distributed.comm import agree
    from graph_trainer.errors import ConfigError, JobError

    assert agree(lambda: 3, "counting") == 3
    refused = ConfigError("x = 1 is refused")

    def refuse():
        raise refused

    with pytest.raises(ConfigError) as info:
        agree(refuse, "starting")
    assert info.value is refused

    def full_disk():
        raise OSError(28, "No space left on device")

    with pytest.raises(JobError, match="^writing: ") as failed:
        agree(full_disk, "writing")
    assert not isinstance(failed.value, ConfigError)
