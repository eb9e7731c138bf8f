"""Analytic cost model: how long one graph node takes on a device.

Compute nodes follow a roofline: ``max(flops / (peak(dtype) * e_flops), bytes /
(hbm_bandwidth * e_bytes)) + launch_overhead``. FLOPs are counted only for matmuls (``mm``,
``addmm``, ``bmm``, ``baddbmm``, ``_grouped_mm``, fp8 ``_scaled_mm`` and ``float8_grouped_mm``:
``2 * out.numel() * K``, at the peak of the first operand's dtype) and scaled-dot-product
attention (forward ``2*B*H*Sq*Sk*(Dqk+Dv)`` = ``4*B*H*S*S*D``, halved when causal; backward
2.5x the forward). Everything else is memory-bound: bytes are the logical sizes of the tensor
outputs plus inputs from ``node.meta["val"]``, an expanded (stride 0) input dim counted once;
ops that read less say so (gathers such as ``embedding`` read only the rows they output,
``nll_loss_forward`` one logit per target, ``nll_loss_backward`` and ``zeros_like``-style
fills write without reading). Views, ``getitem``, ``empty``, placeholders and the output cost
nothing; ``_c10d_functional`` nodes are costed by ``collective_time`` instead. Each kernel is
assumed to run alone (no fusion, no two kernels at once), which is eager PyTorch without CUDA
graphs, on a GPU kept busy by its host (host-side stalls are not modelled).

The efficiencies depend on the kernel (``devices.py`` holds the device models): ``kernel_class``
sorts every compute node into a class of ``KernelEfficiency`` (matmul, grouped_mm, scaled_mm
tensorwise / rowwise, attention forward / backward, elementwise, strided (broadcast /
non-contiguous operands, cat), dtype_cast, reduction, softmax forward / backward, scatter_add)
and a device with ``kernel_efficiency`` applies that class's fraction of the roofline: to the
FLOP side for matmuls and attention (their byte side uses ``elementwise``), to the byte side for
the rest. A device without it (``CPU_2CORE``) uses its global ``flops_efficiency`` and
``bandwidth_efficiency``. ``H100_SXM``'s classes are calibrated on profiles of real H100 steps
(the scaled matmuls on an H200's matmul rates); ``H100_KERNELS`` says from which ops and numbers.

Collectives follow NCCL's algorithms. Each rank of a group of ``n`` sends ``ring_factor * bytes``
(``collective_traffic``): ``(n-1)/n`` for all_gather, reduce_scatter and all_to_all, ``2*(n-1)/n``
for all_reduce, the whole buffer for a broadcast; ``bytes`` is ``collective_bytes`` (the full
buffer; the larger of input and output for all_to_all). Global rank ``r`` sits on node
``r // ranks_per_node`` (the group's ranks if its process group resolves, else ``n`` consecutive
ranks from 0), ``g`` of the group's ranks on a node (``GroupInfo.ranks_on_node``, the fewest on
any), one NIC per GPU. Inside a node every byte goes over NVLink. Across nodes
(``inter_node_share``): ring collectives run one ring per NIC of a node (rail-optimised), each
leaving the node through another GPU, the buffer split evenly over them; a rank's ring neighbour
is off its node in one of its ``g`` rings, so ``1/g`` of its bytes cross its NIC and ``(g-1)/g``
go over NVLink, the node's ``g`` NICs carrying the crossing together (NCCL's maintainers,
github.com/NVIDIA/nccl/issues/601: with NVLink NCCL splits an operation in N parts over N NICs;
nccl-tests' doc/PERFORMANCE.md: a ring's bus bandwidth is its bottleneck link's). An all_to_all
sends ``bytes/n`` to each peer: ``(n-g)/n`` of the buffer through its own NIC, ``(g-1)/n`` over
NVLink. A collective lasts ``collective_latency + max(NVLink bytes / NVLink bandwidth, NIC bytes
/ NIC bandwidth)`` at ``bandwidth_efficiency``, the links running at once; ``CollectiveTraffic``
keeps both parts (``analyze`` reports them). Concurrent collectives do not share bandwidth.

Data-dependent sizes (expert-parallel ``all_to_all_single`` split sizes read with
``.tolist()``) are unbacked symbols without hints. ``SizeHints.from_graph`` assigns them by
**balanced routing**: each split of an all_to_all (or of a ``split_with_sizes``) whose
tensor size is known gets ``rows / len(splits)``, so an all_to_all receives as many rows as
it sends; symbols still unknown take the mean of the resolved ones (1 if none).
"""

from __future__ import annotations

import operator
import weakref
from collections import Counter
from dataclasses import dataclass

import torch
import torch.fx as fx

from graph_trainer.analysis.devices import DeviceModel
from graph_trainer.graph import collectives
from graph_trainer.graph.collectives import collective_bytes, collective_name, group_name, group_size_arg
from graph_trainer.graph.ops import (
    ATTENTION_PREFIX,
    DENSE_MATMULS,
    FLOAT8_GROUPED_MM,
    GROUPED_MM,
    SCALED_MM,
    is_view,
    name_of,
    named_args,
)
from graph_trainer.graph.sizes import SizeHints, tensors_in, value_of
from graph_trainer.torch_compat import is_op_overload, resolve_process_group, sym_expr

aten = torch.ops.aten


# ---------------------------------------------------------------------------------------
# Compute


_ZERO_COST = {
    operator.getitem,
    aten._unsafe_view.default,
    aten.empty.memory_format,
    aten.empty_strided.default,
    aten.sym_size.int,
    aten.sym_numel.default,
    aten.sym_stride.int,
}
_GATHER_LIKE = {aten.embedding.default: 1, aten.index_select.default: 2, aten.gather.default: 2, aten.index.Tensor: 1}
"""Ops that read only the rows they output: position of their index argument."""
FILLS = {
    aten.zeros.default,
    aten.ones.default,
    aten.full.default,
    aten.zeros_like.default,
    aten.ones_like.default,
    aten.full_like.default,
    aten.new_zeros.default,
    aten.new_ones.default,
    aten.new_full.default,
    aten.fill.Scalar,
    aten.fill_.Scalar,
    aten.zero_.default,
    aten.scalar_tensor.default,
}
"""Ops that write their output without reading a tensor input (at most a 0-d value)."""
# Kernel classes by op name (overload-independent), see ``kernel_class``.
_COMPUTE_CLASSES = set(
    "matmul grouped_mm scaled_mm_tensorwise scaled_mm_rowwise attention_forward attention_backward".split()
)
_SOFTMAX_FORWARD = {"_log_softmax", "_softmax", "_safe_softmax"}
_SOFTMAX_BACKWARD = {"_log_softmax_backward_data", "_softmax_backward_data"}
_SCATTER_ADD = set(
    "index_add index_add_ scatter_add scatter_add_ scatter_reduce scatter_reduce_ _embedding_bag_backward".split()
)
_REDUCTIONS = set(
    "sum mean amax amin max min prod var var_mean std norm linalg_vector_norm argmax argmin any all logsumexp "
    "cumsum cumprod topk sort histc".split()
)
_CONCATS = {"cat", "stack"}
_CASTS = {"_to_copy", "to", "copy", "copy_", "_to_dtype"}


def _attention_flops(node: fx.Node, hints: SizeHints) -> tuple[float, torch.dtype] | None:
    """FLOPs of an SDPA forward/backward op with (B, H, S, D) inputs, or None if not one."""
    opname = name_of(node)
    if not opname.startswith(ATTENTION_PREFIX):
        return None  # low-level (B, S, H, D) kernels (_flash_attention_forward ...) are not counted
    args = named_args(node)
    q, k, v = (value_of(args.get(n)) for n in ("query", "key", "value"))
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (q, k, v)):
        return None
    b, h, sq, dqk = (hints.concrete(d) for d in q.shape)
    sk, dv = hints.concrete(k.shape[2]), hints.concrete(v.shape[3])
    flops = 2.0 * b * h * sq * sk * (dqk + dv)
    if args.get("is_causal", False):
        flops /= 2
    if opname.endswith("_backward"):
        flops *= 2.5
    return flops, q.dtype


def node_flops(node: fx.Node, hints: SizeHints | None = None) -> tuple[float, torch.dtype | None]:
    """(FLOPs, dtype deciding the peak) of a matmul or attention node; (0, None) otherwise."""
    hints = hints or SizeHints()
    if node.op != "call_function" or not is_op_overload(node.target):
        return 0.0, None
    out = value_of(node)
    if node.target in DENSE_MATMULS or node.target in (GROUPED_MM, SCALED_MM):
        a = value_of(node.args[DENSE_MATMULS.get(node.target, 0)])
        b = value_of(node.args[DENSE_MATMULS.get(node.target, 0) + 1])
        k = hints.concrete(a.shape[-1])
        numel = hints.numel(out)
        if node.target == GROUPED_MM and a.dim() == 2 and b.dim() == 2:
            numel //= max(1, hints.concrete(out.shape[0]))  # (G, M, N) out; K is split over groups
        return 2.0 * numel * k, a.dtype
    if name_of(node) == FLOAT8_GROUPED_MM:  # (each row block against one expert's [N, K])
        a, b = value_of(node.args[0]), value_of(node.args[2])
        return 2.0 * hints.numel(out) * hints.concrete(b.shape[-1]), a.dtype
    attention = _attention_flops(node, hints)
    return attention if attention is not None else (0.0, None)


def node_bytes(node: fx.Node, hints: SizeHints | None = None) -> int:
    """Bytes a kernel reads and writes: tensor inputs plus outputs (logical sizes), except for
    ops that read only part of an input (gathers, ``nll_loss``) or none of it (``*_like`` fills)."""
    hints = hints or SizeHints()
    out = hints.nbytes(value_of(node))
    if node.target in _GATHER_LIKE:  # reads only the gathered rows, plus the indices
        index = node.args[_GATHER_LIKE[node.target]]
        return 2 * out + hints.nbytes(
            value_of([i for i in index if i is not None] if isinstance(index, list) else index)
        )
    if node.target in FILLS:  # writes its output, reads at most a scalar
        return out
    if node.target == aten.nll_loss_forward.default:
        # Reads one logit per target (a gather), not the whole (N, vocab) input.
        target = value_of(node.args[1])
        return out + hints.nbytes(target) + hints.numel(target) * value_of(node.args[0]).element_size()
    if node.target == aten.nll_loss_backward.default:
        # Zero-fills the (N, vocab) gradient and scatters one value per target; never reads
        # ``self`` (the profiled kernels: fill_ 1.27 ms + a 12 us scatter at 8192 x 128256).
        return out + hints.nbytes(value_of(node.args[2]))
    return out + sum(read_bytes(t, hints) for a in node.all_input_nodes for t in tensors_in(value_of(a)))


def read_bytes(t: torch.Tensor, hints: SizeHints) -> int:
    """Bytes a kernel reads from input ``t``: an expanded (stride 0) dim is read once."""
    n = t.element_size()
    for size, stride in zip(t.shape, t.stride() if t.layout == torch.strided else (1,) * t.dim(), strict=True):
        # Structural test on symbolic strides: comparing an unbacked one would guard on it.
        if (sym_expr(stride) if isinstance(stride, torch.SymInt) else stride) != 0:
            n *= hints.concrete(size)
    return n


def is_free(node: fx.Node) -> bool:
    """Nodes that launch no kernel: placeholders, output, views, getitem, sym arithmetic."""
    if node.op != "call_function":
        return True
    if not is_op_overload(node.target):
        return True  # operator.* on SymInts and other Python-level calls
    return node.target in _ZERO_COST or is_view(node)


def kernel_class(node: fx.Node, hints: SizeHints | None = None) -> str:
    """The ``KernelEfficiency`` field that applies to ``node``'s kernel (a compute node)."""
    target = node.target
    if target in DENSE_MATMULS:
        return "matmul"
    if target == GROUPED_MM:
        return "grouped_mm"
    if name_of(node) == FLOAT8_GROUPED_MM:  # (one rowwise _scaled_mm per expert)
        return "scaled_mm_rowwise"
    if target == SCALED_MM:
        scale_a = value_of(node.args[2])
        rowwise = isinstance(scale_a, torch.Tensor) and (hints or SizeHints()).numel(scale_a) > 1
        return "scaled_mm_rowwise" if rowwise else "scaled_mm_tensorwise"
    name = name_of(node)
    if name.startswith(ATTENTION_PREFIX):
        return "attention_backward" if name.endswith("_backward") else "attention_forward"
    if name in _SOFTMAX_FORWARD:
        return "softmax_forward"
    if name in _SOFTMAX_BACKWARD:
        return "softmax_backward"
    if name in _SCATTER_ADD or (name in ("index_put", "index_put_") and named_args(node).get("accumulate")):
        return "scatter_add"
    if name in _REDUCTIONS:
        return "reduction"
    if name in _CONCATS:
        return "strided"
    if name in _CASTS and _changes_dtype(node):
        return "dtype_cast"
    if _has_strided_operand(node, hints or SizeHints()):
        return "strided"
    return "elementwise"


def _changes_dtype(node: fx.Node) -> bool:
    """Whether a copy's tensor input (``_to_copy(x)``, ``copy(dst, src)``) differs in dtype from its output."""
    out = value_of(node)
    return isinstance(out, torch.Tensor) and any(
        t.dtype != out.dtype for a in node.all_input_nodes for t in tensors_in(value_of(a))
    )


def _has_strided_operand(node: fx.Node, hints: SizeHints) -> bool:
    """Whether a pointwise op has a broadcast operand (fewer elements than the output, more
    than one) or a non-contiguous one: PyTorch then runs its generic, non-vectorized kernel."""
    out = tensors_in(value_of(node))
    if not out or torch.Tag.pointwise not in getattr(node.target, "tags", ()):
        return False
    out_numel = hints.numel(out[0])
    for arg in node.all_input_nodes:
        t = value_of(arg)
        if not isinstance(t, torch.Tensor):
            continue
        numel = hints.numel(t)
        if 1 < numel < out_numel:
            return True
        if numel > 1 and not _is_contiguous(t):
            return True
    return False


_CONTIGUOUS: dict[int, tuple[weakref.ref, bool]] = {}
"""``id(tensor)`` -> (a reference to the tensor, whether it is contiguous): a value is asked about
once for each of its readers in each graph piece simulated."""


def _is_contiguous(t: torch.Tensor) -> bool:
    """Whether ``t`` is contiguous; a tensor whose strides hold unbacked sizes is taken as dense.
    Answered once per tensor: for those tensors torch raises, formatting a stack trace into the
    error each time (milliseconds a call)."""
    known = _CONTIGUOUS.get(id(t))
    if known is not None and known[0]() is t:
        return known[1]
    try:
        contiguous = bool(t.is_contiguous())
    except Exception:  # data-dependent strides of unbacked sizes: assume dense
        contiguous = True
    _CONTIGUOUS[id(t)] = (weakref.ref(t), contiguous)
    return contiguous


def node_compute_time(node: fx.Node, device: DeviceModel, hints: SizeHints | None = None) -> float:
    """Seconds ``node`` occupies the compute stream (0 for free nodes and collectives)."""
    if is_free(node) or collective_name(node) is not None:
        return 0.0
    if hints is None:
        hints = SizeHints.from_graph(node.graph)
    if node.target == aten._local_scalar_dense.default:
        return device.launch_overhead  # a device-to-host read of one scalar
    flops, dtype = node_flops(node, hints)
    flops_eff, bytes_eff = _efficiencies(node, device, hints)
    t_compute = flops / (device.peak_flops(dtype) * flops_eff) if flops else 0.0
    t_memory = node_bytes(node, hints) / (device.hbm_bandwidth * bytes_eff)
    return max(t_compute, t_memory) + device.launch_overhead


def _efficiencies(node: fx.Node, device: DeviceModel, hints: SizeHints) -> tuple[float, float]:
    """(FLOP-side, byte-side) roofline efficiency of ``node`` on ``device``."""
    eff = device.kernel_efficiency
    if eff is None:
        return device.flops_efficiency, device.bandwidth_efficiency
    cls = kernel_class(node, hints)
    if cls in _COMPUTE_CLASSES:
        return getattr(eff, cls), eff.elementwise
    return 1.0, getattr(eff, cls)  # memory classes: the FLOP side is 0 anyway


# ---------------------------------------------------------------------------------------
# Collectives


def _resolve_group(group_name: str):
    """The live ProcessGroup named ``group_name``, or None (private c10d API; see torch_compat)."""
    try:
        return resolve_process_group(group_name)
    except Exception:  # not registered in this process (e.g. a graph from elsewhere)
        return None


@dataclass(frozen=True)
class GroupInfo:
    """A collective's process group as the link model sees it."""

    size: int
    spans_nodes: bool
    ranks_on_node: int
    """Ranks of the group on each node it occupies, the fewest on any one of them (``size``
    when it does not span nodes): the NICs a ring spreads its node-crossing bytes over."""


def group_info(node: fx.Node, ranks_per_node: int = 8, group_size: int | None = None) -> GroupInfo:
    """Size of a collective's group, whether it crosses nodes and how many of its ranks share a node.

    The size is ``group_size`` if given, else the op's own ``group_size`` argument
    (all_gather / reduce_scatter), else the size of the resolved process group. The ranks of
    the resolved group place it (global rank ``r`` on node ``r // ranks_per_node``); without them
    the group is taken as consecutive ranks from 0 (full nodes, the last one holding the rest).
    ``ranks_per_node`` must be >= 1.
    """
    if ranks_per_node < 1:
        raise ValueError(f"ranks_per_node = {ranks_per_node} must be >= 1")
    pg = _resolve_group(group_name(node))
    ranks = None
    if pg is not None:
        import torch.distributed as dist

        ranks = dist.get_process_group_ranks(pg)
    if group_size is None:
        group_size = group_size_arg(node) or (len(ranks) if ranks else None)
    if group_size is None:
        raise ValueError(f"cannot find the group size of {node.name}: pass group_size")
    size = int(group_size)
    return placed_group(ranks if ranks and len(ranks) == size else range(size), ranks_per_node)


def placed_group(ranks, ranks_per_node: int = 8) -> GroupInfo:
    """The ``GroupInfo`` of a group of global ``ranks`` (rank ``r`` on node ``r // ranks_per_node``);
    ``range(n)`` for a group of ``n`` consecutive ranks from 0 where the ranks are not known."""
    per_node = Counter(r // ranks_per_node for r in ranks)
    return GroupInfo(sum(per_node.values()), len(per_node) > 1, min(per_node.values()))


def ring_factor(kind: str, group_size: int) -> float:
    """Fraction of a collective's full buffer (``collective_bytes``) each rank sends in its ring
    algorithm: ``(n-1)/n`` for all_gather, reduce_scatter and all_to_all, ``2(n-1)/n`` for
    all_reduce (a reduce-scatter then an all-gather), the whole buffer for broadcast and other
    launches; 0 for a group of one rank, which sends nothing."""
    n = group_size
    if n <= 1:
        return 0.0
    if kind in ("broadcast", "other"):
        return 1.0
    factor = (n - 1) / n
    return 2 * factor if kind == "all_reduce" else factor


def inter_node_share(kind: str, group: GroupInfo) -> float:
    """Fraction of the bytes a rank sends for a collective of ``kind`` on ``group`` that leaves its
    node through its own NIC (the rest goes over NVLink); the module docstring derives it.

    0 inside a node. all_to_all: the share of its peers on other nodes, ``(n - g) / (n - 1)``.
    Ring collectives: ``1 / g``, NCCL running one ring per NIC of the node, each leaving the
    node through another of the group's ``g`` ranks there."""
    if not group.spans_nodes or group.size <= 1:
        return 0.0
    n, g = group.size, group.ranks_on_node
    if kind == "all_to_all":
        return (n - g) / (n - 1)
    return 1.0 / g


@dataclass(frozen=True)
class CollectiveTraffic:
    """What one rank sends for one collective or transfer (the module docstring's convention)."""

    kind: str
    group_size: int
    bytes_sent: float
    """Bytes this rank sends over all its links: ``ring_factor(kind, group_size) * collective_bytes``."""
    bytes_inter_node: float = 0.0
    """Of ``bytes_sent``, the bytes over this rank's inter-node NIC; the rest go over NVLink."""

    def __post_init__(self) -> None:
        if isinstance(self.bytes_inter_node, bool) or not 0 <= self.bytes_inter_node <= self.bytes_sent * (1 + 1e-12):
            raise ValueError(
                f"bytes_inter_node = {self.bytes_inter_node!r} must be a number of bytes in [0, bytes_sent = "
                f"{self.bytes_sent}]"
            )

    @property
    def bytes_intra_node(self) -> float:
        """Of ``bytes_sent``, the bytes over NVLink."""
        return self.bytes_sent - self.bytes_inter_node

    @property
    def inter_node(self) -> bool:
        """Whether any of the bytes leave the node."""
        return self.bytes_inter_node > 0


def collective_traffic(
    node: fx.Node,
    group_size: int | None = None,
    ranks_per_node: int = 8,
    hints: SizeHints | None = None,
    group: GroupInfo | None = None,
) -> CollectiveTraffic:
    """The bytes one rank sends for collective ``node``, split into NVLink and InfiniBand bytes.

    ``group`` (the simulator resolves it once per process group) replaces what ``group_info``
    finds from ``group_size`` and ``ranks_per_node``; ``hints`` resolves data-dependent sizes
    (default: from the graph).
    """
    if group is None:
        group = group_info(node, ranks_per_node, group_size)
    if hints is None:
        hints = SizeHints.from_graph(node.graph)
    kind = collectives.kind(node)
    if kind is None:
        raise ValueError(f"{node.name} is not a collective launch")
    sent = ring_factor(kind, group.size) * collective_bytes(node, hints)
    return CollectiveTraffic(kind, group.size, sent, sent * inter_node_share(kind, group))


def collective_time(
    node: fx.Node,
    device: DeviceModel,
    group_size: int | None = None,
    ranks_per_node: int = 8,
    hints: SizeHints | None = None,
    group: GroupInfo | None = None,
) -> float:
    """Seconds a collective occupies its group's stream (``traffic_time`` of its ``collective_traffic``)."""
    return traffic_time(collective_traffic(node, group_size, ranks_per_node, hints, group), device)


def traffic_time(traffic: CollectiveTraffic, device: DeviceModel) -> float:
    """Seconds ``traffic`` takes on ``device``: ``collective_latency`` plus the longer of its NVLink
    bytes over NVLink and its InfiniBand bytes over the NIC, at the achieved fraction
    (``bandwidth_efficiency``) of each; the two links carry their parts at the same time."""
    efficiency = device.bandwidth_efficiency
    nvlink = traffic.bytes_intra_node / (device.intra_node_bandwidth * efficiency)
    nic = traffic.bytes_inter_node / (device.inter_node_bandwidth * efficiency)
    return device.collective_latency + max(nvlink, nic)


__all__ = [
    "FILLS",
    "CollectiveTraffic",
    "GroupInfo",
    "collective_time",
    "collective_traffic",
    "group_info",
    "placed_group",
    "inter_node_share",
    "is_free",
    "kernel_class",
    "node_bytes",
    "node_compute_time",
    "node_flops",
    "read_bytes",
    "ring_factor",
    "traffic_time",
]
