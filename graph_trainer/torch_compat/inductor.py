"""Private APIs of Inductor: the overlap scheduler (its compute estimate, swapped for ours inside
one context manager on torch 2.11 and 2.13 alike, and its counters), FX partition fusing, custom
graph passes, standalone compilation inside a trace, its generated-code log and its cache folder."""

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
    "max_memory_increase_gb",
    "max_memory_increase_ratio",
    "max_in_flight_gb",
)
"""The arguments of ``schedule_overlap_bucketing`` that ``auto_bucketing`` passes on every supported torch."""

ESTIMATED_COMPUTE_ARGS = {"compute_estimator": "analytical", "pre_bucketing_fsdp_collectives": False}
"""The further arguments torch 2.13's scheduler takes, set so that it estimates compute instead of
benchmarking it and buckets nothing before it schedules. torch 2.11 has neither: it always estimates
compute through ``benchmark_node`` (which ``roofline_estimate`` replaces) and never pre-buckets."""

ROOFLINE, BENCHMARK = "roofline", "benchmark"
"""How an overlap scheduler gets the runtime of a compute node (``compute_estimate_api``)."""

_ALIGN = "_align_compute_nodes_runtime_estimations_across_all_distributed_ranks"
"""The ``OverlapScheduler`` method that aligns benchmarked estimates across ranks (torch 2.11)."""

_API_ENTRIES = {
    ROOFLINE: ("estimate_roofline_runtime_ms",),
    BENCHMARK: ("benchmark_node", "benchmark_node_with_cache_key", f"OverlapScheduler.{_ALIGN}"),
}
"""The ``overlap_scheduling`` attributes each way of estimating compute goes through."""


def _has_entry(module, dotted: str) -> bool:
    owner = module
    for name in dotted.split("."):
        if not hasattr(owner, name):
            return False
        owner = getattr(owner, name)
    return True


def compute_estimate_api(module) -> str | None:
    """How ``module`` (``overlap_scheduling``) estimates a compute node; None if neither way is there.

    ``ROOFLINE`` (torch 2.13 and later): ``estimate_roofline_runtime_ms(node)`` for every compute
    node, and with ``compute_estimator="analytical"`` nothing else (no benchmark, no cross-rank
    alignment). ``BENCHMARK`` (torch 2.11): every compute node goes through
    ``benchmark_node_with_cache_key``: an on-disk cache of earlier runs (Inductor's cache folder)
    first, then ``custom_runtime_estimation``, then a GPU benchmark; the values are aligned across
    ranks (``all_gather_object`` over the default group, medians) before scheduling, with an
    analytical roofline estimate alongside for the log that needs CUDA (an ``AssertionError`` on
    CPU). Neither the cache nor the alignment is right for a model-driven estimate: a stale cache
    entry would outvote the cost model, and ranks of different pipeline stages gather lists of
    different lengths."""
    for api in (ROOFLINE, BENCHMARK):
        if all(_has_entry(module, entry) for entry in _API_ENTRIES[api]):
            return api
    return None


def overlap_scheduler_problem() -> str | None:
    """Why this torch's overlap scheduler cannot run ``auto_bucketing`` (None: it can)."""
    import inspect

    try:
        module = overlap_scheduling_module()
    except TorchCompatError as e:
        return str(e)
    api = compute_estimate_api(module)
    if api is None:
        missing = [entry for entries in _API_ENTRIES.values() for entry in entries if not _has_entry(module, entry)]
    else:
        params = inspect.signature(module.schedule_overlap_bucketing).parameters
        wanted = OVERLAP_SCHEDULER_ARGS + (tuple(ESTIMATED_COMPUTE_ARGS) if api == ROOFLINE else ())
        missing = [f"argument {name}" for name in wanted if name not in params]
    if not missing:
        return None
    return (
        f"auto_bucketing needs PyTorch's overlap scheduler of torch 2.11 or 2.13; torch {torch.__version__}'s "
        f"overlap_scheduling lacks {', '.join(missing)}"
    )


@contextlib.contextmanager
def _swapped(owner, replacements: dict):
    """``owner``'s attributes set to ``replacements`` inside the block, the originals back on exit."""
    originals = {name: getattr(owner, name) for name in replacements}
    for name, value in replacements.items():
        setattr(owner, name, value)
    try:
        yield
    finally:
        for name, value in originals.items():
            setattr(owner, name, value)


@contextlib.contextmanager
def roofline_estimate(estimate_ms):
    """Temporarily make PyTorch's overlap scheduler take ``estimate_ms(node) -> milliseconds`` as
    the runtime of every compute node, whatever the device: never a GPU probe or benchmark.

    torch 2.13 (``ROOFLINE``): ``estimate_roofline_runtime_ms`` is called for every compute node
    even when ``custom_runtime_estimation`` is given, and without a GPU it crashes (it probes the
    memory bandwidth through Triton: ``RuntimeError: 0 active drivers``): it becomes
    ``estimate_ms``. torch 2.11 (``BENCHMARK``): ``benchmark_node`` and
    ``benchmark_node_with_cache_key`` return ``estimate_ms(node)`` (no cache, no random inputs, no
    benchmark), and the cross-rank alignment is skipped, as 2.13 skips it for analytical
    estimates: every rank computes the same numbers from the same graph (``compute_estimate_api``
    says why the alignment must go). The originals come back on exit, also on errors."""
    module = overlap_scheduling_module()
    api = compute_estimate_api(module)
    if api == ROOFLINE:
        with _swapped(module, {"estimate_roofline_runtime_ms": estimate_ms}):
            yield
        return
    if api is None:
        raise TorchCompatError(overlap_scheduler_problem() or "overlap_scheduling: no compute estimate to replace")

    def benchmark_with_key(node, custom_runtime_estimation=None):
        return estimate_ms(node), None  # no cache key: nothing is written to Inductor's cache

    def benchmark(node, custom_runtime_estimation=None):
        return estimate_ms(node)

    def align(scheduler):
        return None

    with (
        _swapped(module, {"benchmark_node": benchmark, "benchmark_node_with_cache_key": benchmark_with_key}),
        _swapped(module.OverlapScheduler, {_ALIGN: align}),
    ):
        yield


def run_overlap_scheduler(gm: fx.GraphModule, estimate_ms, **kwargs) -> fx.GraphModule:
    """``overlap_scheduling.schedule_overlap_bucketing(gm, **kwargs)`` with every compute node
    estimated by ``estimate_ms`` (``roofline_estimate``), and on torch 2.13 its
    ``ESTIMATED_COMPUTE_ARGS`` too, so that the same call schedules alike on 2.11 and 2.13: compute
    estimated, never benchmarked; collectives as ``kwargs`` say; no pre-bucketing."""
    module = overlap_scheduling_module()
    extra = ESTIMATED_COMPUTE_ARGS if compute_estimate_api(module) == ROOFLINE else {}
    with roofline_estimate(estimate_ms):
        return module.schedule_overlap_bucketing(gm, **kwargs, **extra)


def inductor_counters() -> collections.Counter:
    """``torch._dynamo.utils.counters["inductor"]``, where the overlap scheduler counts exposed collectives
    and the FX graph cache its hits and misses (``fxgraph_cache_hit``, ``fxgraph_cache_miss``)."""
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


def fx_graph_cache_enabled() -> bool:
    """Whether Inductor's FX graph cache is on (``torch._inductor.config.fx_graph_cache``, set from
    ``TORCHINDUCTOR_FX_GRAPH_CACHE``): a second compile of the same graph then loads the first one's result."""
    with private_api("torch._inductor.config.fx_graph_cache"):
        from torch._inductor import config as inductor_config

        return bool(inductor_config.fx_graph_cache)


def default_cache_dir() -> str:
    """Inductor's cache folder when ``TORCHINDUCTOR_CACHE_DIR`` is not set (``/tmp/torchinductor_<user>``)."""
    with private_api("torch._inductor.runtime.cache_dir_utils.default_cache_dir"):
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir as inductor_default

    return inductor_default()
