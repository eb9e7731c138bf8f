"""Simulator semantics on hand-built graphs, the Chrome trace, and one traced job end to end."""

import json

import pytest
import torch
import torch.fx as fx

from graph_trainer.analysis.cost_model import collective_time, node_compute_time
from graph_trainer.analysis.devices import H100_SXM
from graph_trainer.analysis.simulator import format_table, simulate
from suites import CPU_BLOCKS

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
D = H100_SXM


class _Builder:
    """A tiny graph: one bf16 activation, big matmuls, all_gathers of 64 MiB and their waits."""

    def __init__(self):
        self.g = fx.Graph()
        self.x = self._ph("x", torch.empty(8192, 8192, dtype=torch.bfloat16, device="meta"))
        self.shard = self._ph("shard", torch.empty(1 << 22, dtype=torch.bfloat16, device="meta"))
        self.last = self.x

    def _ph(self, name, val):
        n = self.g.placeholder(name)
        n.meta["val"] = val
        return n

    def _call(self, target, args, val):
        n = self.g.call_function(target, args)
        n.meta["val"] = val
        return n

    def mm(self):
        self.last = self._call(aten.mm.default, (self.last, self.x), self.x.meta["val"])
        return self.last

    def all_gather(self, group="g1"):
        return self._call(
            c10d.all_gather_into_tensor.default,
            (self.shard, 8, group),
            torch.empty(8 << 22, dtype=torch.bfloat16, device="meta"),
        )

    def wait(self, coll):
        return self._call(c10d.wait_tensor.default, (coll,), coll.meta["val"])

    def done(self, *extra):
        self.g.output((self.last, *extra))
        return self.g


def test_collective_hidden_behind_enough_compute():
    b = _Builder()
    ag = b.all_gather()
    mm = b.mm()  # ~1.6 ms of matmul vs ~0.17 ms of all_gather
    w = b.wait(ag)
    r = simulate(b.done(w), D)
    assert node_compute_time(mm, D) > collective_time(ag, D, 8)
    assert r.exposed_comm_time == 0.0 and r.collectives[0].exposed == 0.0
    assert r.step_time == pytest.approx(r.compute_time)
    assert r.comm_time == pytest.approx(collective_time(ag, D, 8))


def test_compute_split_by_kernel_class():
    b = _Builder()
    mm = b.mm()
    cast = b._call(aten._to_copy.default, (mm,), torch.empty(8192, 8192, dtype=torch.float32, device="meta"))
    r = simulate(b.done(cast), D)
    assert r.compute_by_class == pytest.approx(
        {"matmul": node_compute_time(mm, D), "dtype_cast": node_compute_time(cast, D)}
    )
    assert sum(r.compute_by_class.values()) == pytest.approx(r.compute_time)


def test_collective_waited_immediately_is_fully_exposed():
    b = _Builder()
    ag = b.all_gather()
    w = b.wait(ag)
    b.mm()
    r = simulate(b.done(w), D)
    (rec,) = r.collectives
    assert rec.exposed == pytest.approx(rec.duration) and rec.start == 0.0
    assert r.exposed_comm_time == pytest.approx(r.comm_time)
    assert r.step_time == pytest.approx(r.compute_time + r.comm_time)


def test_same_group_serializes_different_groups_overlap():
    b = _Builder()
    a1, a2, a3 = b.all_gather("g1"), b.all_gather("g1"), b.all_gather("g2")
    waits = [b.wait(a) for a in (a1, a2, a3)]
    r = simulate(b.done(*waits), D)
    r1, r2, r3 = r.collectives
    assert r2.start == pytest.approx(r1.end)  # queued behind a1 on g1's stream
    assert r3.start == 0.0 and r3.end == pytest.approx(r1.end)  # g2 runs alongside
    assert r.exposed_comm_time == pytest.approx(r2.end)
    assert r.step_time == pytest.approx(r2.end + r.compute_time)


def test_a_wait_behind_an_earlier_collective_of_its_group_exposes_that_one():
    b = _Builder()
    ag = b.all_gather("g1")
    ar = b._call(c10d.all_reduce.default, (b.shard, "max", "g1"), b.shard.meta["val"])
    w_ar = b.wait(ar)  # waited at once: the stream runs the gather first
    mm = b.mm()
    w_ag = b.wait(ag)
    r = simulate(b.done(w_ar, w_ag), D)
    gather, reduce = r.collectives
    assert reduce.start == pytest.approx(gather.end)
    assert gather.exposed == pytest.approx(gather.duration) and reduce.exposed == pytest.approx(reduce.duration)
    assert r.exposed_comm_time == pytest.approx(gather.duration + reduce.duration)
    assert r.step_time == pytest.approx(reduce.end + node_compute_time(mm, D))


def test_partial_overlap_and_group_size_override():
    b = _Builder()
    ar = b._call(c10d.all_reduce.default, (b.x, "sum", "tp"), b.x.meta["val"])
    mm = b.mm()
    w = b.wait(ar)
    r = simulate(b.done(w), D, group_sizes={"tp": 16}, ranks_per_node=1)  # one rank per node
    rec = r.collectives[0]
    assert rec.group_size == 16
    assert rec.duration > node_compute_time(mm, D)  # 128 MiB all_reduce over one NIC outlasts one matmul
    assert rec.exposed == pytest.approx(rec.duration - node_compute_time(mm, D))


def test_sent_bytes_split_by_link_and_kind():
    b = _Builder()
    ag = b.all_gather("g1")  # group size 8 from the op: one node of 8
    ar = b._call(c10d.all_reduce.default, (b.x, "sum", "dp"), b.x.meta["val"])
    waits = [b.wait(ag), b.wait(ar)]
    graph = b.done(*waits)
    r = simulate(graph, D, group_sizes={"dp": 16})  # 16 ranks cannot fit in one node of 8
    ag_sent, ar_sent = 7 / 8 * (8 << 23), 2 * 15 / 16 * (8192 * 8192 * 2)
    assert [(c.bytes_sent, c.inter_node) for c in r.collectives] == [
        pytest.approx((ag_sent, False)),
        pytest.approx((ar_sent, True)),
    ]
    kinds = r.by_kind()
    assert (kinds["all_gather"]["sent_intra_node"], kinds["all_gather"]["sent_inter_node"]) == (
        pytest.approx(ag_sent),
        0.0,
    )
    # Two nodes of 8: a ring per NIC, 1/8 of each rank's bytes over its NIC, the rest over NVLink.
    assert (kinds["all_reduce"]["sent_intra_node"], kinds["all_reduce"]["sent_inter_node"]) == (
        pytest.approx(ar_sent * 7 / 8),
        pytest.approx(ar_sent / 8),
    )
    assert r.sent_bytes(inter_node=False) == pytest.approx(ag_sent + ar_sent * 7 / 8)
    assert r.sent_bytes(inter_node=True) == pytest.approx(ar_sent / 8)
    # Nodes of 4: the 8-rank group spans two of them, so a quarter of its bytes cross nodes too.
    r4 = simulate(graph, D, ranks_per_node=4, group_sizes={"dp": 16})
    assert r4.sent_bytes(inter_node=False) == pytest.approx((ag_sent + ar_sent) * 3 / 4)
    assert r4.sent_bytes(inter_node=True) == pytest.approx((ag_sent + ar_sent) / 4)
    assert r4.comm_time > r.comm_time  # the all_gather's bytes now go over the slower NIC


def test_sent_bytes_of_live_groups_follow_their_ranks():
    from graph_trainer.config_loading import load_config
    from graph_trainer.fake_trace import fake_world, trace_job
    from graph_trainer.validation import validate_config

    cfg = load_config(["--job.config_file", "configs/llama3_debug.toml", "--parallelism.dp_replicate", "2"])
    validate_config(cfg, 4)
    with fake_world(4):  # HSDP 2 x 2: shard groups of adjacent ranks, replicas 2 apart
        graph = trace_job(cfg, 4, gpu_attention=D.fused_attention).gm.graph
        inside = simulate(graph, D, ranks_per_node=4)  # one node
        across = simulate(graph, D, ranks_per_node=2)  # shard groups per node, replicas across
    total = inside.sent_bytes(inter_node=False)
    assert total > 0 and inside.sent_bytes(inter_node=True) == 0.0
    assert across.sent_bytes(inter_node=False) + across.sent_bytes(inter_node=True) == pytest.approx(total)
    kinds = across.by_kind()
    assert kinds["all_reduce"]["sent_intra_node"] == 0.0 and kinds["all_reduce"]["sent_inter_node"] > 0
    assert kinds["all_gather"]["sent_inter_node"] == 0.0 and kinds["all_gather"]["sent_intra_node"] > 0


def test_chrome_trace_has_compute_and_group_tracks(tmp_path):
    b = _Builder()
    a1, a2 = b.all_gather("g1"), b.all_gather("g2")
    b.mm()
    w1, w2 = b.wait(a1), b.wait(a2)
    r = simulate(b.done(w1, w2), D)
    path = tmp_path / "trace.json"
    r.to_chrome_trace(str(path))
    events = json.loads(path.read_text())["traceEvents"]
    names = {e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert names == {"compute", "group g1 (size 8)", "group g2 (size 8)"}
    spans = [e for e in events if e["ph"] == "X"]
    assert {e["tid"] for e in spans} == {0, 1, 2}
    assert all(e["dur"] >= 0 and "ts" in e for e in spans)


def test_format_table():
    text = format_table(
        [{"passes": "none", "step ms": 1.23456, "AG": 3}, {"passes": "auto_bucketing", "step ms": 10.0, "AG": 12}]
    )
    lines = text.splitlines()
    assert len(lines) == 4 and lines[0].split() == ["passes", "step", "ms", "AG"]
    assert len({len(line) for line in lines}) == 1
    assert "1.235" in lines[2]


def test_debug_llama3_world_size_4_end_to_end(tmp_path):
    from graph_trainer.cli.analyze import analyze_job
    from graph_trainer.config_loading import load_config
    from graph_trainer.validation import validate_config

    cfg = load_config(["--job.config_file", "configs/llama3_debug.toml"])
    validate_config(cfg, 4)
    traced, r, _, _ = analyze_job(cfg, 4, D)
    assert r.step_time > 0 and r.compute_time > 0 and r.comm_time > 0
    assert r.exposed_comm_time <= r.comm_time + 1e-12
    assert r.step_time == pytest.approx(r.compute_time + r.exposed_comm_time)
    kinds = r.by_kind()
    assert set(kinds) == {"all_gather", "reduce_scatter"}
    assert all(c.group_size == 4 for c in r.collectives)
    assert r.memory is not None and r.peak_memory_bytes > 0
    # The trace of a real step accounts for the whole step: compute and exposed waits on track 0
    # add up to the step time, one span per collective on the group tracks.
    r.to_chrome_trace(str(tmp_path / "t.json"))
    spans = [e for e in json.loads((tmp_path / "t.json").read_text())["traceEvents"] if e["ph"] == "X"]
    compute = sum(e["dur"] for e in spans if e["cat"] == "compute")
    waits = sum(e["dur"] for e in spans if e["cat"] == "exposed_comm")
    assert compute == pytest.approx(r.compute_time * 1e6) and waits == pytest.approx(r.exposed_comm_time * 1e6)
    comm = [e for e in spans if e["tid"] != 0]
    assert len(comm) == len(r.collectives) and sum(e["dur"] for e in comm) == pytest.approx(r.comm_time * 1e6)


def test_analyze_cli_compare(capsys, tmp_path):
    from graph_trainer.cli.analyze import main
    from models.llama3.flavors import FLAVORS, flops_per_token

    flags = ["--world_size", "2", "--job.config_file", "configs/llama3_debug.toml", "--training.local_batch_size", "2"]
    rc = main([*flags, "--compare", "none;", "--json", str(tmp_path / "out" / "analyze.json")])
    out = capsys.readouterr().out
    assert rc == 0
    assert out.count("\nnone ") >= 2 and "exposed %" in out and "reduce_scatter" in out
    assert out.count("bytes/rank (none): over NVLink ") == 2 and "GB, over InfiniBand 0 GB (by kind" in out
    # --json: the printed rows, unrounded, under the printed column names
    tables = json.loads((tmp_path / "out" / "analyze.json").read_text())
    assert tables["job"] == out.splitlines()[0] and tables["stages"] == []
    assert [r["passes"] for r in tables["summary"]] == ["none", "none"]
    for row in tables["summary"]:  # one microbatch: its graph, then the optimizer step
        assert 0 < row["optim ms"] < row["step ms"] and row["step ms"] - row["optim ms"] >= row["compute ms"]
        # two data-parallel ranks of 2 x 128 tokens (the debug config's seq_len) in the step, on two GPUs
        assert row["tokens/s/GPU"] == pytest.approx(2 * 2 * 128 / (row["step ms"] / 1e3) / 2)
        flops = flops_per_token(FLAVORS["debugmodel"], 128)
        assert row["TFLOP/s/GPU"] == pytest.approx(row["tokens/s/GPU"] * flops / 1e12)
    assert format_table(tables["summary"]) in out and format_table(tables["kinds"]) in out
    assert {r["kind"] for r in tables["kinds"]} >= {"all_gather", "reduce_scatter"}
    assert main(["--world_size", "2", "--compare", "no_such_pass"]) == 2
    capsys.readouterr()
    assert main([*flags, "--json", str(tmp_path)]) == 2  # a folder: refused before tracing
    err = capsys.readouterr().err
    assert err.startswith(f"error: --json {str(tmp_path)!r} is a folder") and err.count("\n") == 1


def test_analyze_cli_ranks_per_node(capsys):
    from graph_trainer.cli.analyze import main

    flags = ["--world_size", "2", "--job.config_file", "configs/llama3_debug.toml", "--training.local_batch_size", "2"]
    assert main([*flags, "--ranks_per_node", "1"]) == 0
    (line,) = [x for x in capsys.readouterr().out.splitlines() if x.startswith("bytes/rank")]
    assert line.startswith("bytes/rank (none): over NVLink 0 GB, over InfiniBand ")
    assert "all_gather 0 + " in line and "reduce_scatter 0 + " in line
    for bad in ("0", "-8", "eight"):
        assert main([*flags, "--ranks_per_node", bad]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: --ranks_per_node") and err.count("\n") == 1


def test_analyze_cli_compares_pipeline_schedules(capsys, tmp_path):
    from graph_trainer.cli.analyze import main

    flags = ["--world_size", "4", "--job.config_file", "configs/llama3_debug.toml", "--parallelism.pp", "2"]
    flags += ["--training.local_batch_size", "2", "--training.global_batch_size", "16"]
    assert main([*flags, "--pp_schedules", "1F1B,GPipe,ZBVZeroBubble", "--json", str(tmp_path / "a.json")]) == 0
    lines = capsys.readouterr().out.splitlines()
    # summary rows (not the stage rows): columns passes, schedule, stages, microbatches, step ms,
    # optim ms, bubble %, tokens/s/GPU, TFLOP/s/GPU, peak GiB, ...
    rows = {r.split()[1]: r.split() for r in lines if r.startswith("none ") and len(r.split()) == 18}
    assert set(rows) == {"1F1B", "GPipe", "ZBVZeroBubble"}
    bubble = {s: float(r[6]) for s, r in rows.items()}
    assert all(0 < b < 100 for b in bubble.values())
    assert all(0 < float(r[5]) < float(r[4]) for r in rows.values())  # the optimizer step, in the step
    # GPipe holds every microbatch in flight, 1F1B at most pp of them
    peak = {s: float(r[9]) for s, r in rows.items()}
    assert peak["GPipe"] > peak["1F1B"]
    assert sum(x.startswith("memory of pipeline rank ") for x in lines) == 2 * 3
    # --json: the same rows with the printed columns; a stage row per stage and schedule
    tables = json.loads((tmp_path / "a.json").read_text())
    assert format_table(tables["stages"]) in "\n".join(lines)
    summary = {r["schedule"]: r for r in tables["summary"]}
    assert set(summary) == set(rows) and tables["kinds"] == []
    for schedule, row in summary.items():
        assert f"{row['bubble %']:.4g}" == rows[schedule][6] and f"{row['peak GiB']:.4g}" == rows[schedule][9]
    assert [(r["schedule"], r["stage"]) for r in tables["stages"]] == [
        (s, k) for s in ("1F1B", "GPipe", "ZBVZeroBubble") for k in range(4 if s == "ZBVZeroBubble" else 2)
    ]
    assert main([*flags[:-2], "--pp_schedules", "1F1B", "--parallelism.pp", "1"]) == 2
    assert "--pp_schedules compares pipeline schedules" in capsys.readouterr().err


@pytest.mark.parametrize("layout", ["fsdp2", "ddp2"])
def test_gradient_accumulation_costs_of_reducing_every_microbatch_or_once(layout, capsys):
    """What ``analyze`` reports for gradient accumulation: reducing every microbatch (the trainer)
    keeps the reduced gradients as the buffer, reducing once would keep the unreduced ones."""
    from graph_trainer.cli.analyze import analyze_job, gradient_reduction_costs, main
    from graph_trainer.config_loading import load_config
    from graph_trainer.validation import validate_config
    from models.registry import MODEL_SPECS, model_args

    flags = ["--job.config_file", "configs/llama3_debug.toml", "--training.local_batch_size", "2", *CPU_BLOCKS]
    flags += ["--training.global_batch_size", "8"]  # 2 microbatches on 2 ranks
    if layout == "ddp2":
        flags += ["--parallelism.dp_replicate", "2", "--parallelism.dp_shard", "1"]
    cfg = load_config(flags)
    validate_config(cfg, 2)
    traced, result, _, _ = analyze_job(cfg, 2, D)
    sent, reduced, unreduced = gradient_reduction_costs(traced.gm.graph, result)
    with torch.device("meta"):
        full = 4 * sum(p.numel() for p in MODEL_SPECS["llama3"].build(model_args(cfg)).parameters())
    assert unreduced == full  # the whole fp32 gradient, whatever the layout
    if layout == "fsdp2":  # a ring reduce-scatter over 2 ranks sends half its input, keeps half
        assert reduced == full // 2 and sent == full // 2
    else:  # a ring all-reduce over 2 ranks sends its input once, keeps all of it
        assert reduced == full and sent == full

    assert main(["--world_size", "2", *flags]) == 0
    out = capsys.readouterr().out
    assert "per-rank batch 2x128 x 2 microbatches" in out
    (line,) = [x for x in out.splitlines() if x.startswith("gradient accumulation (none): 2 microbatches")]
    assert f"reduced every microbatch: {2 * sent / 1e9:.3g} GB sent/rank" in line
    assert f"reduced once: {sent / 1e9:.3g} GB sent/rank" in line
    assert f"simulated step 2 x {result.step_time * 1e3:.1f} + optimizer " in line
    assert "accumulated grads" in next(x for x in out.splitlines() if x.startswith("memory per rank (none)"))


def test_unbacked_all_to_all_graph_simulates():
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    import torch.fx.experimental.symbolic_shapes  # noqa: F401
    from torch.fx.experimental.proxy_tensor import make_fx

    from graph_trainer.fake_trace import fake_world

    with fake_world(2):
        group = dist.group.WORLD

        def step(x, counts):
            received = funcol.all_to_all_single(counts, None, None, group)
            send, recv = counts.tolist(), received.tolist()
            y = funcol.all_to_all_single(x, recv, send, group)
            return funcol.all_to_all_single(torch.mm(y, torch.ones(4, 4)), send, recv, group)

        gm = make_fx(step, tracing_mode="fake")(torch.randn(8, 4), torch.tensor([3, 5]))
        r = simulate(gm.graph, D)
    assert [c.kind for c in r.collectives] == ["all_to_all"] * 3
    assert [c.bytes for c in r.collectives] == [16, 128, 128]  # balanced routing: 8 rows each way
    assert r.step_time > 0 and r.exposed_comm_time == pytest.approx(r.comm_time)
