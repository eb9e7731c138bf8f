"""Concrete sizes of traced values whose shapes may hold symbols.

A traced node's ``meta["val"]`` is a fake tensor (or a list of them, or a SymInt). Static
shapes are plain ints. Data-dependent sizes (expert-parallel ``all_to_all_single`` split sizes
read with ``.tolist()``) are *unbacked* symbols without an example value. ``SizeHints`` gives
every size a number; ``SizeHints.from_graph`` assigns the unbacked ones by **balanced routing**:
each split of an all_to_all (or of a ``split_with_sizes``) whose tensor size is known gets
``rows / len(splits)``, so an all_to_all receives as many rows as it sends; symbols still
unknown take the mean of the resolved ones (1 if none). Cost model, memory estimate and
bucketing all count bytes through this one class.
"""

from __future__ import annotations

import sympy
import torch
import torch.fx as fx

from graph_trainer.torch_compat import is_op_overload, op_name, sym_expr, sym_has_hint, sym_hint

aten = torch.ops.aten
_SPLITS = (aten.split_with_sizes.default, aten.split.sizes)


def value_of(x):
    """The traced value of a node (``meta["val"]``), element-wise for lists; other arguments as they are."""
    if isinstance(x, (list, tuple)):  # e.g. the inputs of a coalesced collective
        return [value_of(v) for v in x]
    return x.meta.get("val") if isinstance(x, fx.Node) else x


def tensors_in(value) -> list[torch.Tensor]:
    """The tensors in a traced value (a tensor, or nested lists of them), flat."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in tensors_in(v)]
    return []


class SizeHints:
    """Concrete ints for shapes that may hold SymInts (see the module docstring)."""

    def __init__(self, values: dict | None = None, fallback: int = 1):
        self.values: dict[sympy.Symbol, sympy.Expr] = dict(values or {})
        self.fallback = fallback

    def resolved(self, x) -> bool:
        """Whether ``x`` has a value without the fallback."""
        if not isinstance(x, torch.SymInt) or sym_has_hint(x):
            return True
        return sym_expr(x).free_symbols <= set(self.values)

    def concrete(self, x) -> int:
        if not isinstance(x, torch.SymInt):
            return int(x)
        if sym_has_hint(x):  # backed symbol traced with an example value
            return sym_hint(x)
        expr = sym_expr(x)
        subs = {s: self.values.get(s, self.fallback) for s in expr.free_symbols}
        return max(0, int(round(float(expr.xreplace(subs)))))

    def numel(self, t: torch.Tensor) -> int:
        n = 1
        for d in t.shape:
            n *= self.concrete(d)
        return n

    def nbytes(self, val) -> int:
        return sum(self.numel(t) * t.element_size() for t in tensors_in(val))

    @classmethod
    def from_graph(cls, graph: fx.Graph) -> SizeHints:
        """Assign unbacked split-size symbols by balanced routing (module docstring)."""
        hints = cls()
        for _ in range(3):  # a few sweeps let assignments propagate (combine after dispatch)
            for node in graph.nodes:
                found = _split_lists(node)
                if found is None:
                    continue
                size, lists = found
                if size is None or not hints.resolved(size):
                    continue
                for splits in lists:
                    if not isinstance(splits, (list, tuple)) or not splits:
                        continue
                    share = sympy.Rational(hints.concrete(size), len(splits))
                    for s in splits:
                        v = value_of(s)
                        if isinstance(v, torch.SymInt) and not sym_has_hint(v):
                            expr = sym_expr(v)
                            if isinstance(expr, sympy.Symbol) and expr not in hints.values:
                                hints.values[expr] = share
        if hints.values:
            vals = [float(v) for v in hints.values.values()]
            hints.fallback = max(1, int(round(sum(vals) / len(vals))))
        return hints


def _split_lists(node: fx.Node):
    """(size of the split dim, [split-size lists]) of an all_to_all or a split by sizes, else None."""
    if node.op != "call_function" or not is_op_overload(node.target):
        return None
    if node.target.namespace == "_c10d_functional" and op_name(node.target) == "all_to_all_single":
        inp = value_of(node.args[0])
        size = inp.shape[0] if isinstance(inp, torch.Tensor) and inp.dim() else None
        return size, [node.args[1], node.args[2]]
    if node.target in _SPLITS:
        inp = value_of(node.args[0])
        dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)
        size = inp.shape[dim] if isinstance(inp, torch.Tensor) else None
        return size, [node.args[1]]
    return None


__all__ = ["SizeHints", "tensors_in", "value_of"]
