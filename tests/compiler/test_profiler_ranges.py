"""graph_trainer/compiler/profiler_ranges.py on a pipeline stage: the runner ranges each piece of the
split stage (forward, backward, dI, dW), so every kernel of every piece is inside its node's range."""

import copy
import dataclasses

import torch

from graph_trainer.compiler.tracer import trace_train_step
from graph_trainer.pipelining.runners import GraphStageRunner
from graph_trainer.torch_compat import record_function_ops
from models.common import keep_stage
from models.llama3.flavors import FLAVORS
from models.llama3.model import Transformer

LLAMA = dataclasses.replace(FLAVORS["debugmodel"], dim=64, n_layers=3, n_heads=4, n_kv_heads=2, vocab_size=128)
PIECES = ("forward", "backward", "backward_input", "backward_weight")


def _ranges_and_ops(gm) -> tuple[list[str], list[str]]:
    enter, leave = record_function_ops()
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    return [n.args[0] for n in calls if n.target == enter], [n.name for n in calls if n.target not in (enter, leave)]


def test_every_piece_of_a_middle_stage_has_its_nodes_ranged():
    model = Transformer(LLAMA)
    model.init_weights(0)
    stage = keep_stage(copy.deepcopy(model), range(1, 2), False, False)
    traced = trace_train_step(stage, torch.randn(2, 16, LLAMA.dim), torch.randn(2, 16, LLAMA.dim))
    plain = GraphStageRunner(copy.deepcopy(traced), stage).graphs
    ranged = GraphStageRunner(traced, stage, profiler_ranges=True).graphs
    for piece in PIECES:
        names, ops = _ranges_and_ops(getattr(ranged, piece))
        assert ops == _ranges_and_ops(getattr(plain, piece))[1], piece  # the same ops, in order
        assert [name.rsplit(": ", 1)[-1] for name in names] == ops, piece  # each inside its own range
    for piece in ("backward_input", "backward_weight"):
        assert any(name.startswith("layers.1.") for name in _ranges_and_ops(getattr(ranged, piece))[0]), piece
