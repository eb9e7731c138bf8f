"""Cut a pipeline stage's joint graph into the callables a pipeline schedule runs.

A stage's joint graph (``graph_trainer.compiler.tracer.trace_train_step`` on a ``keep_stage`` model)
computes its forward and its backward in one go; a pipeline schedule runs them apart, with other
microbatches' work between them, and zero-bubble schedules also run the backward in two halves:
the gradient of the stage's input first (the previous stage is waiting for it), the parameters'
gradients later, in a bubble. ``split_stage`` makes these pieces:

- ``forward``: the joint graph's inputs less ``output_grad`` -> [stage output or loss, *saved];
- ``backward``: [*saved, output_grad?] -> [*parameter gradients (flat), input gradient?];
- ``backward_input`` (dI): [*saved, output_grad?] -> [input gradient, *kept for dW];
- ``backward_weight`` (dW): [*saved, *kept for dW] -> [*parameter gradients (flat)].

``saved`` are the forward values the backward reads (activations, and inputs such as weights),
in graph order. The first stage has no input gradient: its dI is empty and dW is its backward.

With ``grads_into_sums`` (the graph runner's pieces, and the memory estimate of them) the pieces
that make parameter gradients take the step's gradient sums as their last inputs instead of
returning the gradients: each gradient is added into its sum in place (``aten.add_``) right after
it is computed, so it dies there rather than living to the end of the piece beside the sums (a
stage's whole gradient set, in the reduce dtype with weights resident per step). ``backward``
then returns [input gradient?], ``backward_weight`` nothing; ``grad_values`` describes the sums
(shape, stride, dtype of each gradient). A gradient that is only a narrower value widened exactly
(bf16 -> fp32) is added as the narrower value: ``add_`` computes in the sum's dtype, bitwise the
same, without the widened copy. The runner makes the sums once per step, filled with
-0.0: ``x + -0.0`` is ``x`` for every ``x`` (signed zeros and NaN included), so the sums are bitwise
those of taking the first microbatch's gradients as the buffer and adding the later ones in place.

Reads: ``phase`` (``graph_trainer.graph.tags``) on every node: FORWARD, LOSS and INPUT nodes
(bar ``output_grad``) go to the forward; BACKWARD nodes (the memory policy's recomputed copies
included, so recomputation stays in the backward) and ``output_grad`` to the backward;
``input_fqn`` to find ``output_grad``. Writes nothing: every copied node keeps its meta.

Numerics: every node runs exactly once, with the same inputs, in the joint graph's order within
each piece, so forward then backward (or dI then dW) computes bit for bit what the joint graph
computes. Collectives stay in the piece whose nodes they belong to (a parameter's reduce-scatter
is in dW: zero-bubble schedules defer it with the weight gradients).

Fails: a FORWARD node that reads a BACKWARD node (the graph's phases are not two halves), or a
graph without the stage outputs its name says, raises ``ValueError``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from graph_trainer.graph import tags
from graph_trainer.graph.tags import BACKWARD, CUSTOM, INPUT, INPUT_FQN, MODULE_FQN, PHASE

OUTPUT_GRAD = "output_grad"


@dataclass
class StageGraphs:
    """The pieces of one stage's joint graph (module docstring), and how to wire them."""

    forward: fx.GraphModule
    backward: fx.GraphModule
    backward_input: fx.GraphModule
    backward_weight: fx.GraphModule
    num_saved: int
    """How many values ``forward`` returns after the stage output (the backward's first inputs)."""
    num_kept_for_weight: int
    """How many values ``backward_input`` returns after the input gradient (dW's last inputs)."""
    has_input_grad: bool
    """Whether the stage differentiates its input (every stage but the first)."""
    takes_output_grad: bool
    """Whether the backward takes the next stage's gradient (every stage but the last)."""
    grad_values: list[torch.Tensor] | None = None
    """With ``grads_into_sums``: the parameter gradients' (fake) values, in order: what the sums
    ``backward`` and ``backward_weight`` add into look like. None: the pieces return the gradients."""

    def empty_sums(self, device: torch.device) -> list[torch.Tensor]:
        """A step's sums before its first backward: each gradient's shape, stride and dtype, -0.0
        (``x + -0.0`` is ``x`` for every ``x``)."""
        if self.grad_values is None:
            raise ValueError("these pieces return their gradients (split_stage without grads_into_sums)")
        return [
            torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=device).fill_(-0.0) for v in self.grad_values
        ]


def _is_output_grad(node: fx.Node) -> bool:
    return node.op == "placeholder" and tags.get(node, INPUT_FQN) == OUTPUT_GRAD


def _is_backward(node: fx.Node) -> bool:
    return tags.phase(node) == BACKWARD or _is_output_grad(node)


def extract_graph(
    gm: fx.GraphModule, nodes: list[fx.Node], inputs: list[fx.Node], outputs: list[fx.Node]
) -> fx.GraphModule:
    """A graph module that runs ``nodes`` (in ``gm``'s order) from ``inputs`` (its placeholders,
    in this order) to ``outputs`` (a list). Every value a node reads must be an input or one of
    ``nodes``; copies keep the originals' meta (tags included)."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in inputs:
        env[node] = graph.placeholder(node.name)
        env[node].meta = dict(node.meta)
    members = set(nodes)
    for node in gm.graph.nodes:
        if node not in members or node in env:
            continue
        missing = [i for i in node.all_input_nodes if i not in env]
        if missing:
            raise ValueError(
                f"{node.name} reads {[m.name for m in missing]}, which this piece neither computes nor takes"
            )
        env[node] = graph.node_copy(node, env.__getitem__)
    graph.output([env[o] for o in outputs])
    graph.lint()
    return fx.GraphModule(gm, graph)


def _ancestors(roots: list[fx.Node], within: set[fx.Node]) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    stack = [r for r in roots if r in within]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        stack.extend(i for i in node.all_input_nodes if i in within)
    return seen


def _crossing(producers: list[fx.Node], consumers: set[fx.Node]) -> list[fx.Node]:
    """The ``producers`` (in their order) that a node of ``consumers`` reads."""
    return [p for p in producers if any(u in consumers for u in p.users)]


_CASTS = (torch.ops.aten._to_copy.default, torch.ops.prims.convert_element_type.default)
_EXACT_WIDENINGS = {(torch.bfloat16, torch.float32), (torch.float16, torch.float32), (torch.float32, torch.float64)}


def _widened_from(grad: fx.Node) -> fx.Node | None:
    """The narrower value ``grad`` only converts exactly to a wider float dtype (bf16 -> fp32, as
    gradients become the reduce dtype), when nothing but the piece's output reads ``grad``; else
    None. ``sum.add_(narrow)`` computes in the sum's dtype, so it adds bitwise what adding the
    converted copy adds, in one kernel and without the copy."""
    if grad.op != "call_function" or grad.target not in _CASTS or len(grad.users) != 1:
        return None
    if set(grad.kwargs) - {"dtype"} or not isinstance(grad.args[0], fx.Node):
        return None
    source = grad.args[0]
    widening = (source.meta["val"].dtype, grad.meta["val"].dtype)
    return source if widening in _EXACT_WIDENINGS else None


def add_into_sums(piece: fx.GraphModule, num_grads: int) -> fx.GraphModule:
    """``piece`` taking ``num_grads`` more inputs (the sums, last) and adding its first
    ``num_grads`` outputs into them in place, each right after it is computed, instead of
    returning them (module docstring)."""
    graph = piece.graph
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    grads, rest = list(output.args[0][:num_grads]), list(output.args[0][num_grads:])
    anchor = [n for n in graph.nodes if n.op == "placeholder"][-1]
    sums = []
    for i, grad in enumerate(grads):
        with graph.inserting_after(anchor):
            anchor = graph.placeholder(f"grad_sum_{i}")
        anchor.meta = {"val": grad.meta["val"], CUSTOM: {PHASE: BACKWARD}}
        sums.append(anchor)
    added = [_widened_from(g) or g for g in grads]  # (judged while the output still reads them)
    output.args = (rest,)
    for grad_sum, grad, value in zip(sums, grads, added, strict=True):
        with graph.inserting_after(value if value.op != "placeholder" else anchor):
            add = graph.call_function(torch.ops.aten.add_.Tensor, (grad_sum, value))
        add.meta = {"val": grad_sum.meta["val"], CUSTOM: {PHASE: BACKWARD, MODULE_FQN: tags.module_fqn(grad)}}
    for grad in {g for g, value in zip(grads, added, strict=True) if value is not g}:
        graph.erase_node(grad)  # (a widening only the output read)
    graph.lint()
    piece.recompile()
    return piece


def split_stage(gm: fx.GraphModule, num_param_grads: int, grads_into_sums: bool = False) -> StageGraphs:
    """Cut a stage's joint graph (module docstring). ``num_param_grads``: how many of the joint
    graph's outputs after the first are parameter gradients (the flat inner tensors); one more,
    if present, is the input gradient. ``grads_into_sums``: the gradients are added into the
    step's sums in place (module docstring)."""
    nodes = list(gm.graph.nodes)
    (output_node,) = [n for n in nodes if n.op == "output"]
    outs = list(output_node.args[0])
    stage_out, param_grads, rest = outs[0], outs[1 : 1 + num_param_grads], outs[1 + num_param_grads :]
    if len(rest) > 1 or len(param_grads) != num_param_grads:
        raise ValueError(f"the joint graph returns {len(outs)} values; expected 1 + {num_param_grads} + (0 or 1)")
    input_grad = rest[0] if rest else None
    body = [n for n in nodes if n.op != "output"]
    backward = [n for n in body if _is_backward(n)]
    forward = [n for n in body if not _is_backward(n)]
    backward_set = set(backward)
    for node in forward:
        read = [i.name for i in node.all_input_nodes if i in backward_set]
        if read:
            raise ValueError(f"forward node {node.name} reads backward values {read}: the graph is not split by phase")
    output_grads = [n for n in backward if _is_output_grad(n)]
    placeholders = [n for n in forward if n.op == "placeholder" and tags.phase(n) == INPUT]
    saved = _crossing(forward, backward_set)
    if stage_out in backward_set or any(g in set(forward) for g in param_grads if g.op != "placeholder"):
        raise ValueError("the stage output must be a forward value and the gradients backward values")
    backward_inputs = [*saved, *output_grads]
    backward_body = [n for n in backward if not _is_output_grad(n)]
    grads_out = [*param_grads, *([input_grad] if input_grad is not None else [])]

    # dI: what the input gradient needs; dW: the rest of the backward, reading what dI made.
    di_nodes = _ancestors([input_grad], set(backward_body)) if input_grad is not None else set()
    dw_nodes = [n for n in backward_body if n not in di_nodes]
    # (a dI value dW reads, or returns: every parameter gradient is dW's output)
    di_order = [n for n in backward_body if n in di_nodes]
    kept = [n for n in di_order if n in set(param_grads) or any(u in set(dw_nodes) for u in n.users)]
    backward_gm = extract_graph(gm, backward_body, backward_inputs, grads_out)
    backward_weight = extract_graph(gm, dw_nodes, [*saved, *output_grads, *kept], param_grads)
    if grads_into_sums:
        backward_gm = add_into_sums(backward_gm, num_param_grads)
        backward_weight = add_into_sums(backward_weight, num_param_grads)
    return StageGraphs(
        forward=extract_graph(gm, forward, placeholders, [stage_out, *saved]),
        backward=backward_gm,
        # (dI takes every backward input, as the full backward does: one calling convention)
        backward_input=extract_graph(gm, di_order, backward_inputs, [*([input_grad] if input_grad else []), *kept]),
        backward_weight=backward_weight,
        num_saved=len(saved),
        num_kept_for_weight=len(kept),
        has_input_grad=input_grad is not None,
        takes_output_grad=bool(output_grads),
        grad_values=[g.meta["val"] for g in param_grads] if grads_into_sums else None,
    )


__all__ = ["OUTPUT_GRAD", "StageGraphs", "add_into_sums", "extract_graph", "split_stage"]
