"""ep_overlap: run MoE modules as two chunks and hide each chunk's all_to_alls behind the other's compute.

Contract
--------
Before tracing (``prepare_model``): the modules selected by ``compile.ep_overlap.module_fqn``
(``layers.*``: transformer blocks holding an expert-parallel MoE; ``layers.*.moe``: the MoE
layers) run as two chunks along ``compile.ep_overlap.chunk_dim`` (``graph_trainer.distributed.chunking``),
which tags every node with ``chunked_module`` and ``chunk_id``.

Reads: ``chunked_module``, ``chunk_id``, ``phase`` and ``ep_role`` (``graph_trainer.distributed.expert_parallel``)
of each node; the ``all_to_all_single`` launches of a chunked module and their ``wait_tensor``
nodes. Nodes tagged ``fsdp_role`` (parameter gathers and gradient reductions) are FSDP's, not the
chunked module's: this pass leaves them where they are; so are nodes that feed only the graph's
output (under weights resident per step, each gradient's cast to the reduction dtype, made after
the whole backward).

The pass schedules each chunked module in each phase (forward, backward) on its own
(``ChunkedModule``). Its token exchanges, per chunk in graph order, are its *rounds* (forward:
count exchange, dispatch, combine; backward: combine then dispatch). Both chunks must have the
same ``ep_role`` sequence.

Changes: the order of the graph's nodes, nothing else. Inside a chunked module the nodes are
list-scheduled (``plan_chunked_module``):

- chunk order: forward 0 then 1, backward 1 then 0 (autograd runs the later chunk first);
- first any ready node on the way to a not yet issued all_to_all (its ``launch path``), by
  (round, chunk order): so both chunks issue round ``r`` before either waits on it;
- then a wait, the earliest (round, chunk order) first; before a wait on a token exchange
  (dispatch / combine) every ready node that is on no launch path (the other chunk's remaining
  work, shared experts, expert weight gradients, attention backward) runs first and hides it.
  Count exchanges (E integers) are waited on at once: compute is kept for the token exchanges.

The graph order is then a priority topological sort: a chunked module's nodes take its original
positions in their planned order, every other node keeps its position, data dependencies and
the order of reads and writes of every in-place-mutated tensor are kept. Every node is emitted
exactly once; none is added, removed or changed.

Guarantees: ``verify_schedule`` checks, for every chunked module and round, that the first chunk's
all_to_all is issued before the second's and both before the first of their waits; the pass
raises ``PassError`` naming the module if the order it meant did not take effect.

Numerics: only the order changes; every node computes the same value from the same inputs,
so the losses are bitwise those of the chunked graph in traced order
(``compile.ep_overlap.reorder = false``). Chunking itself is not bitwise vs not chunking
(see ``graph_trainer.distributed.chunking``).

Errors (config validation, one line): expert parallelism off (``parallelism.ep`` 1, or a dense
model), a chunk dimension whose size is odd or < 2, an unknown ``chunk_dim``; when the model is
built: ``seq`` chunks of modules that are not MoE layers (attention mixes positions), a
``module_fqn`` that selects no module holding an expert-parallel MoE. Under pipeline parallelism a
rank whose stages hold only dense blocks has nothing to chunk: its graphs pass unchanged.
"""

from __future__ import annotations

import heapq
import logging
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch.fx as fx
import torch.nn as nn

from graph_trainer.compiler.passes.registry import PassContext, PassError, PassSpec
from graph_trainer.distributed.chunking import CHUNK_DIMS, install_chunking, match_modules
from graph_trainer.distributed.expert_parallel import ExpertParallelDispatcher
from graph_trainer.errors import ConfigError
from graph_trainer.graph import tags
from graph_trainer.graph.collectives import ALL_TO_ALL, PairingError, wait_of
from graph_trainer.graph.ops import mutated_args
from graph_trainer.graph.tags import BACKWARD, CHUNK_ID, CHUNKED_MODULE, COUNT_EXCHANGE, EP_ROLE, FORWARD, FSDP_ROLE

logger = logging.getLogger("graph_trainer")

NAME = "ep_overlap"
PHASE_CHUNK_ORDER = {FORWARD: (0, 1), BACKWARD: (1, 0)}


@dataclass
class ChunkedModule:
    """One chunked module in one phase."""

    fqn: str
    phase: str
    nodes: list[fx.Node] = field(default_factory=list)
    """ChunkedModule nodes in graph order."""
    launches: dict[int, list[fx.Node]] = field(default_factory=lambda: defaultdict(list))
    """all_to_all launches of each chunk, in graph order (index = round)."""

    @property
    def name(self) -> str:
        return f"{self.fqn} ({self.phase})"

    @property
    def chunk_order(self) -> tuple[int, int]:
        return PHASE_CHUNK_ORDER[self.phase]

    def roles(self, chunk: int) -> list[str]:
        return [tags.get(n, EP_ROLE, "?") for n in self.launches[chunk]]


def _wait_of(launch: fx.Node) -> fx.Node:
    try:
        return wait_of(launch)
    except PairingError as e:
        raise PassError(f"{NAME}: {e}") from None


def _only_returned(node: fx.Node) -> bool:
    """Whether ``node`` feeds nothing but the graph's output (e.g. a gradient cast to the reduction
    dtype after the whole backward): the step's result, not the module's work, so it keeps its
    place; planning it with the module would stretch the module's slots to the end of the graph."""
    return bool(node.users) and all(user.op == "output" for user in node.users)


def find_chunked_modules(graph: fx.Graph) -> list[ChunkedModule]:
    """The chunked modules of ``graph``, each in its forward and its backward, with their all_to_all launches."""
    found: dict[tuple[str, str], ChunkedModule] = {}
    for node in graph.nodes:
        fqn, phase = tags.get(node, CHUNKED_MODULE), tags.phase(node)
        if fqn is None or phase not in PHASE_CHUNK_ORDER or tags.has(node, FSDP_ROLE) or _only_returned(node):
            continue
        module = found.setdefault((fqn, phase), ChunkedModule(fqn, phase))
        module.nodes.append(node)
        if node.target is ALL_TO_ALL and tags.has(node, CHUNK_ID):
            module.launches[tags.get(node, CHUNK_ID)].append(node)
    for module in found.values():
        if not any(module.launches.values()):
            raise PassError(
                f"{NAME}: chunked module {module.name} has no all_to_all; ep_overlap needs expert parallelism"
            )
        if module.roles(0) != module.roles(1):
            raise PassError(
                f"{NAME}: the two chunks of {module.name} exchange tokens differently: "
                f"{module.roles(0)} vs {module.roles(1)}"
            )
    return list(found.values())


def _launch_paths(module: ChunkedModule, members: set[fx.Node], waits: set[fx.Node]) -> dict[fx.Node, int]:
    """Non-wait nodes of ``module`` that an all_to_all launch needs -> the earliest round needing them."""
    round_of: dict[fx.Node, int] = {}
    rounds = len(module.launches[0])
    for round_ in range(rounds):
        for chunk in module.chunk_order:
            stack = [module.launches[chunk][round_]]
            while stack:
                node = stack.pop()
                if node in round_of or node in waits or node not in members:
                    continue
                round_of[node] = round_
                stack.extend(node.all_input_nodes)
    return round_of


def plan_chunked_module(module: ChunkedModule) -> list[fx.Node]:
    """The module's nodes in the order described in the module docstring (a topological order)."""
    members = set(module.nodes)
    index = {n: i for i, n in enumerate(module.nodes)}
    rank = {chunk: r for r, chunk in enumerate(module.chunk_order)}
    wait_round: dict[fx.Node, tuple[int, int]] = {}
    for chunk, launches in module.launches.items():
        for round_, launch in enumerate(launches):
            wait_round[_wait_of(launch)] = (round_, rank[chunk])
    launch_round = _launch_paths(module, members, set(wait_round))

    def chunk_rank(node: fx.Node) -> int:
        chunk = tags.get(node, CHUNK_ID)
        return -1 if chunk is None else rank[chunk]  # the split and the concatenation serve both

    def key(node: fx.Node) -> tuple:
        if node in wait_round:
            return (*wait_round[node], index[node])
        if node in launch_round:
            return (launch_round[node], chunk_rank(node), index[node])
        return (chunk_rank(node), index[node])

    missing = {n: sum(1 for i in n.all_input_nodes if i in members) for n in module.nodes}
    on_path: list[tuple] = []
    waits: list[tuple] = []
    others: list[tuple] = []

    def push(node: fx.Node) -> None:
        heap = waits if node in wait_round else on_path if node in launch_round else others
        heapq.heappush(heap, (key(node), index[node], node))

    for node in module.nodes:
        if missing[node] == 0:
            push(node)
    order: list[fx.Node] = []
    while on_path or waits or others:
        if on_path:
            heap = on_path
        elif waits and (not others or tags.get(waits[0][2], EP_ROLE) == COUNT_EXCHANGE):
            heap = waits
        else:
            heap = others if others else waits
        node = heapq.heappop(heap)[2]
        order.append(node)
        for user in node.users:
            if user in members:
                missing[user] -= 1
                if missing[user] == 0:
                    push(user)
    if len(order) != len(module.nodes):
        raise PassError(
            f"{NAME}: chunked module {module.name} depends on itself through nodes outside it; "
            f"planned {len(order)} of {len(module.nodes)} nodes"
        )
    return order


def _mutation_edges(graph: fx.Graph) -> dict[fx.Node, list[fx.Node]]:
    """Extra predecessors keeping every read and write of an in-place-mutated tensor in order."""
    mutated = {value for node in graph.nodes for value in mutated_args(node)}
    position = {n: i for i, n in enumerate(graph.nodes)}
    edges: dict[fx.Node, list[fx.Node]] = defaultdict(list)
    for tensor in mutated:
        users = sorted(tensor.users, key=position.__getitem__)
        for before, after in zip(users, users[1:], strict=False):
            edges[after].append(before)
    return edges


def _predecessors(graph: fx.Graph) -> dict[fx.Node, set[fx.Node]]:
    """What each node must come after: its inputs, and the earlier reads and writes of any
    in-place-mutated tensor it reads or writes."""
    extra = _mutation_edges(graph)
    return {n: set(n.all_input_nodes) | set(extra.get(n, ())) for n in graph.nodes}


def _inputs_to_hoist(
    order: list[fx.Node], position: dict[fx.Node, int], preds: dict[fx.Node, set[fx.Node]]
) -> list[fx.Node]:
    """Nodes outside a chunked module, placed after its first node, that its nodes need (and their
    own such predecessors): the plan assumes every outside input is ready when the module starts."""
    members = set(order)
    start = min(position[n] for n in order)
    hoist: set[fx.Node] = set()
    stack = [i for n in order for i in preds[n] if i not in members and position[i] > start]
    while stack:
        node = stack.pop()
        if node in hoist:
            continue
        hoist.add(node)
        for i in preds[node]:
            if i in members:
                raise PassError(
                    f"{NAME}: {node.name} outside the chunked module both needs and feeds its nodes "
                    f"({i.name}); cannot schedule the module as a whole"
                )
            if position[i] > start:
                stack.append(i)
    return sorted(hoist, key=position.__getitem__)


def reorder_graph(graph: fx.Graph, orders: list[list[fx.Node]]) -> None:
    """Topologically re-emit ``graph``: each chunked module's nodes in their planned order on its
    slots, the outside nodes they need just before it, every other node in place."""
    nodes = list(graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    preds = _predecessors(graph)
    priority = {n: (i, 0) for n, i in position.items()}
    for order in orders:
        start = min(position[n] for n in order)
        for node in _inputs_to_hoist(order, position, preds):
            priority[node] = (start, -1, position[node])
        for node, slot in zip(order, sorted(position[n] for n in order), strict=True):
            priority[node] = (slot, 0)
    users: dict[fx.Node, list[fx.Node]] = defaultdict(list)
    for node, before in preds.items():
        for b in before:
            users[b].append(node)
    missing = {n: len(p) for n, p in preds.items()}
    ready = [(priority[n], position[n], n) for n in nodes if missing[n] == 0]
    heapq.heapify(ready)
    emitted: list[fx.Node] = []
    while ready:
        node = heapq.heappop(ready)[2]
        emitted.append(node)
        for user in users[node]:
            missing[user] -= 1
            if missing[user] == 0:
                heapq.heappush(ready, (priority[user], position[user], user))
    if len(emitted) != len(nodes):
        raise PassError(f"{NAME}: the graph has a cycle; emitted {len(emitted)} of {len(nodes)} nodes")
    output = graph.output_node()
    for node in emitted:
        if node.op not in ("placeholder", "output"):
            output.prepend(node)


def verify_schedule(graph: fx.Graph) -> list[str]:
    """What is wrong with the EP schedule of ``graph`` (empty: every chunked module is as intended)."""
    position = {n: i for i, n in enumerate(graph.nodes)}
    problems = []
    for module in find_chunked_modules(graph):
        first, second = module.chunk_order
        for round_, (a, b) in enumerate(zip(module.launches[first], module.launches[second], strict=True)):
            first_wait = min(position[_wait_of(a)], position[_wait_of(b)])
            if not position[a] < position[b] < first_wait:
                problems.append(
                    f"{module.name} round {round_} ({tags.get(a, EP_ROLE)}): chunk {first} issued at "
                    f"{position[a]}, chunk {second} at {position[b]}, first wait at {first_wait}"
                )
    return problems


def schedule_chunked_modules(gm: fx.GraphModule, modules: list[ChunkedModule]) -> None:
    """Plan every chunked module, reorder the graph, and check the result (``PassError`` if it is not
    as intended). Also used by ``auto_bucketing`` to restore the schedule after PyTorch's."""
    before = set(gm.graph.nodes)
    reorder_graph(gm.graph, [plan_chunked_module(m) for m in modules])
    if set(gm.graph.nodes) != before or len(gm.graph.nodes) != len(before):
        raise PassError(f"{NAME}: reordering changed the set of nodes")
    problems = verify_schedule(gm.graph)
    if problems:
        raise PassError(
            f"{NAME}: the intended schedule did not take effect in {len(problems)} places; first: {problems[0]}"
        )
    gm.recompile()


def ep_overlap(gm: fx.GraphModule, context: PassContext) -> fx.GraphModule:
    modules = find_chunked_modules(gm.graph)
    if not modules and not any(tags.has(n, EP_ROLE) for n in gm.graph.nodes):
        logger.info("%s: no expert-parallel MoE in this graph (a pipeline stage of dense blocks)", NAME)
        return gm
    if not modules:
        raise PassError(
            f"{NAME}: the graph has no chunked modules (the model was not prepared with ep_overlap's chunking)"
        )
    if not reorders(context.config):
        logger.info(
            "%s: %d chunked modules (per phase), traced order kept (compile.ep_overlap.reorder = false)",
            NAME,
            len(modules),
        )
        return gm
    schedule_chunked_modules(gm, modules)
    rounds = sum(len(r.launches[0]) for r in modules)
    logger.info(
        "%s: %d chunked modules (per phase; %d token-exchange rounds) scheduled: both chunks issue each "
        "all_to_all before either waits",
        NAME,
        len(modules),
        rounds,
    )
    return gm


def reorders(config: Any) -> bool:
    """Whether a job's ep_overlap schedules its chunked modules (it does unless ``reorder`` is off)."""
    return config is None or bool(config.compile.ep_overlap.reorder)


# --------------------------------------------------------------------------------------
# Configuration and model preparation


def is_ep_moe(module: nn.Module) -> bool:
    """Whether ``module`` is a MoE layer whose tokens cross expert-parallel ranks."""
    return isinstance(getattr(module, "token_dispatcher", None), ExpertParallelDispatcher)


def check_config(cfg: Any, degrees: dict[str, int]) -> None:
    settings = cfg.compile.ep_overlap
    if degrees.get("ep", 1) <= 1:
        raise ConfigError(
            f"compile.passes: {NAME} overlaps expert-parallel all_to_alls and needs a MoE model "
            f"with parallelism.ep > 1 (got ep = {degrees.get('ep', 1)}, model {cfg.model.name})"
        )
    if settings.chunk_dim not in CHUNK_DIMS:
        raise ConfigError(
            f"compile.ep_overlap.chunk_dim = {settings.chunk_dim!r} is not allowed; choose one of: "
            f"{', '.join(CHUNK_DIMS)}"
        )
    size_name = "training.local_batch_size" if settings.chunk_dim == "batch" else "training.seq_len"
    size = cfg.training.local_batch_size if settings.chunk_dim == "batch" else cfg.training.seq_len
    if size < 2 or size % 2:
        raise ConfigError(
            f"{NAME} splits the {settings.chunk_dim} dimension into 2 equal chunks: {size_name} = "
            f"{size} must be even and >= 2"
        )
    if not settings.module_fqn.strip():
        raise ConfigError("compile.ep_overlap.module_fqn is empty; use 'layers.*' or 'layers.*.moe'")


def chunk_selected_modules(model: nn.Module, settings: Any, is_moe: Callable, what: str) -> list[str]:
    """Install two-chunk execution on the modules ``settings.module_fqn`` selects that hold a MoE
    layer (``is_moe``; ``what`` names such a layer in errors); their FQNs. ``seq`` chunks only MoE
    layers themselves: attention mixes positions. A pipeline rank whose stages hold no such layer
    (DeepSeek-V3's dense first blocks) has nothing to chunk: none."""
    if not any(is_moe(m) for m in model.modules()):
        return []
    matched = match_modules(model, settings.module_fqn)
    selected = [fqn for fqn, module in matched if any(is_moe(m) for m in module.modules())]
    if not selected:
        raise ConfigError(
            f"compile.ep_overlap.module_fqn = {settings.module_fqn!r} selects no module holding {what} "
            f"(matched {len(matched)} modules); use 'layers.*' or 'layers.*.moe'"
        )
    not_moe = [fqn for fqn, module in matched if fqn in selected and not is_moe(module)]
    if settings.chunk_dim == "seq" and not_moe:
        raise ConfigError(
            f"compile.ep_overlap.chunk_dim = 'seq' needs MoE layers (tokens routed one by one), "
            f"but module_fqn = {settings.module_fqn!r} selects {not_moe[0]} (attention mixes "
            "positions); use module_fqn = 'layers.*.moe' or chunk_dim = 'batch'"
        )
    install_chunking(model, selected, settings.chunk_dim)
    return selected


def prepare_model(model: nn.Module, cfg: Any) -> None:
    """Install two-chunk execution on the selected modules holding an expert-parallel MoE (before tracing)."""
    settings = cfg.compile.ep_overlap
    selected = chunk_selected_modules(model, settings, is_ep_moe, "an expert-parallel MoE")
    where = f" ({selected[0]} ...)" if selected else " (this pipeline rank holds no MoE layer)"
    logger.info("%s: %d modules run as 2 chunks along %s%s", NAME, len(selected), settings.chunk_dim, where)


EP_OVERLAP = PassSpec(
    NAME,
    ep_overlap,
    "two-chunk MoE modules; each all_to_all hidden behind the other chunk's compute",
    check_config,
    prepare_model,
)

__all__ = [
    "EP_OVERLAP",
    "chunk_selected_modules",
    "ChunkedModule",
    "ep_overlap",
    "find_chunked_modules",
    "is_ep_moe",
    "plan_chunked_module",
    "reorder_graph",
    "reorders",
    "schedule_chunked_modules",
    "verify_schedule",
]
