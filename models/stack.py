"""The model every family is: a token embedding, a stack of blocks, a final norm and an output
projection, with a rotary table; a family says only what its blocks are.

``DecoderStack`` holds the layout the rest of the trainer relies on (``tok_embeddings``,
``layers`` keyed "0".."N-1", ``norm``, ``output``, the non-persistent ``rope_cache`` buffer, and the
``sequence_shards`` / ``sequence_layout`` the build and the parallel plans set), runs the forward
(``models.common.run_stack``) and initialises the weights from per-parameter rules
(``models.common.stack_init_rules``). A family's model subclasses it and gives its block class, the
width of its rotary table, the table itself (``rope_table``) and its blocks' initialisation rules
(``block_init_rules``). ``TiedOutput`` is the output projection of a model whose embedding is tied
to it (``args.tie_embeddings``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate

from models.common import InitRule, RMSNorm, init_plain_parameters, run_stack, stack_init_rules
from models.sequence import SequenceLayout


class TiedOutput(nn.Module):
    """The output projection of a model whose embedding is tied to it: logits from the token
    embedding's weight (``[vocab, dim]``, as a linear's), the one parameter, which stays the
    embedding's (its name, its SimpleFSDP gather and gradient reduction; each use gathers it).
    Under tensor parallel that weight is split over the vocabulary (``Shard(0)``), as an untied
    column-parallel output projection's: the input is taken as replicated (a plain tensor, or the
    ``Replicate`` DTensor of a sequence-parallel final norm) and the logits stay split over the
    vocabulary (a ``Shard(-1)`` DTensor, for the loss: ``graph_trainer.loss``), as that
    projection's plan makes them."""

    def __init__(self, embedding: nn.Embedding):
        super().__init__()
        self._embedding = [embedding]  # not a submodule: its parameter has one name, the embedding's

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self._embedding[0].weight
        if isinstance(weight, DTensor) and not isinstance(x, DTensor):
            x = DTensor.from_local(x, weight.device_mesh, [Replicate()], run_check=False)
        return F.linear(x, weight)


class DecoderStack(nn.Module, ABC):
    """Token embedding, ``args.n_layers`` blocks (``block(layer_id, args)``), final RMSNorm, output
    projection (its own weight, or the embedding's when ``args.tie_embeddings``: ``TiedOutput``).

    ``args`` has at least ``dim``, ``n_layers``, ``vocab_size``, ``norm_eps`` and ``max_seq_len``.
    Buffer: ``rope_cache`` [max_seq_len, rope_dim] float32, NON-persistent (not in the state dict;
    a pure function of the args): cos of the rotary angles in its first half, sin in the second.
    After building on the meta device and ``to_empty``, call ``init_buffers(device)``. Cast
    parameters, not the whole module, to lower precision: ``model.to(torch.bfloat16)`` would round
    this table too.
    """

    def __init__(self, args, block: Callable[[int, object], nn.Module], rope_dim: int):
        super().__init__()
        self.args = args
        self.sequence_shards = 1
        """Pieces each rank's hidden state splits the sequence into (context parallel's chunks times
        sequence parallel's pieces, set by the parallelize function): a pipeline stage without the
        embedding takes [B, S / sequence_shards, dim]."""
        self.sequence_layout = SequenceLayout()
        """Which tokens of a sequence this rank holds and what attention sees (``models.sequence``;
        set by the build)."""
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        # A ModuleDict keyed "0".."N-1" keeps FQNs "layers.3...." and lets pipeline
        # stages delete blocks without renumbering the rest.
        self.layers = nn.ModuleDict({str(i): block(i, args) for i in range(args.n_layers)})
        self.norm = RMSNorm(args.dim, args.norm_eps)
        if getattr(args, "tie_embeddings", False):
            self.output = TiedOutput(self.tok_embeddings)
        else:
            self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.register_buffer("rope_cache", torch.empty(args.max_seq_len, rope_dim), persistent=False)
        self.init_buffers()

    @abstractmethod
    def rope_table(self, device: torch.device | str | None) -> torch.Tensor:
        """The family's ``[max_seq_len, rope_dim]`` cos | sin table on ``device``."""

    @abstractmethod
    def block_init_rules(self, block: nn.Module, deep: InitRule) -> dict[str, InitRule]:
        """A block's parameters' rules, by FQN inside the block (``deep``: the depth-scaled rule of
        its layer, ``models.common.depth_scaled``)."""

    def init_buffers(self, device: torch.device | str | None = None) -> None:
        """(Re)compute ``rope_cache`` on ``device`` (default: where it lives now)."""
        self.rope_cache = self.rope_table(self.rope_cache.device if device is None else device)

    def forward(
        self, tokens: torch.Tensor, head: Callable[[torch.Tensor, nn.Module], torch.Tensor] | None = None
    ) -> torch.Tensor:
        """``tokens`` [B, S] int64 at positions 0..S-1 -> logits [B, S, vocab] in the output
        weight's dtype (callers upcast for the loss; under tensor parallel a DTensor split over the
        vocabulary, ``full_tensor()`` gathers it); with ``head``, ``head(final normed hidden state,
        output module, local)`` instead (the loss, which then computes the logits itself:
        ``graph_trainer.loss``). ``models.common.run_stack``."""
        return run_stack(self, tokens, head)

    def init_rules(self) -> dict[str, InitRule]:
        """How every parameter (FQN of the unwrapped model) is initialised: ``models.common.stack_init_rules``
        with the family's ``block_init_rules``."""
        return stack_init_rules(self, self.block_init_rules)

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Initialise a plain (unsharded, materialised) model in place from ``seed``: each parameter
        drawn in float32 from a generator seeded by ``stable_seed(seed, fqn)``, exactly as the
        trainer does before sharding, then the buffers filled."""
        init_plain_parameters(self, self.init_rules(), seed)
        self.init_buffers(self.tok_embeddings.weight.device)


__all__ = ["DecoderStack", "TiedOutput"]
