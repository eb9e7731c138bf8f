"""The private PyTorch APIs graph_trainer depends on, in one place.

Everything here reaches below PyTorch's public surface: fx tracing metadata hooks, autograd
node sequence numbers, ``_StridedShard`` (the dp-over-tp placement SimpleFSDP needs),
``OpOverload.is_view`` / ``_opname`` / ``_schema``, SymInt internals (the cost model reads
sizes that may be unbacked symbols), process groups by name, mesh flattening, the fake
process group's store, Inductor's overlap scheduler (its roofline estimate, swapped for ours
inside one context manager, and its counters), and gloo's worker-thread count
(``cpu_backend``). ``tests/test_torch_compat.py`` checks each entry against the installed
PyTorch so that an upgrade that changes one fails loudly there, not deep inside a training run.
"""

from __future__ import annotations

import collections
import contextlib

import torch
import torch.fx as fx
import torch.fx.traceback as fx_traceback
from torch.distributed.tensor.placement_types import _StridedShard as StridedShard  # noqa: F401


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
        seq_nr = node._sequence_nr()
        node.register_prehook(lambda grad_outputs, seq_nr=seq_nr: fx_traceback.set_grad_fn_seq_nr(seq_nr))
        node.register_hook(lambda grad_inputs, grad_outputs: fx_traceback.reset_grad_fn_seq_nr())
        queue.extend(fn for fn, _ in node.next_functions)


def is_view_op(node: fx.Node) -> bool:
    """Whether ``node`` calls an aten op whose result aliases its input (``OpOverload.is_view``)."""
    return isinstance(node.target, torch._ops.OpOverload) and node.target.is_view


def fake_store():
    """A store for ``init_process_group("fake", ...)``: collectives are recorded, never run."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore()


def flatten_mesh_dims(mesh, dim_names: tuple[str, ...], name: str):
    """Make ``mesh[name]`` the flattening of ``dim_names`` (``DeviceMesh._flatten``).

    PyTorch 2.13 warns that slicing a flattened dim from the root mesh "will be deprecated";
    it still works, and it is what lets ``mesh[("dp_replicate", "dp_shard")]`` name the dense
    data-parallel dims when ``dp_shard`` is ``efsdp x ep``.
    """
    import warnings

    warnings.filterwarnings("ignore", message="Slicing a flattened dim from root mesh")
    return mesh[dim_names]._flatten(name)


def op_name(target) -> str:
    """The op's name without namespace and overload (``OpOverload._opname``)."""
    return target._opname


def op_schema(target):
    """The op's ``FunctionSchema`` (``OpOverload._schema``): argument names and defaults."""
    return target._schema


def sym_expr(x: torch.SymInt):
    """The sympy expression behind a SymInt (``SymNode.expr``)."""
    return x.node.expr


def sym_has_hint(x: torch.SymInt) -> bool:
    """Whether a SymInt has an example value (backed), unlike an unbacked data-dependent size."""
    return x.node.has_hint()


def sym_hint(x: torch.SymInt) -> int:
    """The example value of a backed SymInt."""
    from torch.fx.experimental.symbolic_shapes import guarding_hint_or_throw

    return int(guarding_hint_or_throw(x))


def resolve_process_group(group_name: str):
    """The live ProcessGroup registered under ``group_name`` (as baked into graph collectives)."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(group_name)


def fake_mode_of(value):
    """The ``FakeTensorMode`` a traced node's ``meta["val"]`` belongs to (``FakeTensor.fake_mode``), else None.

    Passes that add nodes run the new ops on these fake values (under that mode) to give the
    new nodes a ``meta["val"]`` of the same trace.
    """
    from torch._subclasses.fake_tensor import FakeTensor

    return value.fake_mode if isinstance(value, FakeTensor) else None


def overlap_scheduling_module():
    """``torch._inductor.fx_passes.overlap_scheduling``: ``schedule_overlap_bucketing`` and its estimators."""
    from torch._inductor.fx_passes import overlap_scheduling

    return overlap_scheduling


@contextlib.contextmanager
def roofline_estimate(estimate_ms):
    """Temporarily make PyTorch's overlap scheduler use ``estimate_ms(node) -> milliseconds``.

    ``overlap_scheduling.estimate_roofline_runtime_ms`` is called for every compute node even
    when ``custom_runtime_estimation`` is given, and without a GPU it crashes (it probes the
    memory bandwidth through Triton: ``RuntimeError: 0 active drivers``). Inside this block the
    module attribute is ``estimate_ms``; the original is put back on exit, also on errors.
    """
    module = overlap_scheduling_module()
    original = module.estimate_roofline_runtime_ms
    module.estimate_roofline_runtime_ms = estimate_ms
    try:
        yield
    finally:
        module.estimate_roofline_runtime_ms = original


def inductor_counters() -> collections.Counter:
    """``torch._dynamo.utils.counters["inductor"]``, where the overlap scheduler counts exposed collectives."""
    from torch._dynamo.utils import counters

    return counters["inductor"]


ONE_THREAD_GLOO = "gloo_one_thread"
"""Backend name of gloo with one worker thread per process group (``cpu_backend``)."""


def cpu_backend() -> str:
    """The ``init_process_group`` backend for CPU jobs: gloo, with ONE worker thread per group.

    PyTorch's ``ProcessGroupGloo`` runs each group's collectives on two worker threads by
    default, so two collectives of one group can be in flight at once. With PyTorch 2.13 we saw
    the heap corrupted now and then: a 4-process HSDP job with
    ``transformer_block_bucketing,auto_bucketing`` (many collectives of one group in flight)
    aborted with ``malloc(): unaligned tcache chunk detected`` in 4 of 24 runs under
    ``MALLOC_CHECK_=3``; the core dump showed one worker of the group inside an
    ``all_gather_into_tensor_coalesced`` and the other inside an ``_allgather_base`` of that
    same group. With one worker per group, 0 of 34 runs failed, at the same step time (each
    group's collectives run in issue order, still beside compute and beside other groups).
    The faulty code inside PyTorch's gloo backend was not pinned down; the evidence (the dump,
    and no crash with one worker) points at two collectives of one group running at once.

    ``ProcessGroupGloo._Options._threads`` is private, and ``init_process_group`` ignores
    options for gloo; so this registers (once) a backend that builds gloo groups with those
    options, through the public ``Backend.register_backend``. Returns its name.
    """
    import torch.distributed as dist
    from torch.distributed import ProcessGroupGloo

    def create(store, rank: int, size: int, timeout):
        options = ProcessGroupGloo._Options()
        options._timeout = timeout
        options._threads = 1
        options._devices = [ProcessGroupGloo.create_default_device()]
        return ProcessGroupGloo(store, rank, size, options)

    if ONE_THREAD_GLOO not in dist.Backend.backend_list:
        dist.Backend.register_backend(ONE_THREAD_GLOO, create, devices=["cpu"])
    return ONE_THREAD_GLOO
