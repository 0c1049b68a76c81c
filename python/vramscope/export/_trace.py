"""torch.fx tracing with the module stack of every node, and shapes on meta tensors."""
from __future__ import annotations

import contextlib
import dis
import inspect
import operator
import traceback
from typing import Any, Dict, List, Tuple

from ._errors import ExportError
from ._layers import leaves


def user_location(tb) -> str:
    """The innermost frame of a traceback outside torch: where in the user's code it failed."""
    where = ""
    for frame in traceback.extract_tb(tb):
        if "/torch/" not in frame.filename and "/vramscope/export/" not in frame.filename:
            where = f"{frame.filename}:{frame.lineno} ({(frame.line or '').strip()})"
    return where


@contextlib.contextmanager
def _proxy_patches():
    """`n, c, h, w = x.shape` under torch.fx on Python 3.11+ with PyTorch 1.13, whose Proxy
    finds UNPACK_SEQUENCE by an instruction index that 3.11's bytecode no longer matches."""
    from torch.fx.proxy import Proxy
    original = Proxy.__iter__

    def iterate(self):
        frame = inspect.currentframe().f_back
        for ins in dis.get_instructions(frame.f_code):
            if ins.offset == frame.f_lasti:
                if ins.opname == "UNPACK_SEQUENCE":
                    return (self[i] for i in range(ins.argval))
                break
        return original(self)

    def inplace(op):
        return lambda self, other: self.tracer.create_proxy("call_function", op, (self, other), {})

    # `out += identity` stays in place: without __iadd__ Python falls back to __add__ and the
    # graph would say `out = out + identity`, which allocates.
    patched = {"__iter__": iterate, "__iadd__": inplace(operator.iadd), "__imul__": inplace(operator.imul)}
    saved = {k: Proxy.__dict__.get(k) for k in patched}
    for k, v in patched.items():
        setattr(Proxy, k, v)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                delattr(Proxy, k)
            else:
                setattr(Proxy, k, v)


def trace(model):
    """torch.fx symbolic trace with the module stack of every node in node.meta["scope"]: a
    tuple of (qualified name, call index) of the non-leaf modules it runs in."""
    import torch
    import torch.fx

    class Tracer(torch.fx.Tracer):
        def __init__(self):
            super().__init__()
            self.record_stack_traces = True  # node.stack_trace: the user's file and line
            self.stack: List[Tuple[str, int]] = []
            self.calls: Dict[str, int] = {}

        def is_leaf_module(self, m, qualname):
            return type(m) in leaves() or super().is_leaf_module(m, qualname)

        def call_module(self, m, forward, args, kwargs):
            qualname = self.path_of_module(m)
            self.calls[qualname] = self.calls.get(qualname, 0) + 1
            self.stack.append((qualname, self.calls[qualname]))
            try:
                return super().call_module(m, forward, args, kwargs)
            finally:
                self.stack.pop()

        def create_node(self, *args, **kwargs):
            node = super().create_node(*args, **kwargs)
            scope = tuple(self.stack)
            if node.op == "call_module":
                scope = scope[:-1]  # a leaf module runs in its parent's scope
            node.meta["scope"] = scope
            return node

    tracer = Tracer()
    try:
        with _proxy_patches():
            graph = tracer.trace(model)
    except Exception as e:  # noqa: BLE001 (every tracing failure becomes one clear error)
        where = user_location(e.__traceback__)
        raise ExportError([f"{where}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}".lstrip(": "),
                           "torch.fx follows Python code that does not branch on tensor values; for a "
                           "transformers model use `vramscope --hf-config config.json` instead"],
                          "torch.fx cannot trace the model") from None
    return torch.fx.GraphModule(model, graph)


def propagate_shapes(gm, shape: List[int], dtype) -> Dict[str, Any]:
    """Each node's output TensorMetadata (or tuple of them) for an input of `shape`, on meta."""
    import torch
    from torch.fx.passes.shape_prop import ShapeProp
    x = torch.zeros(shape, dtype=dtype, device="meta")
    try:
        ShapeProp(gm).propagate(x)
    except Exception as e:  # noqa: BLE001
        where = user_location(e.__traceback__)
        raise ExportError([f"{where}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"],
                          f"the model does not run on an input of shape {shape}") from None
    return {n.name: n.meta.get("tensor_meta") for n in gm.graph.nodes}
