"""Capture a whole training step as one aten FX graph, and run it.

``trace_train_step`` traces ``step(params, buffers, tokens, labels) -> (loss, grads)`` with
``make_fx`` under a ``FakeTensorMode``: the model forward, the loss and
``torch.autograd.grad`` become ONE graph of aten ops (and ``_c10d_functional`` collectives
when parameters are DTensors). No real memory is touched while tracing, so real-size
models trace on one CPU.

The graph boundary is flat and plain. Tensor subclasses (DTensor) are unwrapped into their
inner tensors with ``__tensor_flatten__`` before tracing; inside the traced function they
are rebuilt with ``__tensor_unflatten__``, so DTensor dispatch happens during tracing and
the graph sees only plain tensors and collectives. Gradients are unwrapped the same way on
the way out and rewrapped by ``TracedStep.__call__`` (``graph_trainer.compiler.flat_tensors``).

The graph computes each value once: identical computations of one phase and one unit are merged
(``compiler.cse``; bitwise), as ``torch.compile`` would.

Graph inputs, in order: the inner tensors of every parameter (``named_parameters`` order),
of every buffer, then ``tokens`` and ``labels``. Outputs: the loss, then the inner tensors of
every parameter's gradient, in parameter order.

Node metadata written here (the contract passes rely on; keys and values in ``graph_trainer.graph.tags``):

- ``phase``: ``"input"`` (placeholders), ``"forward"``, ``"loss"``, ``"backward"``,
  ``"output"``.
- ``module_fqn``: the innermost module whose forward produced the node (``"layers.3.attention"``,
  ``"output"``; ``"loss"`` for the loss). Backward nodes get the FQN of the forward op they
  differentiate (matched through autograd sequence numbers). Placeholders get the FQN of the
  module owning the parameter or buffer (``""`` for tokens and labels); the output node gets
  ``""``. Parametrization modules are never named: their ops belong to the owning module.
- ``input_fqn`` (placeholders only): the parameter or buffer name (``"layers.0.attention.wq.weight"``),
  or ``"tokens"`` / ``"labels"`` (a pipeline stage's: ``"stage_input"`` / ``"output_grad"``, see
  ``trace_train_step``).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.fx.experimental.symbolic_shapes  # noqa: F401  (make_fx needs it imported first)
import torch.nn as nn
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from graph_trainer import torch_compat
from graph_trainer.compiler.cse import eliminate_common_subexpressions
from graph_trainer.compiler.flat_tensors import FlatTensorSpec, flatten_tensor, split_flat, unflatten_tensor
from graph_trainer.distributed.simple_fsdp import is_parametrization, owner_fqn
from graph_trainer.graph import tags
from graph_trainer.graph.collectives import collective_counts, format_counts, is_collective, waits_among_users
from graph_trainer.graph.tags import (
    BACKWARD,
    FORWARD,
    FSDP_PARAM,
    FSDP_ROLE,
    INHERITED_BY_BACKWARD,
    INPUT,
    INPUT_FQN,
    LOSS,
    LOSS_MODULE,
    MODULE_FQN,
    OUTPUT,
    PHASE,
    REDUCE_GRAD,
    UNSHARD,
)
from graph_trainer.loss import token_cross_entropy

logger = logging.getLogger("graph_trainer")


# --------------------------------------------------------------------------------------
# Module FQN annotation


@contextlib.contextmanager
def annotate_module_fqns(model: nn.Module) -> Iterator[None]:
    """While active, ops run inside a submodule's forward are tagged with its FQN."""
    handles = []
    stack: list[contextlib.AbstractContextManager] = []

    def enter(fqn: str) -> Callable:
        def hook(module: nn.Module, args: Any) -> None:
            cm = tags.annotate({MODULE_FQN: fqn})
            cm.__enter__()
            stack.append(cm)

        return hook

    def leave(module: nn.Module, args: Any, output: Any) -> None:
        stack.pop().__exit__(None, None, None)

    for fqn, module in model.named_modules():
        if not fqn or is_parametrization(fqn):
            continue
        handles.append(module.register_forward_pre_hook(enter(fqn)))
        handles.append(module.register_forward_hook(leave, always_call=True))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _copy_forward_meta_to_backward(gm: fx.GraphModule) -> None:
    """Give every backward node the module_fqn of the forward op it differentiates.

    Backward nodes of a SimpleFSDP gather chain (``fsdp_role`` unshard) are that
    parameter's gradient reduction: they get ``fsdp_role`` reduce_grad and its ``fsdp_param``.
    Expert-parallel and chunk tags (``INHERITED_BY_BACKWARD``) are copied as they are.
    """
    forward_by_seq: dict[int, fx.Node] = {}
    position = {n: i for i, n in enumerate(gm.graph.nodes)}
    for node in gm.graph.nodes:
        if tags.phase(node) in (FORWARD, LOSS):
            forward_by_seq.setdefault(node.meta.get("seq_nr", -1), node)
    for node in gm.graph.nodes:
        if tags.phase(node) != BACKWARD:
            continue
        forward = forward_by_seq.get(node.meta.get("seq_nr", -1))
        if forward is None:
            inherited = _tags_shared_by_inputs(node, position)
        else:
            inherited = {
                key: value
                for key, value in tags.tags(forward).items()
                if key in INHERITED_BY_BACKWARD or key == MODULE_FQN
            }
            if tags.get(forward, FSDP_ROLE) == UNSHARD:
                inherited.update({FSDP_ROLE: REDUCE_GRAD, FSDP_PARAM: tags.get(forward, FSDP_PARAM)})
        tags.update(
            node,
            {MODULE_FQN: inherited.get(MODULE_FQN, "")},
            **{key: value for key, value in inherited.items() if key != MODULE_FQN},
        )


def _tags_shared_by_inputs(node: fx.Node, position: dict[fx.Node, int]) -> dict:
    """Tags for a backward node that differentiates no forward op (autograd's sum of the
    gradients flowing into a tensor used twice, traced with ``torch_compat.UNPAIRED_SEQ_NR``):
    the module of its latest backward input (the sum runs once that contribution is made, e.g. a
    residual's branch gradient), and each inherited tag on which all its backward inputs agree
    ({"module_fqn": "loss"} if none)."""
    inputs = [
        tags.tags(i)
        for i in sorted(node.all_input_nodes, key=position.__getitem__, reverse=True)
        if tags.phase(i) == BACKWARD
    ]
    if not inputs:
        return {MODULE_FQN: LOSS_MODULE}
    shared = {MODULE_FQN: inputs[0].get(MODULE_FQN, "")}
    for key in INHERITED_BY_BACKWARD:
        values = {repr(c.get(key)) for c in inputs}
        if len(values) == 1 and key in inputs[0]:
            shared[key] = inputs[0][key]
    return shared


def _read_collective_sizes_from_waits(gm: fx.GraphModule) -> None:
    """Make every collective's only user its wait.

    A data-dependent size (an all_to_all's received rows) is read by make_fx from the node
    that first produced it: the collective, not its wait. PyTorch's bucketers (and our passes)
    want a collective with exactly one user, its wait, which returns the same tensor: the
    ``sym_size`` reads are moved to just after the wait and read it instead.
    """
    for node in list(gm.graph.nodes):
        if not is_collective(node):
            continue
        waits = waits_among_users(node)
        size_reads = [u for u in node.users if u.target == torch.ops.aten.sym_size.int]
        if len(waits) != 1 or not size_reads:
            continue
        for read in reversed(size_reads):
            waits[0].append(read)
            read.replace_input_with(node, waits[0])
            # it now runs where the wait runs (a read first needed in backward still reads the forward wait)
            tags.replace(read, tags.tags(waits[0]))


def _finalize_meta(gm: fx.GraphModule, input_fqns: list[str]) -> None:
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    assert len(placeholders) == len(input_fqns), (len(placeholders), len(input_fqns))
    for node, fqn in zip(placeholders, input_fqns, strict=True):
        owner = "" if fqn in BATCH_INPUTS else owner_fqn(fqn)
        tags.replace(node, {PHASE: INPUT, MODULE_FQN: owner, INPUT_FQN: fqn})
    _copy_forward_meta_to_backward(gm)
    for node in gm.graph.nodes:
        if node.op == "output":
            tags.update(node, {PHASE: OUTPUT, MODULE_FQN: ""})
        # Nodes made between annotated regions (e.g. detach of inputs) belong to the forward.
        tags.set_default(node, PHASE, FORWARD)
        tags.set_default(node, MODULE_FQN, "")


# --------------------------------------------------------------------------------------
# Tracing

STAGE_INPUT_NAMES = {True: "tokens", False: "stage_input"}
"""``input_fqn`` of the graph input the stage starts from, keyed by whether it is the first stage."""
STAGE_TARGET_NAMES = {True: "labels", False: "output_grad"}
"""``input_fqn`` of the last graph input, keyed by whether the stage is the last (ends in the loss)."""
BATCH_INPUTS = frozenset((*STAGE_INPUT_NAMES.values(), *STAGE_TARGET_NAMES.values()))


def loss_head(labels: torch.Tensor, chunks: int) -> Callable[..., torch.Tensor]:
    """The models' ``head(hidden, output, local)``: the mean token cross-entropy (``graph_trainer.loss``)
    of this rank's tokens against their labels (``local``: the rank's positions of a whole-sequence
    tensor, ``models.sequence.SequencePlan.local``)."""
    return lambda hidden, output, local: token_cross_entropy(hidden, output, local(labels), chunks)


def batch_signature(tokens: torch.Tensor, labels: torch.Tensor) -> tuple:
    """What a traced graph is specialised to: shapes, dtypes and device of the batch."""
    return tuple((tuple(t.shape), t.dtype, t.device.type) for t in (tokens, labels))


@dataclass
class TracedStep:
    """A traced training step and everything needed to call it with live tensors."""

    gm: fx.GraphModule
    param_names: list[str]
    buffer_names: list[str]
    input_specs: list[FlatTensorSpec]
    """Flat specs of parameters then buffers (tokens and labels are plain)."""
    grad_specs: list[FlatTensorSpec]
    signature: tuple
    trace_seconds: float

    @property
    def num_flat_param_grads(self) -> int:
        """How many of the graph's outputs after the first are parameter gradients (DTensors'
        inner tensors counted one by one); a pipeline stage's input gradient follows them."""
        return sum(spec.num_inner for spec in self.grad_specs[: len(self.param_names)])

    def flat_inputs(
        self, params: list[torch.Tensor], buffers: list[torch.Tensor], tokens: torch.Tensor, labels: torch.Tensor
    ) -> list[torch.Tensor]:
        flat: list[torch.Tensor] = []
        for t in (*params, *buffers):
            flat.extend(flatten_tensor(t)[0])
        return flat + [tokens, labels]

    def __call__(
        self, params: list[torch.Tensor], buffers: list[torch.Tensor], tokens: torch.Tensor, labels: torch.Tensor
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        if batch_signature(tokens, labels) != self.signature:
            raise RuntimeError(
                f"batch {batch_signature(tokens, labels)} does not match the traced graph {self.signature}"
            )
        with torch.no_grad():
            outs = self.gm(*self.flat_inputs(params, buffers, tokens, labels))
        loss, flat_grads = outs[0], list(outs[1:])
        grads = [
            unflatten_tensor(inner, spec)
            for inner, spec in zip(split_flat(flat_grads, self.grad_specs), self.grad_specs, strict=True)
        ]
        return loss, grads


def fake_like(t: torch.Tensor, mode, device: torch.device | None) -> torch.Tensor:
    """A fake tensor with ``t``'s metadata; meta tensors become fake tensors on ``device``."""
    if t.device.type == "meta":
        target = device if device is not None else t.device
        with mode:
            return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=target)
    return mode.from_tensor(t)


def is_first_stage(model: nn.Module) -> bool:
    """Whether ``model`` starts from tokens: the whole model, or the first pipeline stage
    (``models.common.keep_stage``: later stages have no embedding and take hidden states)."""
    return getattr(model, "tok_embeddings", True) is not None


def is_last_stage(model: nn.Module) -> bool:
    """Whether ``model`` ends in the loss: the whole model, or the last pipeline stage."""
    return getattr(model, "norm", True) is not None


@dataclass(frozen=True)
class FlatState:
    """A model's parameters and buffers as the graph's flat inputs (``compiler.flat_tensors``).
    ``graph_trainer.compiler.resident`` derives the state of a step on gathered weights."""

    param_names: list[str]
    buffer_names: list[str]
    specs: list[FlatTensorSpec]
    """Parameters then buffers."""
    flat: list[torch.Tensor]

    @classmethod
    def of(cls, model: nn.Module) -> FlatState:
        params, buffers = list(model.named_parameters()), list(model.named_buffers())
        specs, flat = [], []
        for _, t in (*params, *buffers):
            inners, spec = flatten_tensor(t)
            flat.extend(inners)
            specs.append(spec)
        return cls([n for n, _ in params], [n for n, _ in buffers], specs, flat)

    def input_fqns(self) -> list[str]:
        """The ``input_fqn`` of each flat input: a tensor's name once per inner tensor."""
        names = [*self.param_names, *self.buffer_names]
        return [name for name, spec in zip(names, self.specs, strict=True) for _ in range(spec.num_inner)]

    def rebuild(self, flat: list[torch.Tensor]) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
        """(the parameters, detached and requiring grad; every tensor by name) from flat values."""
        groups, n = split_flat(flat, self.specs), len(self.param_names)
        params = [
            unflatten_tensor([i.detach() for i in inner], spec).requires_grad_(True)
            for inner, spec in zip(groups[:n], self.specs[:n], strict=True)
        ]
        buffers = [unflatten_tensor(inner, spec) for inner, spec in zip(groups[n:], self.specs[n:], strict=True)]
        names = [*self.param_names, *self.buffer_names]
        return params, dict(zip(names, [*params, *buffers], strict=True))

    def computing(self, params: list[torch.Tensor]) -> contextlib.AbstractContextManager:
        """Active while the model computes with ``params`` (``rebuild``'s)."""
        return contextlib.nullcontext()

    def finish_grads(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """The graph's gradient outputs from ``autograd.grad``'s (one per parameter)."""
        return list(grads)


class _JointStep:
    """What ``make_fx`` traces: the flat state, the stage input and the target in; the loss (or a
    stage's hidden state) and the flat gradients out. ``grad_specs`` holds how the gradients
    were flattened once a call has run."""

    def __init__(self, model: nn.Module, state: FlatState, loss_chunks: int, grad_scale: float):
        self.model, self.state, self.loss_chunks, self.grad_scale = model, state, loss_chunks, grad_scale
        self.first, self.last = is_first_stage(model), is_last_stage(model)
        self.grad_specs: list[FlatTensorSpec] = []

    def __call__(self, *flat_args: torch.Tensor) -> list[torch.Tensor]:
        *flat_state, stage_in, target = flat_args
        params, tensors = self.state.rebuild(list(flat_state))
        wrt = params if self.first else [*params, stage_in.detach().requires_grad_(True)]
        with tags.annotate({PHASE: FORWARD}), self.state.computing(params):  # (the loss head tags "loss")
            head = {"head": loss_head(target, self.loss_chunks)} if self.last else {}
            result = torch.func.functional_call(self.model, tensors, (stage_in if self.first else wrt[-1],), head)
        if self.last:
            with tags.annotate({PHASE: LOSS, MODULE_FQN: LOSS_MODULE}):
                scaled = result * self.grad_scale if self.grad_scale != 1.0 else result
            seed, seed_grad = scaled, None
        else:  # the loss scale is in the output gradient the next stage hands back
            seed, seed_grad = result, target
        torch_compat.tag_backward_with_forward_seq_nr(seed)
        with tags.annotate({PHASE: BACKWARD}), torch_compat.unpaired_seq_nr():
            grads = torch.autograd.grad(seed, wrt, grad_outputs=seed_grad)
            grads = [*self.state.finish_grads(list(grads[: len(params)])), *grads[len(params) :]]
        flattened = [flatten_tensor(g) for g in grads]
        self.grad_specs = [spec for _, spec in flattened]
        return [result, *(inner for inners, _ in flattened for inner in inners)]


def _make_fx(joint: _JointStep, inputs: list[torch.Tensor], fake_device: torch.device | None) -> fx.GraphModule:
    """``joint`` traced on fake copies of ``inputs``, every node tagged with its module's FQN.

    Static shapes: a graph is made for one batch shape (see ``GraphStep``). The ShapeEnv is still
    needed for data-dependent sizes (unbacked symbols), e.g. expert-parallel split sizes."""
    fake_mode = torch_compat.new_fake_mode(shape_env=ShapeEnv(), static_shapes=True, allow_non_fake_inputs=False)
    *state, tokens, labels = inputs
    # (one tensor passed as both batch inputs would become one fake tensor, one graph input)
    second = labels.clone() if labels is tokens and labels.device.type != "meta" else labels
    fake_inputs = [fake_like(t, fake_mode, fake_device) for t in (*state, tokens, second)]
    with (
        torch.fx.traceback.preserve_node_meta(),
        annotate_module_fqns(joint.model),
        torch.autograd.set_multithreading_enabled(False),  # keep backward on this thread
        torch_compat.lazy_graph_modules(),  # (each pass recompiles: the code is made where it runs)
        fake_mode,
    ):
        return make_fx(joint, record_stack_traces=False)(*fake_inputs)


def trace_train_step(
    model: nn.Module,
    tokens: torch.Tensor,
    labels: torch.Tensor,
    loss_chunks: int = 1,
    *,
    grad_scale: float = 1.0,
    fake_device: torch.device | None = None,
    state: FlatState | None = None,
) -> TracedStep:
    """Trace forward + loss + backward of ``model`` on a batch of this shape into one graph.

    Gradients are those of ``loss * grad_scale`` (data parallelism passes 1/dp_size); the
    returned loss is unscaled. Parameters and buffers may be real, meta (then ``fake_device``
    says which device the graph is for) or DTensors of either. Nothing is computed on real data.

    A pipeline stage (``models.common.keep_stage``) traces the same way, with its own ends: a
    stage after the first takes the previous stage's hidden state in place of ``tokens`` (input
    ``"stage_input"``) and also returns its gradient, after the parameters' (the joint graph
    differentiates it too); a stage before the last returns its hidden state in place of the loss
    and takes that hidden state's gradient in place of ``labels`` (input ``"output_grad"``, the
    only input of the backward). ``graph_trainer.pipelining.split`` cuts such a joint graph into
    the callables a pipeline schedule runs.

    ``state`` (default ``FlatState.of(model)``) says which tensors are the graph's inputs and
    which of them are differentiated (``graph_trainer.compiler.resident``: gathered weights).
    """
    start = time.perf_counter()
    state = state if state is not None else FlatState.of(model)
    joint = _JointStep(model, state, loss_chunks, grad_scale)
    gm = _make_fx(joint, [*state.flat, tokens, labels], fake_device)
    ends = [STAGE_INPUT_NAMES[joint.first], STAGE_TARGET_NAMES[joint.last]]
    _finalize_meta(gm, state.input_fqns() + ends)
    _read_collective_sizes_from_waits(gm)
    eliminate_common_subexpressions(gm)
    gm.graph.lint()
    gm.recompile()
    return TracedStep(
        gm=gm,
        param_names=state.param_names,
        buffer_names=state.buffer_names,
        input_specs=state.specs,
        grad_specs=joint.grad_specs,
        signature=batch_signature(tokens, labels),
        trace_seconds=time.perf_counter() - start,
    )


class GraphStep:
    """Runs the training step through traced graphs, one per batch shape.

    The first batch of a shape triggers a trace (logged) and the optional ``post_trace``
    hook (the pass pipeline); later batches of that shape reuse the graph. A batch of a new
    shape retraces instead of running a graph made for another shape.
    """

    def __init__(
        self,
        model: nn.Module,
        loss_chunks: int = 1,
        grad_scale: float = 1.0,
        post_trace: Callable[[TracedStep], TracedStep] | None = None,
    ):
        self.model = model
        self.loss_chunks = loss_chunks
        self.grad_scale = grad_scale
        self.post_trace = post_trace
        self.graphs: dict[tuple, TracedStep] = {}

    def get(self, tokens: torch.Tensor, labels: torch.Tensor) -> TracedStep:
        sig = batch_signature(tokens, labels)
        if sig not in self.graphs:
            if self.graphs:
                logger.info("batch shape %s is new: retracing", sig)
            logger.info("tracing the training step (forward + loss + backward) ...")
            traced = trace_train_step(self.model, tokens, labels, self.loss_chunks, grad_scale=self.grad_scale)
            counts = collective_counts(traced.gm.graph)
            logger.info(
                "traced in %.2fs: %d nodes, collectives: %s",
                traced.trace_seconds,
                len(traced.gm.graph.nodes),
                format_counts(counts),
            )
            if self.post_trace is not None:
                traced = self.post_trace(traced)
            self.graphs[sig] = traced
        return self.graphs[sig]

    def __call__(self, tokens: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        traced = self.get(tokens, labels)
        params = [p for _, p in self.model.named_parameters()]
        buffers = [b for _, b in self.model.named_buffers()]
        return traced(params, buffers, tokens, labels)


def eager_step(
    model: nn.Module,
    tokens: torch.Tensor,
    labels: torch.Tensor,
    loss_chunks: int = 1,
    grad_scale: float = 1.0,
    wrt: list[torch.Tensor] | None = None,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The same step without tracing: the numerics baseline for ``GraphStep``. The gradients are
    of ``wrt`` (default: the parameters, ``named_parameters`` order)."""
    params = wrt if wrt is not None else [p for _, p in model.named_parameters()]
    loss = model(tokens, head=loss_head(labels, loss_chunks))
    scaled = loss * grad_scale if grad_scale != 1.0 else loss
    grads = torch.autograd.grad(scaled, params)
    return loss.detach(), list(grads)
