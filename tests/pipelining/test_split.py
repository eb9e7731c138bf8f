"""Pipeline stages: a model cut into stages (``keep_stage``), each stage's joint graph traced and
cut into forward / backward / dI / dW (``graph_trainer.pipelining.split``), computes bit for bit
what the whole model's traced step computes."""

import copy
import dataclasses

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from graph_trainer.analysis.memory import estimate_peak_memory
from graph_trainer.compiler.tracer import TracedStep, trace_train_step
from graph_trainer.graph import tags
from graph_trainer.graph.tags import INPUT_FQN
from graph_trainer.pipelining.split import add_into_sums, split_stage
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


@pytest.mark.parametrize("kind", ["llama3", "deepseek_v3"])
def test_backward_pieces_add_into_the_sums_bitwise_as_returned_gradients_added(kind):
    """``grads_into_sums``: the backward (and dW) add each gradient into the step's sums in place;
    from the runner's start (sums of -0.0) one microbatch leaves bitwise its gradients, signed
    zeros included, two leave bitwise the first plus the second; the backward allocates less."""
    model = _model(kind)
    tokens, labels = _batch(model.args.vocab_size)
    stage = _stages(model)[-1]  # (the last stage: it differentiates its input, the hidden state)
    hidden = torch.randn(*tokens.shape, model.args.dim, generator=torch.Generator().manual_seed(2))
    traced = trace_train_step(stage, hidden, labels, grad_scale=0.5)
    plain = split_stage(traced.gm, len(traced.param_names))
    summing = split_stage(traced.gm, len(traced.param_names), grads_into_sums=True)
    _, *saved = summing.forward(*_flat(traced, stage, hidden, labels))
    *grads, input_grad = plain.backward(*saved)
    cpu = torch.device("cpu")

    once = summing.empty_sums(cpu)
    (summed_input_grad,) = summing.backward(*saved, *once)
    assert torch.equal(summed_input_grad, input_grad)
    for total, grad in zip(once, grads, strict=True):
        assert total.dtype == grad.dtype and torch.equal(total, grad)
        assert torch.equal(torch.signbit(total), torch.signbit(grad))
    twice = summing.empty_sums(cpu)
    for _ in range(2):
        summing.backward(*saved, *twice)
    assert all(torch.equal(total, grad.clone().add_(grad)) for total, grad in zip(twice, grads, strict=True))
    _, *kept = summing.backward_input(*saved)
    weight_sums = summing.empty_sums(cpu)
    assert summing.backward_weight(*saved, *kept, *weight_sums) == []
    assert all(torch.equal(total, grad) for total, grad in zip(weight_sums, grads, strict=True))

    def allocated(graphs):
        return estimate_peak_memory(graphs.backward.graph).peak_activation_bytes

    assert allocated(summing) < allocated(plain)


def test_a_widened_gradient_is_added_as_its_narrower_value():
    """bf16 -> fp32 is exact and ``add_`` computes in the sum's dtype: the widening is left out."""

    def piece(w, x):
        narrow = (w * x).to(torch.bfloat16)
        return [narrow.to(torch.float32), w * 2, x.sum()]

    w, x = torch.randn(8), torch.randn(8)
    gm = make_fx(piece)(w, x)
    casts = [n for n in gm.graph.nodes if n.target is torch.ops.aten._to_copy.default]
    assert len(casts) == 2
    summing = add_into_sums(copy.deepcopy(gm), 2)
    assert len([n for n in summing.graph.nodes if n.target is torch.ops.aten._to_copy.default]) == 1
    adds = [n for n in summing.graph.nodes if n.target is torch.ops.aten.add_.Tensor]
    assert [a.args[1].meta["val"].dtype for a in adds] == [torch.bfloat16, torch.float32]
    start = torch.tensor([-0.0, 0.0, 1.0, -2.5, 3.0, 0.5, -0.0, 7.0])
    sums = [start.clone(), start.clone()]
    assert summing(w, x, *sums) == [x.sum()]
    widened, doubled, _ = gm(w, x)
    assert torch.equal(sums[0], start.clone().add_(widened)) and torch.equal(sums[1], start.clone().add_(doubled))
