"""graph_trainer.graph.tags: the one home of node metadata."""

import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

from graph_trainer.graph import tags
from graph_trainer.graph.tags import BACKWARD, FORWARD, LOSS_CHUNK, MODULE_FQN, PHASE, RECOMPUTED


def _graph() -> fx.GraphModule:
    return make_fx(lambda x: (x.sin() * 2).cos())(torch.randn(3))


def test_annotate_tags_every_node_made_inside_and_inner_values_win():
    def step(x):
        with tags.annotate({PHASE: FORWARD, MODULE_FQN: "layers.0"}):
            y = x.sin()
            with tags.annotate({MODULE_FQN: "layers.0.attention"}):
                y = y * 2
        return y.cos()

    with torch.fx.traceback.preserve_node_meta():
        gm = make_fx(step)(torch.randn(3))
    sin, mul, cos = (n for n in gm.graph.nodes if n.op == "call_function")
    assert dict(tags.tags(sin)) == {PHASE: FORWARD, MODULE_FQN: "layers.0"}
    assert dict(tags.tags(mul)) == {PHASE: FORWARD, MODULE_FQN: "layers.0.attention"}
    assert dict(tags.tags(cos)) == {} and tags.get(cos, PHASE) is None and tags.module_fqn(cos) == ""


def test_getters_are_read_only_and_writes_never_touch_a_shared_dict():
    gm = _graph()
    sin = next(n for n in gm.graph.nodes if n.op == "call_function")
    tags.update(sin, {PHASE: FORWARD}, module_fqn="layers.3.moe")
    view = tags.tags(sin)
    try:
        view[PHASE] = BACKWARD  # type: ignore[index]
        raise AssertionError("tags() must be read-only")
    except TypeError:
        pass
    # node_copy shares node.meta's dict shallowly: writing the copy must not retag the original.
    with gm.graph.inserting_after(sin):
        copy = gm.graph.node_copy(sin)
    assert copy.meta["custom"] is sin.meta["custom"]
    tags.update(copy, {PHASE: BACKWARD, RECOMPUTED: True})
    tags.remove(copy, MODULE_FQN)
    tags.set_default(copy, LOSS_CHUNK, 0)
    assert dict(tags.tags(sin)) == {PHASE: FORWARD, MODULE_FQN: "layers.3.moe"}
    assert dict(tags.tags(copy)) == {PHASE: BACKWARD, RECOMPUTED: True, LOSS_CHUNK: 0}
    tags.set_default(copy, LOSS_CHUNK, 5)  # present: kept
    assert tags.get(copy, LOSS_CHUNK) == 0
    tags.replace(copy, {PHASE: FORWARD})
    assert dict(tags.tags(copy)) == {PHASE: FORWARD} and tags.has(copy, PHASE) and not tags.has(copy, RECOMPUTED)


def test_block_and_unit_come_from_module_fqn_and_loss_chunk():
    gm = _graph()
    node = next(n for n in gm.graph.nodes if n.op == "call_function")
    for fqn, block in [
        ("layers.12.attention.wq", "layers.12"),
        ("layers.3", "layers.3"),
        ("layers", None),
        ("layersX.1", None),
        ("tok_embeddings", None),
        ("", None),
        ("output", None),
    ]:
        tags.replace(node, {MODULE_FQN: fqn})
        assert tags.block_of(node) == block, fqn
        assert tags.unit_of(node) == block, fqn
    tags.update(node, {LOSS_CHUNK: 2})  # a loss row block is its own unit, whatever the module
    assert tags.unit_of(node) == "loss_chunk.2"
