"""The operator-level recorder: one training forward at the level of PyTorch's operators.

The model runs on meta tensors under a TorchDispatchMode, so Python that branches on shapes
simply runs (proxy-style tracing, not torch.fx's symbolic tracing) and every ATen operator below
autograd is seen with its inputs, outputs and aliasing (the schema's `Tensor(a)` views and
`Tensor(a!)` writes). Global module hooks give each operator its module call (path and class),
and the frame that called it gives the user's source line. After the forward, the autograd graph
is walked: what each node keeps for backward (its `_saved_*` fields, PyTorch's SavedVariables) is
matched to the recorded tensors by storage, so the file says exactly what PyTorch's autograd
keeps for this model, op by op.

The model runs in bfloat16, which stands for the run's floating dtype: the file calls those
tensors "float", and keeps "f32" for what the model holds in f32 at any dtype (upcasts).

Under autocast (`amp`), the model keeps its f32 parameters ("float": an amp run's dtype is f32)
and runs on fake CUDA tensors (FakeTensorMode: meta storage with a CUDA device) with CUDA's
autocast switched on, so PyTorch's own autocast kernels pick each operator's dtype and insert
the casts (autocast_mode.cpp's lists, as on a GPU); the half tensors keep their own dtype.

Where the CUDA kernels keep something else than the meta (CPU) path, the CUDA path is recorded
instead, each with its source:
- `F.dropout` (not in place) on CUDA is `native_dropout`: the output and a bool mask, which
  NativeDropoutBackward0 keeps (ATen Dropout.cpp, `is_fused_kernel_acceptable` true for CUDA
  inputs); on the CPU it is a float noise tensor and a multiply. In-place dropout takes the
  noise path on CUDA too (`_dropout<true>`), so it is recorded as it runs.
- `F.scaled_dot_product_attention` on CUDA runs a fused kernel (`sdp_utils.cpp`), not the
  CPU's math path: see `_sdpa`.

Sizes that follow the batch (and the sequence, for token inputs) are found by recording again
at batch + 1 (and sequence + 1): each size is written as `a*batch*seq + b*batch + c*seq + d`.
"""
from __future__ import annotations

import functools
import os
import sys
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from ._errors import ExportError, one_line
from ._expert_parallel import AssumedSplits, local_parameters
from ._routing import AssumedRouting

FORMAT_OPS = 1  # the "graph" form's own version, inside model-file version 1

# The recording runs the model in bfloat16: a bfloat16 tensor is one that follows the run's
# dtype ("float" in the file); float32 tensors there are ones the model keeps in f32 whatever
# the run's dtype (RMSNorm's upcast, rotary tables, the loss's logits.float()).
DTYPES = {
    "float32": "f32", "float16": "f16", "bfloat16": "float", "float64": "f64",
    "int64": "i64", "int32": "i32", "uint8": "u8", "int8": "u8", "bool": "bool",
}
# Under autocast the model holds f32 (the run's dtype) and autocast's half type is itself.
DTYPES_AUTOCAST = dict(DTYPES, float32="float", bfloat16="bf16")
AUTOCAST = {"bf16": "bfloat16", "f16": "float16"}  # the file's "autocast" -> torch's dtype

# How each operator's backward treats the gradient is the runtime's to know (runtime/src/graph/op_rules.cpp).

MAX_OPS = 2_000_000  # a recording larger than this is not one training step of a real model


@dataclass
class TensorRec:
    id: int
    shape: List[int]
    dtype: str
    kind: str                      # input, param, buffer, const, op
    base: Optional[int] = None     # the tensor whose storage this one views
    name: str = ""
    requires_grad: bool = False
    storage_bytes: int = 0


@dataclass
class OpRec:
    name: str                      # "aten.convolution.default"
    inputs: List[int]
    outputs: List[int]
    call: int                      # the innermost module call
    line: str
    alias: List[int] = field(default_factory=list)  # per output: the input it views or writes, -1 for new
    inplace: bool = False
    saves: List[int] = field(default_factory=list)
    frees: List[int] = field(default_factory=list)  # tensors whose last reference went after this op
    frees_after: List[List[int]] = field(default_factory=list)  # [call, tensor]: went once back in that call
    node: str = ""                 # the autograd node PyTorch made ("ConvolutionBackward0")
    args: Dict[str, Any] = field(default_factory=dict)  # the scalars the runtime reads


@dataclass
class CallRec:
    path: str
    cls: str
    parent: int
    checkpoint: bool = False
    positional: List[int] = field(default_factory=list)  # tensors passed positionally (checkpoint saves those)
    inline: bool = False  # code of the enclosing module (a checkpointed function), no path of its own


class Recording:
    """One forward at one size: tensors, operators and module calls, in execution order."""

    def __init__(self):
        self.tensors: List[TensorRec] = []
        self.ops: List[OpRec] = []
        self.calls: List[CallRec] = []
        self.inputs: List[int] = []
        self.output: Optional[int] = None
        self.assumed: List[str] = []  # values read from tensors, which meta tensors do not have
        self.experts_loops: List[Tuple[int, int, int]] = []  # (experts, top_k, tokens) of each eager loop


def _short_op(name: str) -> str:
    """aten.transpose.int -> transpose."""
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


_SKIPPED: Dict[Tuple[str, Tuple[str, ...]], bool] = {}  # (file, skip) -> not the user's (asked per op)


def _user_line(skip: Sequence[str]) -> str:
    """file:line (function) of the innermost frame outside torch and this package."""
    frame = sys._getframe(2)
    key_skip = tuple(skip)
    while frame is not None:
        filename = frame.f_code.co_filename
        skipped = _SKIPPED.get((filename, key_skip))
        if skipped is None:
            skipped = any(s in filename for s in skip) or filename.startswith("<")
            _SKIPPED[(filename, key_skip)] = skipped
        if not skipped:
            return f"{os.path.basename(filename)}:{frame.f_lineno} ({frame.f_code.co_name})"
        frame = frame.f_back
    return "?"


def _not_users(torch) -> Tuple[str, ...]:
    """Where a frame is not the user's code: torch, this package, the standard wrappers."""
    return (str(Path(torch.__file__).parent) + "/", str(Path(__file__).parent), "/contextlib.py", "/functools.py")


def _user_line_of_caller() -> str:
    """The user's line that called into torch (for what a fake GPU answered)."""
    import torch
    return _user_line(_not_users(torch))


class _Recorder:
    """The dispatch mode, the module hooks and the CUDA substitutions of one recording."""

    def __init__(self, torch, model, names: Dict[int, str], params: Dict[int, Tuple[str, Any]],
                 buffers: Dict[int, Tuple[str, Any]], autocast: Optional[str] = None):
        self.torch = torch
        self.dtypes = DTYPES_AUTOCAST if autocast else DTYPES
        self.autocast = autocast
        self.cache_casts: set = set()  # records of autocast's cached casts of parameters
        self.rec = Recording()
        self.model = model
        self.names = names
        self.params = params
        self.buffers = buffers
        # id(tensor) -> tensor record, for live tensors only: a finalizer drops the entry when the
        # tensor dies (and notes when), so an id the interpreter reuses is never mistaken.
        self.by_obj: Dict[int, int] = {}
        # (ops recorded when it died, the module call running then, tensor record)
        self.deaths: List[Tuple[int, int, int]] = []
        self.storage_owner: Dict[int, int] = {}  # StorageImpl address -> the record that made it
        self.stack: List[int] = []
        self.pending: List[Tuple[int, List[Any]]] = []  # (op index, output tensors) awaiting grad_fn
        self.node_op: Dict[Any, int] = {}
        self.nodes: List[Any] = []
        self.problems: List[str] = []
        self.finished = False
        self.paused = 0
        self.markers: Dict[int, Tuple[int, Any]] = {}  # marker storage -> (record, marker kept alive)
        # (ops recorded when it was packed, tensor record): every tensor autograd saved, in order
        self.packed: List[Tuple[int, int]] = []
        self.skip = _not_users(torch)
        self.routing = AssumedRouting(torch)
        self.rec.experts_loops = self.routing.seen
        self.splits = AssumedSplits(torch)
        self.rec.expert_splits = self.splits
        # Functional collectives whose result is their input on a GPU: wait_tensor returns it
        # (Functional.cpp), _wrap_tensor_autograd wraps it (AsyncCollectiveTensor); their meta
        # kernels make a new tensor instead.
        c10d = getattr(torch.ops, "_c10d_functional", None)
        self.same_storage = {getattr(c10d, n).default for n in ("wait_tensor", "_wrap_tensor_autograd")
                             if c10d is not None and hasattr(c10d, n)}

    # --- tensors ---------------------------------------------------------------------------
    def _storage_key(self, t) -> int:
        return t.untyped_storage()._cdata

    def tensor_id(self, t, kind_hint: str = "const") -> int:
        key = id(t)
        found = self.by_obj.get(key)
        if found is not None:
            return found
        if t.device.type == "cpu":
            # A wrapped Python number or a CPU tensor: on the host, never on the device.
            name, kind, rg = "", "host", False
        elif key in self.params:
            name, _ = self.params[key]
            kind, rg = "param", bool(t.requires_grad)
        elif key in self.buffers:
            name, _ = self.buffers[key]
            kind, rg = "buffer", False
        else:
            name, kind, rg = "", kind_hint, bool(t.requires_grad)
        return self._add(t, kind, name, rg)

    def _add(self, t, kind: str, name: str = "", requires_grad: bool = False, base: Optional[int] = None) -> int:
        dtype = self.dtypes.get(str(t.dtype).replace("torch.", ""))
        if dtype is None:
            self.problems.append(f"a tensor of dtype {t.dtype} ({self._where()}): vramscope models "
                                 f"{', '.join(sorted(self.dtypes))}")
            dtype = "f32"
        if len(t.shape) > 6:
            self.problems.append(f"a tensor of {len(t.shape)} dimensions {list(t.shape)} ({self._where()}): "
                                 "vramscope's tensors have at most 6")
        rid = len(self.rec.tensors)
        storage = self._storage_key(t)
        rec = TensorRec(rid, [int(s) for s in t.shape], dtype, kind, base, name, requires_grad,
                        int(t.untyped_storage().nbytes()))
        self.rec.tensors.append(rec)
        self.by_obj[id(t)] = rid
        weakref.finalize(t, self._died, id(t), rid)
        if base is None:
            # The newest tensor made on this address: storages die and their addresses come
            # back, so an older entry is a dead storage's.
            self.storage_owner[storage] = rid
        return rid

    def _died(self, key: int, rid: int) -> None:
        """The last reference to a tensor went away: where the program frees it (its storage, once
        no view of it is left). Autograd keeps no reference while recording: its saved tensors
        are packed as record numbers (_saved_hooks)."""
        if self.by_obj.get(key) == rid:
            del self.by_obj[key]
        if not self.finished:
            self.deaths.append((len(self.rec.ops), self.stack[-1] if self.stack else -1, rid))

    def _where(self) -> str:
        call = self.stack[-1] if self.stack else None
        path = self.rec.calls[call].path if call is not None else ""
        return f"in {path or 'the model'}, {_user_line(self.skip)}"

    def pause(self):
        """A context in which operators run unrecorded (a substitution records its own)."""
        recorder = self

        class Paused:
            def __enter__(self):
                recorder.paused += 1

            def __exit__(self, *exc):
                recorder.paused -= 1
                return False

        return Paused()

    def assume(self, t):
        """A value read from a tensor (`.item()`, `if tensor:`): meta tensors have none. The
        recording takes the answer of an ordinary training batch (a boolean check holds, a count
        is 1) and lists it in the file, with its place, for the reader to judge."""
        value = True if t.dtype == self.torch.bool else (1 if not t.is_floating_point() else 1.0)
        place = f"{self._where()}: read a {str(t.dtype).replace('torch.', '')} value, assumed {value}"
        if place not in self.rec.assumed:
            self.rec.assumed.append(place)
        return value

    # --- module calls ----------------------------------------------------------------------
    def pre_hook(self, module, args):
        self.routing.enter(module, args)
        self.splits.enter(module, args)
        name = self.names.get(id(module))
        if name is None:
            self.stack.append(self.stack[-1] if self.stack else -1)
            return
        parent = self.stack[-1] if self.stack else -1
        positional = [self.by_obj[id(a)] for a in self.torch.utils._pytree.tree_flatten(args)[0]
                      if isinstance(a, self.torch.Tensor) and id(a) in self.by_obj]
        self.rec.calls.append(CallRec(name, type(module).__name__, parent, positional=positional))
        self.stack.append(len(self.rec.calls) - 1)

    def post_hook(self, module, args, output):
        self.routing.leave(module)
        self.splits.leave(module)
        if self.stack:
            self.stack.pop()

    # --- operators -------------------------------------------------------------------------
    def resolve_pending(self):
        for op_index, outs in self.pending:
            for t in outs:
                fn = getattr(t, "grad_fn", None)
                if fn is not None and fn not in self.node_op:
                    self.node_op[fn] = op_index
                    self.nodes.append(fn)
                    # Named now: a later in-place op on a view replaces this node in the graph
                    # (CopySlices), where the walk below would not find it.
                    op = self.rec.ops[op_index]
                    op.node = op.node or type(fn).__name__
        self.pending = []

    def record(self, func, args, kwargs, out, name: Optional[str] = None, attrs: Optional[dict] = None):
        torch = self.torch
        self.resolve_pending()
        if len(self.rec.ops) >= MAX_OPS:
            raise ExportError([f"more than {MAX_OPS:,} operators in one forward"], "cannot export the model")
        flat_in, _ = torch.utils._pytree.tree_flatten((args, kwargs or {}))
        in_tensors = [a for a in flat_in if isinstance(a, torch.Tensor)]
        known = len(self.rec.tensors)
        inputs = [self.tensor_id(a) for a in in_tensors]
        flat_out, _ = torch.utils._pytree.tree_flatten(out)
        if name is None and func is torch.ops.aten.lift_fresh.default and inputs and inputs[0] >= known \
                and self.rec.tensors[inputs[0]].kind == "const":
            # torch.tensor(data) in forward: a tensor made there, not a constant of the model
            # (on CUDA, a new block at this point). Recorded as this op's output.
            self.rec.tensors[inputs[0]].kind = "op"
            op = OpRec("aten.lift_fresh.default", [], [inputs[0]], self.stack[-1] if self.stack else -1,
                       _user_line(self.skip), [-1], False)
            self.rec.ops.append(op)
            self.pending.append((len(self.rec.ops) - 1, [in_tensors[0]]))
            return
        out_tensors = [o for o in flat_out if isinstance(o, torch.Tensor)]
        opname = name or str(func)
        alias_of = self._aliases(func, args, kwargs, in_tensors, len(out_tensors)) if name is None else \
            [-1] * len(out_tensors)
        # An output on an input's storage that the schema does not annotate (_unsafe_view):
        # both alive now, so the same storage address is the same storage.
        in_storage = {}
        for i, a in enumerate(in_tensors):
            if a.device.type != "cpu":
                in_storage.setdefault(self._storage_key(a), i)
        for k, t in enumerate(out_tensors):
            if alias_of[k] < 0 and t.device.type != "cpu":
                alias_of[k] = in_storage.get(self._storage_key(t), -1)
        outputs, inplace = [], False
        for t, a in zip(out_tensors, alias_of):
            if a >= 0 and id(t) == id(in_tensors[a]):
                inplace = True  # the op wrote into its input and returned it: the same tensor
                outputs.append(inputs[a])
                continue
            base = None
            if a >= 0:
                src = self.rec.tensors[inputs[a]]
                base = src.base if src.base is not None else src.id
            outputs.append(self._add(t, "host" if t.device.type == "cpu" else "op", base=base))
        if not out_tensors and not in_tensors:
            return
        call = self.stack[-1] if self.stack else -1
        op = OpRec(opname, inputs, outputs, call, _user_line(self.skip), alias_of, inplace, args=attrs or {})
        self.rec.ops.append(op)
        self.pending.append((len(self.rec.ops) - 1, out_tensors))

    def _aliases(self, func, args, kwargs, in_tensors, n_out) -> List[int]:
        """Per output, the index among the op's tensor inputs that it aliases, or -1."""
        result = [-1] * n_out
        if func in self.same_storage and in_tensors and n_out == 1:
            return [0]
        schema = getattr(func, "_schema", None)
        if schema is None:
            return result
        sets: Dict[str, int] = {}
        wildcard = -1  # the argument a list return views (split's `Tensor(a -> *) self`)
        position = 0
        bound = list(args) + [kwargs.get(a.name) for a in schema.arguments[len(args):]] if kwargs else list(args)
        for arg, value in zip(schema.arguments, bound):
            count = self._count_tensors(value)
            info = arg.alias_info
            if info is not None and count == 1:
                for s in info.before_set:
                    sets.setdefault(s, position)
                if "*" in info.after_set and wildcard < 0:
                    wildcard = position
            position += count
        out_index = 0
        for i, ret in enumerate(schema.returns):
            if out_index >= n_out:
                break
            # A list return (split's `Tensor(a)[]`) stands for every output left.
            is_list = str(ret.type).startswith("List") or str(ret.type).endswith("[]")
            count = n_out - out_index if is_list and i == len(schema.returns) - 1 else 1
            info = ret.alias_info
            source = -1
            if info is not None:
                for s in info.before_set:
                    if s in sets:
                        source = sets[s]
                        break
                # The schema's Python binding leaves a list's element alias out: `Tensor(a)[]`
                # reads as a list with no set; its elements view the wildcard argument.
                if source < 0 and not info.before_set and str(ret.type).startswith("List"):
                    source = wildcard
            for k in range(out_index, out_index + count):
                result[k] = source
            out_index += count
        return result

    def _count_tensors(self, value) -> int:
        torch = self.torch
        if isinstance(value, torch.Tensor):
            return 1
        if isinstance(value, (list, tuple)):
            return sum(self._count_tensors(v) for v in value)
        return 0


def _make_mode(recorder: _Recorder):
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func in _NO_RECORD or recorder.paused:
                return func(*args, **kwargs)
            answered, out = recorder.splits.answer(func, args, kwargs)
            if answered:  # expert parallel's split sizes, read to the host: no device operator
                return out
            answered, out = recorder.routing.answer(func, args, kwargs)
            if answered:  # the experts loop's nonzero and expert ids, under the assumed routing
                if func is not _ITEM:
                    recorder.record(func, args, kwargs, out)
                return out
            if func is _ITEM:
                return recorder.assume(args[0])
            try:
                out = func(*args, **kwargs)
            except Exception as e:  # noqa: BLE001 (named with its place, while the user's frame is on the stack)
                raise _OpFailure(_failure(func, e, recorder._where())) from None
            attrs = _scalar_args(func, args, kwargs) if func in _WITH_ARGS else None
            cache = recorder.autocast and func is _TO_COPY and id(args[0]) in recorder.params \
                and args[0].requires_grad and out.dtype != args[0].dtype
            if cache:
                # Autocast's cast of a parameter: kept in its cache until the autocast region
                # ends (autocast_mode.cpp, cached_cast: leaves that require grad), not freed
                # where the program drops it. A parameter cast the model writes itself (rare
                # inside autocast) is taken for one too.
                attrs = {"autocast_cache": True}
            recorder.record(func, args, kwargs, out, attrs=attrs)
            if cache:
                recorder.cache_casts.add(recorder.by_obj[id(out)])
            return out

    _NO_RECORD = {torch.ops.prim.device.default} if hasattr(torch.ops, "prim") else set()
    _ITEM = torch.ops.aten._local_scalar_dense.default
    _TO_COPY = torch.ops.aten._to_copy.default
    # The operators the runtime runs with its own ops (op_kernels.cpp) read their scalars.
    _WITH_ARGS = {torch.ops.aten._scaled_dot_product_efficient_attention.default, torch.ops.aten.convolution.default,
                  torch.ops.aten.native_batch_norm.default}
    return Mode()


def _scalar_args(func, args, kwargs) -> dict:
    """The numbers among an operator's arguments, by the schema's names; a list of equal ints
    (a square convolution's stride) as one number, other lists left out."""
    out = {}
    for arg, value in zip(func._schema.arguments, list(args) + [None] * len(func._schema.arguments)):
        value = kwargs.get(arg.name, value)
        if isinstance(value, bool):
            out[arg.name] = value
        elif isinstance(value, (int, float)):
            out[arg.name] = value
        elif isinstance(value, (list, tuple)) and value and all(isinstance(v, int) for v in value) \
                and len(set(value)) == 1:
            out[arg.name] = value[0]
    return out


class assumed_values:
    """A context in which reading a value from a meta tensor (`.item()`, `if tensor:`) gets the
    recorder's assumption (a check holds, a count is 1) instead of an error: what a plain
    PyTorch run on meta tensors needs to follow the recording's path."""

    def __enter__(self):
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode
        item = torch.ops.aten._local_scalar_dense.default

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if func is item:
                    t = args[0]
                    return True if t.dtype == torch.bool else (1 if not t.is_floating_point() else 1.0)
                return func(*args, **(kwargs or {}))

        self.mode = Mode()
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self.mode.__exit__(*exc)


def _failure(func, e: Exception, where: str) -> str:
    """One line for an operator that cannot run without values: what it is, where, what to do."""
    name = _short_op(str(func))
    if isinstance(e, NotImplementedError) or "data-dependent" in str(e) or "meta" in str(e):
        return (f"{name} ({where}): its output's size depends on the tensor's values, which a recording "
                f"on meta tensors does not have (nonzero, masked_select, unique, boolean indexing); "
                f"vramscope cannot know that size ahead of a run")
    return f"{name} ({where}): {one_line(e, 200)}"


class _OpFailure(Exception):
    """An operator that cannot run on meta tensors (data-dependent: .item(), nonzero)."""


def _make_function_mode(recorder: Optional[_Recorder] = None, flash: bool = False):
    """The CUDA substitutions (module docstring): dropout and scaled_dot_product_attention.
    Inside __torch_function__ this mode is off, so the calls below dispatch (and record).
    `flash`: half inputs without a mask run the flash kernel, as sdp_utils.cpp picks it (a
    measurement of PyTorch's saved tensors under autocast; the recording leaves that choice to
    the runtime, which makes it by the run's dtype)."""
    import torch
    import torch.nn.functional as F
    from torch.overrides import TorchFunctionMode

    sdpa = getattr(F, "scaled_dot_product_attention", None)

    class Mode(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = dict(kwargs or {})
            if func is F.dropout or func is torch.dropout:
                bound = dict(zip(("input", "p", "training", "inplace"), args))
                bound.update(kwargs)
                x, p = bound["input"], bound.get("p", 0.5)
                if bound.get("training", True) and 0 < p < 1 and not bound.get("inplace", False) and x.numel() > 0:
                    # ATen Dropout.cpp: a CUDA input takes the fused kernel (native_dropout).
                    return torch.native_dropout(x, p, True)[0]
            if sdpa is not None and func is sdpa:
                return _sdpa(torch, args, kwargs, recorder, flash)
            return func(*args, **kwargs)

    return Mode()


_GROUPED = []  # the autograd.Function below, made once torch is imported


def _grouped_attention(torch):
    """Attention over grouped k and v (enable_gqa) as the fused CUDA kernels run it: flash takes
    k and v with fewer heads as they are (sdp_utils.cpp, check_grouped_query_attention), so its
    node keeps q, k, v, the output and the logsumexp, not copies of k and v repeated to q's heads.
    On meta tensors the memory-efficient kernel computes the shapes on repeated k and v."""
    if not _GROUPED:
        class GroupedAttention(torch.autograd.Function):
            @staticmethod
            def forward(ctx, q, k, v, dropout, causal, scale):
                n = q.shape[-3] // k.shape[-3]
                out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
                    q, k.repeat_interleave(n, dim=-3), v.repeat_interleave(n, dim=-3), None, True, dropout, causal,
                    scale=scale)[:2]
                ctx.save_for_backward(q, k, v, out, lse)
                return out

            @staticmethod
            def backward(ctx, grad):  # never run: the recording stops at the forward
                raise NotImplementedError

        _GROUPED.append(GroupedAttention)
    return _GROUPED[0]


def _sdpa(torch, args, kwargs, recorder: Optional[_Recorder] = None, flash: bool = False):
    """F.scaled_dot_product_attention as one fused CUDA kernel: recorded as the memory-efficient
    kernel's operator (it takes every dtype and a mask), which keeps q, k, v, the mask
    (attn_bias), the output and its f32 logsumexp (derivatives.yaml,
    _scaled_dot_product_efficient_attention). The runtime runs it without a mask as its own
    attention op, flash or memory-efficient as sdp_utils.cpp picks for the run's dtype. The
    efficient kernel has no grouped-query path: with enable_gqa, k and v are repeated to q's
    heads first (sdpa's `repeat_interleave`)."""
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
    bound = dict(zip(names, args))
    bound.update(kwargs)
    q, k, v = bound["query"], bound["key"], bound["value"]
    mask = bound.get("attn_mask")
    if q.device.type == "cuda" and torch.is_autocast_enabled("cuda"):
        # Autocast casts scaled_dot_product_attention's floating inputs to its half type
        # (autocast_mode.cpp: lower_precision_fp), which this substitution, made before the
        # autocast kernel, does itself: q and k in f32 after llama's rotary (cos and sin
        # follow the f32 residual) are cast, and the kernel keeps the half copies.
        half = torch.get_autocast_dtype("cuda")
        q, k, v = (t.to(half) if t.is_floating_point() else t for t in (q, k, v))
        if mask is not None and mask.is_floating_point():
            mask = mask.to(half)
    if mask is not None and mask.dtype == torch.bool:
        # A boolean mask becomes an additive float bias first (sdpa's convert_boolean_attn_mask).
        mask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(mask.logical_not(), float("-inf"))
    dropout, causal = float(bound.get("dropout_p", 0.0) or 0.0), bool(bound.get("is_causal", False))
    if bound.get("enable_gqa", False) and k.shape[-3] != q.shape[-3] and mask is None and q.dim() == 4 \
            and torch.is_grad_enabled():
        # One operator over q, k and v as given; the runtime runs it as its own attention op,
        # which takes grouped k and v (op_kernels.cpp).
        fn = _grouped_attention(torch)
        if recorder is None:
            return fn.apply(q, k, v, dropout, causal, bound.get("scale"))
        with recorder.pause():
            out = fn.apply(q, k, v, dropout, causal, bound.get("scale"))
        recorder.record(None, (q, k, v), {}, out, name="aten._scaled_dot_product_efficient_attention.default",
                        attrs={"dropout_p": dropout, "is_causal": causal, "enable_gqa": True})
        return out
    if bound.get("enable_gqa", False) and k.shape[-3] != q.shape[-3]:
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
        v = v.repeat_interleave(q.shape[-3] // v.shape[-3], dim=-3)
    if flash and mask is None and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] % 8 == 0 \
            and q.shape[-1] <= 256 and q.dim() == 4:
        # sdp_utils.cpp: check_flash_attention_datatype, check_head_dim_size_flash (the
        # runtime's flash_supports, ops_attention.cpp). Flash keeps an unpadded logsumexp.
        return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, dropout, causal, scale=bound.get("scale"))[0]
    if mask is not None:
        mask = mask.expand(q.shape[:-1] + (k.shape[-2],)) if mask.dim() == q.dim() else mask
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, mask))
    out = torch.ops.aten._scaled_dot_product_efficient_attention(
        q, k, v, mask, needs_grad, dropout, causal, scale=bound.get("scale"))
    return out[0]


# --- one recording ----------------------------------------------------------------------------

def record(model, args: tuple, kwargs: dict, pick_output: Callable[[Any], Any],
           autocast: Optional[str] = None) -> Recording:
    """Runs `model(*args, **kwargs)` on meta tensors once and records it (module docstring).
    `pick_output` chooses the tensor the loss starts from among the model's outputs.
    `autocast` ("bf16", "f16"): under CUDA's autocast, on fake CUDA tensors."""
    if autocast is None:
        return _record(model, args, kwargs, pick_output)
    with _FakeCuda(model, autocast) as fake:
        args, kwargs = fake.inputs(args, kwargs)
        with fake.autocast():
            rec = _record(model, args, kwargs, pick_output, autocast)
    rec.assumed.extend(a for a in fake.asked if a not in rec.assumed)
    return rec


class _FakeCuda:
    """The model's parameters and buffers swapped for fake CUDA tensors of the same shapes (and
    put back after), so that CUDA's autocast runs: it only acts on CUDA tensors. No GPU is
    touched: a fake tensor is a meta tensor that says it is on CUDA."""

    def __init__(self, model, autocast: str):
        import torch
        from torch._subclasses.fake_tensor import FakeTensorMode
        if autocast not in AUTOCAST:
            raise ExportError([f"--amp {autocast!r}: expected one of {', '.join(AUTOCAST)}"], "bad option")
        self.torch, self.model, self.dtype = torch, model, getattr(torch, AUTOCAST[autocast])
        self.mode = FakeTensorMode(allow_non_fake_inputs=True)
        self.swapped: List[Tuple[Any, str, str, Any]] = []  # (module, dict, name, original)
        self.asked: List[str] = []  # what the model asked of the GPU, and the answer it got
        self.patched: List[Tuple[Any, str, Any]] = []

    # A model may ask which GPU it runs on (transformers' grouped experts need compute
    # capability 8.0): it gets an H100's answer, listed in the file's "assumed".
    CAPABILITY = (9, 0)

    def _capability(self, device=None):
        place = f"{_user_line_of_caller()}: asked the GPU's compute capability, assumed " \
                f"{self.CAPABILITY[0]}.{self.CAPABILITY[1]} (an H100)"
        if place not in self.asked:
            self.asked.append(place)
        return self.CAPABILITY

    def fake(self, t, cache: Dict[int, Any]):
        torch = self.torch
        found = cache.get(id(t))
        if found is None:
            with self.mode:
                found = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cuda")
            if isinstance(t, torch.nn.Parameter):
                found = torch.nn.Parameter(found, requires_grad=t.requires_grad)
            elif t.requires_grad:
                found.requires_grad_(True)
            cache[id(t)] = found
        return found

    def __enter__(self):
        cache: Dict[int, Any] = {}  # tied weights stay one tensor
        for module in self.model.modules():
            for kind in ("_parameters", "_buffers"):
                table = getattr(module, kind)
                for name, t in list(table.items()):
                    if t is not None:
                        self.swapped.append((module, kind, name, t))
                        table[name] = self.fake(t, cache)
        self.cache = cache
        cuda = self.torch.cuda
        self.patched.append((cuda, "get_device_capability", cuda.get_device_capability))
        cuda.get_device_capability = self._capability
        # transformers takes a fake tensor for tracing (import_utils.is_tracing) and then builds
        # the attention masks a GPU run skips (masking_utils: is_causal instead of a mask): these
        # stand for CUDA tensors, so it is told they are not fake.
        utils = sys.modules.get("transformers.utils.import_utils")
        if utils is not None and hasattr(utils, "is_fake_tensor"):
            self.patched.append((utils, "is_fake_tensor", utils.is_fake_tensor))
            utils.is_fake_tensor = lambda tensor: False
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)
        for owner, name, value in self.patched:
            setattr(owner, name, value)
        for module, kind, name, t in reversed(self.swapped):
            getattr(module, kind)[name] = t
        return False

    def inputs(self, args, kwargs):
        torch = self.torch
        to_fake = lambda t: self.fake(t, self.cache) if isinstance(t, torch.Tensor) and t.device.type == "meta" else t
        return torch.utils._pytree.tree_map(to_fake, (args, kwargs))

    def autocast(self):
        """`torch.autocast("cuda", dtype)` without its check for a GPU (it turns itself off
        without one): the same switches, set directly."""
        torch, dtype = self.torch, self.dtype

        class Region:
            def __enter__(self):
                self.previous = (torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda"),
                                 torch.is_autocast_cache_enabled())
                torch.set_autocast_enabled("cuda", True)
                torch.set_autocast_dtype("cuda", dtype)
                torch.set_autocast_cache_enabled(True)
                torch.autocast_increment_nesting()

            def __exit__(self, *exc):
                if torch.autocast_decrement_nesting() == 0:
                    torch.clear_autocast_cache()
                torch.set_autocast_enabled("cuda", self.previous[0])
                torch.set_autocast_dtype("cuda", self.previous[1])
                torch.set_autocast_cache_enabled(self.previous[2])
                return False

        return Region()


def _record(model, args: tuple, kwargs: dict, pick_output: Callable[[Any], Any],
            autocast: Optional[str] = None) -> Recording:
    import torch
    names = {id(m): n for n, m in model.named_modules()}
    # A DTensor parameter (expert parallel) is recorded as its local shard, the rank's own.
    local = local_parameters(model)
    params = {id(p): (n, p) for n, p, _ in local}
    buffers = {id(b): (n, b) for n, b in model.named_buffers()}
    recorder = _Recorder(torch, model, names, params, buffers, autocast)
    flat, _ = torch.utils._pytree.tree_flatten((args, kwargs))
    for t in flat:
        if isinstance(t, torch.Tensor):
            recorder.rec.inputs.append(recorder._add(t, "input", requires_grad=bool(t.requires_grad)))
    # Parameters and buffers in registration order (what the file declares), used or not.
    for n, p, requires_grad in local:
        rid = recorder.tensor_id(p)
        recorder.rec.tensors[rid].requires_grad = requires_grad
    for n, b in model.named_buffers():
        recorder.tensor_id(b)
    def pack(t):
        rid = recorder.by_obj.get(id(t))
        if rid is None:  # an output saved as a new tensor on its storage
            rid = recorder.storage_owner.get(t.untyped_storage()._cdata, -1)
        recorder.packed.append((len(recorder.rec.ops), rid))
        return rid

    def unpack(rid):
        # Reading a node's saved tensor (the graph walk below) gets a marker whose storage names
        # the record (autograd hands back a new Python object on the same storage).
        marker = torch.empty(0, device="meta")
        recorder.markers[marker.untyped_storage()._cdata] = (rid, marker)
        return marker

    pre = torch.nn.modules.module.register_module_forward_pre_hook(recorder.pre_hook)
    post = torch.nn.modules.module.register_module_forward_hook(recorder.post_hook, always_call=True)
    marks = _CheckpointMarks(recorder)
    try:
        with marks, _meta_autocast(), torch.autograd.graph.saved_tensors_hooks(pack, unpack), \
                _make_function_mode(recorder), _make_mode(recorder):
            out = model(*args, **kwargs)
            chosen = pick_output(out)
        recorder.resolve_pending()
    except _OpFailure as e:
        raise ExportError([str(e)] + sorted(set(recorder.problems)), "cannot record the model's operators") from None
    finally:
        pre.remove()
        post.remove()
    if recorder.problems:
        raise ExportError(sorted(set(recorder.problems)), "cannot record the model's operators")
    if not isinstance(chosen, torch.Tensor):
        raise ExportError([f"the chosen output is {type(chosen).__name__}, not a tensor"], "cannot export the model")
    recorder.rec.output = recorder.by_obj.get(id(chosen))
    if recorder.rec.output is None:
        recorder.rec.output = recorder.tensor_id(chosen)
    # What every output keeps (googlenet's auxiliary logits too: alive while the output is).
    roots = [t for t in torch.utils._pytree.tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
    recorder.finished = True
    for after, call, rid in recorder.deaths:
        if after <= 0 or rid in recorder.cache_casts:
            continue
        op = recorder.rec.ops[after - 1]
        # Died once the op's call had returned to an enclosing call (a local of that call going
        # at its return, `identity` in a residual block): freed there, after the child returns.
        ancestor = op.call
        while ancestor >= 0 and ancestor != call:
            ancestor = recorder.rec.calls[ancestor].parent
        if call >= 0 and ancestor == call and call != op.call:
            op.frees_after.append([call, rid])
        else:
            op.frees.append(rid)
    _find_saved(recorder, [chosen] + roots)
    _claim_unwalked(recorder)
    return recorder.rec


class _meta_autocast:
    """`torch.autocast(device_type=tensor.device.type, ...)` on meta tensors (PEFT's LoRA on
    experts turns autocast off around its product): the meta device has no autocast, so it is
    the CPU's there, which does nothing to meta tensors. On a GPU it is CUDA's."""

    def __enter__(self):
        import torch
        self.torch, self.original = torch, torch.autocast
        original = self.original

        class autocast(original):  # noqa: N801 (torch's name)
            def __init__(self, device_type, *args, **kwargs):
                super().__init__("cpu" if device_type == "meta" else device_type, *args, **kwargs)

        torch.autocast = autocast
        return self

    def __exit__(self, *exc):
        self.torch.autocast = self.original
        return False


class _CheckpointMarks:
    """torch.utils.checkpoint inside forward: the checkpointed module call is marked (the file's
    "checkpoint") and traced as any other call; the runtime checkpoints it as PyTorch would. A
    function that is not a module's (torchvision's memory-efficient DenseNet checkpoints a
    closure, `bn_function`) becomes an inline call of its own: code of the enclosing module,
    with no name, run under one checkpoint."""

    def __init__(self, recorder: _Recorder):
        self.recorder = recorder
        self.saved = None

    def __enter__(self):
        import torch.utils.checkpoint as cp
        self.saved = cp.checkpoint
        recorder = self.recorder
        original = cp.checkpoint

        def checkpoint(function, *args, use_reentrant=None, **kwargs):
            # transformers' GradientCheckpointingLayer checkpoints partial(super().__call__, **kwargs):
            # the layer's own call, its keyword arguments in the closure.
            target = function.func if isinstance(function, functools.partial) else function
            module = target if hasattr(target, "named_modules") else getattr(target, "__self__", None)
            before = len(recorder.rec.calls)
            kwargs.pop("preserve_rng_state", None)
            kwargs.pop("determinism_check", None)
            kwargs.pop("debug", None)
            kwargs.pop("context_fn", None)
            mode = "reentrant" if use_reentrant is not False else "non-reentrant"
            if module is None or id(module) not in recorder.names:
                parent = recorder.stack[-1] if recorder.stack else -1
                path = recorder.rec.calls[parent].path if parent >= 0 else ""
                positional = [recorder.by_obj[id(a)] for a in args if id(a) in recorder.by_obj]
                recorder.rec.calls.append(CallRec(path, "checkpoint", parent, checkpoint=mode, positional=positional,
                                                  inline=True))
                recorder.stack.append(len(recorder.rec.calls) - 1)
                try:
                    return function(*args, **kwargs)
                finally:
                    recorder.stack.pop()
            result = function(*args, **kwargs)
            if module is not None and id(module) in recorder.names:
                for call in recorder.rec.calls[before:]:
                    if call.path == recorder.names[id(module)]:
                        call.checkpoint = mode
                        break
            return result

        cp.checkpoint = checkpoint
        self.original = original
        # gradient_checkpointing_enable() bound torch's checkpoint into each layer
        # (_gradient_checkpointing_func, with its use_reentrant): the same, through the one above.
        self.bound = []
        for m in recorder.model.modules():
            f = m.__dict__.get("_gradient_checkpointing_func")
            if f is not None:
                keywords = dict(f.keywords) if isinstance(f, functools.partial) else {}
                self.bound.append((m, f))
                m._gradient_checkpointing_func = functools.partial(checkpoint, **keywords)
        return self

    def __exit__(self, *exc):
        import torch.utils.checkpoint as cp
        cp.checkpoint = self.saved
        for m, f in self.bound:
            m._gradient_checkpointing_func = f
        return False


def _saved_tensors(torch, node) -> List[Any]:
    """What an autograd node keeps: its SavedVariables (`_saved_*`), tensors and lists of them; a
    custom autograd.Function's node keeps what its forward gave ctx.save_for_backward."""
    found = []
    for attr in dir(node):
        if not attr.startswith("_saved_") and attr != "saved_tensors":
            continue
        try:
            value = getattr(node, attr)
        except Exception:  # noqa: BLE001 (a saved tensor already freed, or an undefined one)
            continue
        for v in (value if isinstance(value, (list, tuple)) else (value,)):
            if isinstance(v, torch.Tensor):
                found.append(v)
    return found


def _claim_unwalked(recorder: _Recorder) -> None:
    """Saved tensors of nodes the graph walk cannot read: an in-place op on a view is wrapped in a
    CopySlices node, which keeps the op's own node (and its saved tensors) out of sight. Such a
    tensor was packed right before its op ran (an input) or right after (an output): it goes to
    that op, whose node keeps it until its backward as CopySlices does."""
    claimed = {rid for op in recorder.rec.ops for rid in op.saves}
    ops = recorder.rec.ops
    for position, rid in recorder.packed:
        if rid < 0 or rid in claimed:
            continue
        claimed.add(rid)
        after = ops[position] if position < len(ops) else None
        before = ops[position - 1] if position > 0 else None
        if after is not None and rid in after.inputs:
            op = after
        elif before is not None and (rid in before.outputs or rid in before.inputs):
            op = before
        else:
            op = after or before
        if op is None:
            continue
        op.saves.append(rid)
        op.node = op.node or "CopySlices"


def _find_saved(recorder: _Recorder, roots) -> None:
    """Walks the autograd graph from `roots`; each node's saved tensors become its op's `saves`."""
    torch = recorder.torch
    seen = set()
    todo = [r.grad_fn for r in roots if r.grad_fn is not None]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        todo.extend(fn for fn, _ in node.next_functions)
        op_index = recorder.node_op.get(node)
        if op_index is None:
            continue
        op = recorder.rec.ops[op_index]
        op.node = type(node).__name__
        for t in _saved_tensors(torch, node):
            rid = recorder.markers.get(t.untyped_storage()._cdata, (-1, None))[0]
            if rid >= 0 and rid not in op.saves:
                op.saves.append(rid)
