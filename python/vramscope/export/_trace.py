"""torch.fx tracing with the module stack of every node, and shapes on meta tensors."""
from __future__ import annotations

import contextlib
import dis
import inspect
import io
import operator
import re
import sys
import traceback
from typing import Any, Dict, List, Tuple

from ._errors import ExportError, debugging, one_line
from ._layers import leaves


def user_location(tb) -> str:
    """The innermost frame of a traceback outside torch: where in the user's code it failed."""
    where = ""
    for frame in traceback.extract_tb(tb):
        if _users(frame.filename):
            where = f"{frame.filename}:{frame.lineno} ({(frame.line or '').strip()})"
    return where


def _users(filename: str) -> bool:
    """A frame of the user's code: not torch's, the exporter's, Python's import machinery or
    fx's generated code (a notebook's "<ipython-input-...>" is the user's)."""
    return not (filename.startswith(("<frozen", "<eval_with_key")) or "/torch/" in filename
                or "/vramscope/export/" in filename)


def node_location(node) -> str:
    """file:line of the user's code that made an fx node, from its recorded stack."""
    frames = re.findall(r'File "([^"]+)", line (\d+)', node.stack_trace or "")
    # The line that did it is the user's frame next to fx's own (proxy.py, where the node was
    # made): torch 2.15 lists frames outermost first as Python's tracebacks do, so it is the
    # last user frame before fx's; an fx that lists the innermost first has it after them.
    fx = next((i for i, (f, _) in enumerate(frames) if "/torch/fx/" in f), len(frames))
    users = [i for i, (f, _) in enumerate(frames) if not f.startswith("<") and _users(f)]
    before = [i for i in users if i < fx]
    chosen = before[-1] if before else next((i for i in users if i > fx), None)
    return "" if chosen is None else f"{frames[chosen][0]}:{frames[chosen][1]}"


def _no_forward(m) -> bool:
    """nn.Module's own forward, which only raises: a class that did not define one."""
    import torch
    return getattr(type(m), "forward", None) is torch.nn.Module.forward


@contextlib.contextmanager
def _stderr_held():
    """torch.fx prints a traceback of its own before raising (ShapeProp's print_exc): hold
    stderr back while torch runs, and pass it on (warnings) only if nothing failed."""
    held = io.StringIO()
    with contextlib.redirect_stderr(held):
        yield
    sys.stderr.write(held.getvalue())


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


def _caller() -> str:
    """file:line of the user's code that called into the exporter's stand-ins."""
    for frame in inspect.stack()[2:]:
        if _users(frame.filename):
            return f"{frame.filename}:{frame.lineno}"
    return ""


REGION = "<checkpoint"  # the scope of a checkpointed call that is not a module's


def is_region(qualname: str) -> bool:
    return qualname.startswith(REGION)


@contextlib.contextmanager
def _checkpoint_calls(model, marks: Dict[str, Any], problems: List[str], scopes: List[Tuple[str, int]]):
    """`checkpoint(self.block, x)` in a forward: torch.fx would trace through it and lose it.
    While tracing, torch.utils.checkpoint's functions (and every global of the model's
    forwards bound to them) are stand-ins that note the module as checkpointed (the model
    file's "checkpoint": true, or "reentrant" for use_reentrant=True or unset, PyTorch's
    default) and run it, so its forward is traced as any other. A checkpointed call that is
    not a module's (`checkpoint(self.block1, x)` of a method, `checkpoint(F.relu, x)`) runs
    inside a scope of its own on the tracer's `scopes`, "<checkpoint n>": the ops traced
    there become an inline region under one checkpoint, with no name of its own."""
    import torch
    import torch.utils.checkpoint as cp
    original, original_sequential = cp.checkpoint, cp.checkpoint_sequential
    names = {m: n for n, m in model.named_modules()}
    regions = [0]

    def note(function, use_reentrant):
        """Marks the module `function` runs and returns it, or opens a region's scope key."""
        mark = "reentrant" if use_reentrant in (None, True) else True
        target = function
        if getattr(function, "__name__", "") == "forward" and isinstance(getattr(function, "__self__", None),
                                                                       torch.nn.Module):
            target = function.__self__  # checkpoint(self.block.forward, x)
        if isinstance(target, torch.nn.Module) and names.get(target):
            marks[names[target]] = mark
            return target, None
        regions[0] += 1
        key = (f"{REGION} {regions[0]}>", 1)
        marks[key[0]] = mark
        return None, key

    def checkpoint(function, *args, use_reentrant=None, **kwargs):
        target, region = note(function, use_reentrant)
        if target is not None:
            return target(*args)
        scopes.append(region)
        try:
            return function(*args)
        finally:
            scopes.pop()

    def without_reentrant(function, *args, **kwargs):
        """PyTorch 2.x's non-reentrant checkpoint: a generator run around the call, which
        the real checkpoint then makes itself (torch/utils/checkpoint.py)."""
        _, region = note(function, False)
        if region is not None:
            scopes.append(region)
        try:
            yield
        finally:
            if region is not None:
                scopes.pop()

    def checkpoint_sequential(functions, segments, input, **kwargs):
        problems.append(f"{_caller()}: checkpoint_sequential inside forward: export the model without it and give "
                        "`vramscope sweep --segments`, which sweeps the segment counts")
        for f in (functions.children() if isinstance(functions, torch.nn.Sequential) else functions):
            input = f(input)
        return input

    patched = []

    def patch(namespace: dict, key: str, value) -> None:
        patched.append((namespace, key, namespace[key]))
        namespace[key] = value

    patch(cp.__dict__, "checkpoint", checkpoint)
    patch(cp.__dict__, "checkpoint_sequential", checkpoint_sequential)
    # A name bound where this cannot see it (an import inside a function) reaches the real
    # checkpoint, which on PyTorch 1.13 hands the work to these two: catch it there.
    if "_checkpoint_without_reentrant" in cp.__dict__:
        patch(cp.__dict__, "_checkpoint_without_reentrant",
              lambda function, preserve_rng_state=True, *args, **kwargs: checkpoint(function, *args,
                                                                                   use_reentrant=False))
    # PyTorch 2.x: `_checkpoint_without_reentrant_generator(function, preserve, ..., *args)`
    # (2.1-2.13) or `..._impl(function, args, kwargs, ...)` (2.14+), next()-ed before and
    # after the real checkpoint calls the function.
    for name in ("_checkpoint_without_reentrant_generator", "_checkpoint_without_reentrant_generator_impl"):
        if name in cp.__dict__:
            patch(cp.__dict__, name, without_reentrant)
    if "CheckpointFunction" in cp.__dict__:
        patch(cp.__dict__, "CheckpointFunction", type("CheckpointFunction", (), {
            "apply": staticmethod(lambda function, preserve_rng_state, *args: checkpoint(function, *args,
                                                                                         use_reentrant=True))}))
    seen = set()
    for m in model.modules():
        namespace = getattr(getattr(type(m), "forward", None), "__globals__", None)
        if namespace is None or id(namespace) in seen:
            continue
        seen.add(id(namespace))
        for key, value in list(namespace.items()):
            if value is original:
                patch(namespace, key, checkpoint)
            elif value is original_sequential:
                patch(namespace, key, checkpoint_sequential)
    try:
        yield
    finally:
        for namespace, key, value in reversed(patched):
            namespace[key] = value


def trace(model):
    """torch.fx symbolic trace with the module stack of every node in node.meta["scope"]: a
    tuple of (qualified name, call index) of the non-leaf modules it runs in. Returns the
    GraphModule, the checkpoint marks of the modules forward checkpoints ({path: true or
    "reentrant"}) and the checkpoint calls that cannot be marked."""
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
            if _no_forward(m):
                raise ExportError([f"module '{qualname}' ({type(m).__name__}) is called but has no forward()"])
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

    if _no_forward(model):  # fx would fail on nn.Module's stand-in (on some versions, deep in code())
        raise ExportError([f"{type(model).__name__} has no forward(): define forward(self, x) in the class"])
    tracer = Tracer()
    marks: Dict[str, Any] = {}
    problems: List[str] = []
    try:
        with _stderr_held(), _proxy_patches(), _checkpoint_calls(model, marks, problems, tracer.stack):
            graph = tracer.trace(model)
    except ExportError:
        raise
    except (Exception, SystemExit) as e:  # noqa: BLE001 (every tracing failure becomes one clear error)
        if debugging():
            raise
        where = user_location(e.__traceback__)
        if isinstance(e, SystemExit):
            raise ExportError([where or "(no frame outside torch)"],
                              f"the model's forward called {one_line(e)} while being traced") from None
        lines = [f"{where}: {one_line(e)}" if where else one_line(e)]
        # fx's own limits (a branch on a tensor, a Proxy where Python wants a number): say what it follows.
        if isinstance(e, getattr(torch.fx.proxy, "TraceError", ())) or "Proxy" in str(e):
            lines.append("torch.fx follows Python code that does not branch on tensor values; for a "
                            "transformers model use `vramscope --hf-config config.json` instead")
        raise ExportError(lines, "torch.fx cannot trace the model") from None
    return torch.fx.GraphModule(model, graph), marks, problems


def propagate_shapes(gm, shape: List[int], dtype, headline: str = "") -> Dict[str, Any]:
    """Each node's output TensorMetadata (or tuple of them) for an input of `shape`, on meta.
    A failure names the node that failed, what it was given and, for the common layers,
    what they take."""
    import torch
    from torch.fx.passes.shape_prop import ShapeProp
    running: List[Any] = [None]

    class Prop(ShapeProp):
        def run_node(self, n):
            running[0] = n
            return super().run_node(n)

    try:
        x = torch.zeros(shape, dtype=dtype, device="meta")
        with _stderr_held():
            Prop(gm).propagate(x)
    except (Exception, SystemExit) as e:  # noqa: BLE001
        if debugging():
            raise
        # ShapeProp wraps the error in one that dumps the node's metadata: the cause is what failed.
        cause = e.__cause__ if e.__cause__ is not None and str(e).startswith("ShapeProp error") else e
        raise ExportError([_failed_node(gm, running[0], cause)],
                          headline or f"the model does not run on an input of shape {shape}") from None
    return {n.name: n.meta.get("tensor_meta") for n in gm.graph.nodes}


def _failed_node(gm, node, e: BaseException) -> str:
    """One line: the module or function that failed, where, on what, and what it takes."""
    if node is None or node.op == "placeholder":
        return one_line(e)
    loc = node_location(node)
    given = next((a.meta.get("tensor_meta") for a in node.all_input_nodes
                  if hasattr(a.meta.get("tensor_meta"), "shape")), None)
    got = ""
    if given is not None:
        got = f"{str(given.dtype).replace('torch.', '')} {list(given.shape)}"
    if node.op == "call_module":
        m = gm.get_submodule(node.target)
        unmapped = "" if type(m) in leaves() else ", which has no model-file layer"
        what = f"module '{node.target}' ({type(m).__name__}{unmapped})"
        takes = _takes(m)
    else:
        scope = node.meta.get("scope", ())
        target = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))
        what = f"{target} in '{scope[-1][0]}'" if scope else f"{target} in the model's forward"
        takes = ""
    line = what + (f" ({loc})" if loc else "")
    if takes:
        line += f" takes {takes}" + (f", not {got}" if got else "")
    elif got:
        line += f" on {got}"
    return f"{line}: {one_line(e)}"


def _takes(m) -> str:
    """The input a common layer takes (its batched form), from its arguments."""
    import torch.nn as nn
    name = type(m).__name__
    spatial = {"1d": "L", "2d": "H, W", "3d": "D, H, W"}
    if isinstance(m, nn.Linear):
        return f"[..., {m.in_features}] (in_features {m.in_features})"
    if isinstance(m, nn.modules.conv._ConvNd):
        return f"[N, {m.in_channels}, {spatial.get(name[-2:], '...')}] (in_channels {m.in_channels})"
    if isinstance(m, nn.modules.batchnorm._BatchNorm):
        if name == "BatchNorm1d":
            return f"[N, {m.num_features}] or [N, {m.num_features}, L]"
        return f"[N, {m.num_features}, {spatial.get(name[-2:], '...')}]"
    if isinstance(m, nn.GroupNorm):
        return f"[N, {m.num_channels}, ...]"
    if isinstance(m, nn.LayerNorm):
        return f"[..., {', '.join(str(d) for d in m.normalized_shape)}]"
    if isinstance(m, nn.Embedding):
        return f"int64 token ids below {m.num_embeddings} (--input-dtype int64)"
    if isinstance(m, nn.MultiheadAttention):
        return f"[N, L, {m.embed_dim}]" if m.batch_first else f"[L, N, {m.embed_dim}]"
    if "Pool" in name and name[-2:] in spatial:
        return f"[N, C, {spatial[name[-2:]]}]"
    return ""
