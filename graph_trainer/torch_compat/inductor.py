"""Private APIs of Inductor: the overlap scheduler (its roofline estimate, swapped for ours inside
one context manager, and its counters), FX partition fusing, custom graph passes, standalone
compilation inside a trace, its generated-code log and its cache folder."""

from __future__ import annotations

import collections
import contextlib
import logging

import torch
import torch.fx as fx

from graph_trainer.errors import TorchCompatError
from graph_trainer.torch_compat.versions import private_api


def overlap_scheduling_module():
    """``torch._inductor.fx_passes.overlap_scheduling``: ``schedule_overlap_bucketing`` and its estimators."""
    with private_api("torch._inductor.fx_passes.overlap_scheduling"):
        from torch._inductor.fx_passes import overlap_scheduling

    return overlap_scheduling


OVERLAP_SCHEDULER_ARGS = (
    "collective_bucketing",
    "insert_overlap_deps",
    "custom_runtime_estimation",
    "collective_estimator",
    "compute_estimator",
    "max_memory_increase_gb",
    "max_memory_increase_ratio",
    "max_in_flight_gb",
    "pre_bucketing_fsdp_collectives",
)
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
    return (
        f"auto_bucketing needs PyTorch's overlap scheduler of torch 2.13; torch {torch.__version__}'s "
        f"overlap_scheduling lacks {', '.join(missing)}"
    )


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


def inductor_compile(
    gm: fx.GraphModule,
    example_inputs: list,
    fake_mode,
    post_grad_pass=None,
    deterministic: bool = False,
    eager_precision: bool = False,
):
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
