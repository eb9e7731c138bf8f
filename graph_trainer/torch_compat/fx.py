"""Private APIs of tracing: autograd sequence numbers, op overload internals, SymInt internals,
fake tensor modes, and the grouped matmul kernel."""

from __future__ import annotations

import collections
import contextlib
import warnings

import torch
import torch.fx as fx
import torch.fx.traceback as fx_traceback

from graph_trainer.errors import TorchCompatError
from graph_trainer.torch_compat.versions import private_api


def tag_backward_with_forward_seq_nr(loss: torch.Tensor) -> None:
    """Make nodes traced during backward carry the sequence number of their forward op.

    Each autograd node remembers the sequence number of the forward op that created it
    (``_sequence_nr()``). Pre/post hooks on every node of ``loss``'s autograd graph push and
    pop that number into the FX tracing metadata (``fx.traceback.set_grad_fn_seq_nr``), so
    backward FX nodes get ``meta["seq_nr"]`` equal to their forward node's. The tracer then
    copies the forward ``module_fqn`` across. Needs ``fx.traceback.preserve_node_meta()``.
    """
    if loss.grad_fn is None:
        return
    seen: set = set()
    queue = collections.deque([loss.grad_fn])
    while queue:
        node = queue.popleft()
        if node is None or node in seen:
            continue
        seen.add(node)
        with private_api("autograd Node._sequence_nr"):
            seq_nr = node._sequence_nr()
        node.register_prehook(lambda grad_outputs, seq_nr=seq_nr: fx_traceback.set_grad_fn_seq_nr(seq_nr))
        node.register_hook(lambda grad_inputs, grad_outputs: fx_traceback.reset_grad_fn_seq_nr())
        queue.extend(fn for fn, _ in node.next_functions)


UNPAIRED_SEQ_NR = -2
"""``meta["seq_nr"]`` of the ops autograd traces between backward nodes (``unpaired_seq_nr``):
no forward op has it (forward numbers are >= -1)."""


@contextlib.contextmanager
def unpaired_seq_nr():
    """Around ``torch.autograd.grad`` (after ``tag_backward_with_forward_seq_nr``): ops the engine
    traces outside every backward node's hooks get ``UNPAIRED_SEQ_NR``, ops inside a node still
    get its forward op's number.

    The engine adds two gradient contributions to one tensor (a tensor used twice) between
    nodes. Without this, such an add gets autograd's current sequence number minus one, which
    depends on what created autograd nodes last: the last forward op when nothing did (torch
    2.11, and 2.13 without DTensor: the loss, or a pipeline stage's last block), a number past
    every forward op once DTensor's backward has made some (2.13's ``to_local`` backward wraps
    the gradient with ``from_local``). Paired by number, the add would take the module of
    whichever forward op that is; unpaired, the tracer tags it from its inputs."""
    with private_api("torch.fx.traceback.set_grad_fn_seq_nr"):
        fx_traceback.set_grad_fn_seq_nr(UNPAIRED_SEQ_NR)
    try:
        yield
    finally:
        fx_traceback.reset_grad_fn_seq_nr()


def is_op_overload(target) -> bool:
    """Whether an FX node's target is an operator overload (``torch._ops.OpOverload``, e.g.
    ``aten.mm.default``), as opposed to a Python function or method name."""
    return isinstance(target, torch._ops.OpOverload)


def is_view_op(node: fx.Node) -> bool:
    """Whether ``node`` calls an aten op whose result aliases its input (``OpOverload.is_view``)."""
    return is_op_overload(node.target) and node.target.is_view


def has_side_effects(node: fx.Node) -> bool:
    """Whether ``node`` has side effects other than drawing random numbers
    (``Node.is_impure(impure_random=False)``, marked not backward compatible: callers judge
    random ops themselves, e.g. attention whose dropout is 0)."""
    with private_api("fx.Node.is_impure(impure_random=...)"):
        try:
            return node.is_impure(impure_random=False)
        except TypeError as e:  # (a signature without the flag)
            raise AttributeError(str(e)) from None


def op_name(target) -> str:
    """The op's name without namespace and overload (``OpOverload._opname``)."""
    with private_api("OpOverload._opname"):
        return target._opname


def op_schema(target):
    """The op's ``FunctionSchema`` (``OpOverload._schema``): argument names and defaults."""
    with private_api("OpOverload._schema"):
        return target._schema


def sym_expr(x: torch.SymInt):
    """The sympy expression behind a SymInt (``SymNode.expr``)."""
    return x.node.expr


def sym_has_hint(x: torch.SymInt) -> bool:
    """Whether a SymInt has an example value (backed), unlike an unbacked data-dependent size."""
    return x.node.has_hint()


def sym_hint(x: torch.SymInt) -> int:
    """The example value of a backed SymInt (``guarding_hint_or_throw`` since torch 2.13,
    ``hint_int`` before)."""
    import torch.fx.experimental.symbolic_shapes as symbolic_shapes

    with private_api("torch.fx.experimental.symbolic_shapes.guarding_hint_or_throw (or hint_int)"):
        hint = getattr(symbolic_shapes, "guarding_hint_or_throw", None) or symbolic_shapes.hint_int
    return int(hint(x))


def new_fake_mode(**kwargs):
    """A ``FakeTensorMode`` (``torch._subclasses.fake_tensor``) built with ``kwargs`` (shape_env,
    static_shapes, ...)."""
    with private_api("torch._subclasses.fake_tensor.FakeTensorMode"):
        from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(**kwargs)


@contextlib.contextmanager
def lazy_graph_modules():
    """While active, ``make_fx`` returns a ``_LazyGraphModule`` (``torch.fx._lazy_graph_module``,
    as Inductor's passes use): its ``recompile()`` only marks the Python code stale, which is
    generated when the module is first called or its ``code`` read. A chain of passes that each
    recompile a large graph then generates its code once, where it runs, and never where it
    is only analysed (the dry run, analyze)."""
    with private_api("torch.fx._lazy_graph_module._use_lazy_graph_module"):
        from torch.fx._lazy_graph_module import _use_lazy_graph_module

    with _use_lazy_graph_module(True):
        yield


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm``: row block ``i`` of ``a`` (rows up to ``offs[i]``) times ``b[i]``, one kernel."""
    with private_api("torch._grouped_mm"):
        kernel = torch._grouped_mm
    return kernel(a, b, offs=offs)


def scaled_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor, **kwargs) -> torch.Tensor:
    """``torch._scaled_mm``: float8 ``a @ b`` (``b`` column-major on CUDA), each output element times
    its row's ``scale_a`` and column's ``scale_b`` (one value each, or one per row / column);
    ``kwargs``: ``out_dtype``, ``use_fast_accum``."""
    with private_api("torch._scaled_mm"):
        kernel = torch._scaled_mm
    return kernel(a, b, scale_a, scale_b, **kwargs)


SCALED_MM_ARGUMENTS = ("self", "mat2", "scale_a", "scale_b", "bias", "scale_result", "out_dtype", "use_fast_accum")
"""``aten::_scaled_mm``'s arguments, in order, as a CPU kernel given to ``use_cpu_scaled_mm`` takes them."""
_cpu_scaled_mm: list = []  # (kernel, its torch.library registration), kept for the process's life


def use_cpu_scaled_mm(kernel) -> None:
    """Make ``kernel(a, b, scale_a, scale_b, bias, scale_result, out_dtype, use_fast_accum)`` the
    CPU implementation of ``torch._scaled_mm`` in this process (its ``out=`` form too), in place of
    ATen's, for every caller: eager code, a traced graph's ``aten._scaled_mm`` nodes, Inductor's
    fallback. Once per process; another kernel later is an error. CUDA keeps ATen's."""
    if _cpu_scaled_mm:
        if _cpu_scaled_mm[0][0] is not kernel:
            raise RuntimeError("torch._scaled_mm already has another CPU kernel in this process")
        return
    with private_api("torch.ops.aten._scaled_mm"):
        schemas = [torch.ops.aten._scaled_mm.default._schema, torch.ops.aten._scaled_mm.out._schema]
    for schema in schemas:
        names = tuple(a.name for a in schema.arguments if not a.kwarg_only)
        if names != SCALED_MM_ARGUMENTS:
            raise TorchCompatError(
                f"aten::_scaled_mm takes {names} in torch {torch.__version__}, not {SCALED_MM_ARGUMENTS}: "
                f"graph_trainer's CPU kernel for it needs updating"
            )

    def into_out(*args, out: torch.Tensor) -> torch.Tensor:
        result = kernel(*args)
        out.resize_(result.shape)
        return out.copy_(result)

    library = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():  # (torch says once that the kernel overrides ATen's: that is the point)
        warnings.filterwarnings("ignore", message="(?s).*Overriding a previously registered kernel")
        library.impl("_scaled_mm", kernel, "CPU")
        library.impl("_scaled_mm.out", into_out, "CPU")
    _cpu_scaled_mm.append((kernel, library))


def fake_mode_of_nodes(nodes):
    """The ``FakeTensorMode`` of the first of ``nodes`` whose ``meta["val"]`` is a fake tensor, else None."""
    for node in nodes:
        mode = fake_mode_of(node.meta.get("val"))
        if mode is not None:
            return mode
    return None


def fake_mode_of(value):
    """The ``FakeTensorMode`` a traced node's ``meta["val"]`` belongs to (``FakeTensor.fake_mode``), else None.

    Passes that add nodes run the new ops on these fake values (under that mode) to give the
    new nodes a ``meta["val"]`` of the same trace.
    """
    with private_api("torch._subclasses.fake_tensor.FakeTensor"):
        from torch._subclasses.fake_tensor import FakeTensor

    return value.fake_mode if isinstance(value, FakeTensor) else None
