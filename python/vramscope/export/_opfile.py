"""From operator recordings to a model file's "graph" form (docs/MODEL_FILES.md, "Operator graphs").

The model is recorded at a few sizes (batch, batch + 1, and the same with sequence + 1 when
the inputs are token sequences); every recording must run the same operators, and each size
becomes a formula over the file's options: `a*batch*seq + b*batch + c*seq + d`, checked at one
more size. A size that no such formula gives (a length rounded up by a kernel) is refused by
name, unless the runtime computes it itself (the efficient attention kernel's logsumexp, rounded
up to 32 rows: ops.hpp).
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

from ._errors import ExportError
from ._ops import FORMAT_OPS, Recording, record
from ._expert_parallel import RECEIVED
from ._routing import ROWS, expert_of, routing_document

# Outputs whose sizes the runtime derives itself (not from the file's formulas): op -> outputs.
RUNTIME_SIZED = {"aten._scaled_dot_product_efficient_attention.default": (1, 2, 3)}

MakeInputs = Callable[[int, int], Tuple[tuple, dict]]


def _formula(values: Dict[Tuple[int, int], int], batch: int, seq: Optional[int]) -> Optional[str]:
    """The size as a formula over batch (and seq), from its values at the recorded sizes; None
    when no formula of that form gives every value."""
    B, S = batch, seq or 0
    v00 = values[(B, S)]
    v10 = values[(B + 1, S)]
    if seq is None:
        b = v10 - v00
        d = v00 - b * B
        terms = [(b, "batch"), (d, "")]
        check = [((B + 2, S), lambda bb, ss: b * bb + d)]
    else:
        v01, v11 = values[(B, S + 1)], values[(B + 1, S + 1)]
        a = v11 - v10 - v01 + v00
        b = v10 - v00 - a * S
        c = v01 - v00 - a * B
        d = v00 - a * B * S - b * B - c * S
        terms = [(a, "batch*seq"), (b, "batch"), (c, "seq"), (d, "")]
        check = [((B + 2, S + 3), lambda bb, ss: a * bb * ss + b * bb + c * ss + d)]
    for point, fn in check:
        if point in values and values[point] != fn(*point):
            return None
    text = ""
    for coef, name in terms:
        if coef == 0:
            continue
        if not name:
            part = str(abs(coef))
        elif abs(coef) == 1:
            part = name
        else:
            part = f"{abs(coef)}*{name}"
        if not text:
            text = part if coef > 0 else f"-{part}"
        else:
            text += f" + {part}" if coef > 0 else f" - {part}"
    return text or "0"


def _size(values: Dict[Tuple[int, int], int], batch: int, seq: Optional[int]):
    """An int when the size is fixed, else its formula (None: no formula fits)."""
    if len(set(values.values())) == 1:
        return next(iter(values.values()))
    return _formula(values, batch, seq)


def _points(batch: int, seq: Optional[int]) -> List[Tuple[int, int]]:
    if seq is None:
        return [(batch, 0), (batch + 1, 0), (batch + 2, 0)]
    return [(batch, seq), (batch + 1, seq), (batch, seq + 1), (batch + 1, seq + 1), (batch + 2, seq + 3)]


def record_sizes(model, make_inputs: MakeInputs, pick_output, batch: int,
                 seq: Optional[int], autocast: Optional[str] = None) -> Tuple[Recording, Dict[int, List[Any]], Dict[int, List[Any]]]:
    """Records at every point and turns each tensor's sizes into formulas. Returns the first
    recording, the tensors' shapes as written, and the shapes that no formula gives."""
    recordings = {}
    for point in _points(batch, seq):
        args, kwargs = make_inputs(point[0], point[1] if seq is not None else 0)
        recordings[point] = record(model, args, kwargs, pick_output, autocast)
    first = recordings[_points(batch, seq)[0]]
    for point, rec in recordings.items():
        if [op.name for op in rec.ops] != [op.name for op in first.ops] or len(rec.tensors) != len(first.tensors):
            what = f"batch {point[0]}" + (f", sequence {point[1]}" if seq is not None else "")
            raise ExportError([f"the model runs other operators at {what} than at batch {batch}"
                               + (f", sequence {seq}" if seq is not None else "") +
                               " (Python that branches on the size?); vramscope needs one graph for every size"],
                              "cannot export the model")
    runtime_sized = set()
    for op in first.ops:
        for k in RUNTIME_SIZED.get(op.name, ()):
            if k < len(op.outputs):
                runtime_sized.add(op.outputs[k])
    shapes, unfit = {}, {}
    for t in first.tensors:
        dims = []
        for d in range(len(t.shape)):
            values = {p: r.tensors[t.id].shape[d] for p, r in recordings.items()}
            size = _size(values, batch, seq)
            if size == RECEIVED:
                size = "ep_rows"  # the rows a rank's experts receive (_expert_parallel.py)
            elif isinstance(size, int) and size >= ROWS:
                # An expert's rows in the eager loop (_routing.py): named, computed by the runtime.
                expert = expert_of(size)
                size = f"expert_rows_{expert}" if expert is not None else None
            if size is None:
                unfit.setdefault(t.id, []).append(d)
                size = t.shape[d]
            dims.append(size)
        shapes[t.id] = dims
    unfit = {tid: dims for tid, dims in unfit.items() if tid not in runtime_sized}
    first.routing = routing_document({p: r.experts_loops for p, r in recordings.items()},
                                     lambda values: _size(values, batch, seq))
    first.expert_rows = first.expert_splits.document(
        {p: r.expert_splits.answers[0][0] for p, r in recordings.items() if r.expert_splits.answers},
        lambda values: _size(values, batch, seq))
    return first, shapes, unfit


def graph_document(rec: Recording, shapes: Dict[int, List[Any]], autocast: Optional[str] = None) -> dict:
    """The "graph" object of the model file."""
    import torch
    tensors = []
    for t in rec.tensors:
        entry: Dict[str, Any] = {"kind": t.kind, "shape": shapes[t.id], "dtype": t.dtype}
        if t.base is not None:
            entry["base"] = t.base
        if t.name:
            entry["name"] = t.name
        if t.requires_grad and t.kind in ("param", "input"):
            entry["requires_grad"] = True
        tensors.append(entry)
    ops = []
    for op in rec.ops:
        entry = {"op": op.name, "in": op.inputs, "out": op.outputs, "call": op.call, "line": op.line}
        if any(a >= 0 for a in op.alias):
            entry["alias"] = op.alias
        if op.inplace:
            entry["inplace"] = True
        if op.node:
            entry["node"] = op.node
            entry["saves"] = op.saves
        if op.args:
            entry["args"] = op.args
        if op.frees:
            entry["frees"] = op.frees
        if op.frees_after:
            entry["frees_after"] = op.frees_after
        ops.append(entry)
    calls = [{"module": c.path, "class": c.cls, "parent": c.parent, "args": c.positional} for c in rec.calls]
    for c, out in zip(rec.calls, calls):
        if c.checkpoint:
            out["checkpoint"] = c.checkpoint
        if c.inline:
            out["inline"] = True
    doc = {"format": FORMAT_OPS, "recorded_with": f"torch {torch.__version__}"}
    if autocast:
        doc["autocast"] = autocast
    doc.update({"calls": calls, "tensors": tensors, "inputs": rec.inputs, "output": rec.output, "ops": ops})
    return doc


def _pick(output_key: Optional[str]):
    """The tensor the loss starts from: `output_key` of a dict or dataclass output (transformers'
    ModelOutput), else the loss a model computed itself, else the first tensor."""
    import torch

    def pick(out):
        if isinstance(out, torch.Tensor) and output_key is None:
            return out
        if output_key is not None:
            value = out.get(output_key) if hasattr(out, "get") else getattr(out, output_key, None)
            if value is None and isinstance(out, (tuple, list)) and output_key.isdigit() and int(output_key) < len(out):
                value = out[int(output_key)]
            if not isinstance(value, torch.Tensor):
                raise ExportError([f"--output {output_key}: the model's output has no tensor of that name"],
                                  "cannot export the model")
            return value
        if hasattr(out, "get") and isinstance(out.get("loss"), torch.Tensor):
            return out.get("loss")
        flat, _ = torch.utils._pytree.tree_flatten(out)
        for v in flat:
            if isinstance(v, torch.Tensor) and v.is_floating_point():
                return v
        raise ExportError(["the model returns no floating tensor to take a loss of"], "cannot export the model")

    return pick


def export_graph(model, make_inputs: MakeInputs, *, name: str, batch: int, seq: Optional[int], loss_of,
                 output_key: Optional[str] = None, description: str = "", source: str = "",
                 input_note: Optional[dict] = None, autocast: Optional[str] = None) -> dict:
    """The model file of `model` at the operator level. `make_inputs(batch, seq)` gives the
    forward's arguments (meta tensors); `loss_of(output shape)` the file's "loss"; `autocast`
    ("bf16", "f16"): recorded under CUDA's autocast, for runs with --dtype amp-bf16 / amp."""
    rec, shapes, unfit = record_sizes(model, make_inputs, _pick(output_key), batch, seq, autocast)
    if unfit:
        where = []
        for op in rec.ops:
            for o in op.outputs:
                if o in unfit:
                    call = rec.calls[op.call].path if op.call >= 0 else ""
                    where.append(f"{op.name} in {call or 'the model'} ({op.line}): output sizes "
                                 f"{rec.tensors[o].shape} follow the {'batch or sequence' if seq else 'batch'} "
                                 f"non-linearly (dimension {unfit[o][0]})")
        raise ExportError(sorted(set(where))[:20], "cannot export the model")
    doc: Dict[str, Any] = {"format": "vramscope-model", "version": 1, "name": name}
    if description:
        doc["description"] = description
    doc["source"] = source or f"exported by vramscope.export from {type(model).__name__}"
    doc["options"] = {"batch": batch} if seq is None else {"batch": batch, "seq": seq}
    routing = getattr(rec, "routing", None)
    if routing and "error" in routing:
        raise ExportError([routing["error"]], "cannot export the model")
    expert_rows = getattr(rec, "expert_rows", None)
    if routing or expert_rows:
        doc["options"]["expert_skew"] = 1
    if expert_rows:
        doc["expert_parallel"] = expert_rows  # completed by the caller that applied it
    first_input = rec.tensors[rec.inputs[0]] if rec.inputs else None
    doc["input"] = input_note or {"shape": shapes[first_input.id] if first_input else ["batch"]}
    out_shape = shapes[rec.output]
    doc["loss"] = loss_of(out_shape, rec.tensors[rec.output].shape)
    doc["graph"] = graph_document(rec, shapes, autocast)
    assumed = list(rec.assumed)
    splits = getattr(rec, "expert_splits", None)
    if splits is not None and splits.describe():
        # Expert parallel: the rows each rank's experts get are the routing's over all ranks.
        assumed.append(splits.describe())
    elif any(op.name.startswith("aten._grouped_mm") for op in rec.ops):
        # Mixtures of experts: transformers 5's grouped experts multiply tokens x top-k rows
        # sorted by expert, whatever the routing; the eager per-expert loop would depend on it.
        assumed.append("experts run grouped (grouped_mm over tokens x top-k rows): the buffers do not depend on "
                       "how the router spreads the tokens")
    if routing:
        # The eager per-expert loop: each expert's rows are the routing's (the runtime prints it).
        doc["graph"]["routing"] = routing
        assumed.append("experts run their per-expert loop (eager): every expert gets tokens, each its share of "
                       "tokens x top_k as \"routing\" and the option expert_skew say")
    if assumed:
        doc["graph"]["assumed"] = assumed
    return doc
