"""The private PyTorch APIs graph_trainer depends on, in one place.

Everything here reaches below PyTorch's public surface: fx tracing metadata hooks, autograd
node sequence numbers, ``_StridedShard`` (the dp-over-tp placement SimpleFSDP needs),
``OpOverload.is_view`` / ``_opname`` / ``_schema``, SymInt internals (the cost model reads
sizes that may be unbacked symbols), process groups by name, mesh flattening, the fake
process group's store, fake tensor modes, functional all_to_all (expert parallel),
``torch._grouped_mm`` (the experts' kernel), Inductor's overlap scheduler (its roofline estimate, swapped for ours
inside one context manager, and its counters), and gloo's worker-thread count
(``cpu_backend``), DCP internals (the classes a checkpoint's metadata pickle holds, a reader that
unpickles it safely) and process-group timeouts. ``tests/test_torch_compat.py`` checks each entry against the installed
PyTorch so that an upgrade that changes one fails loudly there, not deep inside a training run;
and a lookup that fails at run time raises ``TorchCompatError`` (one line: the API, the installed
torch, the supported range ``SUPPORTED_TORCH``), not an ImportError deep in a traceback.
"""

from __future__ import annotations

import collections
import logging
import contextlib
import os

import torch
import torch.fx as fx
import torch.fx.traceback as fx_traceback

from graph_trainer.errors import TorchCompatError

SUPPORTED_TORCH = "2.11 to 2.13"
"""Torch releases graph_trainer runs on: 2.13 (CPU, where CI runs), 2.11 (CUDA, as on the H100
machine). The user passes need 2.13 (``pass_needs_torch_2_13``)."""

TORCH_VERSION = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2])


def pass_needs_torch_2_13(name: str) -> str | None:
    """Why pass ``name`` cannot run on this torch (None: it can). ``auto_bucketing`` drives 2.13's
    overlap scheduler, whose API 2.11 lacks; on torch 2.11 (CPU) the schedule checks of
    ``transformer_block_bucketing`` and ``ep_overlap`` fail on the traced graphs (its traces differ;
    not investigated yet), so they are refused there rather than run untested."""
    if TORCH_VERSION >= (2, 13):
        return None
    return (f"{name} is supported with torch 2.13 (this is torch {torch.__version__}: its traced graphs and "
            f"overlap scheduler differ, and the pass's checks fail there)")


@contextlib.contextmanager
def private_api(name: str):
    """Turn an ImportError/AttributeError raised while looking ``name`` up into one
    ``TorchCompatError`` naming the API and the installed torch, instead of a traceback."""
    try:
        yield
    except (ImportError, AttributeError) as e:
        raise TorchCompatError(f"PyTorch private API {name} is not available in torch {torch.__version__} ({e}); "
                               f"graph_trainer supports torch {SUPPORTED_TORCH}") from None


with private_api("torch.distributed.tensor.placement_types._StridedShard"):
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
        with private_api("autograd Node._sequence_nr"):
            seq_nr = node._sequence_nr()
        node.register_prehook(lambda grad_outputs, seq_nr=seq_nr: fx_traceback.set_grad_fn_seq_nr(seq_nr))
        node.register_hook(lambda grad_inputs, grad_outputs: fx_traceback.reset_grad_fn_seq_nr())
        queue.extend(fn for fn, _ in node.next_functions)


def is_op_overload(target) -> bool:
    """Whether an FX node's target is an operator overload (``torch._ops.OpOverload``, e.g.
    ``aten.mm.default``), as opposed to a Python function or method name."""
    return isinstance(target, torch._ops.OpOverload)


def is_view_op(node: fx.Node) -> bool:
    """Whether ``node`` calls an aten op whose result aliases its input (``OpOverload.is_view``)."""
    return is_op_overload(node.target) and node.target.is_view


def fake_store():
    """A store for ``init_process_group("fake", ...)``: collectives are recorded, never run."""
    with private_api("torch.testing._internal.distributed.fake_pg.FakeStore"):
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
    with private_api("DeviceMesh._flatten"):
        flatten = mesh[dim_names]._flatten
    return flatten(name)


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


def resolve_process_group(group_name: str):
    """The live ProcessGroup registered under ``group_name`` (as baked into graph collectives)."""
    with private_api("torch.distributed.distributed_c10d._resolve_process_group"):
        from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(group_name)


def new_fake_mode(**kwargs):
    """A ``FakeTensorMode`` (``torch._subclasses.fake_tensor``) built with ``kwargs`` (shape_env, static_shapes, ...)."""
    with private_api("torch._subclasses.fake_tensor.FakeTensorMode"):
        from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(**kwargs)


def all_to_all_single(x: torch.Tensor, output_split_sizes, input_split_sizes, group) -> torch.Tensor:
    """Functional ``all_to_all_single`` without autograd (``torch.distributed._functional_collectives``):
    one ``_c10d_functional.all_to_all_single`` node and its wait in a traced graph."""
    with private_api("torch.distributed._functional_collectives.all_to_all_single"):
        import torch.distributed._functional_collectives as funcol

    return funcol.all_to_all_single(x, output_split_sizes, input_split_sizes, group)


def all_to_all_single_autograd(x: torch.Tensor, output_split_sizes, input_split_sizes, group) -> torch.Tensor:
    """Functional ``all_to_all_single`` whose backward is the reverse exchange (``_functional_collectives``)."""
    with private_api("torch.distributed._functional_collectives.all_to_all_single_autograd"):
        from torch.distributed._functional_collectives import all_to_all_single_autograd as exchange
    return exchange(x, output_split_sizes, input_split_sizes, group)


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm``: row block ``i`` of ``a`` (rows up to ``offs[i]``) times ``b[i]``, one kernel."""
    with private_api("torch._grouped_mm"):
        kernel = torch._grouped_mm
    return kernel(a, b, offs=offs)


def fake_mode_of(value):
    """The ``FakeTensorMode`` a traced node's ``meta["val"]`` belongs to (``FakeTensor.fake_mode``), else None.

    Passes that add nodes run the new ops on these fake values (under that mode) to give the
    new nodes a ``meta["val"]`` of the same trace.
    """
    with private_api("torch._subclasses.fake_tensor.FakeTensor"):
        from torch._subclasses.fake_tensor import FakeTensor

    return value.fake_mode if isinstance(value, FakeTensor) else None


def overlap_scheduling_module():
    """``torch._inductor.fx_passes.overlap_scheduling``: ``schedule_overlap_bucketing`` and its estimators."""
    with private_api("torch._inductor.fx_passes.overlap_scheduling"):
        from torch._inductor.fx_passes import overlap_scheduling

    return overlap_scheduling


OVERLAP_SCHEDULER_ARGS = ("collective_bucketing", "insert_overlap_deps", "custom_runtime_estimation",
                          "collective_estimator", "compute_estimator", "max_memory_increase_gb",
                          "max_memory_increase_ratio", "max_in_flight_gb", "pre_bucketing_fsdp_collectives")
"""The arguments of ``schedule_overlap_bucketing`` that ``auto_bucketing`` passes (torch 2.13)."""


def overlap_scheduler_problem() -> str | None:
    """Why this torch's overlap scheduler cannot run ``auto_bucketing`` (None: it can). torch 2.11
    has neither the swappable ``estimate_roofline_runtime_ms`` nor ``compute_estimator``: it
    benchmarks compute on CUDA."""
    import inspect

    try:
        module = overlap_scheduling_module()
    except TorchCompatError as e:
        return str(e)
    missing = [] if hasattr(module, "estimate_roofline_runtime_ms") else ["estimate_roofline_runtime_ms"]
    params = inspect.signature(module.schedule_overlap_bucketing).parameters
    missing += [f"argument {name}" for name in OVERLAP_SCHEDULER_ARGS if name not in params]
    if not missing:
        return None
    return (f"auto_bucketing needs PyTorch's overlap scheduler of torch 2.13; torch {torch.__version__}'s "
            f"overlap_scheduling lacks {', '.join(missing)}")


@contextlib.contextmanager
def roofline_estimate(estimate_ms):
    """Temporarily make PyTorch's overlap scheduler use ``estimate_ms(node) -> milliseconds``.

    ``overlap_scheduling.estimate_roofline_runtime_ms`` is called for every compute node even
    when ``custom_runtime_estimation`` is given, and without a GPU it crashes (it probes the
    memory bandwidth through Triton: ``RuntimeError: 0 active drivers``). Inside this block the
    module attribute is ``estimate_ms``; the original is put back on exit, also on errors.
    """
    module = overlap_scheduling_module()
    with private_api("overlap_scheduling.estimate_roofline_runtime_ms"):
        original = module.estimate_roofline_runtime_ms
    module.estimate_roofline_runtime_ms = estimate_ms
    try:
        yield
    finally:
        module.estimate_roofline_runtime_ms = original


def inductor_counters() -> collections.Counter:
    """``torch._dynamo.utils.counters["inductor"]``, where the overlap scheduler counts exposed collectives."""
    with private_api("torch._dynamo.utils.counters"):
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
        with private_api("ProcessGroupGloo._Options (_timeout, _threads, _devices)"):
            options = ProcessGroupGloo._Options()
            options._timeout = timeout
            options._threads = 1
            options._devices = [ProcessGroupGloo.create_default_device()]
        return ProcessGroupGloo(store, rank, size, options)

    if ONE_THREAD_GLOO not in dist.Backend.backend_list:
        dist.Backend.register_backend(ONE_THREAD_GLOO, create, devices=["cpu"])
    return ONE_THREAD_GLOO


# ------------------------------------------------------------------ checkpoints and process groups

def dcp_metadata_globals() -> dict[tuple[str, str], object]:
    """Every global a DCP ``.metadata`` pickle written by graph_trainer refers to, by (module, name).

    Found by unpickling real checkpoints (one process and FSDP over gloo, float32 and bfloat16)
    and recording each ``find_class``: the ``Metadata`` dataclasses, ``_StorageInfo`` (where each
    tensor lies in which file), ``torch.Size``, the dtypes, the layout (pickled as a call of
    ``torch.serialization._get_layout("torch.strided")``, a lookup by name), the memory-format
    enum ``_MEM_FORMAT_ENCODING`` and ``pathlib.PosixPath`` (the saving folder). None of them
    runs anything but its own constructor. Deliberately absent: ``BytesStorageMetadata`` (a
    non-tensor entry, which DCP's planner would read back with ``torch.load(weights_only=False)``:
    graph_trainer saves only tensors).
    """
    import pathlib

    import torch.distributed.checkpoint.metadata as md

    allowed: dict[tuple[str, str], object] = {
        ("torch", "Size"): torch.Size,
        ("pathlib", "PosixPath"): pathlib.PosixPath,
    }
    for name in ("Metadata", "MetadataIndex", "StorageMeta", "TensorStorageMetadata", "ChunkStorageMetadata",
                 "TensorProperties"):
        allowed[(md.__name__, name)] = getattr(md, name)
    with private_api("torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING"):
        allowed[(md.__name__, "_MEM_FORMAT_ENCODING")] = md._MEM_FORMAT_ENCODING
    with private_api("torch.distributed.checkpoint.filesystem._StorageInfo"):
        from torch.distributed.checkpoint.filesystem import _StorageInfo
    allowed[("torch.distributed.checkpoint.filesystem", "_StorageInfo")] = _StorageInfo
    with private_api("torch.serialization._get_layout"):
        from torch.serialization import _get_layout
    allowed[("torch.serialization", "_get_layout")] = _get_layout
    for name, value in vars(torch).items():
        if isinstance(value, torch.dtype):
            allowed[("torch", name)] = value
    return allowed


def dcp_storage_files(metadata) -> set[str]:
    """The files (relative to the checkpoint folder) a DCP ``Metadata`` says hold its tensors
    (``_StorageInfo.relative_path`` of every ``storage_data`` entry)."""
    with private_api("torch.distributed.checkpoint.filesystem._StorageInfo.relative_path"):
        return {info.relative_path for info in metadata.storage_data.values()}


DCP_METADATA_FILE = ".metadata"
"""The file ``dcp.FileSystemWriter`` writes its pickled ``Metadata`` to (``filesystem._metadata_fn``)."""


def dcp_reader(path: str, read_metadata):
    """A ``dcp.FileSystemReader`` of ``path`` whose ``read_metadata()`` returns ``read_metadata(file)``
    for the folder's ``.metadata`` file instead of ``pickle.load``-ing it.

    ``FileSystemReader.read_metadata`` unpickles ``.metadata`` with plain ``pickle`` (torch
    2.11 to 2.13), so whoever can write a checkpoint folder could run code in the job that
    resumes from it. The subclass keeps what the original does besides unpickling: it stamps
    the reader's ``load_id`` into ``metadata.storage_meta``. Per-rank metadata files
    (``read_metadata(rank=r)``, a fallback DCP tries when the global file cannot be read) are
    not offered: graph_trainer always writes the global one.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import StorageMeta

    class _Reader(dcp.FileSystemReader):
        def read_metadata(self):
            with private_api("FileSystemReader.path / load_id"):
                folder, load_id = str(self.path), self.load_id
            metadata = read_metadata(os.path.join(folder, DCP_METADATA_FILE))
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = load_id
            return metadata

    return _Reader(path)


def process_groups() -> list:
    """Every process group this process belongs to (the world and each group a device mesh made),
    from ``distributed_c10d._world.pg_map``."""
    with private_api("torch.distributed.distributed_c10d._world.pg_map"):
        from torch.distributed.distributed_c10d import _world

        return list(_world.pg_map)


def set_group_timeout(group, timeout) -> None:
    """Give ``group``'s gloo or NCCL backend a new collective timeout (``distributed_c10d._set_pg_timeout``)."""
    with private_api("torch.distributed.distributed_c10d._set_pg_timeout"):
        from torch.distributed.distributed_c10d import _set_pg_timeout
    _set_pg_timeout(timeout, group)


def fuse_partitions(gm: fx.GraphModule, partitions: list[dict], prefix: str) -> fx.GraphModule:
    """``torch.fx.passes.utils.fuser_utils.fuse_by_partitions``: each partition (a dict of nodes,
    topologically closed) becomes a submodule called where its last node was; a submodule always
    returns a tuple."""
    with private_api("torch.fx.passes.utils.fuser_utils.fuse_by_partitions"):
        from torch.fx.passes.utils.fuser_utils import fuse_by_partitions

    return fuse_by_partitions(gm, partitions, prefix=prefix, always_return_tuple=True)


def inductor_graph_pass(fn, version: str):
    """``fn(graph)`` as an Inductor ``CustomGraphPass`` (``torch._inductor.custom_graph_pass``)
    whose ``uuid`` is ``version``: Inductor adds it to the FX graph cache key, so a compile with
    the pass never reuses an artifact made without it (or with another version of it)."""
    with private_api("torch._inductor.custom_graph_pass.CustomGraphPass"):
        from torch._inductor.custom_graph_pass import CustomGraphPass

    class _Pass(CustomGraphPass):
        def __call__(self, graph: fx.Graph) -> None:
            fn(graph)

        def uuid(self) -> str:
            return version

    return _Pass()


def inductor_compile(gm: fx.GraphModule, example_inputs: list, fake_mode, post_grad_pass=None,
                     deterministic: bool = False, eager_precision: bool = False):
    """Compile an aten graph with Inductor (``torch._inductor.standalone_compile``) as part of the
    trace that made it: shapes and data-dependent sizes come from ``fake_mode``'s ShapeEnv (a
    ``TracingContext``), so the compiled code is specialised like the traced graph. No input needs
    a gradient, so AOTAutograd compiles an inference graph (no partitioner, nothing recomputed
    or saved differently).

    ``deterministic``: compile under ``torch.use_deterministic_algorithms``, so Inductor lowers
    accumulating scatters (``index_put`` with accumulate: the embedding's gradient) to ATen's
    deterministic kernel instead of parallel atomic adds, whose summation order varies run to run.
    ``eager_precision``: Inductor's ``emulate_precision_casts``: a fused kernel rounds every
    intermediate to the dtype the op-by-op graph stores it in (bf16 values are otherwise kept in
    fp32 inside a kernel) and Triton does not contract ``a * b + c`` into an FMA, so an op
    computes the same value whichever ops it is fused with. ``post_grad_pass(graph)``, if given,
    runs on the graph Inductor lowers, after Inductor's own FX passes; a plain function disables
    the FX graph cache for this compile (it has no cache key), an ``inductor_graph_pass`` does not.
    Returns a callable taking the graph's inputs positionally."""
    with private_api("torch._inductor.standalone_compile"):
        from torch._inductor import config as inductor_config
        from torch._inductor import standalone_compile
    with private_api("torch._inductor.config.emulate_precision_casts"):
        inductor_config.emulate_precision_casts  # noqa: B018  (raises if the option is gone)
    with private_api("torch._guards.TracingContext"):
        from torch._guards import TracingContext, tracing

    patches = {"emulate_precision_casts": eager_precision}
    if post_grad_pass is not None:
        patches["post_grad_custom_post_pass"] = post_grad_pass
    with inductor_config.patch(patches), tracing(TracingContext(fake_mode)), deterministic_algorithms(deterministic):
        return standalone_compile(gm, list(example_inputs), dynamic_shapes="from_tracing_context", aot=False)


@contextlib.contextmanager
def deterministic_algorithms(enabled: bool = True):
    """Deterministic algorithms on inside when ``enabled`` (or already on); the previous setting after."""
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(enabled or previous)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(previous)


@contextlib.contextmanager
def inductor_output_files():
    """Collect the paths of the Python modules Inductor writes for the graphs compiled inside
    (its ``output_code`` artifact log, ``Output code written to: <path>``), on a cache hit too."""
    name = "torch._inductor.codecache.__output_code"
    log = logging.getLogger(name)
    paths: list[str] = []

    class _Collect(logging.Handler):
        def emit(self, record):
            if record.msg.startswith("Output code written to") and record.args:
                paths.append(str(record.args[0]))

    handler, level, propagate = _Collect(), log.level, log.propagate
    log.addHandler(handler)
    log.setLevel(logging.DEBUG)
    log.propagate = False
    try:
        yield paths
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
        log.propagate = propagate


def default_cache_dir() -> str:
    """Inductor's cache folder when ``TORCHINDUCTOR_CACHE_DIR`` is not set (``/tmp/torchinductor_<user>``)."""
    with private_api("torch._inductor.runtime.cache_dir_utils.default_cache_dir"):
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir as inductor_default

    return inductor_default()
