"""Cost formulas of graph_trainer.analysis.cost_model on tiny hand-built FX graphs."""

import pytest
import torch
import torch.fx as fx

from graph_trainer.analysis.cost_model import (
    CollectiveTraffic,
    GroupInfo,
    collective_time,
    collective_traffic,
    group_info,
    node_compute_time,
    node_flops,
    ring_factor,
)
from graph_trainer.analysis.devices import H100_SXM
from graph_trainer.graph.collectives import collective_bytes
from graph_trainer.graph.sizes import SizeHints

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
D = H100_SXM
K = D.kernel_efficiency  # calibrated per kernel class (devices.H100_KERNELS)
LAUNCH = D.launch_overhead
US = 1e-6


def _meta(*shape, dtype=torch.bfloat16):
    return torch.empty(*shape, dtype=dtype, device="meta")


def _node(graph, target, args, val):
    node = graph.call_function(target, args)
    node.meta["val"] = val
    return node


def _placeholder(graph, name, val):
    node = graph.placeholder(name)
    node.meta["val"] = val
    return node


def _mm_graph(m, k, n, dtype):
    g = fx.Graph()
    a = _placeholder(g, "a", _meta(m, k, dtype=dtype))
    b = _placeholder(g, "b", _meta(k, n, dtype=dtype))
    mm = _node(g, aten.mm.default, (a, b), _meta(m, n, dtype=dtype))
    g.output(mm)
    return g, mm


def test_mm_flops_and_dtype_aware_peak():
    m, k, n = 4096, 8192, 2048
    g, mm = _mm_graph(m, k, n, torch.bfloat16)
    flops, dtype = node_flops(mm)
    assert flops == 2 * m * k * n and dtype == torch.bfloat16
    expected = 2 * m * k * n / (989e12 * K.matmul) + LAUNCH
    assert node_compute_time(mm, D) == pytest.approx(expected)
    _, mm32 = _mm_graph(m, k, n, torch.float32)
    assert node_compute_time(mm32, D) == pytest.approx(2 * m * k * n / (67e12 * K.matmul) + LAUNCH)


def test_small_mm_is_memory_bound_and_addmm_bmm_count():
    g, mm = _mm_graph(8, 8192, 8192, torch.bfloat16)  # reads a 128 MiB weight for 1 GFLOP
    bytes_ = (8 * 8192 + 8192 * 8192 + 8 * 8192) * 2
    # The byte side of a matmul uses the elementwise (streaming) efficiency.
    assert node_compute_time(mm, D) == pytest.approx(bytes_ / (3.35e12 * K.elementwise) + LAUNCH)
    g = fx.Graph()
    bias, a, b = (_placeholder(g, n, v) for n, v in (("bias", _meta(32)), ("a", _meta(16, 64)), ("b", _meta(64, 32))))
    addmm = _node(g, aten.addmm.default, (bias, a, b), _meta(16, 32))
    x, y = _placeholder(g, "x", _meta(4, 16, 64)), _placeholder(g, "y", _meta(4, 64, 32))
    bmm = _node(g, aten.bmm.default, (x, y), _meta(4, 16, 32))
    assert node_flops(addmm)[0] == 2 * 16 * 64 * 32
    assert node_flops(bmm)[0] == 2 * 4 * 16 * 64 * 32


def test_elementwise_is_bytes_over_bandwidth_and_views_are_free():
    g = fx.Graph()
    x = _placeholder(g, "x", _meta(1 << 20, dtype=torch.float32))
    y = _placeholder(g, "y", _meta(1 << 20, dtype=torch.float32))
    add = _node(g, aten.add.Tensor, (x, y), _meta(1 << 20, dtype=torch.float32))
    view = _node(g, aten.view.default, (add, [1024, 1024]), _meta(1024, 1024, dtype=torch.float32))
    g.output(view)
    assert node_compute_time(add, D) == pytest.approx(3 * 4 * (1 << 20) / (3.35e12 * K.elementwise) + LAUNCH)
    assert node_compute_time(view, D) == 0.0
    assert node_compute_time(x, D) == 0.0
    assert node_compute_time(list(g.nodes)[-1], D) == 0.0  # output


def test_attention_flops_causal_and_backward():
    b, h, s, d = 2, 8, 1024, 64
    g = fx.Graph()
    q, k, v = (_placeholder(g, n, _meta(b, h, s, d)) for n in "qkv")
    fwd = aten._scaled_dot_product_flash_attention_for_cpu.default
    full = _node(g, fwd, (q, k, v, 0.0, False), (_meta(b, h, s, d), _meta(b, h, s, dtype=torch.float32)))
    causal = _node(g, fwd, (q, k, v, 0.0, True), (_meta(b, h, s, d), _meta(b, h, s, dtype=torch.float32)))
    grad, out = _placeholder(g, "grad", _meta(b, h, s, d)), _placeholder(g, "out", _meta(b, h, s, d))
    lse = _placeholder(g, "lse", _meta(b, h, s, dtype=torch.float32))
    bwd = _node(
        g,
        aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
        (grad, q, k, v, out, lse, 0.0, True),
        (_meta(b, h, s, d),) * 3,
    )
    assert node_flops(full)[0] == 4 * b * h * s * s * d
    assert node_flops(causal)[0] == 2 * b * h * s * s * d
    assert node_flops(bwd)[0] == 2.5 * 2 * b * h * s * s * d


def test_grouped_mm_flops():
    g = fx.Graph()
    x = _placeholder(g, "x", _meta(96, 64))
    w = _placeholder(g, "w", _meta(4, 64, 32))
    offs = _placeholder(g, "offs", torch.empty(4, dtype=torch.int32, device="meta"))
    out = _node(g, aten._grouped_mm.default, (x, w, offs), _meta(96, 32))
    assert node_flops(out)[0] == 2 * 96 * 64 * 32
    dy = _placeholder(g, "dy", _meta(32, 96))  # weight grad: (N, T) x (T, K) -> (G, N, K)
    dw = _node(g, aten._grouped_mm.default, (dy, x, offs), _meta(4, 32, 64))
    assert node_flops(dw)[0] == 2 * 32 * 96 * 64


def _collective_graph(kind, nbytes, group="g"):
    g = fx.Graph()
    n = nbytes // 2
    if kind == "all_gather":
        x = _placeholder(g, "x", _meta(n // 8))
        node = _node(g, c10d.all_gather_into_tensor.default, (x, 8, group), _meta(n))
    elif kind == "reduce_scatter":
        x = _placeholder(g, "x", _meta(n))
        node = _node(g, c10d.reduce_scatter_tensor.default, (x, "sum", 8, group), _meta(n // 8))
    elif kind == "all_to_all":
        x = _placeholder(g, "x", _meta(n))
        node = _node(g, c10d.all_to_all_single.default, (x, [n // 8] * 8, [n // 8] * 8, group), _meta(n))
    else:
        x = _placeholder(g, "x", _meta(n))
        node = _node(g, c10d.all_reduce.default, (x, "sum", group), _meta(n))
    g.output(_node(g, c10d.wait_tensor.default, (node,), node.meta["val"]))
    return node


def test_collective_time_ring_model():
    mb = 1 << 26
    ag = _collective_graph("all_gather", mb)
    assert collective_bytes(ag) == mb
    nvlink = 450e9 * 0.8
    assert collective_time(ag, D, 8) == pytest.approx(15 * US + 7 / 8 * mb / nvlink)
    assert collective_time(ag, D) == collective_time(ag, D, 8)  # group size from the op's args
    # Bytes scale linearly; group size through (n-1)/n.
    big = _collective_graph("all_gather", 4 * mb)
    assert collective_time(big, D, 8) - 15 * US == pytest.approx(4 * (collective_time(ag, D, 8) - 15 * US))
    assert collective_time(ag, D, 2) - 15 * US == pytest.approx(
        (1 / 2) / (7 / 8) * (collective_time(ag, D, 8) - 15 * US)
    )
    rs = _collective_graph("reduce_scatter", mb)
    assert collective_time(rs, D, 8) == pytest.approx(collective_time(ag, D, 8))
    ar = _collective_graph("all_reduce", mb)
    assert collective_time(ar, D, 8) - 15 * US == pytest.approx(2 * (collective_time(rs, D, 8) - 15 * US))


def test_nvlink_vs_infiniband():
    ar = _collective_graph("all_reduce", 1 << 26)
    inside = collective_time(ar, D, 8) - 15 * US
    # 16 ranks on two nodes of 8: 1/8 of each rank's bytes over its own NIC, 7/8 over NVLink.
    across = collective_time(ar, D, 16) - 15 * US
    assert across / inside == pytest.approx((15 / 16) / (7 / 8) * (1 / 8) * 450 / 50)
    assert collective_time(ar, D, 8, ranks_per_node=4) > collective_time(ar, D, 8)
    with pytest.raises(ValueError):  # all_reduce carries no group size and no PG is live
        collective_time(ar, D)


def test_ring_factor_per_kind():
    assert ring_factor("all_gather", 8) == ring_factor("reduce_scatter", 8) == pytest.approx(7 / 8)
    assert ring_factor("all_to_all", 8) == pytest.approx(7 / 8)
    assert ring_factor("all_reduce", 8) == pytest.approx(2 * 7 / 8)
    assert ring_factor("all_reduce", 2) == pytest.approx(1.0)
    assert ring_factor("broadcast", 4) == 1.0
    assert all(ring_factor(k, 1) == 0.0 for k in ("all_gather", "all_reduce", "all_to_all", "broadcast"))


@pytest.mark.parametrize("kind", ["all_gather", "reduce_scatter", "all_reduce", "all_to_all"])
def test_traffic_is_what_the_time_model_sends(kind):
    mb = 1 << 26
    node = _collective_graph(kind, mb)
    t = collective_traffic(node, 8)
    assert (t.kind, t.group_size, t.inter_node, t.bytes_inter_node) == (kind, 8, False, 0.0)
    assert t.bytes_sent == pytest.approx(ring_factor(kind, 8) * collective_bytes(node))
    assert collective_time(node, D, 8) == pytest.approx(15 * US + t.bytes_sent / (450e9 * 0.8))
    across = collective_traffic(node, 16)  # 16 ranks cannot fit in one node of 8
    ring = ring_factor(kind, 16) * collective_bytes(node)
    assert across.inter_node and across.bytes_sent == pytest.approx(ring)
    assert across.bytes_inter_node + across.bytes_intra_node == pytest.approx(ring)
    nic = 8 / 16 * collective_bytes(node) if kind == "all_to_all" else ring / 8  # 8 peers off the node
    assert across.bytes_inter_node == pytest.approx(nic)
    expected = max(across.bytes_intra_node / (450e9 * 0.8), nic / (50e9 * 0.8))
    assert collective_time(node, D, 16) == pytest.approx(15 * US + expected)


@pytest.mark.parametrize("kind", ["all_gather", "reduce_scatter", "all_reduce"])
def test_spanning_ring_time_scales_with_one_over_the_ranks_per_node(kind):
    # 64 ranks, g of them on each node: the ring's node-crossing bytes spread over g NICs.
    node = _collective_graph(kind, 1 << 28)
    ring = ring_factor(kind, 64) * collective_bytes(node)
    seconds = {}
    for g in (1, 2, 4, 8):
        group = GroupInfo(64, True, g)
        t = collective_traffic(node, group=group)
        assert t.bytes_sent == pytest.approx(ring)
        assert (t.bytes_inter_node, t.bytes_intra_node) == (pytest.approx(ring / g), pytest.approx(ring * (g - 1) / g))
        seconds[g] = collective_time(node, D, group=group) - 15 * US
        # The same from consecutive ranks on nodes of g (group_info's placement without a live group).
        assert collective_time(node, D, 64, ranks_per_node=g) - 15 * US == pytest.approx(seconds[g])
    assert seconds[1] == pytest.approx(ring / (50e9 * 0.8))  # one NIC carries it all
    assert all(seconds[g] * g == pytest.approx(seconds[1]) for g in seconds)  # not constant: 1/g


def test_all_to_all_sends_its_off_node_share_through_its_own_nic():
    node = _collective_graph("all_to_all", 1 << 28)
    buffer = collective_bytes(node)
    for g in (1, 2, 4, 8):
        t = collective_traffic(node, group=GroupInfo(64, True, g))
        assert t.bytes_inter_node == pytest.approx((64 - g) / 64 * buffer)  # not spread over the node's NICs
        assert t.bytes_intra_node == pytest.approx((g - 1) / 64 * buffer)
        assert collective_time(node, D, group=GroupInfo(64, True, g)) == pytest.approx(
            15 * US + t.bytes_inter_node / (50e9 * 0.8)
        )


def test_traffic_rejects_non_collectives_bad_ranks_per_node_and_bad_splits():
    g, mm = _mm_graph(8, 8, 8, torch.bfloat16)
    with pytest.raises(ValueError, match="not a collective"):
        collective_traffic(mm, 8)
    with pytest.raises(ValueError, match="ranks_per_node"):
        group_info(_collective_graph("all_gather", 1024), ranks_per_node=0)
    for bad in (True, -1.0, 2048.0):  # a link flag where bytes belong, or outside [0, bytes_sent]
        with pytest.raises(ValueError, match="bytes_inter_node"):
            CollectiveTraffic("send", 2, 1024.0, bad)


def test_group_info_places_consecutive_ranks_without_a_live_group():
    ag = _collective_graph("all_gather", 1024)
    assert group_info(ag, 8, 8) == GroupInfo(8, False, 8)
    assert group_info(ag, 8, 16) == GroupInfo(16, True, 8)
    assert group_info(ag, 8, 12) == GroupInfo(12, True, 4)  # a full node and one holding 4
    assert group_info(ag, 4, 8) == GroupInfo(8, True, 4)


def test_traffic_of_a_live_group_inside_and_across_nodes():
    from torch.distributed.device_mesh import init_device_mesh

    from graph_trainer.fake_trace import fake_world

    with fake_world(16):
        mesh = init_device_mesh("cpu", (2, 8), mesh_dim_names=("replicate", "shard"))
        shard = _collective_graph("all_reduce", 1 << 20, group=mesh.get_group("shard").group_name)
        inside = collective_traffic(shard)  # ranks 0..7: one node of 8
        assert not inside.inter_node and inside.bytes_sent == pytest.approx(2 * 7 / 8 * (1 << 20))
        split = collective_traffic(shard, ranks_per_node=4)  # the same ranks on two nodes of 4
        assert split.bytes_sent == pytest.approx(inside.bytes_sent)
        assert split.bytes_inter_node == pytest.approx(inside.bytes_sent / 4)  # over the 4 NICs of a node
        replicate = _collective_graph("all_reduce", 1 << 20, group=mesh.get_group("replicate").group_name)
        across = collective_traffic(replicate)  # ranks 0 and 8, one per node: all over the NIC
        assert across.bytes_inter_node == pytest.approx(across.bytes_sent) and across.bytes_intra_node == 0.0


def test_group_info_from_live_fake_groups():
    from torch.distributed.device_mesh import init_device_mesh

    from graph_trainer.fake_trace import fake_world

    with fake_world(16):
        mesh = init_device_mesh("cpu", (2, 8), mesh_dim_names=("replicate", "shard"))
        for dim, rpn, expected in (
            ("replicate", 8, GroupInfo(2, True, 1)),
            ("shard", 8, GroupInfo(8, False, 8)),
            ("shard", 4, GroupInfo(8, True, 4)),
            ("replicate", 16, GroupInfo(2, False, 2)),
        ):
            ar = _collective_graph("all_reduce", 1024, group=mesh.get_group(dim).group_name)
            assert group_info(ar, rpn) == expected, (dim, rpn)
        # A 2-rank group across nodes, one rank per node, is limited by InfiniBand despite its size.
        ar = _collective_graph("all_reduce", 1 << 26, group=mesh.get_group("replicate").group_name)
        assert collective_time(ar, D) == pytest.approx(15 * US + 2 * (1 / 2) * (1 << 26) / (50e9 * 0.8))


@pytest.mark.parametrize("rank", [0, 9])
def test_context_parallel_key_value_gathers_are_placed_on_their_ranks_nodes(rank):
    # TP 8 inside a node, CP 2 across two nodes: a rank's cp group is itself and the rank 8 away, one
    # rank on each node, so every byte of its key/value gathers and their gradients' reduce-scatters
    # leaves through its own NIC
    import torch.distributed as dist

    from graph_trainer.config_loading import load_config
    from graph_trainer.fake_trace import fake_world, trace_job
    from graph_trainer.graph import tags
    from graph_trainer.graph.collectives import group_name, is_collective, kind
    from graph_trainer.torch_compat import resolve_process_group

    flags = ["--training.local_batch_size", "1", "--training.seq_len", "64", "--model.n_layers", "1"]
    cfg = load_config([*flags, "--parallelism.tp", "8", "--parallelism.cp", "2"])
    with fake_world(16, rank):
        graph = trace_job(cfg, 16, gpu_attention=True).gm.graph
        cp_group = [rank % 8, rank % 8 + 8]
        on_cp = [
            n
            for n in graph.nodes
            if is_collective(n) and dist.get_process_group_ranks(resolve_process_group(group_name(n))) == cp_group
        ]
        # one block: its keys and values gathered, their gradients reduce-scattered (and SimpleFSDP's,
        # over dp_shard x cp: the same two ranks here)
        attention = [(kind(n), tags.get(n, "cp_role")) for n in on_cp if not tags.get(n, "fsdp_role")]
        assert sorted(attention, key=str) == [("all_gather", "kv_gather")] * 2 + [("reduce_scatter", None)] * 2
        for node in on_cp:
            assert group_info(node) == GroupInfo(2, True, 1)
            traffic = collective_traffic(node)
            assert traffic.bytes_sent > 0 and traffic.bytes_inter_node == pytest.approx(traffic.bytes_sent)


def test_unbacked_all_to_all_sizes_assume_balanced_routing():
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
            z = torch.mm(y, torch.ones(4, 4))
            return funcol.all_to_all_single(z, send, recv, group)

        gm = make_fx(step, tracing_mode="fake")(torch.randn(8, 4), torch.tensor([3, 5]))
        hints = SizeHints.from_graph(gm.graph)
        a2a = [n for n in gm.graph.nodes if n.target == c10d.all_to_all_single.default]
        assert [collective_bytes(n, hints) for n in a2a] == [2 * 8, 8 * 4 * 4, 8 * 4 * 4]
        mm = next(n for n in gm.graph.nodes if n.target == aten.mm.default)
        assert node_flops(mm, hints)[0] == 2 * 8 * 4 * 4
        assert collective_time(a2a[1], D, hints=hints) == pytest.approx(15 * US + 0.5 * 128 / (450e9 * 0.8))


def test_embedding_reads_only_its_rows_and_coalesced_bytes():
    from graph_trainer.analysis.cost_model import node_bytes

    g = fx.Graph()
    table = _placeholder(g, "table", _meta(128256, 4096))
    ids = _placeholder(g, "ids", torch.empty(1, 8192, dtype=torch.long, device="meta"))
    emb = _node(g, aten.embedding.default, (table, ids), _meta(1, 8192, 4096))
    assert node_bytes(emb) == 2 * 8192 * 4096 * 2 + 8192 * 8
    a, b = _placeholder(g, "a", _meta(1024)), _placeholder(g, "b", _meta(2048))
    rs = _node(g, c10d.reduce_scatter_tensor_coalesced.default, ([a, b], "sum", 8, "g"), [_meta(128), _meta(256)])
    assert collective_bytes(rs) == (1024 + 2048) * 2
    assert collective_time(rs, D) == pytest.approx(15 * US + 7 / 8 * 6144 / (450e9 * 0.8))


def _class_graph():
    """One node of each kernel class, with the shapes the calibration profiles had."""
    f32, i64 = torch.float32, torch.long
    g = fx.Graph()
    x = _placeholder(g, "x", _meta(8192, 4096))
    y = _placeholder(g, "y", _meta(8192, 4096))
    w = _placeholder(g, "w", _meta(4096, 4096))
    row = _placeholder(g, "row", _meta(8192, 1))
    logits = _placeholder(g, "logits", _meta(8192, 1024, dtype=f32))
    idx = _placeholder(g, "idx", torch.empty(8192, dtype=i64, device="meta"))
    nodes = {
        "matmul": _node(g, aten.mm.default, (x, w), _meta(8192, 4096)),
        "elementwise": _node(g, aten.add.Tensor, (x, y), _meta(8192, 4096)),
        "strided": _node(g, aten.mul.Tensor, (x, row), _meta(8192, 4096)),
        "dtype_cast": _node(g, aten._to_copy.default, (x,), _meta(8192, 4096, dtype=f32)),
        "reduction": _node(g, aten.sum.dim_IntList, (x, [0]), _meta(4096)),
        "softmax_forward": _node(g, aten._log_softmax.default, (logits, 1, False), _meta(8192, 1024, dtype=f32)),
        "scatter_add": _node(g, aten.index_add.default, (x, 0, idx, y), _meta(8192, 4096)),
    }
    nodes["concat"] = _node(g, aten.cat.default, ([x, y], 1), _meta(8192, 8192))
    return g, nodes


def test_kernel_classes_pick_their_calibrated_efficiency():
    from graph_trainer.analysis.cost_model import kernel_class, node_bytes

    _, nodes = _class_graph()
    for cls, node in nodes.items():
        assert kernel_class(node) == ("strided" if cls == "concat" else cls)
    assert node_compute_time(nodes["matmul"], D) == pytest.approx(2 * 8192 * 4096 * 4096 / (989e12 * K.matmul) + LAUNCH)
    for cls in ("elementwise", "strided", "dtype_cast", "reduction", "softmax_forward", "scatter_add"):
        node = nodes[cls]
        expected = node_bytes(node) / (3.35e12 * getattr(K, cls)) + LAUNCH
        assert node_compute_time(node, D) == pytest.approx(expected), cls
    # Memory-bound kernels of different classes moving similar bytes: the calibrated order.
    t = {cls: node_compute_time(n, D) for cls, n in nodes.items()}
    assert t["elementwise"] < t["strided"] and t["scatter_add"] > 5 * t["elementwise"]


def test_cpu_device_keeps_global_efficiencies():
    from graph_trainer.analysis.cost_model import node_bytes
    from graph_trainer.analysis.devices import CPU_2CORE

    _, nodes = _class_graph()
    cpu = CPU_2CORE
    assert cpu.kernel_efficiency is None
    for node in nodes.values():
        flops, dtype = node_flops(node)
        expected = (
            max(
                flops / (cpu.peak_flops(dtype) * cpu.flops_efficiency) if flops else 0.0,
                node_bytes(node) / (cpu.hbm_bandwidth * cpu.bandwidth_efficiency),
            )
            + cpu.launch_overhead
        )
        assert node_compute_time(node, cpu) == pytest.approx(expected)


def test_bytes_of_expanded_inputs_fills_and_nll_loss():
    from graph_trainer.analysis.cost_model import node_bytes

    f32 = torch.float32
    g = fx.Graph()
    # mean's backward: a (N, 1) gradient expanded to (N, D) is read once per row.
    small = _placeholder(g, "small", _meta(8192, 1, dtype=f32).expand(8192, 4096))
    div = _node(g, aten.div.Scalar, (small, 4096), _meta(8192, 4096, dtype=f32))
    assert node_bytes(div) == 8192 * 4 + 8192 * 4096 * 4
    x = _placeholder(g, "x", _meta(8192, 4096))
    zeros = _node(g, aten.zeros_like.default, (x,), _meta(8192, 4096))
    assert node_bytes(zeros) == 8192 * 4096 * 2
    logp = _placeholder(g, "logp", _meta(8192, 128256, dtype=f32))
    target = _placeholder(g, "target", torch.empty(8192, dtype=torch.long, device="meta"))
    scalar = torch.empty((), dtype=f32, device="meta")
    loss = _node(g, aten.nll_loss_forward.default, (logp, target, None, 1, -100), (scalar, scalar))
    assert node_bytes(loss) == 2 * 4 + 8192 * 8 + 8192 * 4  # one logit per target, not the whole input
    grad, total = _placeholder(g, "grad", scalar), _placeholder(g, "total", scalar)
    back = _node(
        g, aten.nll_loss_backward.default, (grad, logp, target, None, 1, -100, total), _meta(8192, 128256, dtype=f32)
    )
    assert node_bytes(back) == 8192 * 128256 * 4 + 8192 * 8  # fill + scatter, never reads logp


@pytest.mark.parametrize("rowwise", [False, True])
def test_scaled_mm_counts_fp8_flops_at_twice_the_bf16_peak(rowwise):
    from graph_trainer.analysis.cost_model import kernel_class

    m, k, n = 8192, 4096, 14336
    fp8 = torch.float8_e4m3fn
    g = fx.Graph()
    a = _placeholder(g, "a", _meta(m, k, dtype=fp8))
    b = _placeholder(g, "b", _meta(k, n, dtype=fp8))
    scale_shapes = ((m, 1), (1, n)) if rowwise else ((), ())
    scale_a, scale_b = (
        _placeholder(g, name, torch.empty(shape, dtype=torch.float32, device="meta"))
        for name, shape in zip(("scale_a", "scale_b"), scale_shapes, strict=True)
    )
    mm = _node(g, aten._scaled_mm.default, (a, b, scale_a, scale_b), _meta(m, n))
    g.output(mm)
    assert node_flops(mm) == (2 * m * k * n, fp8)
    cls = "scaled_mm_rowwise" if rowwise else "scaled_mm_tensorwise"
    assert kernel_class(mm) == cls
    expected = 2 * m * k * n / (2 * 989e12 * getattr(K, cls)) + LAUNCH
    assert node_compute_time(mm, D) == pytest.approx(expected)
    # the same product in bf16 takes longer by the two peaks and the two efficiencies
    _, bf16 = _mm_graph(m, k, n, torch.bfloat16)
    ratio = (node_compute_time(bf16, D) - LAUNCH) / (node_compute_time(mm, D) - LAUNCH)
    assert ratio == pytest.approx(2 * getattr(K, cls) / K.matmul)
