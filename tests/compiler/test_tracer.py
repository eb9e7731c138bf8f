"""The tracer: one graph for forward + loss + backward, its metadata, and its shape cache."""

import dataclasses

import pytest
import torch

from graph_trainer.compiler.tracer import GraphStep, eager_step, trace_train_step
from graph_trainer.graph import tags
from models.llama3.flavors import FLAVORS
from models.llama3.model import Transformer

TINY = dataclasses.replace(FLAVORS["debugmodel"], dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128)


def _model(seed=0):
    model = Transformer(TINY)
    model.init_weights(seed)
    return model


def _batch(batch=2, seq=16, seed=1):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, TINY.vocab_size, (batch, seq + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def test_graph_matches_eager_bitwise():
    model = _model()
    tokens, labels = _batch()
    traced = trace_train_step(model, tokens, labels)
    params = list(model.parameters())
    loss, grads = traced(params, list(model.buffers()), tokens, labels)
    ref_loss, ref_grads = eager_step(model, tokens, labels)
    assert torch.equal(loss, ref_loss)
    assert len(grads) == len(ref_grads) == len(params)
    for g, r in zip(grads, ref_grads, strict=True):
        assert torch.equal(g, r)


def test_every_node_has_phase_and_module_fqn():
    model = _model()
    traced = trace_train_step(model, *_batch())
    phases = {"input", "forward", "loss", "backward", "output"}
    nodes = list(traced.gm.graph.nodes)
    for node in nodes:
        assert tags.phase(node) in phases, node
        assert isinstance(tags.get(node, "module_fqn"), str), node
    by_phase = {p: [n for n in nodes if tags.get(n, "phase") == p] for p in phases}
    assert all(by_phase[p] for p in phases)
    # Backward matmuls inherit the FQN of the forward module they differentiate.
    bwd_fqns = {tags.get(n, "module_fqn") for n in by_phase["backward"] if n.target == torch.ops.aten.mm.default}
    assert {"layers.0.attention.wq", "layers.1.feed_forward.w2", "output"} <= bwd_fqns
    fwd_fqns = {tags.get(n, "module_fqn") for n in by_phase["forward"]}
    assert {"layers.0.attention_norm", "layers.1.feed_forward.w1", "norm", "tok_embeddings"} <= fwd_fqns
    assert {tags.get(n, "module_fqn") for n in by_phase["loss"]} == {"loss"}
    # Placeholders name the tensor they carry and its owning module.
    inputs = {tags.get(n, "input_fqn"): tags.get(n, "module_fqn") for n in by_phase["input"]}
    assert inputs["layers.0.attention.wq.weight"] == "layers.0.attention.wq"
    assert inputs["tokens"] == "" and inputs["labels"] == ""
    # The graph is one piece: forward nodes come before loss nodes, which come before backward.
    order = {n: i for i, n in enumerate(nodes)}
    assert max(order[n] for n in by_phase["forward"]) < min(order[n] for n in by_phase["loss"])
    assert max(order[n] for n in by_phase["loss"]) < min(order[n] for n in by_phase["backward"])


def test_shape_cache_retraces_and_refuses_wrong_shapes():
    model = _model()
    step = GraphStep(model)
    a = _batch(seq=16)
    b = _batch(seq=8)
    step(*a)
    step(*a)
    assert len(step.graphs) == 1
    loss_b, _ = step(*b)
    assert len(step.graphs) == 2
    assert torch.equal(loss_b, eager_step(model, *b)[0])
    traced_a = step.get(*a)
    with pytest.raises(RuntimeError, match="does not match the traced graph"):
        traced_a(list(model.parameters()), list(model.buffers()), *b)


def test_trace_on_meta_touches_no_memory():
    with torch.device("meta"):
        model = Transformer(TINY)
    tokens, labels = (torch.empty(2, 16, dtype=torch.long, device="meta") for _ in range(2))
    traced = trace_train_step(model, tokens, labels, fake_device=torch.device("cpu"))
    vals = [n.meta["val"] for n in traced.gm.graph.nodes if n.op == "placeholder"]
    assert all(v.device.type == "cpu" for v in vals)
    assert len(traced.gm.graph.nodes) > 100
