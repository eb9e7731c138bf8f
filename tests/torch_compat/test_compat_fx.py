"""graph_trainer.torch_compat.fx: the tracing entries: annotations and sequence numbers, op internals,
SymInts, fake modes, grouped_mm.

Fails loudly when a PyTorch upgrade changes a private API graph_trainer relies on."""

import pytest
import torch
import torch.fx.traceback as fx_traceback

from graph_trainer.graph import tags


def test_annotations_and_backward_seq_nr_reach_node_meta():
    # The tracer tags nodes with fx.traceback.annotate (under preserve_node_meta) and gives each
    # backward node its forward node's seq_nr through tag_backward_with_forward_seq_nr
    # (autograd hooks calling set_grad_fn_seq_nr / reset_grad_fn_seq_nr).
    from torch.fx.experimental.proxy_tensor import make_fx

    from graph_trainer.torch_compat import tag_backward_with_forward_seq_nr

    def step(x):
        x = x.detach().requires_grad_(True)
        with fx_traceback.annotate({"phase": "forward"}):
            loss = (torch.sin(x) * 3.0).sum()
        tag_backward_with_forward_seq_nr(loss)
        with fx_traceback.annotate({"phase": "backward"}):
            (grad,) = torch.autograd.grad(loss, [x])
        return grad

    with fx_traceback.preserve_node_meta(), torch.autograd.set_multithreading_enabled(False):
        gm = make_fx(step, tracing_mode="fake")(torch.randn(3))
    aten = torch.ops.aten
    (sin,) = (n for n in gm.graph.nodes if n.target == aten.sin.default)
    (cos,) = (n for n in gm.graph.nodes if n.target == aten.cos.default)  # d/dx sin, traced in backward
    muls = [n for n in gm.graph.nodes if n.target == aten.mul.Tensor]
    forward_mul = next(n for n in muls if n.args[0] is sin)  # sin(x) * 3
    backward_muls = [n for n in muls if n is not forward_mul]
    # (where graph_trainer.graph.tags reads them)
    assert tags.tags(sin) == {"phase": "forward"} and tags.tags(cos) == {"phase": "backward"}
    assert sin.meta["seq_nr"] != forward_mul.meta["seq_nr"]  # two forward ops, two numbers
    assert cos.meta["seq_nr"] == sin.meta["seq_nr"]
    # MulBackward's own mul (grad * 3) carries the forward mul's number, SinBackward's (grad * cos) sin's.
    assert sorted(n.meta["seq_nr"] for n in backward_muls) == sorted([forward_mul.meta["seq_nr"], sin.meta["seq_nr"]])


def test_unpaired_seq_nr_marks_what_autograd_traces_between_backward_nodes():
    # x is used twice: the engine sums its two gradient contributions between backward nodes,
    # outside every node's hooks. By default that add takes autograd's current number minus one,
    # here the last forward op's (the sum's): the tracer would pair it with that op. Inside
    # unpaired_seq_nr it gets UNPAIRED_SEQ_NR, and the ops of each backward node keep their
    # forward op's number.
    import contextlib

    from torch.fx.experimental.proxy_tensor import make_fx

    from graph_trainer.torch_compat import UNPAIRED_SEQ_NR, tag_backward_with_forward_seq_nr, unpaired_seq_nr

    aten = torch.ops.aten

    def trace(unpaired: bool):
        def step(x):
            x = x.detach().requires_grad_(True)
            loss = (torch.sin(x) * x).sum()
            tag_backward_with_forward_seq_nr(loss)
            with unpaired_seq_nr() if unpaired else contextlib.nullcontext():
                return torch.autograd.grad(loss, [x])

        with fx_traceback.preserve_node_meta(), torch.autograd.set_multithreading_enabled(False):
            return make_fx(step, tracing_mode="fake")(torch.randn(3))

    for unpaired in (False, True):
        gm = trace(unpaired)
        (sin,) = (n for n in gm.graph.nodes if n.target == aten.sin.default)
        (cos,) = (n for n in gm.graph.nodes if n.target == aten.cos.default)
        (loss_sum,) = (n for n in gm.graph.nodes if n.target == aten.sum.default)
        (add,) = (n for n in gm.graph.nodes if n.target == aten.add.Tensor)  # the sum of x's two contributions
        assert cos.meta["seq_nr"] == sin.meta["seq_nr"]  # inside SinBackward: sin's number either way
        assert add.meta["seq_nr"] == (UNPAIRED_SEQ_NR if unpaired else loss_sum.meta["seq_nr"])
    assert UNPAIRED_SEQ_NR < -1  # forward ops are numbered from -1 up


def test_autograd_node_sequence_numbers_and_hooks():
    # tag_backward_with_forward_seq_nr walks next_functions from the loss, reads _sequence_nr()
    # and needs each node's prehook to run right before the node computes, its hook right after.
    events = []

    class Double(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            events.append(("run", "double"))
            return grad * 2

    x = torch.ones(2, requires_grad=True)
    y = Double.apply(x)
    loss = y.sum()
    double, total = y.grad_fn, loss.grad_fn
    assert double._sequence_nr() < total._sequence_nr()  # numbered in creation order
    assert total.next_functions[0][0] is double
    for node, name in ((double, "double"), (total, "sum")):
        node.register_prehook(lambda grad_outputs, name=name: events.append(("pre", name)))
        node.register_hook(lambda grad_inputs, grad_outputs, name=name: events.append(("post", name)))
    loss.backward()
    assert events == [("pre", "sum"), ("post", "sum"), ("pre", "double"), ("run", "double"), ("post", "double")]
    assert x.grad.tolist() == [2.0, 2.0]  # the hooks (returning None) leave the gradients alone


def test_is_view_op():
    import torch.fx as fx

    from graph_trainer.torch_compat import is_view_op

    graph = fx.Graph()
    x = graph.placeholder("x")
    t = graph.call_function(torch.ops.aten.t.default, (x,))
    mm = graph.call_function(torch.ops.aten.mm.default, (x, t))
    assert is_view_op(t) and not is_view_op(mm) and not is_view_op(x)


def test_op_name_and_schema():
    from graph_trainer.torch_compat import op_name, op_schema

    target = torch.ops._c10d_functional.all_gather_into_tensor.default
    assert op_name(target) == "all_gather_into_tensor"
    assert [a.name for a in op_schema(target).arguments][:2] == ["input", "group_size"]


def test_symint_internals():
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

    from graph_trainer.torch_compat import sym_expr, sym_has_hint, sym_hint

    env = ShapeEnv()
    backed = env.create_symintnode(env.create_symbol(5, ConstantSource("x"), dynamic_dim=DimDynamic.DYNAMIC), hint=5)
    unbacked = env.create_unbacked_symint()
    assert sym_has_hint(backed) and sym_hint(backed) == 5
    assert not sym_has_hint(unbacked)
    assert len(sym_expr(unbacked).free_symbols) == 1


def test_fake_mode_of_a_fake_value():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from graph_trainer.torch_compat import fake_mode_of

    mode = FakeTensorMode()
    with mode:
        fake = torch.empty(2, 3)
    assert fake_mode_of(fake) is mode
    assert fake_mode_of(torch.empty(2)) is None and fake_mode_of(None) is None
    with fake_mode_of(fake):  # new ops on fake values give fake values of the same mode
        out = torch.cat([fake.view(-1), fake.view(-1)])
    assert fake_mode_of(out) is mode and out.shape == (12,)


def test_fake_mode_of_a_graph_is_its_first_fake_value():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from graph_trainer.torch_compat import fake_mode_of_nodes

    graph = torch.fx.Graph()
    plain, faked = graph.placeholder("plain"), graph.placeholder("faked")
    plain.meta["val"] = torch.empty(2)
    assert fake_mode_of_nodes(graph.nodes) is None
    mode = FakeTensorMode()
    with mode:
        faked.meta["val"] = torch.empty(2)
    assert fake_mode_of_nodes(graph.nodes) is mode and fake_mode_of_nodes([plain]) is None


def test_sym_hint_falls_back_to_hint_int_before_torch_2_13(monkeypatch):
    import torch.fx.experimental.symbolic_shapes as symbolic_shapes
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

    from graph_trainer.errors import TorchCompatError
    from graph_trainer.torch_compat import sym_hint

    env = ShapeEnv()
    backed = env.create_symintnode(env.create_symbol(7, ConstantSource("y"), dynamic_dim=DimDynamic.DYNAMIC), hint=7)
    calls = []
    monkeypatch.delattr(symbolic_shapes, "guarding_hint_or_throw", raising=False)
    monkeypatch.setattr(symbolic_shapes, "hint_int", lambda x: calls.append(x) or 7, raising=False)
    assert sym_hint(backed) == 7 and calls == [backed]
    monkeypatch.delattr(symbolic_shapes, "hint_int")
    with pytest.raises(TorchCompatError, match="guarding_hint_or_throw"):
        sym_hint(backed)


def test_fake_mode_functional_all_to_all_and_grouped_mm_entries():
    import torch.distributed as dist

    from graph_trainer.fake_trace import fake_world
    from graph_trainer.torch_compat import (
        all_to_all_single,
        all_to_all_single_autograd,
        grouped_mm,
        is_op_overload,
        new_fake_mode,
    )

    mode = new_fake_mode(static_shapes=True)
    with mode:
        fake = torch.empty(3, 4)
    assert fake.fake_mode is mode and fake.shape == (3, 4)
    assert is_op_overload(torch.ops.aten.mm.default) and not is_op_overload(torch.mm)
    assert not is_op_overload(torch.ops.aten.mm)  # the packet, not an overload
    # Each exchange is one _c10d_functional.all_to_all_single node (and its wait) when traced,
    # with the split sizes it was given; the autograd one has the reverse exchange as backward.
    from torch.fx.experimental.proxy_tensor import make_fx

    with fake_world(2):
        group = dist.group.WORLD

        def exchange(x):
            y = all_to_all_single(x, [1, 3], [2, 2], group)
            return all_to_all_single_autograd(y, [3, 1], [1, 3], group)

        gm = make_fx(exchange, tracing_mode="fake")(torch.randn(4, 2))
    a2a = [n for n in gm.graph.nodes if n.target == torch.ops._c10d_functional.all_to_all_single.default]
    assert [n.args[1:3] for n in a2a] == [([1, 3], [2, 2]), ([3, 1], [1, 3])]
    # grouped_mm: row block i of a times b[i] (bf16 on CPU), as two separate matmuls would give.
    g = torch.Generator().manual_seed(0)
    a = torch.randn(5, 16, generator=g).bfloat16()  # strides must be multiples of 16 bytes
    b = torch.randn(2, 16, 8, generator=g).bfloat16()
    out = grouped_mm(a, b, offs=torch.tensor([2, 5], dtype=torch.int32))
    torch.testing.assert_close(out.float(), torch.cat([a[:2] @ b[0], a[2:] @ b[1]]).float(), rtol=2e-2, atol=2e-2)


def test_scaled_mm_scales_each_row_and_column_of_the_float8_product():
    from graph_trainer.torch_compat import scaled_mm

    g = torch.Generator().manual_seed(0)
    a = torch.randn(4, 16, generator=g).to(torch.float8_e4m3fn)
    b = torch.randn(8, 16, generator=g).to(torch.float8_e4m3fn)
    sa, sb = torch.rand(4, 1, generator=g) + 0.5, torch.rand(1, 8, generator=g) + 0.5
    out = scaled_mm(a, b.t(), sa, sb, out_dtype=torch.float32)
    expected = (a.float() @ b.float().t()) * sa * sb  # (float8 products are exact in float32)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_a_cpu_scaled_mm_kernel_serves_eager_and_traced_calls_once_per_process():
    from torch.fx.experimental.proxy_tensor import make_fx

    from graph_trainer.torch_compat import SCALED_MM_ARGUMENTS, use_cpu_scaled_mm
    from models.float8 import scaled_mm_in_float32

    schema = torch.ops.aten._scaled_mm.default._schema  # the arguments our kernel takes, in order
    assert tuple(a.name for a in schema.arguments) == SCALED_MM_ARGUMENTS
    use_cpu_scaled_mm(scaled_mm_in_float32)
    use_cpu_scaled_mm(scaled_mm_in_float32)  # (the same kernel again: nothing to do)
    with pytest.raises(RuntimeError, match="already has another CPU kernel"):
        use_cpu_scaled_mm(lambda *args: None)
    g = torch.Generator().manual_seed(0)
    a = torch.randn(32, 16, generator=g).to(torch.float8_e4m3fn)
    b = torch.randn(16, 16, generator=g).to(torch.float8_e4m3fn).t()
    scale = torch.tensor(0.37)
    expected = scaled_mm_in_float32(a, b, scale, scale, out_dtype=torch.float32)

    def step(a, b, scale):
        return torch._scaled_mm(a, b, scale, scale, out_dtype=torch.float32)

    graph = make_fx(step, tracing_mode="fake")(a, b, scale)
    assert [n.target for n in graph.graph.nodes if n.op == "call_function"] == [torch.ops.aten._scaled_mm.default]
    assert torch.equal(step(a, b, scale), expected) and torch.equal(graph(a, b, scale), expected)


def test_side_effects_leave_random_ops_to_the_caller():
    # activation checkpointing recomputes attention without dropout: fx's purity check must be
    # able to leave random ops out (Node.is_impure(impure_random=False)) and still flag mutation.
    import torch.fx as fx

    from graph_trainer.torch_compat import has_side_effects

    aten = torch.ops.aten
    g = fx.Graph()
    q = g.placeholder("q")
    attention = g.call_function(aten._scaled_dot_product_cudnn_attention.default, (q, q, q, None, True, 0.0, True))
    rand = g.call_function(aten.rand.default, ([2],))
    mutation = g.call_function(aten.add_.Tensor, (q, q))
    assert not has_side_effects(attention) and not has_side_effects(rand)
    assert has_side_effects(mutation)
    assert rand.is_impure()  # (the default still counts random ops: why the flag is needed)


def test_lazy_graph_modules_generate_code_where_the_module_runs():
    # make_fx under lazy_graph_modules returns a module whose recompile() only marks its code
    # stale; calling it (or reading its code) generates the code of the graph as it is then.
    import copy

    from torch.fx.experimental.proxy_tensor import make_fx

    from graph_trainer.torch_compat import lazy_graph_modules

    with lazy_graph_modules():
        gm = make_fx(lambda x: torch.sin(x) + 1.0)(torch.randn(3))
    x = torch.randn(3)
    (add,) = (n for n in gm.graph.nodes if n.target == torch.ops.aten.add.Tensor)
    add.target = torch.ops.aten.sub.Tensor
    assert gm.recompile() is None  # (a plain GraphModule returns the PythonCode it made)
    assert torch.equal(gm(x), torch.sin(x) - 1.0)
    assert "aten.sub.Tensor" in gm.code
    twin = copy.deepcopy(gm)
    assert torch.equal(twin(x), torch.sin(x) - 1.0)
    plain = make_fx(lambda x: torch.sin(x))(x)
    assert plain.recompile() is not None  # outside the context: code made at once
