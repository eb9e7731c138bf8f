"""Op facts: which ops a node calls, as named sets, and how to read an op's arguments.

Every part of the code that asks "is this a matmul / a view / a read of a data-dependent size" asks here,
so a new op (``_scaled_mm``, another attention kernel) is added in one place.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from graph_trainer.torch_compat import is_op_overload, is_view_op, op_name, op_schema

aten = torch.ops.aten

FLOAT8_GROUPED_MM = "float8_grouped_mm"
"""The routed experts' float8 matmul (``models.float8``: ``graph_trainer::float8_grouped_mm``, a
``_scaled_mm`` per expert's row block): (a [M, K], a's scales, b [E, N, K], b's scales, counts, ...)."""
MATMUL_OP_NAMES = ("mm", "addmm", "bmm", "baddbmm", "_grouped_mm", "_scaled_mm", FLOAT8_GROUPED_MM)
"""Matmul ops by name (any overload): dense, grouped (MoE experts) and scaled (fp8)."""
DENSE_MATMULS = {aten.mm.default: 0, aten.bmm.default: 0, aten.addmm.default: 1, aten.baddbmm.default: 1}
"""Dense matmul overloads -> position of their first matrix argument (``addmm``'s 0 is the addend)."""
GROUPED_MM = aten._grouped_mm.default
SCALED_MM = aten._scaled_mm.default
"""FP8 matmul: (mat1, mat2, scale_a, scale_b, ...); one scale per tensor, or per row / column."""
ADDMM = aten.addmm.default
ATTENTION_FORWARD_OP_NAMES = (
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
)
"""Fused scaled-dot-product attention forward kernels (CPU and GPU)."""
ATTENTION_PREFIX = "_scaled_dot_product_"
"""Prefix of every fused SDPA op name, forward and ``_backward``."""
SIZE_READS = frozenset({aten.sym_size.int, aten._local_scalar_dense.default})
"""Ops reading a size or a data-dependent scalar (an all_to_all's split sizes) back to the host."""
SCALAR_READ = aten._local_scalar_dense.default
"""Reads one value of a tensor to the host (``.item()`` / ``.tolist()``): never run twice."""


def name_of(node: fx.Node) -> str:
    """The aten op name of a call (``"mm"``), "" for anything that is not an op overload."""
    return op_name(node.target) if node.op == "call_function" and is_op_overload(node.target) else ""


def is_matmul(node: fx.Node) -> bool:
    """Whether ``node`` runs a matmul (``MATMUL_OP_NAMES``)."""
    return name_of(node) in MATMUL_OP_NAMES


def is_attention(node: fx.Node) -> bool:
    """Whether ``node`` runs a fused SDPA kernel (forward or backward)."""
    return name_of(node).startswith(ATTENTION_PREFIX)


def is_view(node: fx.Node) -> bool:
    """Whether ``node`` calls an aten op whose result aliases its input."""
    return node.op == "call_function" and is_view_op(node)


def is_random(node: fx.Node) -> bool:
    """Whether ``node`` calls an op that draws random numbers (torch's ``nondeterministic_seeded`` tag)."""
    return torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ())


def is_one_number(node: fx.Node) -> bool:
    """Whether ``node``'s value is a 0-d tensor (one number, as a tensorwise float8 scale's amax):
    holding it longer costs a few bytes."""
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.dim() == 0


def aliases_input(node: fx.Node) -> bool:
    """A view of its input or a ``getitem`` of a multi-output op: no memory, no compute of its own."""
    return node.target is operator.getitem or is_view(node)


def mutated_args(node: fx.Node) -> list[fx.Node]:
    """The arguments ``node`` writes in place (from the op's schema alias annotations)."""
    if node.op != "call_function" or not is_op_overload(node.target):
        return []
    schema = op_schema(node.target)
    return [
        value
        for arg, value in zip(schema.arguments, node.args, strict=False)
        if arg.alias_info is not None and arg.alias_info.is_write and isinstance(value, fx.Node)
    ]


def named_args(node: fx.Node) -> dict:
    """An op call's arguments by schema name, defaults filled in."""
    schema = op_schema(node.target)
    out = {}
    for i, arg in enumerate(schema.arguments):
        if i < len(node.args) and not arg.kwarg_only:
            out[arg.name] = node.args[i]
        elif arg.name in node.kwargs:
            out[arg.name] = node.kwargs[arg.name]
        elif arg.has_default_value():
            out[arg.name] = arg.default_value
    return out


def matmul_count(graph: fx.Graph) -> int:
    """How many matmul ops ``graph`` runs."""
    return sum(1 for n in graph.nodes if is_matmul(n))


__all__ = [
    "ADDMM",
    "ATTENTION_FORWARD_OP_NAMES",
    "ATTENTION_PREFIX",
    "DENSE_MATMULS",
    "SCALED_MM",
    "GROUPED_MM",
    "MATMUL_OP_NAMES",
    "SCALAR_READ",
    "SIZE_READS",
    "aliases_input",
    "is_attention",
    "is_matmul",
    "is_one_number",
    "is_view",
    "matmul_count",
    "mutated_args",
    "name_of",
    "named_args",
]
