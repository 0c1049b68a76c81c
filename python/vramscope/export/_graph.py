"""The fx graph reduced to tensor operations: layers, joins and their data inputs; the
functions and tensor methods of forward mapped here, modules through _layers."""
from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ._errors import Unsupported
from ._layers import _flatten_spec, _output_size, _single, leaves
from ._trace import node_location


@dataclass(eq=False)
class Op:
    """One tensor-producing step: a layer (spec) or a join of branches."""
    name: str                      # fx node name
    index: int                     # position in the graph (a topological order)
    scope: Tuple[Tuple[str, int], ...]
    inputs: List["Op"] = field(default_factory=list)
    spec: Optional[dict] = None    # a layer of the model file
    module: Optional[str] = None   # the leaf module's qualified name, or None for a function
    join: Optional[str] = None     # "add", "concat", "mul", "matmul"
    inplace: bool = False
    dim: int = 1
    where: str = ""
    broken: bool = False           # could not be mapped (listed in the error)


class Graph:
    """The fx graph reduced to tensor operations with their data inputs."""

    def __init__(self, gm, model, metas: Dict[str, Any], metas_next: Dict[str, Any], batch: int):
        self.gm, self.model, self.batch = gm, model, batch
        self.metas, self.metas_next = metas, metas_next
        self.modules = dict(model.named_modules())
        self.problems: List[str] = []
        self.ops: List[Op] = []
        self.by_node: Dict[str, Op] = {}
        self.constant: set = set()   # nodes computed from parameters only (get_attr, expand of one)
        self.calls: Dict[str, int] = {}  # leaf module -> calls so far
        self.source: Optional[Op] = None
        self.output: Optional[Op] = None
        for i, node in enumerate(gm.graph.nodes):
            try:
                self._add(i, node)
            except Exception as e:  # noqa: BLE001 (Unsupported, or a case this mapping did not foresee)
                if not isinstance(e, Unsupported):
                    e = Unsupported(f"not understood ({type(e).__name__}: {e})")
                # Listed, and kept as a stand-in so that what follows is still checked.
                broken = Op(node.name, i, node.meta.get("scope", ()), self._data_inputs(node), broken=True)
                self.by_node[node.name] = broken
                if not (node.target is operator.getitem and all(o.broken for o in broken.inputs)):
                    self.problems.append(f"{self._where(node)}: {self._what(node)}: {e}")

    # Where a node comes from in the user's code: the module, else the function's stack.
    def _where(self, node) -> str:
        scope = node.meta.get("scope", ())
        owner = scope[-1][0] if scope else ""
        loc = node_location(node)
        if node.op == "call_module":
            return f"module '{node.target}'" + (f" ({loc})" if loc else "")
        return (f"in '{owner}'" if owner else "in the model's forward") + (f" ({loc})" if loc else "")

    def _what(self, node) -> str:
        if node.op == "call_module":
            return type(self.modules[node.target]).__name__
        target = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))
        return f"{node.op} {target}"

    def _is_tensor(self, node) -> bool:
        from torch.fx.passes.shape_prop import TensorMetadata
        return isinstance(self.metas.get(node.name), TensorMetadata)

    def shape(self, node) -> List[int]:
        return list(self.metas[node.name].shape)

    def sized(self, node, dims: Sequence[int]) -> List[Any]:
        """Sizes of a result, those that follow the batch written as "batch" formulas."""
        other = list(self.metas_next[node.name].shape)
        out: List[Any] = []
        for a, b in zip(dims, other):
            if a == b:
                out.append(a)
            elif b - a and a % (b - a) == 0 and a // (b - a) == self.batch:
                k = b - a
                out.append("batch" if k == 1 else f"{k} * batch")
            else:
                raise Unsupported(f"a size ({a}) that depends on the batch other than in proportion")
        return out

    def _first_empty(self, node) -> bool:
        """A result with a zero size where its inputs have none (what follows it is empty too);
        a module with an empty parameter is named for that parameter instead, in _module."""
        if 0 not in self.shape(node) or any(0 in self.shape(a) for a in node.all_input_nodes if self._is_tensor(a)):
            return False
        return node.op != "call_module" or all(p.numel() for p in self.modules[node.target].parameters())

    def _data_inputs(self, node) -> List[Op]:
        """The ops whose tensors this node reads (parameters and sizes left out)."""
        import torch.fx
        found: List[Op] = []

        def visit(a):
            if isinstance(a, torch.fx.Node):
                op = self.by_node.get(a.name)
                if op is not None and op not in found:
                    found.append(op)
            elif isinstance(a, (list, tuple)):
                for x in a:
                    visit(x)
            elif isinstance(a, dict):
                for x in a.values():
                    visit(x)

        visit(node.args)
        visit(node.kwargs)
        return found

    def _add(self, i: int, node) -> None:
        import torch.fx
        if node.op == "placeholder":
            if self.source is not None:
                raise Unsupported("a second input: the model must take one tensor")
            self.source = Op(node.name, i, ())
            self.by_node[node.name] = self.source
            return
        if node.op == "output":
            out = node.args[0]
            if not isinstance(out, torch.fx.Node) or out.name not in self.by_node:
                raise Unsupported("the model must return one tensor")
            self.output = self.by_node[out.name]
            return
        if node.op == "get_attr":
            self.constant.add(node.name)
            return
        if not self._is_tensor(node):
            meta = self.metas.get(node.name)
            if node.op == "call_module" and isinstance(meta, (tuple, list)):
                pass  # a module returning a tuple (nn.MultiheadAttention): element 0 is taken below
            else:
                return  # sizes, asserts, None
        elif self._first_empty(node):
            raise Unsupported(f"returns a tensor of shape {self.shape(node)}: a zero dimension, which a model "
                              "file cannot hold")
        args = list(node.args)
        tensors_in = [a for a in node.all_input_nodes if a.name in self.constant or a.name in self.by_node]
        if tensors_in and all(a.name in self.constant for a in tensors_in):
            self.constant.add(node.name)  # class_token.expand(n, -1, -1): still a parameter
            return
        data = self._data_inputs(node)
        if not data:
            raise Unsupported("a tensor made from nothing the model was given (a factory inside forward)")
        op = Op(node.name, i, node.meta.get("scope", ()), data, where=self._where(node))
        if node.target is operator.getitem and all(o.broken for o in data):
            op.broken = True  # an element of what an unmapped module returned: listed already
            self.by_node[node.name] = op
            return
        if node.op == "call_module":
            self._module(op, node)
        else:
            self._function(op, node, args)
        self.ops.append(op)
        self.by_node[node.name] = op

    def _module(self, op: Op, node) -> None:
        m = self.modules[node.target]
        mapper = leaves().get(type(m))
        if mapper is None:
            raise Unsupported("no model-file layer for this module type")
        params = list(m.parameters(recurse=True))
        empty = next((list(p.shape) for p in params if p.numel() == 0), None)
        if empty is not None:
            raise Unsupported(f"a parameter of shape {empty}: a layer with a zero dimension")
        spec = dict(mapper(m))
        self.calls[node.target] = self.calls.get(node.target, 0) + 1
        if params and self.calls[node.target] > 1:
            raise Unsupported("called again: a module with parameters used twice shares its weights, which a "
                              "model file cannot say")
        if params:
            frozen = [not p.requires_grad for p in params]
            if all(frozen):
                spec["frozen"] = True
            elif any(frozen):
                raise Unsupported("some of its parameters are frozen and some not (a model file freezes whole modules)")
        if type(m).__name__ == "MultiheadAttention":
            q = node.kwargs.get("query", node.args[0] if node.args else None)
            k = node.kwargs.get("key", node.args[1] if len(node.args) > 1 else None)
            v = node.kwargs.get("value", node.args[2] if len(node.args) > 2 else None)
            if not (q is k is v):
                raise Unsupported("attention whose query, key and value differ (self-attention only)")
            need = node.kwargs.get("need_weights", node.args[3] if len(node.args) > 4 else True)
            if need is not False:
                raise Unsupported("need_weights=True (PyTorch then skips scaled_dot_product_attention); "
                                  "call it with need_weights=False")
            for key in ("key_padding_mask", "attn_mask"):
                if node.kwargs.get(key) is not None:
                    raise Unsupported(f"{key} (not modelled)")
            if node.kwargs.get("is_causal"):
                raise Unsupported("is_causal (not modelled)")
        if spec["type"] == "Softmax":
            rank = len(self.shape(node))
            dim = m.dim
            if dim is None:  # nn.Softmax(): PyTorch's legacy _get_softmax_dim picks 0 for 0-, 1- and 3-d input, else 1
                dim = 0 if rank in (0, 1, 3) else 1
            if dim % max(rank, 1) != rank - 1:
                raise Unsupported("softmax over a dimension other than the last")
            spec["dim"] = -1
        if len(op.inputs) != 1:
            raise Unsupported("a module that takes more than one tensor")
        op.spec, op.module = spec, node.target

    # Functions and tensor methods.
    def _function(self, op: Op, node, args) -> None:
        import torch
        import torch.nn.functional as F
        t = node.target
        name = t if isinstance(t, str) else getattr(t, "__name__", "")
        kw = node.kwargs

        def arg(i, key, default=None):
            if key in kw:
                return kw[key]
            return args[i] if len(args) > i else default

        if t is operator.getitem and len(op.inputs) == 1 and op.inputs[0].spec is not None \
                and op.inputs[0].spec.get("type") == "MultiheadAttention":
            if args[1] != 0:
                raise Unsupported("the attention weights (need_weights=False returns None)")
            op.spec, op.module, op.join = {"type": "_Alias"}, None, None
            return
        constants = [a for a in node.all_input_nodes if a.name in self.constant]
        # A tensor times (or over) a Python number: x * 0.5, x / math.sqrt(d).
        numbers = [a for a in args[:2] if isinstance(a, (int, float)) and not isinstance(a, bool)]
        if name in ("mul", "truediv", "div") and len(op.inputs) == 1 and not constants and len(numbers) == 1 \
                and len(args) == 2 and not kw:
            factor = float(numbers[0])
            if name != "mul":
                if args[1] is not numbers[0]:
                    raise Unsupported("a number divided by a tensor (no model-file layer)")
                if factor == 0:
                    raise Unsupported("a division by zero")
                factor = 1.0 / factor
            op.spec = {"type": "Scale", "factor": factor}
            return
        if name in ("imul", "mul_", "itruediv", "div_") and numbers:
            raise Unsupported("an in-place product with a number (write x = x * c)")
        # Joins of two or more branches.
        if name in ("add", "iadd", "add_", "mul", "imul", "mul_", "matmul", "bmm", "cat", "concat") and \
                (len(op.inputs) >= 2 or name in ("cat", "concat") or (len(op.inputs) == 1 and not constants)):
            if name in ("cat", "concat"):
                tensors = arg(0, "tensors")
                if any(getattr(a, "name", None) in self.constant for a in tensors):
                    return self._class_token(op, node, tensors, arg(1, "dim", 0))
                rank = len(self.shape(node))
                dim = arg(1, "dim", 0)
                op.join, op.dim = "concat", dim % rank
                op.inputs = [self.by_node[a.name] for a in tensors]
                return
            operands = [a for a in args[:2] if isinstance(a, torch.fx.Node)]
            if len(operands) != 2 or any(a.name in self.constant for a in operands):
                raise Unsupported("arithmetic with a number or a parameter (no model-file layer)")
            if node.kwargs.get("alpha", 1) != 1:
                raise Unsupported("add with alpha")
            op.inputs = [self.by_node[a.name] for a in operands]
            if name in ("add", "iadd", "add_"):
                op.join = "add"
                op.inplace = name in ("iadd", "add_")
            elif name in ("mul", "imul", "mul_"):
                if name != "mul":
                    raise Unsupported("an in-place product")
                op.join = "mul"
            else:
                op.join = "matmul"
            if self.shape(operands[0]) != self.shape(operands[1]) and op.join != "matmul":
                raise Unsupported(f"operands of shapes {self.shape(operands[0])} and {self.shape(operands[1])} "
                                  "(broadcasting joins are not modelled)")
            return
        if name == "add" and constants and len(op.inputs) == 1:
            return self._position_embedding(op, node, constants[0])
        if len(op.inputs) != 1:
            raise Unsupported("an operation on several tensors with no model-file equivalent")
        x = next(a for a in node.all_input_nodes if a.name in self.by_node)
        shape_in, shape_out = self.shape(x), self.shape(node)
        rank = len(shape_in)

        def inplace(default=False):
            v = kw.get("inplace", args[1] if len(args) > 1 and isinstance(args[1], bool) else default)
            return {"inplace": True} if v else {}

        if t in (F.relu, torch.relu) or name in ("relu",):
            op.spec = {"type": "ReLU", **inplace()}
        elif t is torch.relu_ or name == "relu_":
            op.spec = {"type": "ReLU", "inplace": True}
        elif t is F.relu6:
            op.spec = {"type": "ReLU6", **inplace()}
        elif t is F.silu:
            op.spec = {"type": "SiLU", **inplace()}
        elif t is F.leaky_relu:
            slope = arg(1, "negative_slope", 0.01)
            op.spec = {"type": "LeakyReLU", **({"negative_slope": slope} if slope != 0.01 else {}),
                       **({"inplace": True} if arg(2, "inplace", False) else {})}
        elif t in (F.gelu,) or name == "gelu":
            approx = kw.get("approximate", "none")
            op.spec = {"type": "GELU", **({"approximate": "tanh"} if approx == "tanh" else {})}
        elif t in (torch.sigmoid, F.sigmoid) or name == "sigmoid":
            op.spec = {"type": "Sigmoid"}
        elif t in (torch.tanh, F.tanh) or name == "tanh":
            op.spec = {"type": "Tanh"}
        elif t in (F.softmax, torch.softmax) or name == "softmax":
            dim = arg(1, "dim")
            if dim is None or dim % rank != rank - 1:
                raise Unsupported("softmax over a dimension other than the last")
            if kw.get("dtype") is not None:
                raise Unsupported("softmax with a dtype")
            op.spec = {"type": "Softmax", "dim": -1}
        elif t is F.dropout or name == "dropout":
            p = arg(1, "p", 0.5)
            training = arg(2, "training", True)
            if arg(3, "inplace", False):
                raise Unsupported("in-place dropout")
            op.spec = {"type": "Dropout", "p": p if training else 0.0}
        elif t is F.adaptive_avg_pool2d:
            op.spec = {"type": "AdaptiveAvgPool2d", "output_size": _output_size(arg(1, "output_size"))}
        elif t is F.max_pool2d or t is F.avg_pool2d:
            k = _single(arg(1, "kernel_size"), "kernel_size")
            stride = arg(2, "stride") or k
            op.spec = {"type": "MaxPool2d" if t is F.max_pool2d else "AvgPool2d", "kernel_size": k}
            if _single(stride, "stride") != k:
                op.spec["stride"] = _single(stride, "stride")
            if _single(arg(3, "padding", 0), "padding"):
                op.spec["padding"] = _single(arg(3, "padding", 0), "padding")
            if arg(5 if t is F.max_pool2d else 4, "ceil_mode", False):
                raise Unsupported("ceil_mode=True")
        elif t is torch.mean or name == "mean":
            dims = arg(1, "dim")
            if dims is None or kw.get("dtype") is not None:
                raise Unsupported("a mean over every dimension, or with a dtype")
            dims = sorted(d % rank for d in (dims if isinstance(dims, (list, tuple)) else [dims]))
            if dims[0] < 1 or dims != list(range(dims[0], rank)):
                raise Unsupported("a mean over other than the trailing dimensions after the batch")
            op.spec = {"type": "Mean", "dims": dims, **({"keepdim": True} if arg(2, "keepdim", False) else {})}
        elif t is torch.flatten or name == "flatten":
            op.spec = _flatten_spec(arg(1, "start_dim", 0) % rank, arg(2, "end_dim", -1) if arg(2, "end_dim", -1) == -1
                                    else arg(2, "end_dim") % rank - rank)
        elif name in ("view", "reshape"):
            op.spec = self._reshape(node, shape_in, shape_out)
        elif name == "permute" or t is torch.permute:
            dims = [a for a in args[1:]] if not (len(args) == 2 and isinstance(args[1], (list, tuple))) else list(args[1])
            op.spec = {"type": "Permute", "dims": [d % rank for d in dims]}
        elif name == "transpose" or t is torch.transpose:
            op.spec = {"type": "Transpose", "dim0": arg(1, "dim0") % rank, "dim1": arg(2, "dim1") % rank}
        elif name == "contiguous":
            op.spec = {"type": "Contiguous"}
        elif t is operator.getitem:
            op.spec = self._select(args[1], shape_in)
        else:
            raise Unsupported("no model-file layer for this function")

    def _reshape(self, node, shape_in, shape_out) -> dict:
        for start in range(len(shape_in)):
            if shape_out[:start] == shape_in[:start] and len(shape_out) == start + 1 and start >= 1:
                return {"type": "Flatten", **({"start_dim": start} if start != 1 else {})}
        sizes = self.sized(node, shape_out)
        return {"type": "Reshape", "shape": sizes}

    def _select(self, index, shape_in) -> dict:
        if not isinstance(index, tuple):
            index = (index,)
        rest = [i for i in index if i != slice(None, None, None) and i is not Ellipsis]
        if len(rest) != 1 or not isinstance(rest[0], int):
            raise Unsupported(f"indexing {index!r} (only x[:, i]-style selection of one position)")
        dim = index.index(rest[0])
        if dim == 0:
            raise Unsupported("indexing the batch")
        return {"type": "SelectToken", **({"dim": dim} if dim != 1 else {}), "index": rest[0] % shape_in[dim]}

    def _param(self, node):
        """The parameter a constant node reads, with its qualified name."""
        seen = node
        while seen.op != "get_attr":
            ins = [a for a in seen.all_input_nodes if a.name in self.constant]
            if len(ins) != 1:
                raise Unsupported("a tensor computed from several parameters")
            seen = ins[0]
        target = seen.target
        obj = self.gm
        for part in target.split("."):
            obj = getattr(obj, part)
        return target, obj

    def _position_embedding(self, op: Op, node, const) -> None:
        target, p = self._param(const)
        shape = list(p.shape)
        out = self.shape(node)
        if len(shape) != 3 or shape[0] != 1 or shape[1:] != out[1:]:
            raise Unsupported(f"adding the parameter '{target}' of shape {shape} (a learned [1, N, E] position "
                              "embedding is what a model file can add)")
        op.spec = {"type": "PositionEmbedding", "num_positions": shape[1], "embed_dim": shape[2],
                   **({} if p.requires_grad else {"frozen": True})}
        op.module = target  # named after the parameter, in the scope of the code that adds it

    def _class_token(self, op: Op, node, tensors, dim) -> None:
        if len(tensors) != 2 or tensors[0].name not in self.constant or dim % len(self.shape(node)) != 1:
            raise Unsupported("concatenating a parameter other than a class token before the tokens (dim 1)")
        target, p = self._param(tensors[0])
        shape = list(p.shape)
        if len(shape) != 3 or shape[:2] != [1, 1]:
            raise Unsupported(f"concatenating the parameter '{target}' of shape {shape} (a [1, 1, E] class token)")
        op.spec = {"type": "ClassToken", "embed_dim": shape[2], **({} if p.requires_grad else {"frozen": True})}
        op.module = target
        op.inputs = [self.by_node[tensors[1].name]]
