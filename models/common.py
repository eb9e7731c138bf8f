"""Building blocks the model families share: norms, the SwiGLU MLP, rotary embedding, init rules.

The families (``models.llama3``, ``models.deepseek_v3``, ``models.qwen3``) import what they share
from here and never from each other. Everything here is plain PyTorch, written to be traced into one aten graph.

Parameter initialisation is described as data (``InitRule``), so it can be replayed under any
sharding: a model says *how* each parameter is initialised (``init_rules() -> {fqn: InitRule}``);
the trainer decides *when* and *where*. Every parameter's FULL tensor is drawn from its own
generator, seeded from ``(seed, fqn)`` by ``stable_seed``, and only then sharded, so the initial
weights are the same whatever the parallel layout, the number of processes or the order in which
parameters are visited.
"""

from __future__ import annotations

import copy
import hashlib
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module

from graph_trainer.graph.tags import SEQUENCE_GATHER, TP_ROLE, annotate

# --------------------------------------------------------------------------------------
# Layers


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight, normalised in float32 for stability in bf16."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


class FeedForward(nn.Module):
    """SwiGLU MLP: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def apply_rope(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Rotate each pair (x[..., 2i], x[..., 2i+1]) of ``x`` [B, S, H, head_dim] by the angle
    of (position, i); ``table`` is ``rope_table(...)`` at the tokens' positions ([S, head_dim], or
    [B, S, head_dim] when rows differ: ``SequencePlan.rope``). Computed in float32, returned
    in ``x``'s dtype.

    Same as multiplying the complex number x[2i] + j*x[2i+1] by exp(j*angle).
    """
    half = x.shape[-1] // 2
    rows = table.shape[0] if table.dim() == 3 else 1  # (per-row positions: [B, S, head_dim])
    cos = table[..., :half].view(rows, x.shape[1], 1, half)
    sin = table[..., half:].view(rows, x.shape[1], 1, half)
    pairs = x.float().reshape(*x.shape[:-1], half, 2)
    real, imag = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack([real * cos - imag * sin, real * sin + imag * cos], dim=-1)
    return rotated.flatten(-2).type_as(x)


def rotary_table(freqs: torch.Tensor, max_seq_len: int, device: torch.device | str | None = None) -> torch.Tensor:
    """``[max_seq_len, 2 * len(freqs)]`` float32: cos of the angles ``p * freqs[i]`` in the first
    half of the last dim, sin in the second half (the layout ``apply_rope`` reads).

    ``freqs`` are float64; angles are formed in float64 and only the cos/sin are rounded to
    float32, so positions in the thousands keep full float32 accuracy.
    """
    positions = torch.arange(max_seq_len, dtype=torch.float64, device=device)
    angles = torch.outer(positions, freqs.to(device))
    return torch.cat([angles.cos(), angles.sin()], dim=-1).to(torch.float32)


# --------------------------------------------------------------------------------------
# Communication buckets


def head_modules(model: nn.Module) -> list[str]:
    """FQNs of the modules the forward computes last and the backward first: the final norm and
    the output projection ([] on a pipeline stage without them)."""
    return ["norm", "output"] if model.norm is not None else []


def block_bucket_plan(model: nn.Module) -> list[list[str]]:
    """Module FQN groups that form one communication bucket each (for bucketing passes): the
    embeddings, each transformer block ``layers.<i>``, the head (``head_modules``), those a
    pipeline stage holds."""
    first = [["tok_embeddings"]] if model.tok_embeddings is not None else []
    head = head_modules(model)
    return [*first, *[[f"layers.{i}"] for i in model.layers], *([head] if head else [])]


# --------------------------------------------------------------------------------------
# Rows in a routed order (MoE token sorting, expert-parallel regrouping)


def inverse_permutation(order: torch.Tensor) -> torch.Tensor:
    """``inverse[order[i]] = i``: the permutation that undoes ``order`` (a scatter, not a sort)."""
    positions = torch.arange(order.shape[0], device=order.device, dtype=order.dtype)
    return torch.empty_like(order).scatter_(0, order, positions)


class _SortedCopies(torch.autograd.Function):
    """Forward ``x.index_select(0, order // copies)``; backward a gather and a sum, not a scatter.

    Autograd's backward of ``index_select`` adds every row of the gradient into a zeroed tensor
    (``index_add``: atomics on a GPU, nondeterministic, and a slow kernel class). Here ``order`` is
    a permutation of the ``n * copies`` slots (slot ``i * copies + j`` is copy ``j`` of row ``i``),
    so the gradient is put back in slot order by a gather with the inverse permutation and the
    ``copies`` rows of each input row are summed: the same sum, its terms added in copy order."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, order: torch.Tensor, copies: int, inverse: torch.Tensor | None):
        ctx.copies = copies
        ctx.save_for_backward(inverse_permutation(order) if inverse is None else inverse)
        return x.index_select(0, order // copies if copies > 1 else order)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (inverse,) = ctx.saved_tensors
        in_slot_order = grad.index_select(0, inverse)
        if ctx.copies > 1:
            in_slot_order = in_slot_order.view(-1, ctx.copies, *grad.shape[1:]).sum(dim=1)
        return in_slot_order, None, None, None


def sorted_copies(
    x: torch.Tensor, order: torch.Tensor, copies: int = 1, inverse: torch.Tensor | None = None
) -> torch.Tensor:
    """Each row of ``x`` repeated ``copies`` times, the ``len(x) * copies`` slots then taken in
    ``order`` (a permutation of them; ``copies`` 1: a permutation of the rows). ``inverse``:
    ``inverse_permutation(order)`` when the caller has it. Values as ``x.index_select(0, order //
    copies)``; the backward gathers (``_SortedCopies``)."""
    return _SortedCopies.apply(x, order, copies, inverse)


# --------------------------------------------------------------------------------------
# Pipeline stages


def keep_stage(model: nn.Module, blocks, first: bool, last: bool) -> nn.Module:
    """Cut ``model`` (both families' layout: ``tok_embeddings``, ``layers`` keyed "0".."N-1",
    ``norm``, ``output``) down to what one pipeline rank holds, in place: the blocks whose indices
    are in ``blocks`` (one stage's range, or the union of a rank's stages), the embedding if
    ``first``, the final norm and output if ``last``. Kept modules keep their FQNs ("layers.5..."
    stays "layers.5..."), so the state dict is a slice of the model's. Call it on the meta model,
    before parallelising; ``stage_view`` then gives each stage of the rank its own module."""
    keep = set(blocks)
    n = len(model.layers)
    if not keep or not keep <= set(range(n)):
        raise ValueError(f"a pipeline rank holds some of the {n} blocks, got {sorted(keep)}")
    for name in list(model.layers):
        if int(name) not in keep:
            del model.layers[name]
    if not first:
        model.tok_embeddings = None
    if not last:
        model.norm = None
        model.output = None
    return model


def run_stack(model: nn.Module, tokens: torch.Tensor, head=None) -> torch.Tensor:
    """Both families' forward after their own checks: embedding, blocks, final norm, then the
    output projection (under tensor parallel its logits split over the vocabulary: ``split_vocabulary``)
    or ``head(normed hidden state, output module, local)`` (the loss, which computes the logits itself,
    e.g. in chunks: ``graph_trainer.loss``; ``local`` takes this rank's tokens of the labels:
    ``models.sequence``). Rotary positions, masks and this rank's tokens under context parallel come
    from ``model.sequence_layout`` (``models.sequence``). A pipeline stage without the embedding
    takes the previous stage's hidden state [B, S / model.sequence_shards, dim] (its piece of the
    sequence under context and sequence parallel); one without the norm returns its own."""
    first = model.tok_embeddings is not None
    seq = tokens.shape[1] * (1 if first else model.sequence_shards)
    if seq > model.args.max_seq_len:
        raise ValueError(f"sequence length {seq} exceeds the model's max_seq_len {model.args.max_seq_len}")
    plan = model.sequence_layout.plan(tokens if first else None, seq, tokens.device)
    h = model.tok_embeddings(plan.local(tokens)) if first else tokens
    plan = plan.with_masks(h.dtype)  # (in the blocks' compute dtype)
    rope = plan.rope(model.rope_cache)
    for block in model.layers.values():
        h = block(h, rope, plan)
    if model.norm is None:
        return h
    if head is not None:
        return head(model.norm(h), model.output, plan.local)
    return model.output(model.norm(h))


def block_costs(model: nn.Module) -> tuple[list[float], float]:
    """(each block's cost, the output projection's) for balancing pipeline stages: the parameters a
    token multiplies by (matmul FLOPs per token are twice that), with routed experts counted at the
    share a token activates (``n_activated_experts / n_routed_experts``). Works on the meta model."""
    args = model.args
    active = getattr(args, "n_activated_experts", 1) / max(getattr(args, "n_routed_experts", 1), 1)
    costs = []
    for block in model.layers.values():
        routed = getattr(getattr(block, "moe", None), "experts", None)
        routed_ids = {id(p) for p in routed.parameters()} if routed is not None else set()
        costs.append(sum(p.numel() * (active if id(p) in routed_ids else 1.0) for p in block.parameters()))
    return costs, float(args.vocab_size * args.dim)  # the output projection, tied or not


def stage_view(model: nn.Module, blocks: range, first: bool, last: bool) -> nn.Module:
    """One pipeline stage of ``model`` (a rank's ``keep_stage`` model) as a module of the same class
    that shares ``model``'s submodules, parameters and buffers: its forward runs the blocks in
    ``blocks`` (after the embedding if ``first``; ending in the norm and the loss head if ``last``),
    and its parameters keep their FQNs. A stage without the embedding takes the previous stage's
    hidden state [B, S, dim]; one without the norm returns its own."""
    view = copy.copy(model)  # (a new object whose own tables are replaced below: nothing is copied)
    view._parameters, view._buffers, view._modules = dict(model._parameters), dict(model._buffers), dict(model._modules)
    view.layers = nn.ModuleDict({str(i): model.layers[str(i)] for i in blocks})
    if not first:
        view.tok_embeddings = None
    if not last:
        view.norm = None
        view.output = None
    return view


# --------------------------------------------------------------------------------------
# Initialisation

_KINDS = ("normal", "trunc_normal", "ones")


@dataclass(frozen=True)
class InitRule:
    """How one parameter is initialised.

    kind: ``"normal"`` (mean 0, ``std``), ``"trunc_normal"`` (mean 0, ``std``, cut at the
        absolute bounds ``a``/``b``) or ``"ones"``.
    std: standard deviation for the two normal kinds (ignored for ``"ones"``).
    a, b: truncation bounds for ``"trunc_normal"``; ``None`` means torch's defaults -2 / 2
        (absolute values, not multiples of ``std``).
    """

    kind: str
    std: float = 0.0
    a: float | None = None
    b: float | None = None

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ValueError(f"InitRule.kind must be one of {_KINDS}, got {self.kind!r}")
        if self.kind != "ones" and self.std <= 0.0:
            raise ValueError(f"InitRule({self.kind!r}) needs std > 0, got {self.std}")


ONES = InitRule("ones")
"""Norm weights."""
BASE = InitRule("trunc_normal", std=0.02)
"""Projections reading the residual stream or a latent."""


def depth_scaled(layer_id: int) -> InitRule:
    """Projections writing into the residual stream (and w3): std 0.02 / sqrt(2 (layer_id + 1)), so
    deeper blocks start with smaller updates."""
    return InitRule("trunc_normal", std=0.02 / math.sqrt(2 * (layer_id + 1)))


def stack_init_rules(model: nn.Module, block_rules: Callable[[nn.Module, InitRule], dict[str, InitRule]]) -> dict:
    """Every parameter's rule in a model of ``tok_embeddings``, ``layers``, ``norm`` and ``output``
    (and ``args.dim``):
    embedding N(0, 1), each block's ``block_rules(block, depth_scaled(block.layer_id))`` (names
    relative to the block), final norm ones, output truncated normal std dim**-0.5 cut at +-3 std;
    an embedding tied to the output projection (``args.tie_embeddings``) gets the output's rule (its
    rows are the logits' weights) and there is no ``output.weight``."""
    rules = {"tok_embeddings.weight": InitRule("normal", std=1.0)}
    for name, block in model.layers.items():
        own = block_rules(block, depth_scaled(block.layer_id))
        rules.update({f"layers.{name}.{fqn}": rule for fqn, rule in own.items()})
    out_std = model.args.dim**-0.5
    rules["norm.weight"] = ONES
    output = InitRule("trunc_normal", std=out_std, a=-3 * out_std, b=3 * out_std)
    rules["tok_embeddings.weight" if getattr(model.args, "tie_embeddings", False) else "output.weight"] = output
    return rules


def stable_seed(seed: int, fqn: str) -> int:
    """A 63-bit generator seed from ``(seed, fqn)``, identical in every process and run.

    Python's ``hash()`` of a str is salted per interpreter, so it cannot be used here.
    """
    digest = hashlib.sha256(f"{int(seed)}/{fqn}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def materialize_init(
    rule: InitRule,
    shape,
    dtype: torch.dtype,
    generator: torch.Generator | None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """A new tensor of ``shape`` filled according to ``rule``, drawing from ``generator``."""
    out = torch.empty(tuple(shape), dtype=dtype, device=device)
    with torch.no_grad():
        if rule.kind == "ones":
            nn.init.ones_(out)
        elif rule.kind == "normal":
            nn.init.normal_(out, mean=0.0, std=rule.std, generator=generator)
        else:  # trunc_normal
            a = -2.0 if rule.a is None else rule.a
            b = 2.0 if rule.b is None else rule.b
            nn.init.trunc_normal_(out, mean=0.0, std=rule.std, a=a, b=b, generator=generator)
    return out


def draw_parameter(rule: InitRule, fqn: str, shape, seed: int, device: torch.device | str) -> torch.Tensor:
    """The FULL float32 initial value of parameter ``fqn``: from its own generator seeded by
    ``(seed, fqn)``, so it does not depend on sharding, process count or visiting order."""
    generator = torch.Generator(device=device).manual_seed(stable_seed(seed, fqn))
    return materialize_init(rule, shape, torch.float32, generator, device)


@torch.no_grad()
def init_plain_parameters(model: nn.Module, rules: dict[str, InitRule], seed: int) -> None:
    """Initialise a plain (unsharded, materialised) model in place, exactly as the trainer does."""
    for fqn, param in model.named_parameters():
        param.copy_(draw_parameter(rules[fqn], fqn, param.shape, seed, param.device))


def split_vocabulary(model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool = False) -> None:
    """Tensor parallel on the vocabulary, as both models use it: ``tok_embeddings`` row-parallel
    (each rank looks up its rows; the sum is all-reduced, or under ``sequence_parallel``
    reduce-scattered along the sequence), ``output`` column-parallel with its logits left split
    over the vocabulary: a ``Shard(-1)`` DTensor of this rank's [tokens, vocab / tp] slice, from
    which the loss computes the cross-entropy (loss parallel, ``graph_trainer.loss``). Under
    ``sequence_parallel`` the final norm computes on this rank's piece of the sequence (its weight
    replicated over tp, the weight's gradient summed there) and its output is all-gathered along
    the sequence (``gather_norm_output``): the output projection and the loss see every token."""
    plan = {}
    if model.tok_embeddings is not None:  # (a pipeline stage may hold neither: keep_stage)
        stream = Shard(1) if sequence_parallel else Replicate()
        plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=stream)
    if model.output is not None:
        if isinstance(model.output, nn.Linear):  # (a tied output computes with the embedding's split weight)
            plan["output"] = ColwiseParallel(use_local_output=False)
        if sequence_parallel:
            plan["norm"] = SequenceParallel(use_local_output=False)
    if plan:
        parallelize_module(model, tp_mesh, plan)
    if model.output is not None and sequence_parallel:
        gather_norm_output(model.norm)


def gather_norm_output(norm: nn.Module) -> None:
    """After a ``SequenceParallel`` norm (its output this rank's piece of the sequence, a sharded
    DTensor), the whole sequence as a ``Replicate`` DTensor (an all-gather tagged ``tp_role``
    sequence_gather); backward, its gradient, partial over tp from the column-parallel projection
    reading it, is reduce-scattered back to the piece."""

    def gather(_module: nn.Module, _args: tuple, piece: DTensor) -> DTensor:
        with annotate({TP_ROLE: SEQUENCE_GATHER}):
            return piece.redistribute(piece.device_mesh, [Replicate()])

    norm.register_forward_hook(gather)


def region_output(sequence_parallel: bool, sequence_dim: int = 1) -> RowwiseParallel:
    """The row-parallel projection that ends a tensor-parallel region (attention's ``wo``, a
    feed-forward's ``w2``): its partial outputs all-reduced, or under ``sequence_parallel``
    reduce-scattered along ``sequence_dim`` (each rank keeps its piece of the residual stream)."""
    return RowwiseParallel(output_layouts=Shard(sequence_dim)) if sequence_parallel else RowwiseParallel()


def gather_sequence(module: nn.Module, tp_mesh: DeviceMesh, sequence_dim: int = 1, local: bool = False) -> None:
    """Sequence parallel's entry into a tensor-parallel region: ``module``'s first input, this rank's
    piece of the sequence (a ``Shard(sequence_dim)`` DTensor or its local tensor), is all-gathered
    (tagged ``tp_role`` sequence_gather: the memory policy may recompute it for backward, from the
    piece); the other inputs pass as they are. The module gets a ``Replicate`` DTensor, whose
    gradient (partial over tp, from the column-parallel projections reading it) is reduce-scattered
    back; with ``local`` a plain tensor, for modules that also compute on it with replicated
    weights: its gradient must then be whole and the same on every tp rank, and goes back as this
    rank's slice."""

    def gather(_module: nn.Module, args: tuple) -> tuple:
        piece, *rest = args
        with annotate({TP_ROLE: SEQUENCE_GATHER}):
            if not isinstance(piece, DTensor):
                piece = DTensor.from_local(piece, tp_mesh, [Shard(sequence_dim)], run_check=False)
            whole = piece.redistribute(tp_mesh, [Replicate()])
        return (whole.to_local() if local else whole, *rest)

    module.register_forward_pre_hook(gather)


def keep_sequence_piece(module: nn.Module, tp_mesh: DeviceMesh, sequence_dim: int = 1) -> None:
    """The exit of a region that computes on the whole sequence the same on every tp rank (a
    ``gather_sequence(..., local=True)`` module): its output is cut to this rank's piece along
    ``sequence_dim``; backward, the pieces' gradients are all-gathered into the whole one."""

    def keep_piece(_module: nn.Module, _args: tuple, whole: torch.Tensor) -> torch.Tensor:
        replicated = DTensor.from_local(whole, tp_mesh, [Replicate()], run_check=False)
        return replicated.redistribute(tp_mesh, [Shard(sequence_dim)]).to_local()

    module.register_forward_hook(keep_piece)


def sequence_parallel_norms(names: list[str]) -> dict:
    """Norms computed on this rank's piece of the sequence (their weights replicated over tp as
    DTensors, so the weight's gradient, partial over tp, is summed there), each returning its piece
    as a ``Shard(1)`` DTensor for the region it feeds (``gather_sequence``)."""
    return {name: SequenceParallel() for name in names}


def feed_forward_plan(fqn: str, sequence_parallel: bool = False, sequence_dim: int = 1) -> dict:
    """The tensor-parallel plan of a ``FeedForward`` at ``fqn``: ``w1``, ``w3`` column-parallel,
    ``w2`` row-parallel (``region_output``). Under ``sequence_parallel`` the caller gathers its input
    along ``sequence_dim`` (``gather_sequence``)."""
    return {
        f"{fqn}.w1": ColwiseParallel(),
        f"{fqn}.w3": ColwiseParallel(),
        f"{fqn}.w2": region_output(sequence_parallel, sequence_dim),
    }


__all__ = [
    "FeedForward",
    "InitRule",
    "RMSNorm",
    "apply_rope",
    "block_bucket_plan",
    "block_costs",
    "draw_parameter",
    "feed_forward_plan",
    "gather_norm_output",
    "gather_sequence",
    "head_modules",
    "init_plain_parameters",
    "inverse_permutation",
    "keep_sequence_piece",
    "keep_stage",
    "materialize_init",
    "region_output",
    "rotary_table",
    "run_stack",
    "sequence_parallel_norms",
    "sorted_copies",
    "split_vocabulary",
    "stage_view",
    "stable_seed",
]
