"""Pipeline stages: a model cut into stages (``keep_stage``), each stage's joint graph traced and
cut into forward / backward / dI / dW (``graph_trainer.pipelining.split``), computes bit for bit
what the whole model's traced step computes."""

import copy
import dataclasses

import pytest
import torch

from graph_trainer.compiler.tracer import TracedStep, trace_train_step
from graph_trainer.graph import tags
from graph_trainer.graph.tags import INPUT_FQN
from graph_trainer.pipelining.split import split_stage
from models.common import keep_stage
from models.deepseek_v3.model import DeepSeekV3
from models.llama3.flavors import FLAVORS
from models.llama3.model import Transformer
from tests.deepseek_v3_tiny import TINY_V3

LLAMA = dataclasses.replace(FLAVORS["debugmodel"], dim=64, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=128)
DEEPSEEK = dataclasses.replace(TINY_V3, n_layers=4)
# first / middle / last stage, and a stage that is both a MoE and a dense block
STAGES = [range(0, 2), range(2, 3), range(3, 4)]


def _model(kind: str):
    model = Transformer(LLAMA) if kind == "llama3" else DeepSeekV3(DEEPSEEK)
    model.init_weights(0)
    return model


def _batch(vocab: int, batch=2, seq=16):
    tokens = torch.randint(0, vocab, (batch, seq + 1), generator=torch.Generator().manual_seed(1))
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _stages(model):
    n = len(STAGES)
    return [keep_stage(copy.deepcopy(model), blocks, i == 0, i == n - 1) for i, blocks in enumerate(STAGES)]


def _flat(traced: TracedStep, stage, stage_in, target):
    return traced.flat_inputs(list(stage.parameters()), list(stage.buffers()), stage_in, target)


@pytest.mark.parametrize("kind", ["llama3", "deepseek_v3"])
def test_stage_graphs_compute_what_the_whole_step_computes(kind):
    """Forward of every stage, then both backwards from the same saved values: the full backward,
    and dI then dW (each its own chain of output gradients)."""
    model = _model(kind)
    tokens, labels = _batch(model.args.vocab_size)
    whole = trace_train_step(copy.deepcopy(model), tokens, labels, grad_scale=0.5)
    ref_loss, *ref_grads = whole.gm(*_flat(whole, model, tokens, labels))
    reference = dict(zip(whole.param_names, ref_grads, strict=True))

    stages = _stages(model)
    hidden = torch.empty(*tokens.shape, model.args.dim)
    pieces, saved, stage_in = [], [], tokens
    for i, stage in enumerate(stages):  # forward, first to last
        last = i == len(stages) - 1
        traced = trace_train_step(stage, stage_in, labels if last else hidden, grad_scale=0.5)
        graphs = split_stage(traced.gm, len(traced.param_names))
        names = [tags.get(n, INPUT_FQN) for n in traced.gm.graph.nodes if n.op == "placeholder"]
        assert names[-2:] == [["tokens", "stage_input"][i > 0], ["output_grad", "labels"][last]]
        flat = _flat(traced, stage, stage_in, labels if last else hidden)
        out, *kept = graphs.forward(*(flat if last else flat[:-1]))
        assert len(kept) == graphs.num_saved
        pieces.append((traced, graphs))
        saved.append(kept)
        stage_in = out
    assert torch.equal(stage_in, ref_loss)

    full_chain: list = []
    split_chain: list = []
    for i in reversed(range(len(stages))):  # backward, last to first
        traced, graphs = pieces[i]
        outs = graphs.backward(*saved[i], *full_chain)
        *grads, input_grad = outs if graphs.has_input_grad else [*outs, None]
        split_inputs = [*saved[i], *split_chain]
        split_input_grad, *for_weight = graphs.backward_input(*split_inputs) if graphs.has_input_grad else [None]
        assert len(for_weight) == graphs.num_kept_for_weight
        split_grads = graphs.backward_weight(*split_inputs, *for_weight)
        assert len(grads) == len(split_grads) == len(traced.param_names)
        for name, grad, split_grad in zip(traced.param_names, grads, split_grads, strict=True):
            want = reference.pop(name)
            assert torch.equal(grad, want) and torch.equal(split_grad, want), name
        full_chain = [input_grad] if input_grad is not None else []
        split_chain = [split_input_grad] if split_input_grad is not None else []
        if input_grad is not None:
            assert torch.equal(input_grad, split_input_grad)
    assert not reference, f"no stage holds {sorted(reference)}"
