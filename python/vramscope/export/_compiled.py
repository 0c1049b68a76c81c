"""The joint graph torch.compile partitions, recorded for vramscope's own partitioner.

`torch.compile` (inductor) traces the training step into one joint forward-backward graph of
decomposed ATen operators, runs its joint-graph passes and CSE, and then AOTAutograd's min-cut
partitioner (torch/_functorch/partitioners.py, min_cut_rematerialization_partition) chooses
which forward values the backward keeps. vramscope runs that choice itself
(runtime/src/compiled/min_cut_partition.cpp), under any activation_memory_budget; what it needs
from PyTorch is the graph as the partitioner sees it, written here as data:

- each node's users and arguments, its bytes (partitioners.py `_size_of`), its FLOPs
  (`estimate_runtime`, torch.utils.flop_counter: the knapsack's runtimes under a budget);
- each operator's class in PyTorch's lists (`get_default_op_list()`: fusible, compute intensive,
  random, view, recomputable), and the flags the partitioner reads from a node's meta;
- the partitioner's configuration (torch._functorch.config), so a later PyTorch's values travel
  with the file.

The graph is recorded on fake CPU tensors (no memory, no GPU): AOTAutograd's partition depends
on the graph, not on the device, but the operators a device runs may differ (CPU attention is
`_scaled_dot_product_flash_attention_for_cpu`); the file says which device it was traced for.
"""
from __future__ import annotations

import contextlib
import functools
import operator
from typing import Any, Dict, List, Optional

from ._errors import ExportError, debugging, one_line


def _placeholder_kind(node) -> str:
    target = str(node.target)
    if "tangents" in target:
        return "tangent"
    if "fwd_seed" in target or "fwd_base_offset" in target:
        return "fwd_seed"
    if "bwd_seed" in target or "bwd_base_offset" in target:
        return "bwd_seed"
    return "primal"


# The runtime's dtypes; int8 (a one-byte mask) is held as u8, the same bytes.
_DTYPES = {"float32": "f32", "float16": "f16", "bfloat16": "bf16", "float64": "f64", "int64": "i64", "uint8": "u8",
           "int8": "u8", "bool": "bool", "int32": "i32"}


def _dtype_name(dtype) -> str:
    name = str(dtype).replace("torch.", "")
    if name not in _DTYPES:
        raise ExportError([f"the compiled step makes a {name} tensor, which vramscope does not hold"],
                          "cannot record the compiled step")
    return _DTYPES[name]


def _value_kind(node) -> str:
    import torch
    from torch._functorch.partitioners import is_sym_node
    if is_sym_node(node):
        return "sym"
    val = node.meta.get("val")
    if "val" not in node.meta and "tensor_meta" not in node.meta:
        return "other"
    if isinstance(val, torch.Tensor):
        return "tensor"
    # What the partitioner weighs 0 (partitioners.py: BackwardState, script objects, opaque values).
    from torch._functorch.partitioners import is_opaque_node
    from torch._library.fake_class_registry import FakeScriptObject
    from torch.fx.experimental._backward_state import BackwardState
    if isinstance(val, (BackwardState, FakeScriptObject)) or is_opaque_node(node):
        return "opaque"
    return "other"


def joint_graph_document(joint_graph, node_info, device: str) -> dict:
    """The joint graph as choose_saved_values_set receives it, as data."""
    grads = _gradients(joint_graph, node_info.num_fwd_outputs)
    import torch
    from torch._functorch import config as fconfig
    from torch._functorch import partitioners as P
    from torch._functorch.partitioners import get_default_op_list, _size_of
    from torch._inductor.fx_utils import get_node_storage
    from torch.utils.checkpoint import CheckpointPolicy

    op_types = get_default_op_list()
    nodes = list(joint_graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    storages: Dict[Any, int] = {}
    out: List[dict] = []
    for n in nodes:
        entry: Dict[str, Any] = {"name": n.name, "op": n.op}
        if n.op == "output":
            # pytree's leaves, as _extract_fwd_bwd_outputs takes them (a None output is no leaf).
            leaves = torch.utils._pytree.arg_tree_leaves(*n.args)
            entry["outputs"] = [index[o] for o in leaves if isinstance(o, torch.fx.Node)]
            out.append(entry)
            continue
        entry["target"] = str(n.target)
        entry["users"] = [index[u] for u in n.users]
        entry["args"] = [index[a] for a in n.args if isinstance(a, torch.fx.Node)]
        entry["inputs"] = [index[a] for a in n.all_input_nodes]
        kind = _value_kind(n)
        entry["value"] = kind
        try:
            entry["bytes"] = int(_size_of(n))
        except RuntimeError:
            entry["bytes"] = 0
        val = n.meta.get("val")
        if isinstance(val, torch.Tensor):
            entry["shape"] = [int(d) for d in val.shape]
            entry["dtype"] = _dtype_name(val.dtype)
        if kind == "sym":
            entry["sym_size"] = P.sym_node_size(n)
        storage = get_node_storage(n) if kind == "tensor" else None
        if storage is not None:
            entry["storage"] = storages.setdefault(storage, len(storages))
        flags = []
        if n.op == "placeholder":
            entry["placeholder"] = _placeholder_kind(n)
            if n in grads:
                entry["grad"] = index[grads[n]]
            if n in node_info.static_lifetime_input_nodes:
                flags.append("static")
        else:
            classes = {"fusible": op_types.is_fusible(n), "compute_intensive": op_types.is_compute_intensive(n),
                       "random": op_types.is_random(n), "view": op_types.is_view(n),
                       "recomputable": op_types.is_recomputable(n)}
            flags += [k for k, v in classes.items() if v]
            if P.get_aten_target(n) == torch.ops.aten.cat:
                flags.append("cat")
            if n.target is operator.getitem:
                flags.append("getitem")
            if n.target in (torch.ops.aten.lift_fresh_copy.default, torch.ops.aten.lift_fresh.default):
                flags.append("lift_fresh")
            if P.is_non_builtin_to_include(n):
                flags.append("non_builtin")
            if P._must_be_in_backward(n):
                flags.append("must_be_in_backward")
            if isinstance(val, torch.device):
                flags.append("device_value")
            if str(n.target).startswith("_c10d_functional."):
                flags.append("collective")
            if n.is_impure():
                flags.append("impure")  # dead-code elimination keeps it in the forward graph
            if classes["fusible"] and isinstance(val, torch.Tensor):
                # A fusible operator that makes fewer elements than it reads (sum, amax, var_mean):
                # inductor keeps a reduction's output as a buffer of its own.
                largest = max((a.meta["val"].numel() for a in n.args
                               if isinstance(a, torch.fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)), default=0)
                if val.numel() < largest:
                    flags.append("reduction")
        policy = n.meta.get("recompute")
        if policy == CheckpointPolicy.MUST_SAVE:
            flags.append("must_save")
        elif policy in (CheckpointPolicy.MUST_RECOMPUTE, CheckpointPolicy.PREFER_RECOMPUTE):
            flags.append("must_recompute")
        if n.meta.get("aot_runtime_epilogue_input_mutation", False):
            flags.append("epilogue_mutation")
        if flags:
            entry["flags"] = flags
        if n.target is torch.ops.aten.convolution.default:
            # Inductor's layout optimization reads a convolution's groups (graph.py, decide_layout_opt).
            entry["conv_groups"] = int(n.args[8])
        if n.op == "call_function" and n.target is not operator.getitem:
            # The knapsack's runtime of a node under a budget (estimate_runtime, "flops" mode),
            # and the step's FLOPs. An operator the counter cannot run goes without (vramscope
            # refuses a budget that would need it).
            try:
                entry["flops"] = int(P.estimate_runtime(n))
            except Exception:  # noqa: BLE001 (PyTorch's own estimator, on PyTorch's node)
                pass
        out.append(entry)
    names = ("recompute_views", "treat_parameters_as_free_to_save", "max_dist_from_bw", "ban_recompute_used_far_apart",
             "ban_recompute_long_fusible_chains", "ban_recompute_materialized_backward",
             "ban_recompute_not_in_allowlist", "ban_recompute_reductions", "aggressive_recomputation",
             "activation_memory_budget_solver", "activation_memory_budget_runtime_estimator")
    return {"traced_on": device, "torch": torch.__version__,
            "partitioner": {k: getattr(fconfig, k) for k in names},
            # The forward's outputs come first in the joint graph's output (partitioners.py,
            # _extract_fwd_bwd_outputs); their count is the partitioner's num_fwd_outputs.
            "forward_outputs": node_info.num_fwd_outputs,
            "nodes": out}


def _gradients(joint_graph, num_fwd_outputs: int) -> dict:
    """primal placeholder -> the backward output that is its gradient (AOTAutograd's joint graph
    returns the forward's outputs, then one gradient or None per primal, in order)."""
    import torch
    nodes = list(joint_graph.nodes)
    primals = [n for n in nodes if n.op == "placeholder" and _placeholder_kind(n) == "primal"]
    raw = list(nodes[-1].args[0])
    grads = raw[num_fwd_outputs:]
    if len(grads) != len(primals):
        raise ExportError([f"the joint graph returns {len(grads)} gradients for {len(primals)} inputs"],
                          "cannot record the compiled step")
    return {p: g for p, g in zip(primals, grads) if isinstance(g, torch.fx.Node)}


@contextlib.contextmanager
def recording():
    """Within it, a compiled training step records its joint graphs (one per graph dynamo makes)
    and the partitioner's own choice; inductor's code generation is skipped."""
    import torch._functorch.partitioners as P
    records: List[dict] = []
    original_choose = P.choose_saved_values_set
    original_classify = P.classify_nodes

    def classify(joint_module, static_lifetime_input_indices, num_fwd_outputs):
        info = original_classify(joint_module, static_lifetime_input_indices, num_fwd_outputs)
        info.num_fwd_outputs = num_fwd_outputs
        return info

    def choose(joint_graph, node_info, memory_budget=1):
        saved = original_choose(joint_graph, node_info, memory_budget)
        records.append({"graph": joint_graph, "info": node_info, "budget": memory_budget,
                        "saved": [n.name for n in saved]})
        return saved

    P.choose_saved_values_set, P.classify_nodes = choose, classify
    try:
        yield records
    finally:
        P.choose_saved_values_set, P.classify_nodes = original_choose, original_classify


def _graph_only(gm, example_inputs, **_):
    """inductor's inner compiler replaced: the graph runs as it is (on fake tensors)."""
    from torch._functorch._aot_autograd.utils import make_boxed_func
    return make_boxed_func(gm.forward)


def on_fake_cpu(meta_model, fake_mode):
    """The meta model's copy on fake CPU tensors (the same modules; no memory). Tied parameters
    stay tied (to_empty makes one tensor per module's attribute)."""
    import copy
    model = copy.deepcopy(meta_model)
    ties: Dict[int, List[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        ties.setdefault(id(p), []).append(name)
    with fake_mode:
        model = model.to_empty(device="cpu")
    for names in ties.values():
        first = model.get_parameter(names[0])
        for other in names[1:]:
            owner, _, attr = other.rpartition(".")
            setattr(model.get_submodule(owner) if owner else model, attr, first)
    return model


def record_compiled(meta_model, make_inputs, batch: int, seq: Optional[int], step_loss, budget: float = 1.0):
    """Compile `step_loss(model, *args, **kwargs) -> scalar` with inductor's partitioner on fake CPU
    tensors, run one forward and backward, and return (recording, primal names): the joint graph
    with the partitioner's own saved set, and what each primal input of the graph is ("param:
    NAME", "buffer: NAME", "input: KEY")."""
    import torch
    import torch._dynamo
    from torch._inductor.compile_fx import compile_fx
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch._functorch import config as fconfig

    torch._dynamo.reset()
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    model = on_fake_cpu(meta_model, fake)
    args, kwargs = make_inputs(batch, seq or 0)
    with fake:
        args = tuple(torch.empty(a.shape, dtype=a.dtype) if isinstance(a, torch.Tensor) else a for a in args)
        kwargs = {k: torch.empty(v.shape, dtype=v.dtype) if isinstance(v, torch.Tensor) else v
                  for k, v in kwargs.items()}
    what: Dict[int, str] = {}
    for i, a in enumerate(args):
        what.setdefault(id(a), f"input: {i}")
    for k, v in kwargs.items():
        what.setdefault(id(v), f"input: {k}")
    what.update({id(p): f"param: {n}" for n, p in model.named_parameters()})
    what.update({id(b): f"buffer: {n}" for n, b in model.named_buffers()})
    primals: List[List[str]] = []

    def backend(gm, example_inputs):
        primals.append([what.get(id(t), "other") for t in example_inputs])
        return compile_fx(gm, example_inputs, inner_compile=_graph_only)

    step = torch.compile(functools.partial(step_loss, model), backend=backend, fullgraph=True)
    try:
        with recording() as records, fconfig.patch(activation_memory_budget=budget), fake:
            loss = step(*args, **kwargs)
            loss.backward()
    except torch._dynamo.exc.Unsupported as e:
        raise ExportError([f"torch.compile(fullgraph=True) breaks the step into several graphs: "
                           f"{str(e).splitlines()[0]}"], "cannot record the compiled step") from None
    except ExportError:
        raise
    except Exception as e:  # noqa: BLE001 (PyTorch's compiler on the user's model: said in one line)
        if debugging():
            raise
        raise ExportError([f"torch.compile could not compile the step at batch {batch}"
                           + (f", sequence {seq}" if seq is not None else "") + f": {one_line(e)}"],
                          "cannot record the compiled step") from None
    finally:
        torch._dynamo.reset()
    if len(records) != 1 or len(primals) != 1:
        raise ExportError([f"torch.compile made {len(records)} graphs with a backward; vramscope models one"],
                          "cannot record the compiled step")
    return records[0], primals[0]


def compiled_document(meta_model, make_inputs, batch: int, seq: Optional[int], step_loss) -> dict:
    """The file's "compiled" object: the joint graph the partitioner sees, with what each primal
    input is and which backward output is its gradient. The step is compiled again at further
    sizes (the batch + 1 and + 2; with a sequence, a grid of three lengths): when each graph is
    the same, every size and FLOP count becomes a formula over batch (and seq), so the file runs
    at any batch; else it runs at the recorded one only."""
    record, primals = record_compiled(meta_model, make_inputs, batch, seq, step_loss)
    doc = joint_graph_document(record["graph"], record["info"], "cpu")
    placeholders = [n for n in doc["nodes"] if n.get("placeholder") == "primal"]
    if len(placeholders) != len(primals):
        raise ExportError([f"the joint graph has {len(placeholders)} primal inputs, dynamo's graph "
                           f"{len(primals)}"], "cannot record the compiled step")
    for node, name in zip(placeholders, primals):
        node["primal"] = name
    others = {}
    for point in _points(batch, seq)[1:]:
        other, _ = record_compiled(meta_model, make_inputs, point[0], point[1] if seq is not None else None,
                                   step_loss)
        others[point] = joint_graph_document(other["graph"], other["info"], "cpu")
    out = {"batch": batch}
    if seq is not None:
        out["seq"] = seq
    why = _as_formulas(doc, others, batch, seq)
    if why:
        out["fixed"] = why  # the sizes hold at the recorded batch (and sequence) only
    out["graph"] = doc
    return out


def _points(batch: int, seq: Optional[int]):
    """Where the step is compiled: FLOPs of attention grow with the square of the sequence, so
    a sequence takes three lengths (and a fourth point checks every formula)."""
    if seq is None:
        return [(batch, 0), (batch + 1, 0), (batch + 2, 0)]
    return [(batch, seq), (batch + 1, seq), (batch, seq + 1), (batch + 1, seq + 1), (batch, seq + 2),
            (batch + 1, seq + 2), (batch + 2, seq + 3)]


_SAME = ("name", "op", "target", "users", "args", "inputs", "value", "placeholder", "flags", "grad",
         "outputs", "conv_groups", "storage")


def _as_formulas(doc: dict, others: dict, batch: int, seq: Optional[int]) -> Optional[str]:
    """Rewrites `doc`'s sizes and FLOPs as formulas over batch (and seq) from the recordings at
    the other points; returns why not (and leaves `doc` as recorded) when a graph differs or a
    value follows no formula."""
    first = (batch, seq or 0)
    nodes = doc["nodes"]
    for point, other in others.items():
        if len(other["nodes"]) != len(nodes) or other["forward_outputs"] != doc["forward_outputs"] or any(
                a.get(k) != b.get(k) for a, b in zip(nodes, other["nodes"]) for k in _SAME):
            return (f"torch.compile makes another joint graph at batch {point[0]}" +
                    (f", sequence {point[1]}" if seq is not None else ""))
    rewritten = []
    for i, node in enumerate(nodes):
        entry = {}
        for key in ("bytes", "flops"):
            if key not in node:
                continue
            values = {first: node[key]}
            values.update({p: o["nodes"][i].get(key) for p, o in others.items()})
            if any(v is None for v in values.values()):
                entry[key] = None  # not counted at every size: left out
                continue
            formula = _polynomial(values, batch, seq)
            if formula is None:
                return f"{node['name']}'s {key} follow no formula over the batch" + (" and sequence" if seq else "")
            entry[key] = formula
        if "shape" in node:
            dims = []
            for d in range(len(node["shape"])):
                values = {first: node["shape"][d]}
                values.update({p: o["nodes"][i]["shape"][d] for p, o in others.items()})
                formula = _polynomial(values, batch, seq)
                if formula is None:
                    return f"{node['name']}'s shape follows no formula over the batch" + (" and sequence" if seq else "")
                dims.append(formula)
            entry["shape"] = dims
        rewritten.append(entry)
    for node, entry in zip(nodes, rewritten):
        for key, value in entry.items():
            if value is None:
                node.pop(key, None)
            else:
                node[key] = value
    return None


def _polynomial(values: dict, batch: int, seq: Optional[int]):
    """The value as an int when it is fixed, else a formula in batch (degree 1) and seq (degree
    2) that gives every recorded value; None when no such formula with whole coefficients does."""
    from fractions import Fraction
    if len(set(values.values())) == 1:
        return next(iter(values.values()))
    B, S = batch, seq or 0
    if seq is None:
        slope = values[(B + 1, 0)] - values[(B, 0)]
        terms = {"batch": Fraction(slope), "": Fraction(values[(B, 0)] - slope * B)}
    else:
        # For each batch, the quadratic in s through three lengths; then each coefficient linear in b.
        def quadratic(b):
            y0, y1, y2 = (Fraction(values[(b, S + k)]) for k in range(3))
            a2 = (y2 - 2 * y1 + y0) / 2
            a1 = (y1 - y0) - a2 * (2 * S + 1)
            a0 = y0 - a1 * S - a2 * S * S
            return a0, a1, a2
        q0, q1 = quadratic(B), quadratic(B + 1)
        names = (("", "batch"), ("seq", "batch*seq"), ("seq*seq", "batch*seq*seq"))
        terms = {}
        for (plain, with_batch), c0, c1 in zip(names, q0, q1):
            slope = c1 - c0
            terms[with_batch] = slope
            terms[plain] = c0 - slope * B
    if any(c.denominator != 1 for c in terms.values()):
        return None

    def evaluate(b, s):
        return sum(int(c) * (b if "batch" in k else 1) * (s ** k.count("seq")) for k, c in terms.items())
    if any(evaluate(b, s) != v for (b, s), v in values.items()):
        return None
    text = ""
    for name in ("batch*seq*seq", "seq*seq", "batch*seq", "batch", "seq", ""):
        c = int(terms.get(name, 0))
        if c == 0:
            continue
        part = str(abs(c)) if not name else (name if abs(c) == 1 else f"{abs(c)}*{name}")
        text += (part if c > 0 else f"-{part}") if not text else (f" + {part}" if c > 0 else f" - {part}")
    return text or 0


def size_at(value, batch: int, seq: int) -> int:
    """A size the exporter wrote (an int, or a formula such as "48*batch*seq + 2") at batch, seq."""
    if isinstance(value, int):
        return value
    names = {"batch": batch, "seq": seq}
    total = 0
    for term in str(value).replace(" - ", " + -").split(" + "):
        term = term.strip()
        product = -1 if term.startswith("-") else 1
        for factor in term.lstrip("-").split("*"):
            factor = factor.strip()
            product *= names[factor] if factor in names else int(factor)
        total += product
    return total


def step_with_loss(make_inputs, loss: dict, pick, out_shape):
    """The training step a script compiles for a model whose loss is outside it: the forward, the
    output the file's loss starts from, the loss against a target that is one of the batch's
    tensors. `out_shape` is the output's shape as the recording wrote it (formulas over batch and
    seq). Returns (step, make_inputs with the target as the keyword "target")."""
    import torch
    import torch.nn.functional as F
    kind = loss["type"]

    def with_target(b: int, s: int):
        a, k = make_inputs(b, s)
        if kind in ("cross_entropy", "mse", "bce_with_logits"):
            shape = [size_at(d, b, s) for d in out_shape]
            if kind == "cross_entropy":
                k = dict(k, target=torch.empty(shape[:-1], dtype=torch.int64, device="meta"))
            else:
                k = dict(k, target=torch.empty(shape, dtype=torch.bfloat16, device="meta"))
        return a, k

    def step(model, *a, target=None, **k):
        o = pick(model(*a, **k))
        if kind == "cross_entropy":
            return F.cross_entropy(o.flatten(0, -2), target.flatten())
        if kind == "mse":
            return F.mse_loss(o, target)
        if kind == "bce_with_logits":
            return F.binary_cross_entropy_with_logits(o, target)
        if kind == "sum":
            return o.sum()
        return o

    return step, with_target
