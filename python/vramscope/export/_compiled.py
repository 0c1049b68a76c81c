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

from ._errors import ExportError


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
            "forward_outputs": _num_fwd_outputs(nodes, node_info),
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


def _num_fwd_outputs(nodes, node_info) -> int:
    # The forward's outputs come first in the joint graph's output (partitioners.py,
    # _extract_fwd_bwd_outputs); their count is the partitioner's num_fwd_outputs.
    return node_info.num_fwd_outputs


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
    finally:
        torch._dynamo.reset()
    if len(records) != 1 or len(primals) != 1:
        raise ExportError([f"torch.compile made {len(records)} graphs with a backward; vramscope models one"],
                          "cannot record the compiled step")
    return records[0], primals[0]


def compiled_document(meta_model, make_inputs, batch: int, seq: Optional[int], step_loss) -> dict:
    """The file's "compiled" object: the joint graph the partitioner sees, at the file's batch (and
    sequence length), with what each primal input is and which backward output is its gradient."""
    record, primals = record_compiled(meta_model, make_inputs, batch, seq, step_loss)
    doc = joint_graph_document(record["graph"], record["info"], "cpu")
    placeholders = [n for n in doc["nodes"] if n.get("placeholder") == "primal"]
    if len(placeholders) != len(primals):
        raise ExportError([f"the joint graph has {len(placeholders)} primal inputs, dynamo's graph "
                           f"{len(primals)}"], "cannot record the compiled step")
    for node, name in zip(placeholders, primals):
        node["primal"] = name
    out = {"batch": batch, "graph": doc}
    if seq is not None:
        out["seq"] = seq
    return out


def step_with_loss(meta_model, make_inputs, batch: int, seq: Optional[int], loss: dict, pick):
    """The training step a script compiles for a model whose loss is outside it: the forward, the
    output the file's loss starts from, the loss against a target that is one of the batch's
    tensors. Returns (step, make_inputs with the target as the keyword "target")."""
    import torch
    import torch.nn.functional as F
    args, kwargs = make_inputs(batch, seq or 0)
    with torch.no_grad():
        out = pick(meta_model(*args, **kwargs))
    kind = loss["type"]
    if kind == "cross_entropy":
        target_of = lambda shape, dtype: torch.empty(shape[:-1], dtype=torch.int64, device="meta")  # noqa: E731
    elif kind in ("mse", "bce_with_logits"):
        target_of = lambda shape, dtype: torch.empty(shape, dtype=dtype, device="meta")  # noqa: E731
    else:
        target_of = None

    def with_target(b: int, s: int):
        a, k = make_inputs(b, s)
        if target_of is not None:
            k = dict(k, target=target_of(list(out.shape), out.dtype))
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
