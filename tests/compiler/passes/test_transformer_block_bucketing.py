"""transformer_block_bucketing: one FSDP all-gather / gradient reduction per block, prefetched, bitwise.

Run as a script under torchrun (``_grads_worker``), this file also compares the loss and every
gradient of one traced step with and without the pass, bit for bit, on real gloo processes
(each rank writes its verdict to ``bitwise_rank<r>.txt`` in the dump folder).
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from collections import Counter

import pytest
import torch

from graph_trainer.compiler.passes import PASS_REGISTRY, PassContext, PassError
from graph_trainer.compiler.passes.bucket_merge import transposed_copies
from graph_trainer.compiler.passes.transformer_block_bucketing import bucket_index, transformer_block_bucketing
from graph_trainer.config_loading import load_config
from graph_trainer.errors import ConfigError
from graph_trainer.fake_trace import fake_world, trace_job
from graph_trainer.graph import tags
from graph_trainer.graph.collectives import collective_name, is_collective, wait_of
from graph_trainer.graph.ops import is_view
from graph_trainer.validation import validate_config
from suites import CPU_BLOCK_COUNT, CPU_BLOCKS
from tests.conftest import ROOT
from tests.graph_compare import node_signature
from tests.launch import FAST_ARGS, run_forked

TBB = "transformer_block_bucketing"
SMALL = ["--training.local_batch_size", "2", "--training.seq_len", "32", *CPU_BLOCKS]
BLOCKS = CPU_BLOCK_COUNT  # (the cpu suite's; every check below is per block)
PLAN = [["tok_embeddings"], *[[f"layers.{i}"] for i in range(BLOCKS)], ["norm", "output"]]
NAMES = ["+".join(group) for group in PLAN]
LAYOUTS = {
    "fsdp4": [],
    "fsdp2xtp2": ["--parallelism.tp", "2"],
    "reshard_never": ["--parallelism.fsdp_reshard_after_forward", "never"],
    "reshard_always": ["--parallelism.fsdp_reshard_after_forward", "always"],
    # SimpleFSDP over the cp ranks alone (dp_shard 1): their collectives are bucketed, the K/V gathers kept
    "cp4": ["--parallelism.cp", "4"],
    # float8 weights: each gather's chain holds an amax all-reduce and the scale (float8_gather)
    "float8_all_gather": [
        *["--parallelism.tp", "2", "--float8.recipe_name", "tensorwise", "--float8.enable_fsdp_float8_all_gather"]
    ],
}


@functools.cache
def _trace(extra: tuple[str, ...], passes: str = TBB, world_size: int = 4):
    cfg = load_config([*SMALL, "--compile.passes", passes, *extra] if passes else [*SMALL, *extra])
    with fake_world(world_size):
        return trace_job(cfg, world_size).gm


def _fsdp_collectives(gm, name: str, phase: str) -> list:
    return [
        n
        for n in gm.graph.nodes
        if collective_name(n) == name and tags.get(n, "fsdp_role") and tags.get(n, "phase") == phase
    ]


def _compute(gm, phase: str) -> dict[int, list[int]]:
    """Positions of each bucket's compute nodes in ``phase`` (FSDP gather/reduce nodes excluded)."""
    out: dict[int, list[int]] = {}
    for i, n in enumerate(gm.graph.nodes):
        c = tags.tags(n)
        if n.op == "call_function" and c.get("phase") == phase and not c.get("fsdp_role") and not c.get("recomputed"):
            b = bucket_index(PLAN, c.get("module_fqn", ""))
            if b is not None:
                out.setdefault(b, []).append(i)
    return out


def _reduced_gradients(gm, bucket: str) -> list[int]:
    """Positions of the gradients a reduce-scatter bucket reads: the nodes feeding what the pass
    made for it (``fsdp_bucket``), looking through the reduction's own nodes (``reduce_grad``:
    under torch 2.13 the identity view DTensor puts between a gradient and its reduce-scatter,
    which 2.11 does not add; tests/torch_compat/test_compat_distributed.py)."""
    made = {
        n for n in gm.graph.nodes if tags.get(n, "fsdp_bucket") == bucket and tags.get(n, "fsdp_role") == "reduce_grad"
    }
    position = {n: i for i, n in enumerate(gm.graph.nodes)}
    gradients, frontier = [], [i for n in made for i in n.all_input_nodes if i not in made]
    while frontier:
        node = frontier.pop()
        if tags.get(node, "fsdp_role") == "reduce_grad":
            frontier.extend(node.all_input_nodes)
        else:
            gradients.append(position[node])
    return gradients


def _issue_and_wait(gm, node) -> tuple[int, int]:
    position = {n: i for i, n in enumerate(gm.graph.nodes)}
    (wait,) = node.users
    return position[node], position[wait]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_one_all_gather_and_one_reduce_scatter_per_bucket(layout):
    extra = tuple(LAYOUTS[layout])
    gm = _trace(extra)
    forward = _fsdp_collectives(gm, "all_gather_into_tensor", "forward")
    backward = _fsdp_collectives(gm, "all_gather_into_tensor", "backward")
    reduce = _fsdp_collectives(gm, "reduce_scatter_tensor", "backward")
    assert [tags.get(n, "fsdp_bucket") for n in forward] == NAMES
    if layout == "reshard_never":
        assert backward == []
    else:  # backward order; the embedding's backward does not read its weight, and by default
        # the head's (norm and output) keeps the forward's gather
        regathered = NAMES[:0:-1] if layout == "reshard_always" else NAMES[-2:0:-1]
        assert [tags.get(n, "fsdp_bucket") for n in backward] == regathered
    assert sorted(tags.get(n, "fsdp_bucket") for n in reduce) == sorted(NAMES)
    # Everything else (TP all_reduces / all_gathers) is exactly what it was without the pass.
    plain = _trace(extra, passes="")

    def others(g):
        return Counter(
            (node_signature(n), tags.get(n, "phase"))
            for n in g.graph.nodes
            if is_collective(n) and not tags.get(n, "fsdp_role")
        )

    assert others(gm) == others(plain)  # same op, process group and input node, in the same phase
    assert any("all_reduce" in sig[2] for sig, _ in others(gm)) == ("tp" in " ".join(extra))  # TP's stay


def test_float8_amax_all_reduces_one_per_block_and_group_before_its_gather():
    """Each block's 7 float8 weights' amaxes: one all-reduce (max) over dp_shard and one over tp
    per block, not 7 of each, issued before the block's gather (whose casts read them)."""
    gm = _trace(tuple(LAYOUTS["float8_all_gather"]))
    plain = _trace(tuple(LAYOUTS["float8_all_gather"]), passes="")
    amax = [n for n in _fsdp_collectives(gm, "all_reduce", "forward") if tags.get(n, "fsdp_role") == "unshard"]
    before = [n for n in _fsdp_collectives(plain, "all_reduce", "forward") if tags.get(n, "fsdp_role") == "unshard"]
    assert len(before) == BLOCKS * 7 * 2 and len(amax) == BLOCKS * 2
    assert sorted(tags.get(n, "fsdp_bucket") for n in amax) == sorted(NAMES[1:-1] * 2)
    assert all(n.meta["val"].shape == (7,) for n in amax)
    position = {n: i for i, n in enumerate(gm.graph.nodes)}
    gathers = {tags.get(n, "fsdp_bucket"): n for n in _fsdp_collectives(gm, "all_gather_into_tensor", "forward")}
    assert all(position[n] < position[gathers[tags.get(n, "fsdp_bucket")]] for n in amax)


def _backward_copies(gm) -> Counter:
    """How many copies (``clone``) each module's backward makes."""
    return Counter(
        tags.module_fqn(n)
        for n in gm.graph.nodes
        if n.target is torch.ops.aten.clone.default and tags.get(n, "phase") == "backward"
    )


def _matmuls_reading(node) -> list:
    """The ``_scaled_mm`` nodes reading ``node`` directly or through views."""
    found, frontier = [], [node]
    while frontier:
        for user in frontier.pop().users:
            if user.target is torch.ops.aten._scaled_mm.default:
                found.append(user)
            elif is_view(user):
                frontier.append(user)
    return found


def test_float8_backward_gathers_copied_out_transposed():
    """A float8 weight's backward gather is read only transposed (its input-gradient matmul takes
    it column-major): the bucket copies it out in that layout, one copy where there were two, and
    the matmul reads that copy."""
    plain = _trace(tuple(LAYOUTS["float8_all_gather"]), passes="")
    gm = _trace(tuple(LAYOUTS["float8_all_gather"]))
    gathers = _fsdp_collectives(plain, "all_gather_into_tensor", "backward")
    read_transposed = {tags.get(g, "fsdp_param") for g in gathers if transposed_copies(wait_of(g))}
    linears = [f"attention.w{x}" for x in "qkvo"] + [f"feed_forward.w{i}" for i in (1, 2, 3)]
    assert read_transposed == {f"layers.{b}.{m}.weight" for b in range(BLOCKS) for m in linears}
    permute_op = torch.ops.aten.permute.default
    permutes = [n for n in gm.graph.nodes if n.target is permute_op and tags.get(n, "fsdp_role") == "unshard"]
    assert sorted(tags.get(n, "fsdp_param") for n in permutes) == sorted(read_transposed)
    for permute in permutes:  # (world, rows / world, cols) -> (cols, world, rows / world), copied, multiplied
        (copy,) = permute.users
        assert copy.target is torch.ops.aten.clone.default and copy.meta["val"].is_contiguous()
        assert len(_matmuls_reading(copy)) == 1
    # Per weight, the bucketed backward copies it as often as the unbucketed one did: its
    # copy-out is its transposed copy (a row-major copy-out beside the transposed copy is one more).
    before, after = _backward_copies(plain), _backward_copies(gm)
    assert all(after[w.removesuffix(".weight")] == before[w.removesuffix(".weight")] for w in read_transposed)


@pytest.mark.parametrize("layout", ["fsdp4", "fsdp2xtp2", "float8_all_gather", "reshard_always", "cp4"])
def test_gathers_are_prefetched_and_reduce_scatters_deferred(layout):
    gm = _trace(tuple(LAYOUTS[layout]))
    forward_compute, backward_compute = _compute(gm, "forward"), _compute(gm, "backward")
    forward = _fsdp_collectives(gm, "all_gather_into_tensor", "forward")
    for i, ag in enumerate(forward[1:]):
        issue, wait = _issue_and_wait(gm, ag)
        # bucket i+1's gather is in flight across the whole compute of bucket i
        assert issue < forward_compute[i][0] and wait > forward_compute[i][-1], (i, issue, wait)
    backward = _fsdp_collectives(gm, "all_gather_into_tensor", "backward")  # blocks from the last, down to 1
    for ag in backward:
        after = NAMES.index(tags.get(ag, "fsdp_bucket")) + 1  # the bucket whose backward runs before it
        if after < len(PLAN):  # (the head's, by default kept from forward and not gathered again)
            issue, wait = _issue_and_wait(gm, ag)
            assert issue < backward_compute[after][0] and wait > backward_compute[after][-1], (after, issue, wait)
    reduce = _fsdp_collectives(gm, "reduce_scatter_tensor", "backward")
    for rs, following in zip(reduce, reduce[1:], strict=False):
        issue, wait = _issue_and_wait(gm, rs)
        next_issue, _ = _issue_and_wait(gm, following)
        next_bucket = NAMES.index(tags.get(following, "fsdp_bucket"))
        # waited only when the next bucket's reduce-scatter is issued, after all its gradients
        gradients = _reduced_gradients(gm, NAMES[next_bucket])
        assert issue < backward_compute[next_bucket][0] and max(gradients) < wait < next_issue


@pytest.mark.parametrize(
    "layout,replicate,shard",
    [("ddp2", 2, 1), ("hsdp2x2", 2, 2)],
)
def test_gradient_all_reduces_one_per_bucket_after_the_reduce_scatter(layout, replicate, shard):
    extra = ("--parallelism.dp_replicate", str(replicate), "--parallelism.dp_shard", str(shard))
    gm = _trace(extra, world_size=replicate * shard)
    plain = _trace(extra, passes="", world_size=replicate * shard)
    all_reduces = _fsdp_collectives(gm, "all_reduce", "backward")
    assert sorted(tags.get(n, "fsdp_bucket") for n in all_reduces) == sorted(NAMES)
    # the bucket sums exactly the elements the per-parameter all-reduces summed
    plain_elements = sum(n.meta["val"].numel() for n in _fsdp_collectives(plain, "all_reduce", "backward"))
    assert sum(n.meta["val"].numel() for n in all_reduces) == plain_elements
    position = {n: i for i, n in enumerate(gm.graph.nodes)}
    reduce_scatters = {
        tags.get(n, "fsdp_bucket"): n for n in _fsdp_collectives(gm, "reduce_scatter_tensor", "backward")
    }
    assert len(reduce_scatters) == (len(NAMES) if shard > 1 else 0)
    nodes = list(gm.graph.nodes)
    for i, (ar, following) in enumerate(zip(all_reduces, [*all_reduces[1:], None], strict=True)):
        issue, wait = _issue_and_wait(gm, ar)
        rs = reduce_scatters.get(tags.get(ar, "fsdp_bucket"))
        if rs is not None:  # HSDP: the shard is summed over replicas once its reduce-scatter is waited
            assert _issue_and_wait(gm, rs)[1] < issue
        if following is not None:  # in flight until the next bucket's all-reduce is issued
            assert wait < position[following]
        if i < len(all_reduces) - 2:  # ... over backward compute (the last ones run after the last block's)
            hiding = [n for n in nodes[issue + 1 : wait] if n.op == "call_function"]
            assert any(tags.phase(n) == "backward" and not tags.get(n, "fsdp_role") for n in hiding), i


def test_deepseek_dense_buckets():
    gm = _trace(("--model.name", "deepseek_v3"))
    forward = _fsdp_collectives(gm, "all_gather_into_tensor", "forward")
    assert [tags.get(n, "fsdp_bucket") for n in forward] == NAMES
    assert len(_fsdp_collectives(gm, "reduce_scatter_tensor", "backward")) == len(PLAN)


def test_deepseek_expert_parallel_gets_one_collective_per_bucket_and_group():
    gm = _trace(("--model.name", "deepseek_v3", "--parallelism.ep", "2"))
    forward = _fsdp_collectives(gm, "all_gather_into_tensor", "forward")
    per_bucket = Counter(tags.get(n, "fsdp_bucket") for n in forward)
    assert per_bucket["layers.0"] == 1 and per_bucket["layers.1"] == 2  # dense layer; dense + experts (efsdp)


# (fp32 FSDP2, HSDP2x2, DDP2, FSDP2xTP2, EP2: the cpu suite's *_tbb cases, losses and step-1 gradients)
@pytest.mark.parametrize(
    "nproc,extra",
    [(2, ["--training.mixed_precision_param", "bfloat16"]), (2, ["--parallelism.cp", "2"])],
    ids=["fsdp2_bf16", "cp2"],
)
def test_loss_and_every_gradient_bitwise(nproc, extra, tmp_path):
    _launch(nproc, *FAST_ARGS, "--job.dump_folder", str(tmp_path), *extra)
    reports = [(tmp_path / f"bitwise_rank{r}.txt").read_text() for r in range(nproc)]
    assert all(report.endswith(": same") for report in reports), reports


def _launch(nproc: int, *args: str) -> None:
    """This file as the script of a multi-process job with ``args`` (see ``__main__``)."""
    run_forked(nproc, os.path.abspath(__file__), *args)


def test_mixed_dtype_gather_bucket_is_bitwise(tmp_path):
    _launch(2, "--mixed-dtypes", str(tmp_path))
    reports = [(tmp_path / f"bitwise_rank{r}.txt").read_text() for r in range(2)]
    assert all(report.endswith(": same") for report in reports), reports


def test_rejected_at_config_validation_without_data_parallelism():
    with pytest.raises(ConfigError) as info:
        validate_config(load_config(["--compile.passes", TBB]), world_size=1)
    assert "\n" not in str(info.value) and "parallelism.dp_shard, cp or dp_replicate > 1" in str(info.value)
    # DDP alone is accepted: its gradient all-reduces are bucketed
    validate_config(load_config(["--compile.passes", TBB, "--parallelism.dp_replicate", "2"]), world_size=2)
    result = subprocess.run(
        [sys.executable, os.path.join(ROOT, "train.py"), "--compile.passes", TBB],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": ROOT},
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [f"error: {info.value}"]


def test_pass_errors():
    gm = _trace((), passes="", world_size=1)
    with pytest.raises(PassError, match="no FSDP all_gather/reduce_scatter"):
        transformer_block_bucketing(gm, PassContext(extras={"bucket_plan": PLAN}))
    with pytest.raises(PassError, match="bucket_plan"):
        transformer_block_bucketing(gm, PassContext())
    assert TBB in PASS_REGISTRY


def _grads_worker(argv: list[str]) -> None:
    """Under torchrun: one batch through the traced step with and without the pass, compared bitwise."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from graph_trainer.build import pass_context
    from graph_trainer.compiler.chain import transform_graph
    from graph_trainer.compiler.tracer import trace_train_step
    from graph_trainer.trainer import Trainer

    cfg = load_config(argv)
    trainer = Trainer(cfg)
    tokens, labels = next(iter(trainer.dataloader))
    params, buffers = list(trainer.model.parameters()), list(trainer.model.buffers())
    context = pass_context(cfg, trainer.layout, trainer.model)
    results = []
    for passes in ([], [TBB]):
        traced = trace_train_step(trainer.model, tokens, labels, grad_scale=trainer.grad_scale)
        traced.gm = transform_graph(traced.gm, context, passes)
        results.append(traced(params, buffers, tokens, labels))

    def bits(t: torch.Tensor) -> torch.Tensor:
        t = t.to_local() if isinstance(t, DTensor) else t
        return t.detach().contiguous().view(-1).view(torch.uint8)

    (loss_a, grads_a), (loss_b, grads_b) = results
    same = (
        torch.equal(bits(loss_a), bits(loss_b))
        and len(grads_a) == len(grads_b) == len(params)
        and all(torch.equal(bits(a), bits(b)) for a, b in zip(grads_a, grads_b, strict=True))
    )
    with open(os.path.join(cfg.job.dump_folder, f"bitwise_rank{dist.get_rank()}.txt"), "w") as f:
        f.write(f"{len(params)} gradients and the loss: {'same' if same else 'DIFFER'}")
    _leave(dist)


def _mixed_dtypes_worker(folder: str) -> None:
    """Under torchrun: fp32, bf16 and fp16 gathers of odd shapes merged into one (a byte bucket)."""
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    from graph_trainer.compiler.passes.bucket_merge import merge_all_gathers
    from graph_trainer.compiler.passes.transformer_block_bucketing import stable_topological_sort
    from graph_trainer.torch_compat import cpu_backend

    dist.init_process_group(cpu_backend())  # the trainer's CPU backend
    rank, world, group = dist.get_rank(), dist.get_world_size(), dist.group.WORLD.group_name
    c10d = torch.ops._c10d_functional

    def gather_each(*shards):
        return [c10d.wait_tensor(c10d.all_gather_into_tensor(x, world, group)) * 1 for x in shards]

    torch.manual_seed(rank)
    shards = [torch.randn(3, 5), torch.randn(7).to(torch.bfloat16), torch.randn(2, 3).to(torch.float16)]
    mode = FakeTensorMode()
    with mode:
        gm = make_fx(gather_each)(*[mode.from_tensor(t) for t in shards])
    gathers = [n for n in gm.graph.nodes if n.target is c10d.all_gather_into_tensor.default]
    for n in gathers:
        tags.replace(n, {"phase": "forward", "fsdp_role": "unshard", "fsdp_param": n.name, "module_fqn": "m"})
    expected = gm(*shards)
    merged = merge_all_gathers(gm.graph, gathers, 0, "m")
    stable_topological_sort(gm.graph)
    gm.graph.lint()
    gm.recompile()
    got = gm(*shards)
    one = [n for n in gm.graph.nodes if n.target is c10d.all_gather_into_tensor.default] == [merged.collective]
    same = one and all(
        a.dtype == b.dtype and torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8))
        for a, b in zip(expected, got, strict=True)
    )
    with open(os.path.join(folder, f"bitwise_rank{rank}.txt"), "w") as f:
        f.write(f"one all_gather of 3 dtypes: {'same' if same else 'DIFFER'}")
    _leave(dist)


def _leave(dist) -> None:
    """Leave together and skip interpreter teardown with gloo threads alive (as train.py does)."""
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    if sys.argv[1] == "--mixed-dtypes":
        _mixed_dtypes_worker(sys.argv[2])
    else:
        _grads_worker(sys.argv[1:])


def test_padded_buckets_sum_like_their_members_on_four_gloo_ranks():
    """gloo reduce-scatters by a ring all-reduce whose chunks need not start at a rank's row: the
    padding from ``ring_aligned_row`` makes every member bitwise its own reduce-scatter. This
    fails loudly if gloo's segmentation changes (padding no longer enough, or no longer needed)."""
    result = run_forked(4, os.path.join(ROOT, "tests", "compiler", "passes", "gloo_bucket_probe.py"))
    lines = [line for line in result.stdout.splitlines() if "pad=" in line]
    assert len(lines) == 3 and all("padded=True" in line for line in lines), lines
    assert "pad=3 unpadded=False padded=True" in lines[-1], lines[-1]  # [2**20, 6]: the case padding fixes
