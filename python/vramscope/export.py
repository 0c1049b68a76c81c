"""Export a vramscope model file (docs/MODEL_FILES.md) from your PyTorch code.

    python3 -m vramscope.export my_model.py:make_model --input 8,3,224,224 -o net.json
    vramscope sweep --model-file net.json --segments auto --dtype f32,amp

`my_model.py:make_model` is a file (or an importable module, `torchvision.models:resnet50`)
and a callable in it that returns your nn.Module. The model is built on the meta device (no
weights are allocated, nothing is downloaded, no GPU is needed), traced with torch.fx, and
every module and function is mapped onto the model file's layers. The file keeps your
module names (vramscope's per-module logs use them), frozen parameters, in-place flags and
the loss. Whatever cannot be mapped is listed in one error, each with its place in your
source; nothing is dropped silently.

The graph must be series-parallel: a chain of layers where a tensor may fork into branches
that join again (a residual add, a concatenation, a gate, a matmul). Sizes are those of
--input; the first dimension is the batch, which stays an option of the file (--batch).
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import dis
import importlib
import importlib.util
import inspect
import json
import operator
import re
import os
import sys
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

LOSSES = ("cross_entropy", "mse", "bce_with_logits", "sum", "none")


class ExportError(Exception):
    """What could not be exported: one line per problem, each with its source location."""

    def __init__(self, problems: Sequence[str], headline: str = "cannot export the model"):
        self.problems = list(problems)
        super().__init__(headline + ":\n" + "\n".join("  - " + p for p in self.problems))


# --- loading the model on the meta device ------------------------------------------------------

def load_factory(target: str) -> Tuple[Callable[[], Any], str]:
    """`path/to/file.py:func` or `package.module:func` -> (the callable, its name)."""
    if ":" not in target:
        raise ExportError([f"{target!r}: expected FILE.py:FUNCTION or module:FUNCTION (for example "
                           "my_model.py:make_model or torchvision.models:resnet50)"], "bad model argument")
    where, name = target.rsplit(":", 1)
    if where.endswith(".py") or os.sep in where:
        path = Path(where)
        if not path.is_file():
            raise ExportError([f"{where}: no such file"], "bad model argument")
        spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(spec)
        sys.path.insert(0, str(path.resolve().parent))  # its own imports, as `python3 file.py` has them
        try:
            spec.loader.exec_module(module)
        finally:
            sys.path.pop(0)
    else:
        module = importlib.import_module(where)
    factory = module
    for part in name.split("."):
        if not hasattr(factory, part):
            raise ExportError([f"{where} has no {name!r}"], "bad model argument")
        factory = getattr(factory, part)
    if not callable(factory):
        raise ExportError([f"{where}:{name} is not callable (give a function or class that returns the model)"],
                          "bad model argument")
    return factory, name.split(".")[-1]


@contextlib.contextmanager
def meta_device():
    """Builds modules without allocating their weights: PyTorch 2's torch.device("meta")
    context, or on 1.13 a TorchFunctionMode that sends every factory function there."""
    import torch
    if hasattr(torch, "get_default_device") or hasattr(torch, "set_default_device"):
        with torch.device("meta"):
            yield
        return
    from torch.overrides import TorchFunctionMode
    factories = {torch.empty, torch.zeros, torch.ones, torch.full, torch.rand, torch.randn, torch.randint,
                 torch.tensor, torch.as_tensor, torch.arange, torch.eye, torch.linspace, torch.empty_strided}

    class Meta(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = dict(kwargs or {})
            if func in factories:
                kwargs["device"] = "meta"
            return func(*args, **kwargs)

    with Meta():
        yield


HF_TYPES = ("llama", "mistral", "qwen2", "gpt2")  # what `vramscope --hf-config` reads


def build_model(factory: Callable[[], Any]):
    import torch
    try:
        with meta_device():
            model = factory()
    except Exception as e:  # noqa: BLE001
        raise ExportError([f"{_user_location(e.__traceback__)}: {type(e).__name__}: {e}"],
                          "building the model failed") from None
    if not isinstance(model, torch.nn.Module):
        raise ExportError([f"the factory returned {type(model).__name__}, not a torch.nn.Module"])
    model.train()
    return model


def refuse_transformers(model, output: Optional[str]) -> None:
    """A Hugging Face transformers model: torch.fx cannot follow its forward (masks, caches,
    Python branches on shapes), and vramscope reads its config.json directly instead."""
    if not any(c.__name__ == "PreTrainedModel" for c in type(model).__mro__) or not hasattr(model, "config"):
        return
    model_type = getattr(model.config, "model_type", "?")
    if model_type not in HF_TYPES:
        raise ExportError([f"{type(model).__name__} is a transformers model (model_type {model_type!r}); vramscope "
                           f"models transformers from their config.json, for model types {', '.join(HF_TYPES)}"],
                          "not exported")
    config = Path(output).with_suffix(".config.json") if output else Path(f"{model_type}.config.json")
    model.config.to_json_file(str(config))
    raise ExportError([f"{type(model).__name__} is a transformers model: vramscope models it from its config "
                       f"(attention, checkpointing, LoRA and QLoRA as transformers and PEFT run them); its config "
                       f"is in {config}: run `vramscope sweep --hf-config {config}` (docs/TRANSFORMERS.md)"],
                      "not exported")


# --- tracing -----------------------------------------------------------------------------------

def _user_location(tb) -> str:
    """The innermost frame of a traceback outside torch: where in the user's code it failed."""
    where = ""
    for frame in traceback.extract_tb(tb):
        if "/torch/" not in frame.filename and "/vramscope/export" not in frame.filename:
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
            return type(m) in LEAVES or super().is_leaf_module(m, qualname)

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
        where = _user_location(e.__traceback__)
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
        where = _user_location(e.__traceback__)
        raise ExportError([f"{where}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"],
                          f"the model does not run on an input of shape {shape}") from None
    return {n.name: n.meta.get("tensor_meta") for n in gm.graph.nodes}


# --- module leaves -------------------------------------------------------------------------------

class Unsupported(Exception):
    pass


def _single(value, what: str) -> int:
    """A square kernel / stride / padding: PyTorch's int or (a, a)."""
    if isinstance(value, (tuple, list)):
        if len(set(value)) != 1:
            raise Unsupported(f"{what} {tuple(value)} is not square (model files take one size)")
        value = value[0]
    if not isinstance(value, int):
        raise Unsupported(f"{what} {value!r} is not a size")
    return value


def _conv(m, kind):
    if m.padding_mode != "zeros":
        raise Unsupported(f"padding_mode={m.padding_mode!r} (zeros only)")
    if isinstance(m.padding, str):
        raise Unsupported(f"padding={m.padding!r} (give the sizes)")
    spec = {"type": kind, "in_channels": m.in_channels, "out_channels": m.out_channels,
            "kernel_size": _single(m.kernel_size, "kernel_size")}
    for key, default in (("stride", 1), ("padding", 0), ("dilation", 1)):
        v = _single(getattr(m, key), key)
        if v != default:
            spec[key] = v
    if kind == "ConvTranspose2d":
        op = _single(m.output_padding, "output_padding")
        if op:
            spec["output_padding"] = op
        if m.groups != 1:
            raise Unsupported("groups > 1 in ConvTranspose2d")
    elif m.groups != 1:
        spec["groups"] = m.groups
    if m.bias is None:
        spec["bias"] = False
    return spec


def _norm(m, kind):
    if not m.affine or not m.track_running_stats:
        raise Unsupported("affine=False or track_running_stats=False")
    spec = {"type": kind, "num_features": m.num_features}
    if m.eps != 1e-5:
        spec["eps"] = m.eps
    if m.momentum != 0.1 and m.momentum is not None:
        spec["momentum"] = m.momentum
    if m.momentum is None:
        raise Unsupported("momentum=None (a cumulative average)")
    return spec


def _pool(m, kind):
    if getattr(m, "ceil_mode", False):
        raise Unsupported("ceil_mode=True")
    spec = {"type": kind, "kernel_size": _single(m.kernel_size, "kernel_size")}
    stride = _single(m.stride if m.stride is not None else m.kernel_size, "stride")
    if stride != spec["kernel_size"]:
        spec["stride"] = stride
    padding = _single(m.padding, "padding")
    if padding:
        spec["padding"] = padding
    if kind == "MaxPool2d" and (_single(m.dilation, "dilation") != 1 or m.return_indices):
        raise Unsupported("dilation or return_indices")
    if kind == "AvgPool2d":
        if m.divisor_override is not None:
            raise Unsupported("divisor_override")
        if not m.count_include_pad:
            spec["count_include_pad"] = False
    return spec


def _layer_norm(m):
    if len(m.normalized_shape) != 1 or not m.elementwise_affine:
        raise Unsupported("normalized_shape over more than the last dimension, or elementwise_affine=False")
    spec = {"type": "LayerNorm", "normalized_shape": m.normalized_shape[0]}
    if m.eps != 1e-5:
        spec["eps"] = m.eps
    if getattr(m, "bias", True) is None:
        raise Unsupported("bias=False")
    return spec


def _rms_norm(m):
    if len(m.normalized_shape) != 1:
        raise Unsupported("normalized_shape over more than the last dimension")
    spec = {"type": "RMSNorm", "normalized_shape": m.normalized_shape[0]}
    if m.eps is not None:
        spec["eps"] = m.eps
    if not m.elementwise_affine:
        spec["elementwise_affine"] = False
    return spec


def _mha(m):
    if not m._qkv_same_embed_dim or m.bias_k is not None:
        raise Unsupported("kdim/vdim other than embed_dim, or add_bias_kv")
    spec = {"type": "MultiheadAttention", "embed_dim": m.embed_dim, "num_heads": m.num_heads}
    if m.dropout:
        spec["dropout"] = m.dropout
    if m.in_proj_bias is None:
        spec["bias"] = False
    if m.batch_first:
        spec["batch_first"] = True
    return spec


def _embedding(m):
    if m.max_norm is not None or m.sparse:
        raise Unsupported("max_norm or sparse")
    return {"type": "Embedding", "num_embeddings": m.num_embeddings, "embedding_dim": m.embedding_dim}


def _inplace(kind):
    return lambda m: {"type": kind, **({"inplace": True} if m.inplace else {})}


def _leaky(m):
    spec = {"type": "LeakyReLU"}
    if m.negative_slope != 0.01:
        spec["negative_slope"] = m.negative_slope
    if m.inplace:
        spec["inplace"] = True
    return spec


def _hardtanh(m):
    import torch
    if type(m) is torch.nn.ReLU6:
        return _inplace("ReLU6")(m)
    spec = {"type": "Hardtanh", "min_val": m.min_val, "max_val": m.max_val}
    if m.inplace:
        spec["inplace"] = True
    return spec


def _softmax(m):
    if m.dim not in (-1, None):
        spec = {"type": "Softmax", "dim": m.dim}  # checked against the rank below
    else:
        spec = {"type": "Softmax", "dim": -1}
    return spec


def _leaves():
    import torch.nn as nn
    table = {
        nn.Linear: lambda m: {"type": "Linear", "in_features": m.in_features, "out_features": m.out_features,
                              **({} if m.bias is not None else {"bias": False})},
        nn.Conv2d: lambda m: _conv(m, "Conv2d"),
        nn.Conv1d: lambda m: _conv(m, "Conv1d"),
        nn.ConvTranspose2d: lambda m: _conv(m, "ConvTranspose2d"),
        nn.BatchNorm2d: lambda m: _norm(m, "BatchNorm2d"),
        nn.BatchNorm1d: lambda m: _norm(m, "BatchNorm1d"),
        nn.GroupNorm: lambda m: {"type": "GroupNorm", "num_groups": m.num_groups, "num_channels": m.num_channels,
                                 **({} if m.eps == 1e-5 else {"eps": m.eps}),
                                 **({} if m.affine else {"affine": False})},
        nn.LayerNorm: _layer_norm,
        nn.ReLU: _inplace("ReLU"),
        nn.ReLU6: _hardtanh,
        nn.Hardtanh: _hardtanh,
        nn.LeakyReLU: _leaky,
        nn.SiLU: _inplace("SiLU"),
        nn.Sigmoid: lambda m: {"type": "Sigmoid"},
        nn.Tanh: lambda m: {"type": "Tanh"},
        nn.GELU: lambda m: {"type": "GELU", **({"approximate": "tanh"} if m.approximate == "tanh" else {})},
        nn.Softmax: _softmax,
        nn.Dropout: lambda m: {"type": "Dropout", "p": m.p},
        nn.Identity: lambda m: {"type": "Identity"},
        nn.MaxPool2d: lambda m: _pool(m, "MaxPool2d"),
        nn.AvgPool2d: lambda m: _pool(m, "AvgPool2d"),
        nn.AdaptiveAvgPool2d: lambda m: {"type": "AdaptiveAvgPool2d", "output_size": _output_size(m.output_size)},
        nn.Flatten: lambda m: _flatten_spec(m.start_dim, m.end_dim),
        nn.Embedding: _embedding,
        nn.MultiheadAttention: _mha,
    }
    if hasattr(nn, "RMSNorm"):
        table[nn.RMSNorm] = _rms_norm
    return table


def _output_size(size):
    if isinstance(size, (tuple, list)):
        if None in size:
            raise Unsupported("output_size with None")
        return size[0] if size[0] == size[1] else list(size)
    return size


def _flatten_spec(start, end):
    if end != -1:
        raise Unsupported(f"end_dim={end} (model files flatten to the last dimension)")
    return {"type": "Flatten", **({"start_dim": start} if start != 1 else {})}


LEAVES: Dict[type, Callable[[Any], dict]] = {}


# --- the graph of tensor operations -------------------------------------------------------------

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
        import torch
        self.gm, self.model, self.batch = gm, model, batch
        self.metas, self.metas_next = metas, metas_next
        self.modules = dict(model.named_modules())
        self.problems: List[str] = []
        self.ops: List[Op] = []
        self.by_node: Dict[str, Op] = {}
        self.constant: set = set()   # nodes computed from parameters only (get_attr, expand of one)
        self.source: Optional[Op] = None
        self.output: Optional[Op] = None
        self.torch = torch
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
        loc = ""
        for m in re.finditer(r'File "([^"]+)", line (\d+)', node.stack_trace or ""):
            file = m.group(1)
            if not (file.startswith("<") or "/torch/" in file or file.endswith("vramscope/export.py")):
                loc = f"{file}:{m.group(2)}"
                break  # fx lists the innermost frame first: the line that did it
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
        args = [a for a in node.args]
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
        mapper = LEAVES.get(type(m))
        if mapper is None:
            raise Unsupported("no model-file layer for this module type")
        spec = dict(mapper(m))
        params = list(m.parameters(recurse=True))
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
        if spec["type"] == "Softmax" and spec["dim"] not in (-1, len(self.shape(node)) - 1):
            raise Unsupported("softmax over a dimension other than the last")
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
        op.inputs = [o for o in op.inputs]

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


# --- series-parallel structure, module by module --------------------------------------------------

class Structure:
    """Turns the op graph into the model file's nested layers: each module call is a
    container (a Sequential, or the Residual / Parallel its forward is), each fork-join a
    Residual or Parallel; code between modules is inline."""

    def __init__(self, graph: Graph):
        self.g = graph
        self.problems: List[str] = []
        self.model = graph.model
        self.modules = graph.modules
        # Classes whose forward is a fork-join at its own level somewhere: blocks, never
        # expanded into the top-level sequence.
        self.block_classes: set = set()
        self.declared_leaves: Dict[str, int] = {}
        # Remove aliases (MHA's [0]) so that ops read the real producer.
        alias = {}
        for op in graph.ops:
            op.inputs = [alias.get(id(i), i) for i in op.inputs]
            if op.spec is not None and op.spec.get("type") == "_Alias":
                alias[id(op)] = op.inputs[0]
        graph.ops = [op for op in graph.ops if not (op.spec is not None and op.spec.get("type") == "_Alias")]
        if graph.output is not None:
            graph.output = alias.get(id(graph.output), graph.output)
        self.users: Dict[int, List[Op]] = {}
        for op in graph.ops:
            for i in op.inputs:
                self.users.setdefault(id(i), []).append(op)

    def build(self) -> List[dict]:
        g = self.g
        live = self._live()
        for op in g.ops:
            if id(op) not in live:
                self.problems.append(f"{op.where}: computes a tensor that the output does not use "
                                     "(remove it, or return it)")
        ops = [op for op in g.ops if id(op) in live]
        items = self._region((), g.source, ops, g.output)
        return self._expand(items, "")

    def _live(self) -> set:
        live, stack = set(), [self.g.output]
        while stack:
            op = stack.pop()
            if op is None or id(op) in live:
                continue
            live.add(id(op))
            stack.extend(op.inputs)
        return live

    # A region: the ops run inside one module call (scope), from `entry` to `exit`.
    def _region(self, scope, entry: Op, ops: List[Op], exit_op: Op) -> List[Any]:
        depth = len(scope)
        groups: Dict[Tuple[str, int], List[Op]] = {}
        rep: Dict[int, Any] = {}
        for op in ops:
            if len(op.scope) > depth:
                key = op.scope[depth]
                groups.setdefault(key, []).append(op)
                rep[id(op)] = ("call", key)
            else:
                rep[id(op)] = op
        inside = {id(op) for op in ops}
        # The level's nodes: direct ops and one node per child module call.
        nodes: Dict[Any, "LevelNode"] = {}
        source = LevelNode(("source",), -1)
        nodes[("source",)] = source

        def node_of(op):
            r = rep[id(op)]
            key = r if isinstance(r, tuple) else ("op", id(op))
            if key not in nodes:
                nodes[key] = LevelNode(key, op.index, op if not isinstance(r, tuple) else None)
            n = nodes[key]
            n.index = max(n.index, op.index)
            return n

        for op in ops:
            node_of(op)
        for op in ops:
            n = node_of(op)
            for i in op.inputs:
                if i is entry:
                    src = source
                elif id(i) in inside:
                    src = node_of(i)
                else:
                    self.problems.append(f"{op.where}: reads a tensor from outside its module "
                                         f"'{scope[-1][0] if scope else ''}' other than the module's input "
                                         "(a module with several tensor inputs is not modelled)")
                    return []
                if src is n:
                    continue
                if src not in n.preds:
                    n.preds.append(src)
                    n.pred_ops.append(i)
        # Each child call: one input (from this level), one output.
        for key, members in groups.items():
            n = nodes[("call", key)]
            mine = {id(m) for m in members}
            outside = [i for m in members for i in m.inputs if id(i) not in mine]
            distinct = list({id(i): i for i in outside}.values())
            if len(distinct) != 1:
                self.problems.append(f"module '{key[0]}': takes {len(distinct)} tensors (one input per module "
                                     "is modelled)")
                return []
            n.entry = distinct[0]
            exits = [m for m in members if m is exit_op or any(id(u) not in mine and id(u) in inside
                                                                for u in self.users.get(id(m), []))]
            if len(exits) != 1:
                self.problems.append(f"module '{key[0]}': returns {len(exits)} tensors used outside it (one is "
                                     "modelled)")
                return []
            n.exit = exits[0]
            n.members = members
        end = node_of(exit_op) if exit_op is not entry else source
        order = sorted(nodes.values(), key=lambda n: n.index)
        idom: Dict[Any, LevelNode] = {}
        pos = {id(n): k for k, n in enumerate(order)}

        def intersect(a, b):
            while a is not b:
                while pos[id(a)] > pos[id(b)]:
                    a = idom[id(a)]
                while pos[id(b)] > pos[id(a)]:
                    b = idom[id(b)]
            return a

        for n in order:
            if n is source:
                continue
            d = None
            for p in n.preds:
                if id(p) not in idom and p is not source:
                    continue
                d = p if d is None else intersect(d, p)
            idom[id(n)] = d if d is not None else source
        idom[id(source)] = source
        self._idom = idom
        return self._parse(source, end, scope)

    def _parse(self, src, end, scope) -> List[Any]:
        """The items computing `end` from `src` (src dominates end)."""
        chain = []
        n = end
        while n is not src:
            chain.append(n)
            n = self._idom[id(n)]
        chain.reverse()
        items: List[Any] = []
        prev = src
        for n in chain:
            items.extend(self._step(prev, n, scope))
            prev = n
        return items

    def _reach(self, src, end) -> set:
        seen, stack = set(), [end]
        while stack:
            n = stack.pop()
            if n is src or id(n) in seen:
                continue
            seen.add(id(n))
            stack.extend(n.preds)
        return seen

    def _step(self, prev, n, scope) -> List[Any]:
        if n.members is not None:
            return [self._call(n, scope)]
        op = n.op
        if op.join is None:
            return [self._leaf(op, scope)]
        # A join: one branch per input, from `prev`.
        branches, seen = [], set()
        ordered = []  # in the join's argument order (torch.cat([a, b]), a @ b)
        for i in op.inputs:
            pn = self._level_node_of(i, n, prev)
            if pn not in ordered:
                ordered.append(pn)
        for pn in ordered:
            reach = self._reach(prev, pn) if pn is not prev else set()
            if reach & seen:
                self.problems.append(f"{op.where}: its inputs share computation other than their common "
                                     "start (the graph is not series-parallel)")
            seen |= reach
            branches.append(self._parse(prev, pn, scope) if pn is not prev else [])
        return [self._join(op, branches, ordered, prev)]

    def _level_node_of(self, i: Op, n, prev):
        for p, o in zip(n.preds, n.pred_ops):
            if o is i:
                return p
        return prev  # the join reads its own source directly

    def _join(self, op: Op, branches, ordered, prev) -> dict:
        if op.join == "add" and len(branches) == 2:
            body, shortcut = branches
            if not body and shortcut:
                body, shortcut = shortcut, body
                if op.inplace:
                    self.problems.append(f"{op.where}: an in-place add into the block's input "
                                         "(`x += f(x)`) is not modelled; write `x = x + f(x)`")
            elif body and shortcut and not op.inplace:
                if self._first_index(shortcut) < self._first_index(body):
                    body, shortcut = shortcut, body  # the branch PyTorch runs first
            item = {"type": "Residual", "inline": True}
            if op.inplace:
                item["inplace"] = True
            item["body"] = body
            if shortcut:
                item["shortcut"] = shortcut
            return item
        item = {"type": "Parallel", "inline": True, "join": op.join, "branches": branches}
        if op.join == "concat" and op.dim != 1:
            item["dim"] = op.dim
        return item

    @staticmethod
    def _first_index(items) -> int:
        for it in items:
            if "_index" in it:
                return it["_index"]
        return 1 << 60

    def _leaf(self, op: Op, scope) -> dict:
        spec = dict(op.spec)
        if op.module is not None:
            name = op.module.rsplit(".", 1)[-1]
        else:
            owner = self.modules[scope[-1][0]] if scope else self.model
            taken = dict(owner.named_children())
            taken.update(dict(owner.named_parameters(recurse=False)))
            name = op.name
            while name in taken:
                name += "_"
        spec = {"name": name, **spec, "_index": op.index, "_module": op.module, "_scope": scope}
        return spec

    def _call(self, n, scope) -> dict:
        key = n.key[1]
        qualname = key[0]
        m = self.modules[qualname]
        items = self._region(scope + (key,), n.entry, n.members, n.exit)
        name = qualname.rsplit(".", 1)[-1]
        cls = type(m).__name__
        joins = [it for it in items if it.get("type") in ("Residual", "Parallel") and it.get("inline")]
        if joins:
            self.block_classes.add(type(m))
        first = items[0] if items else None
        if first is not None and first.get("inline") and (
                len(items) == 1 or (first["type"] == "Residual" and all("inline" not in it for it in items[1:]))):
            item = {"name": name, "type": first["type"], "class": cls}
            item.update((k, v) for k, v in first.items() if k not in ("type", "inline"))
            if len(items) > 1:
                item["then"] = items[1:]
            return item
        return {"name": name, "type": "Sequential", "layers": items, "_class": type(m), "_index": n.index}

    # The top-level sequence: containers that are plain nn.Sequential, and modules whose
    # forward is a chain of other modules (not a block), hand their children up.
    def _expand(self, items, prefix) -> List[dict]:
        import torch.nn as nn
        out = []
        for it in items:
            cls = it.get("_class")
            if it.get("type") == "Sequential" and cls is not None and (
                    cls is nn.Sequential or (not issubclass(cls, nn.Sequential) and cls not in self.block_classes)):
                out.append({"name": it["name"], "type": "Sequential", "expand": True,
                            "layers": self._expand(it["layers"], "")})
            else:
                out.append(it)
        return out


@dataclass(eq=False)
class LevelNode:
    key: Any
    index: int
    op: Optional[Op] = None
    preds: List[Any] = field(default_factory=list)
    pred_ops: List[Op] = field(default_factory=list)
    entry: Optional[Op] = None
    exit: Optional[Op] = None
    members: Optional[List[Op]] = None


def _finish_list(items, declared: Dict[str, str]) -> List[Any]:
    """Drops the private keys; a module its container already ran becomes {"use": name}
    (`declared`: the container's names, shared by a Residual's parts and a Parallel's branches)."""
    out = []
    for it in items:
        it = dict(it)
        module = it.pop("_module", None)
        for k in ("_index", "_class", "_scope", "_shared"):
            it.pop(k, None)
        name = it.get("name")
        if module is not None and declared.get(name) == module:
            out.append({"use": name})
            continue
        if module is not None:
            declared[name] = module
        if it.get("type") == "Residual":
            shared: Dict[str, str] = {}
            for key in ("body", "shortcut", "then"):
                if key in it:
                    it[key] = _finish_list(it[key], shared)
        elif it.get("type") == "Parallel":
            shared = {}
            it["branches"] = [_finish_list(b, shared) for b in it["branches"]]
        elif "layers" in it:
            it["layers"] = _finish_list(it["layers"], {})
        out.append(it)
    return out


# --- the whole export ----------------------------------------------------------------------------

def export(model, input_shape: Sequence[int], *, name: str = "model", input_dtype: str = "float",
           loss: Optional[str] = None, description: str = "", source: str = "") -> dict:
    """The model file (a dict) of `model` for an input of `input_shape` (batch first)."""
    import torch
    global LEAVES
    if not LEAVES:
        LEAVES = _leaves()
    shape = [int(s) for s in input_shape]
    if not shape or any(s <= 0 for s in shape):
        raise ExportError([f"--input {input_shape}: expected positive sizes, the batch first"], "bad input")
    if input_dtype not in ("float", "int64"):
        raise ExportError([f"--input-dtype {input_dtype!r}: expected float or int64"], "bad input")
    dtype = torch.int64 if input_dtype == "int64" else torch.float32
    tensors = list(model.parameters()) + list(model.buffers())
    if any(t.device.type != "meta" for t in tensors):
        model = copy.deepcopy(model).to("meta")  # shapes only: never the user's weights
    model.train()
    gm = trace(model)
    metas = propagate_shapes(gm, shape, dtype)
    metas_next = propagate_shapes(gm, [shape[0] + 1] + shape[1:], dtype)
    graph = Graph(gm, model, metas, metas_next, shape[0])
    problems = list(graph.problems)
    if graph.output is None or graph.source is None:
        raise ExportError(problems or ["the model returns nothing traceable"], f"cannot export {name}")
    structure = Structure(graph)
    layers = structure.build() if not problems else []
    problems += structure.problems
    if problems:
        raise ExportError(problems, f"cannot export {name}: {len(problems)} "
                                    f"thing{'s' if len(problems) != 1 else ''} cannot be mapped to a model file")
    out_shape = list(metas[graph.output.name].shape)
    doc = {"format": "vramscope-model", "version": 1, "name": name}
    if description:
        doc["description"] = description
    doc["source"] = source or f"exported by vramscope.export from {type(model).__name__}"
    doc["options"] = {"batch": shape[0]}
    doc["input"] = {"shape": ["batch"] + shape[1:]}
    if input_dtype == "int64":
        high = _embedding_size(model)
        doc["input"].update({"dtype": "int64", "high": high})
    doc["loss"] = _loss(loss, out_shape, shape[0])
    doc["layers"] = _finish_list(layers, {})
    return doc


def _embedding_size(model) -> int:
    import torch.nn as nn
    for m in model.modules():
        if isinstance(m, nn.Embedding):
            return m.num_embeddings
    raise ExportError(["--input-dtype int64 needs an nn.Embedding to read the token ids (its num_embeddings "
                       "bounds them)"], "bad input")


def _loss(loss: Optional[str], out_shape: List[int], batch: int) -> dict:
    if loss is None:
        if len(out_shape) >= 2:
            loss = "cross_entropy"
        else:
            raise ExportError([f"the model returns {out_shape}: give --loss (one of {', '.join(LOSSES)})"], "no loss")
    if loss not in LOSSES:
        raise ExportError([f"--loss {loss!r}: expected one of {', '.join(LOSSES)}"], "bad loss")
    if loss == "cross_entropy":
        if len(out_shape) < 2:
            raise ExportError([f"cross_entropy takes logits [..., classes]; the model returns {out_shape}"], "bad loss")
        return {"type": "cross_entropy", "classes": out_shape[-1]}
    if loss == "none" and out_shape:
        raise ExportError([f"--loss none takes a model that returns its loss (a scalar); it returns {out_shape}"],
                          "bad loss")
    return {"type": loss}


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python3 -m vramscope.export",
        description="Write a vramscope model file from a PyTorch nn.Module: built on the meta device (no "
                    "weights, no GPU, nothing downloaded), traced with torch.fx, your module names kept.",
        epilog="examples:\n"
               "  python3 -m vramscope.export my_model.py:make_model --input 8,3,224,224 -o net.json\n"
               "  python3 -m vramscope.export torchvision.models:resnet50 --input 32,3,224,224 -o resnet50.json\n"
               "  python3 -m vramscope.export lm.py:TinyLM --input 4,128 --input-dtype int64 -o lm.json\n"
               "then: vramscope sweep --model-file net.json --segments auto --dtype f32,amp",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="FILE.py:FUNCTION or module:FUNCTION returning the nn.Module (a class works)")
    parser.add_argument("--input", required=True, metavar="N,D,...",
                        help="the input's shape, batch first (the batch stays an option of the file)")
    parser.add_argument("--input-dtype", default="float", choices=("float", "int64"),
                        help="float (the run's precision) or int64 token ids for an nn.Embedding")
    parser.add_argument("--loss", choices=LOSSES,
                        help="the loss (default: cross_entropy over the output's last dimension)")
    parser.add_argument("--name", help="the model's name in tables (default: the function's name)")
    parser.add_argument("-o", "--output", metavar="FILE.json", help="where to write (default: standard output)")
    args = parser.parse_args(argv)
    try:
        try:
            shape = [int(s) for s in args.input.split(",")]
        except ValueError:
            raise ExportError([f"--input {args.input!r}: expected sizes separated by commas, such as 8,3,224,224"],
                              "bad input") from None
        factory, fname = load_factory(args.model)
        model = build_model(factory)
        refuse_transformers(model, args.output)
        doc = export(model, shape, name=args.name or fname, input_dtype=args.input_dtype, loss=args.loss,
                     source=f"exported by `python3 -m vramscope.export {args.model} --input {args.input}` "
                            f"from {type(model).__module__}.{type(model).__name__}")
    except ExportError as e:
        print(f"vramscope.export: {e}", file=sys.stderr)
        return 2
    text = json.dumps(doc, indent=1) + "\n"
    if not args.output:
        sys.stdout.write(text)
        return 0
    try:
        Path(args.output).write_text(text)
    except OSError as e:
        print(f"vramscope.export: cannot write {args.output}: {e.strerror}", file=sys.stderr)
        return 2
    params = sum(p.numel() for p in model.parameters())
    loss = doc["loss"]
    print(f"{args.output}: {doc['name']}, {params:,} parameters, {top_level(doc['layers'])} top-level modules, "
          f"input [{', '.join(str(d) for d in doc['input']['shape'])}] with batch {shape[0]}, {loss['type']}"
          + (f" over {loss['classes']} classes" if "classes" in loss else ""), file=sys.stderr)
    return 0


def top_level(layers) -> int:
    """The modules checkpoint_sequential splits: expanded containers count their children."""
    return sum(top_level(it["layers"]) if it.get("expand") else 1 for it in layers)


if __name__ == "__main__":
    sys.exit(main())
