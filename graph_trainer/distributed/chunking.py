"""Run selected modules as two chunks of their input, with every node of a chunk tagged.

``install_chunking(model, fqns, dim)`` replaces the forward of each selected module by one that
splits its first argument in two along ``dim`` (0: batch, 1: sequence), runs the original
forward on each half in turn and concatenates the results. The other arguments (e.g. the
rotary table) are shared by both halves. This happens before tracing, so the traced graph
holds each chunk's ops separately, in program order (chunk 0, then chunk 1), and a graph pass
(``ep_overlap``) may interleave them later.

Tags written (``graph_trainer.graph.tags``, copied onto the backward by the tracer):

==================  ==========================================================================
``chunked_module``    FQN of the chunked module (``layers.3``), on every node made inside it:
                    both chunks, the split and the concatenation.
``chunk_id``        0 or 1, on the nodes of that chunk only (the split and the concatenation
                    have none: they belong to both).
==================  ==========================================================================

Parameters are used once per chunk. With SimpleFSDP each use of a parametrized parameter
would gather it again, so the wrapper gathers every parameter of the module once, before
the chunks, inside ``parametrize.cached()``: both chunks compute with the same gathered
tensor, one all-gather in forward and (autograd summing both chunks' gradients first) one
reduce-scatter in backward, as without chunking. Those gather nodes carry ``chunked_module``
but no ``chunk_id``.

Numerics: each chunk computes exactly what the module computes on its half; results differ
from the unchunked module only by how kernels split the work (matmuls over half the rows, a
weight gradient summed over two halves instead of one matmul), so the loss stays within float
rounding of the unchunked run, not bitwise.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from torch.nn.utils import parametrize

from graph_trainer.graph.tags import CHUNK_ID, CHUNKED_MODULE, MODULE_FQN, annotate

NUM_CHUNKS = 2
CHUNK_DIMS = {"batch": 0, "seq": 1}


def match_modules(model: nn.Module, pattern: str) -> list[tuple[str, nn.Module]]:
    """Modules whose FQN matches ``pattern`` part by part ('*' matches one dot-separated part)."""
    parts = pattern.split(".")
    found = []
    for fqn, module in model.named_modules():
        names = fqn.split(".")
        if (
            fqn
            and len(names) == len(parts)
            and all(fnmatch.fnmatchcase(n, p) for n, p in zip(names, parts, strict=True))
        ):
            found.append((fqn, module))
    return found


def _gather_parameters_once(module: nn.Module, fqn: str) -> None:
    """Materialise every parametrized parameter of ``module`` into ``parametrize``'s cache."""
    for sub_fqn, sub in module.named_modules(prefix=fqn):
        if parametrize.is_parametrized(sub):
            with annotate({MODULE_FQN: sub_fqn}):
                for name in sub.parametrizations:
                    getattr(sub, name)


def _chunked_forward(module: nn.Module, fqn: str, dim: int, forward: Callable) -> Callable:
    def run_in_chunks(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if x.shape[dim] % NUM_CHUNKS:
            raise ValueError(
                f"{fqn}: input dim {dim} of size {x.shape[dim]} cannot be split into {NUM_CHUNKS} equal chunks"
            )
        with annotate({CHUNKED_MODULE: fqn}), parametrize.cached():
            _gather_parameters_once(module, fqn)
            outputs = []
            for chunk_id, piece in enumerate(x.chunk(NUM_CHUNKS, dim=dim)):
                with annotate({CHUNK_ID: chunk_id}):
                    outputs.append(forward(piece, *args, **kwargs))
            return torch.cat(outputs, dim=dim)

    return run_in_chunks


def install_chunking(model: nn.Module, fqns: list[str], chunk_dim: str) -> None:
    """Make each module named in ``fqns`` run as two chunks along ``chunk_dim`` ('batch'/'seq')."""
    modules = dict(model.named_modules())
    for fqn in fqns:
        module = modules[fqn]
        if getattr(module, "_chunked", False):
            raise ValueError(f"{fqn} is already chunked")
        module.forward = _chunked_forward(module, fqn, CHUNK_DIMS[chunk_dim], module.forward)
        module._chunked = True


__all__ = ["CHUNK_DIMS", "NUM_CHUNKS", "install_chunking", "match_modules"]
