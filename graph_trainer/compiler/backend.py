"""Compiler backend: the last stage of the pipeline, after the passes (``--compile.backend``).

``none`` runs the traced graph op by op (the numerics reference). ``inductor`` hands the
compute to Inductor, in one of two scopes (``--compile.inductor_scope``):

``regional`` (the default)
    The graph is cut into regions, each compiled on its own; everything between regions runs
    as before, in the same order.

    Reads: the tags ``phase``, ``module_fqn`` and ``loss_chunk`` (``graph.tags.unit_of``), the
    memory policy's ``recomputed`` copies (their ``phase`` is ``backward``), and which nodes
    are collectives (``graph.collectives``).

    Regions: maximal runs of CONSECUTIVE compute nodes, in graph order, that share a phase
    (forward / loss / backward) and a unit (a transformer block ``layers.<i>``, a row block of a
    chunked loss, or "outside the blocks": embedding, final norm, output). A region ends at every
    node that stays outside: collectives and their waits, reads of data-dependent sizes
    (``sym_size``, ``_local_scalar_dense``), ops with side effects, placeholders and the output.
    Runs of aliasing ops only (views, ``getitem``) are left op by op: there is nothing to fuse.

    Changes: each region's nodes become one ``call_function`` node (tagged ``inductor_region``
    with the region's name, ``phase`` and ``module_fqn`` of its unit) calling the
    Inductor-compiled region, at the place of the region's last node.

    Guarantees: collectives and waits are the same nodes, with the same arguments, in the same
    order, at the same places between compute (a region is a contiguous slice of the graph, so
    cutting it out moves nothing; ``collective_order`` is checked before and after). The regions
    are compiled as inference graphs (their inputs need no gradient), so Inductor sees no
    forward/backward pair to partition: what crosses from a forward region into a backward one
    is exactly what the memory policy saved, and every ``recomputed`` copy is computed where
    the policy put it (``matmul_count`` of the graphs Inductor lowers equals ours).

``full``
    The whole step, collectives included, is one Inductor graph. Inductor's scheduler may move
    compute and waits: the order of the collectives and waits in the code Inductor generated is
    compared with ours and reported (``collective_order_kept``, ``in_flight``), not enforced.
    On CPU, without passes the order is ours; after ``transformer_block_bucketing`` Inductor 2.13
    issues the collectives in our order but moves each wait up to right after its collective, so
    fewer are in flight at once (the prefetch is undone), and 2.14 reorders the collectives and
    keeps more in flight than we did (``tests/compiler/test_backend.py`` asserts both; measured:
    docs/performance.md).

Numerics: Inductor fuses ops and may compute reductions in another order, so ``inductor`` is
NOT bitwise ``none``; the bound is ``INDUCTOR_RTOL`` (``suites/cases.py``), asserted in
``tests/compiler/test_backend.py`` and the cpu suite (why: docs/numerics.md; measured: docs/performance.md).

With ``deterministic`` (the trainer's choice on CPU and with ``--debug.deterministic``) the value
of every op depends only on its inputs:

- not on the run: Inductor compiles, and the compiled code runs, under deterministic algorithms
  (see ``_named_call`` for the kernel that otherwise varies);
- not on which region holds it, i.e. not on where collectives cut the graph: a fused kernel
  rounds each intermediate to the dtype the op-by-op graph stores it in and Triton contracts no
  ``a * b + c`` into an FMA (``eager_precision``, Inductor's ``emulate_precision_casts``), and
  ``split_addmm`` undoes the one Inductor rewrite seen to join two ops into one that rounds
  differently (``mm`` + ``add`` -> ``addmm``, which fires only when both are in one region).

So under ``regional`` every value-preserving pass keeps its bitwise promise though it changes
the regions: ``transformer_block_bucketing`` and ``auto_bucketing`` move collectives (so region
boundaries), ``ep_overlap`` moves compute across collectives, so the regions hold other sets of
ops than its chunked twin's (checked in the cpu suite; the memory policy was bitwise too when
measured). ``tests/compiler/test_backend.py`` cuts a graph in two and shows both effects, fp32 and bf16.
Without ``deterministic`` (CUDA by default) Inductor fuses freely: faster, and a pass that moves
region boundaries may change the rounding.

Compile time is logged; Inductor's on-disk caches (``--compile.cache_dir``, else Inductor's
default folder) make a second start of the same job reuse the kernels, and identical blocks
compile once. ``compile_key`` names what a compile depends on, so that ranks of one host holding
the same graph can compile it once (``--compile.once_per_node``, graph_trainer/loop/gradients.py).
"""

from __future__ import annotations

import hashlib
import inspect
import logging
import operator
import os
import re
import time
import typing
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from graph_trainer import torch_compat
from graph_trainer.config import Backend, InductorScope
from graph_trainer.graph import tags
from graph_trainer.graph.collectives import collective_order, max_in_flight, stays_outside
from graph_trainer.graph.ops import ADDMM, aliases_input, matmul_count
from graph_trainer.graph.tags import FORWARD, INDUCTOR_REGION, MODULE_FQN, PHASE, STEP, unit_of

logger = logging.getLogger("graph_trainer")

BACKENDS = typing.get_args(Backend)
INDUCTOR_SCOPES = typing.get_args(InductorScope)


def _aliases_only(nodes: list[fx.Node]) -> bool:
    return all(aliases_input(n) for n in nodes)


def region_unit(node: fx.Node) -> tuple[str, str]:
    """(phase, unit) of a compute node: what a region must not mix."""
    return tags.get(node, PHASE, FORWARD), unit_of(node) or "outside_blocks"


@dataclass
class InductorRegion:
    """A run of consecutive compute nodes of one phase and one unit, compiled as one."""

    name: str
    phase: str
    unit: str
    nodes: list[fx.Node] = field(default_factory=list)


def find_inductor_regions(graph: fx.Graph) -> list[InductorRegion]:
    """The regions of ``graph`` in graph order (runs of consecutive compute nodes of one unit)."""
    regions: list[InductorRegion] = []
    current: InductorRegion | None = None
    for node in graph.nodes:
        if stays_outside(node):
            current = None
            continue
        if current is not None and node.target is operator.getitem and node.args[0] in current.nodes:
            current.nodes.append(node)  # a part of a multi-output op stays with it, whatever its tags
            continue
        phase, unit = region_unit(node)
        if current is None or (current.phase, current.unit) != (phase, unit):
            current = InductorRegion(f"region_{len(regions)}_{phase}_{unit.replace('.', '_')}", phase, unit)
            regions.append(current)
        current.nodes.append(node)
    return [r for r in regions if not _aliases_only(r.nodes)]


_GENERATED_COLLECTIVE = re.compile(r"^\s*(?:\w+ = )?torch\.ops\._c10d_functional\.(\w+)\.default\(", re.M)


def generated_collective_order(code: str) -> list[str]:
    """The collectives and waits (op names) called by Inductor's generated Python code, in order."""
    return _GENERATED_COLLECTIVE.findall(code)


def _fake_mode(gm: fx.GraphModule):
    mode = torch_compat.fake_mode_of_nodes(gm.graph.nodes)
    if mode is not None:
        return mode
    raise RuntimeError("the traced graph carries no fake values (meta['val']): it cannot be compiled")


def _example_inputs(node: fx.Node) -> list:
    return [a.meta["val"] for a in node.args]


@dataclass
class BackendReport:
    """What the backend did, for the log and the tests."""

    backend: str
    scope: str = ""
    regions: int = 0
    compiled_nodes: int = 0
    nodes_outside: int = 0
    seconds: float = 0.0
    matmuls_before: int = 0
    matmuls_lowered: int | None = None
    """Matmuls in the graphs Inductor lowered (only with ``verify``: it bypasses the cache)."""
    collective_order_kept: bool | None = None
    in_flight: tuple[int, int] | None = None
    """(traced, compiled): the most collectives issued and not yet waited for at once (``full``)."""

    def summary(self) -> str:
        if self.backend == "none":
            return "backend none: the graph runs op by op"
        text = (
            f"inductor ({self.scope}): compiled {self.regions} region(s) of {self.compiled_nodes} nodes "
            f"in {self.seconds:.1f}s, {self.nodes_outside} nodes run outside them"
        )
        if self.collective_order_kept is not None:
            text += f"; collective order {'kept' if self.collective_order_kept else 'CHANGED'}"
        if self.in_flight is not None:
            text += f" (at most {self.in_flight[1]} collectives in flight, traced {self.in_flight[0]})"
        if self.matmuls_lowered is not None:
            text += f"; matmuls {self.matmuls_before} traced, {self.matmuls_lowered} lowered"
        return text


def _parts_next_to_their_op(graph: fx.Graph) -> None:
    """Move each ``getitem`` of a multi-output op right after the op.

    A pass may leave a part's ``getitem`` later in the graph (after a collective the scheduler put
    there). A region that ends before it would have to return the op's whole tuple, which a
    compiled region cannot. A ``getitem`` computes nothing and reads only its op, so moving it
    changes no value and no order of compute or collectives."""
    for node in list(graph.nodes):
        parts = [u for u in node.users if u.target is operator.getitem]
        for part in reversed(parts):
            node.append(part)


def cut_regions(gm: fx.GraphModule) -> tuple[fx.GraphModule, list[str]]:
    """Replace every region by a ``call_module`` of a submodule holding its nodes (nothing compiled
    yet). Returns the graph and the submodule names, in graph order. Raises if the collective
    order changed (it cannot, by construction; this is the check)."""
    before = collective_order(gm.graph)
    _parts_next_to_their_op(gm.graph)
    regions = find_inductor_regions(gm.graph)
    partitions = [dict.fromkeys(r.nodes) for r in regions]
    gm = torch_compat.fuse_partitions(gm, partitions, prefix="inductor_region_")
    names = []
    calls = [n for n in gm.graph.nodes if n.op == "call_module" and n.target.startswith("inductor_region_")]
    by_index = {int(n.target.rsplit("_", 1)[1]): n for n in calls}
    for index, region in enumerate(regions):
        call = by_index[index]
        tags.replace(call, {PHASE: region.phase, MODULE_FQN: region.unit, INDUCTOR_REGION: region.name})
        names.append(call.target)
    _pass_sizes_in(gm, calls)
    after = collective_order(gm.graph)
    if after != before:
        raise RuntimeError("cutting the graph into Inductor regions changed the collective order")
    return gm, names


def split_addmm(graph: fx.Graph) -> None:
    """Compute each ``addmm(c, a, b)`` of a graph Inductor is about to lower as ``mm(a, b) + c``.

    Why: Inductor's post-grad pattern ``add(mm(a, b), c) -> addmm(c, a, b)`` fires only when the
    mm and the add are in the same compiled graph, and ``addmm`` rounds differently (BLAS
    accumulates the product into ``c``). So an op's value would depend on where region boundaries
    fall, which passes that move compute change: ep_overlap hides the shared experts' last mm behind
    a token exchange, away from the add that sums it with the routed output, and its losses were 1
    ulp off its chunked twin's until this ran. Splitting every ``addmm`` (the traced ones too: an
    op the graph holds in every schedule) makes the outcome the same in every partition. Only
    ``alpha == beta == 1``: others are never made by the pattern."""
    for node in list(graph.nodes):
        if node.target is not ADDMM or node.kwargs.get("alpha", 1) != 1 or node.kwargs.get("beta", 1) != 1:
            continue
        bias, mat1, mat2 = node.args
        with graph.inserting_before(node):
            product = graph.call_function(torch.ops.aten.mm.default, (mat1, mat2))
            total = graph.call_function(torch.ops.aten.add.Tensor, (product, bias))
        value = node.meta["val"]
        with torch_compat.fake_mode_of(value):
            product.meta = {**node.meta, "val": torch.ops.aten.mm.default(mat1.meta["val"], mat2.meta["val"])}
        total.meta = dict(node.meta)
        node.replace_all_uses_with(total)
        graph.erase_node(node)


_SPLIT_ADDMM_VERSION = (
    "graph_trainer.compiler.backend.split_addmm:"
    + hashlib.sha256(inspect.getsource(split_addmm).encode()).hexdigest()[:16]
)


def region_post_grad_pass(deterministic: bool, count_into: BackendReport | None = None):
    """What runs on each graph Inductor lowers for a region, after Inductor's own passes:
    ``split_addmm`` when ``deterministic``; with ``count_into``, counting the matmuls into its
    ``matmuls_lowered`` (a plain function: the FX graph cache is bypassed, every graph is lowered)."""
    if count_into is None:
        return torch_compat.inductor_graph_pass(split_addmm, _SPLIT_ADDMM_VERSION) if deterministic else None
    count_into.matmuls_lowered = 0

    def split_and_count(graph: fx.Graph) -> None:
        if deterministic:
            split_addmm(graph)
        count_into.matmuls_lowered += matmul_count(graph)

    return split_and_count


def compile_region(region: fx.GraphModule, example_inputs: list, fake_mode, deterministic: bool, post_grad_pass):
    """One region through Inductor (``post_grad_pass``: ``region_post_grad_pass``'s). With
    ``deterministic`` the value of every op depends only on its inputs: not on the run
    (deterministic algorithms), nor on the ops it is fused with (eager precision, ``split_addmm``)."""
    return torch_compat.inductor_compile(
        region, example_inputs, fake_mode, post_grad_pass, deterministic, eager_precision=deterministic
    )


def _symbols(value) -> set:
    """Free symbols of a traced value's sizes, strides and SymInts (tensors, or lists of them)."""
    if isinstance(value, (list, tuple)):
        return set().union(*(_symbols(v) for v in value)) if value else set()
    if isinstance(value, torch.SymInt):
        return set(torch_compat.sym_expr(value).free_symbols)
    if isinstance(value, torch.Tensor):
        return set().union(*(_symbols(v) for v in (*value.shape, *value.stride())))
    return set()


def _pass_sizes_in(gm: fx.GraphModule, calls: list[fx.Node]) -> None:
    """Give each region the data-dependent sizes it uses as inputs of their own.

    A region may hold tensors whose sizes are expressions of data-dependent symbols (an
    expert's token count ``u3``, read by ``_local_scalar_dense`` outside every region) that its
    inputs' sizes do not spell out one by one (``(u0 + u1 + u2 + u3) // 3``). Inductor must be
    able to compute every size, so the node defining each such symbol becomes an input too."""
    defining = {}
    for node in gm.graph.nodes:
        value = node.meta.get("val")
        if isinstance(value, torch.SymInt) and torch_compat.sym_expr(value).is_Symbol:
            defining.setdefault(torch_compat.sym_expr(value), node)
    for call in calls:
        submodule = getattr(gm, call.target)
        needed = set().union(*(_symbols(n.meta.get("val")) for n in submodule.graph.nodes))
        given = {
            torch_compat.sym_expr(a.meta["val"])
            for a in call.args
            if isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.SymInt)
        }
        missing = [defining[sym] for sym in sorted(needed - given, key=str) if sym in defining]
        if not missing:
            continue
        last = [n for n in submodule.graph.nodes if n.op == "placeholder"][-1]  # (not all at the top)
        for node in missing:
            with submodule.graph.inserting_after(last):
                last = submodule.graph.placeholder(node.name)
            last.meta["val"] = node.meta["val"]
        call.args = (*call.args, *missing)
        submodule.recompile()


def _compile_regions(
    gm: fx.GraphModule, names: list[str], report: BackendReport, post_grad_pass, deterministic: bool
) -> fx.GraphModule:
    fake_mode = _fake_mode(gm)
    calls = {n.target: n for n in gm.graph.nodes if n.op == "call_module"}
    for name in names:
        call = calls[name]
        submodule = getattr(gm, name)
        report.matmuls_before += matmul_count(submodule.graph)
        report.compiled_nodes += sum(1 for n in submodule.graph.nodes if n.op == "call_function")
        compiled = compile_region(submodule, _example_inputs(call), fake_mode, deterministic, post_grad_pass)
        with gm.graph.inserting_after(call):
            new = gm.graph.call_function(_named_call(compiled, name, deterministic), tuple(call.args))
        new.meta = call.meta
        call.replace_all_uses_with(new)
        gm.graph.erase_node(call)
        delattr(gm, name)
    gm.graph.lint()
    gm.recompile()
    return gm


def _named_call(compiled, name: str, deterministic: bool):
    """A plain function calling ``compiled`` (an FX call_function target needs a ``__name__``).

    ``deterministic``: the call runs under ``torch.use_deterministic_algorithms``. Inductor leaves
    some ops to ATen kernels (it lowers an accumulating ``index_put_``, e.g. the embedding's
    gradient, to ATen's when compiling deterministically), and ATen picks the kernel at run time:
    on CPU, ``index_put_`` with accumulate sums rows with parallel atomic adds once it has 2+
    threads and 32768+ elements unless deterministic algorithms are on, and the summation order,
    so the rounding, then changes run to run."""

    def run_region(*args):
        if not deterministic:
            return compiled(*args)
        with torch_compat.deterministic_algorithms():
            return compiled(*args)

    run_region.__name__ = run_region.__qualname__ = name
    return run_region


def apply_backend(
    gm: fx.GraphModule,
    backend: str,
    scope: str = "regional",
    cache_dir: str = "",
    deterministic: bool = True,
    verify: bool = False,
) -> tuple[fx.GraphModule, BackendReport]:
    """Compile ``gm`` (the graph after the passes) with ``backend``; returns the graph to run.

    ``deterministic``: compile so that every op's value depends only on its inputs, not on the
    run nor (``regional``) on the region that holds it (module docstring, "Numerics"); the trainer
    asks for it on CPU and with ``--debug.deterministic``. ``verify``: also count the matmuls of the
    graphs Inductor lowers (``matmuls_lowered``, which must equal ``matmuls_before``: nothing
    recomputed twice or merged away); compiles without the FX graph cache."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown compile.backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    report = BackendReport(backend, scope if backend == "inductor" else "")
    if backend == "none":
        return gm, report
    if scope not in INDUCTOR_SCOPES:
        raise ValueError(f"unknown compile.inductor_scope {scope!r}; choose one of {', '.join(INDUCTOR_SCOPES)}")
    if cache_dir:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.abspath(cache_dir)
    start = time.perf_counter()
    if scope == "regional":
        before = collective_order(gm.graph)
        gm, names = cut_regions(gm)
        report.regions = len(names)
        post_grad_pass = region_post_grad_pass(deterministic, report if verify else None)
        gm = _compile_regions(gm, names, report, post_grad_pass, deterministic)
        report.collective_order_kept = collective_order(gm.graph) == before
        report.nodes_outside = sum(
            1 for n in gm.graph.nodes if n.op == "call_function" and not tags.has(n, INDUCTOR_REGION)
        )
    else:
        report.matmuls_before = matmul_count(gm.graph)
        report.compiled_nodes = sum(1 for n in gm.graph.nodes if n.op == "call_function")
        example = [n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder"]
        traced = [name for name, _, _ in collective_order(gm.graph)]
        with torch_compat.inductor_output_files() as paths:
            count = region_post_grad_pass(False, report) if verify else None
            compiled = torch_compat.inductor_compile(gm, example, _fake_mode(gm), count, deterministic)
        if paths:  # the module Inductor wrote (on a cache hit too)
            with open(paths[-1]) as f:
                generated = generated_collective_order(f.read())
            report.collective_order_kept = generated == traced
            report.in_flight = (max_in_flight(traced), max_in_flight(generated))
        gm = _whole_graph_module(compiled, gm, deterministic)
        report.regions, report.nodes_outside = 1, 0
    report.seconds = time.perf_counter() - start
    return gm, report


def compile_key(gm: fx.GraphModule, backend: str, scope: str, deterministic: bool) -> str:
    """A digest of what ``apply_backend`` makes of ``gm``: its code, every input's shape, stride and
    dtype, and the settings. Two graphs with the same key compile to the same code, so the second
    compile finds the first one's result in Inductor's FX graph cache."""
    digest = hashlib.sha256(f"{backend} {scope} {deterministic}\n{gm.code}".encode())
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            val = node.meta.get("val")
            described = (tuple(val.shape), val.stride(), val.dtype) if isinstance(val, torch.Tensor) else val
            digest.update(repr(described).encode())
    return digest.hexdigest()


def _whole_graph_module(compiled, traced: fx.GraphModule, deterministic: bool) -> fx.GraphModule:
    """A GraphModule with ``traced``'s placeholders whose only compute is one call of ``compiled``
    (the step keeps one calling convention whatever the backend)."""
    graph = fx.Graph()
    inputs = [graph.placeholder(n.name) for n in traced.graph.nodes if n.op == "placeholder"]
    call = graph.call_function(_named_call(compiled, "inductor_full_step", deterministic), tuple(inputs))
    tags.replace(call, {PHASE: STEP, MODULE_FQN: "", INDUCTOR_REGION: "inductor_full_step"})
    graph.output(call)
    return fx.GraphModule(torch.nn.Module(), graph)


__all__ = [
    "BACKENDS",
    "INDUCTOR_SCOPES",
    "BackendReport",
    "InductorRegion",
    "apply_backend",
    "compile_key",
    "compile_region",
    "cut_regions",
    "find_inductor_regions",
    "generated_collective_order",
    "region_post_grad_pass",
    "region_unit",
    "split_addmm",
]
