"""_expert_parallel.py: one rank of a mixture of experts under transformers' expert parallel.

transformers 5.24 shards a MoE's experts over `DistributedConfig(ep_size=N)`
(`transformers/distributed/expert_parallel.py`): each experts module keeps num_experts / N whole
experts (`MoEParamShard`, Shard(0) DTensors), and in training `AllToAllEP` sends each (token,
expert) pair to the rank that holds the expert and the expert's output back:

    send_counts = zeros(E).scatter_add_(0, expert_ids, ones)        # per expert, on the device
    all_to_all_single(recv_counts, send_counts, group=ep_group)      # counts exchanged
    send_sizes, recv_sizes = stack([...]).tolist()                   # the layer's one host sync
    recv_tokens = all_to_all_single_autograd(send_tokens, recv_sizes, send_sizes, ep_group)
    ...experts on recv_tokens...
    recv_out = all_to_all_single_autograd(expert_output, send_sizes, recv_sizes, ep_group)

How many rows each rank receives is data (the router's choices on every rank), and meta tensors
have none: the recording answers the `.tolist()` with the rank's tokens x top_k rows sent evenly
over the N ranks, and received rows of a sentinel size, RECEIVED, the same at every recorded
batch and sequence. The model file writes a dimension of that size as the name `ep_rows`, which
the runtime computes: as many rows as the rank sends under an even routing (every rank alike),
or `expert_skew` times that on the GPU shown (expert_parallel.received, models' model_file.cpp).
The file lists the assumption in "assumed".

The recording runs on PyTorch's fake process group (rank 0 of N: every collective returns at
once, allocating its output as on a GPU); the DTensor parameters are recorded as their local
shards, the rank's parameters.
"""
from typing import Any, List, Optional, Tuple

from ._errors import ExportError, one_line

MAX_RANKS = 1 << 16
RECEIVED = 1 << 42  # the rows a rank receives: no real size, nor _routing.py's expert rows


def distribute(model, ep_size: int) -> Tuple[List[str], List[dict]]:
    """Applies transformers' expert parallel over `ep_size` ranks to `model` (built on the meta
    device), as rank 0 of a fake process group; returns the experts modules' names and
    transformers' fully_shard calls (fsdp_groups). Dense modules stay whole: FSDP2 is the
    runtime's, as those calls say (`--parallel ep:N`)."""
    import torch
    import torch.distributed as dist
    if not 2 <= ep_size <= MAX_RANKS:
        raise ExportError([f"--expert-parallel {ep_size}: expected 2 to {MAX_RANKS} ranks"], "bad arguments")
    try:
        from transformers.distributed import DistributedConfig
        from transformers.distributed.expert_parallel import apply_expert_parallelism
    except ImportError:
        import transformers
        raise ExportError([f"--expert-parallel needs transformers' DistributedConfig (5.24 and later; this is "
                           f"{transformers.__version__})"], "cannot export the model") from None
    if dist.is_initialized():
        if dist.get_world_size() != ep_size:
            raise ExportError([f"--expert-parallel {ep_size}: a process group of {dist.get_world_size()} ranks is "
                               "already initialized in this process"], "bad arguments")
    else:
        from torch.testing._internal.distributed.fake_pg import FakeStore
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=ep_size)
    num_experts = getattr(model.config, "num_experts", None) or getattr(model.config, "num_local_experts", None) \
        or getattr(model.config, "n_routed_experts", None)
    if isinstance(num_experts, int) and num_experts % ep_size:
        raise ExportError([f"--expert-parallel {ep_size}: the {num_experts} experts do not split evenly over "
                           f"{ep_size} ranks (transformers' MoEParamShard refuses it)"], "bad arguments")
    if not getattr(model, "_ep_plan", None) and not getattr(model.config, "base_model_ep_plan", None):
        raise ExportError([f"--expert-parallel: transformers has no expert-parallel plan for {type(model).__name__} "
                           f"(model_type {model.config.model_type!r}): no mixture of experts to shard"],
                          "cannot export the model")
    if getattr(model.config, "_experts_implementation", None) == "eager":
        # The per-expert loop's rows would be a second assumption on top of the received rows.
        raise ExportError(["--expert-parallel records grouped experts (transformers' default); the config asks for "
                           "experts_implementation \"eager\": drop it"], "bad arguments")
    groups = fsdp_groups(model, ep_size)
    try:
        config, _, meshes = model.prepare_distribute_model(DistributedConfig(fsdp_size=ep_size, ep_size=ep_size))
        _, plan, _ = model._resolve_parallel_plans(config)
    except (ValueError, KeyError, TypeError, AttributeError, RuntimeError) as e:
        raise ExportError([f"--expert-parallel {ep_size}: {one_line(e)}"], "transformers cannot apply it") from None
    if not any(style == "ep_dispatch_experts" for style in (plan or {}).values()):
        raise ExportError([f"--expert-parallel: transformers has no expert-parallel plan for {type(model).__name__} "
                           f"(model_type {model.config.model_type!r}): no mixture of experts to shard"],
                          "cannot export the model")
    try:
        model = apply_expert_parallelism(model, meshes.get_mesh("ep"), meshes.get_mesh("tp"), plan)
    except (ValueError, KeyError, TypeError, AttributeError, RuntimeError) as e:
        raise ExportError([f"--expert-parallel {ep_size}: {one_line(e)}"], "transformers cannot apply it") from None
    return [name for name, m in model.named_modules() if getattr(m, "_is_expert_parallel", False)], groups


def fsdp_groups(model, ep_size: int) -> List[dict]:
    """transformers' own fully_shard calls under DistributedConfig(fsdp_size=N, ep_size=N)
    (apply_fully_sharded_data_parallelism, distributed/fsdp.py), in order, on a copy of the
    model: each call's modules, reshard_after_forward and mesh ("efsdp" for the experts, "fsdp"
    for the rest; the root last). The runtime shards as they say, over its own world size."""
    import copy
    import transformers.distributed.fsdp as fsdp_module
    from transformers.distributed import DistributedConfig
    twin = copy.deepcopy(model)
    names = {id(m): n for n, m in twin.named_modules()}
    calls: List[dict] = []
    original = fsdp_module.fully_shard

    def recording(module, *args, mesh=None, reshard_after_forward=None, **kwargs):
        modules = module if isinstance(module, (list, tuple)) else [module]
        experts = any(getattr(m, "_is_expert_parallel", False) for m in modules)
        calls.append({"modules": [names[id(m)] for m in modules],
                      "reshard_after_forward": reshard_after_forward if reshard_after_forward is not None
                      else names[id(modules[0])] != "",  # fully_shard's None: True but for the root
                      "mesh": "efsdp" if experts else "fsdp"})
        return original(module, *args, mesh=mesh, reshard_after_forward=reshard_after_forward, **kwargs)

    fsdp_module.fully_shard = recording
    try:
        config, _, meshes = twin.prepare_distribute_model(DistributedConfig(fsdp_size=ep_size, ep_size=ep_size))
        twin.maybe_distribute_model(twin, config, meshes)
    except (ValueError, KeyError, TypeError, AttributeError, RuntimeError) as e:
        raise ExportError([f"--expert-parallel {ep_size}: FSDP2 as transformers applies it: {one_line(e)}"],
                          "transformers cannot apply it") from None
    finally:
        fsdp_module.fully_shard = original
    return calls


def local_parameters(model) -> List[Tuple[str, Any, bool]]:
    """model.named_parameters() as the rank holds them: a DTensor's local shard, with the
    DTensor's requires_grad (the shard itself does not require grad)."""
    from torch.distributed.tensor import DTensor
    return [(n, p._local_tensor, bool(p.requires_grad)) if isinstance(p, DTensor) else (n, p, bool(p.requires_grad))
            for n, p in model.named_parameters()]


class AssumedSplits:
    """Scoped to the forward of an experts module under AllToAllEP: answers the split sizes'
    `.tolist()` (a `_to_copy` of the [2, N] int64 counts to the CPU) with the even routing."""

    def __init__(self, torch):
        self.torch = torch
        self.to_copy = torch.ops.aten._to_copy.default
        self.module = None
        self.pairs = 0
        self.top_k = 0
        self.local_experts = 0
        self.answers: List[Tuple[int, List[int]]] = []  # (tokens x top_k, the split) of each layer

    def enter(self, module, args) -> None:
        if self.module is not None or not getattr(module, "_is_expert_parallel", False):
            return
        # (hidden_states, top_k_index, top_k_weights): the rank's tokens x top_k pairs
        if len(args) >= 2 and isinstance(args[1], self.torch.Tensor) and args[1].dim() == 2:
            self.module, self.pairs = module, int(args[1].numel())
            self.top_k, self.local_experts = int(args[1].shape[1]), int(module.num_experts)

    def leave(self, module) -> None:
        if module is self.module:
            self.module = None

    def answer(self, func, args, kwargs) -> Tuple[bool, Optional[Any]]:
        if self.module is None or func is not self.to_copy or not args:
            return False, None
        t = args[0]
        if not isinstance(t, self.torch.Tensor) or t.device.type != "meta" or t.is_floating_point() \
                or t.dim() != 2 or t.shape[0] != 2 or str((kwargs or {}).get("device")) != "cpu":
            return False, None
        ranks = int(t.shape[1])
        q, r = divmod(self.pairs, ranks)
        even = [q + (i < r) for i in range(ranks)]
        self.answers.append((self.pairs, even))
        # Received: RECEIVED rows in all (only their sum sizes a tensor: the all-to-all's output,
        # repeat_interleave's output_size).
        return True, self.torch.tensor([even, [RECEIVED] + [0] * (ranks - 1)], dtype=t.dtype)

    def document(self, pairs_per_point, fit) -> Optional[dict]:
        """The file's expert_parallel.received (the rows sent, a formula over the recorded
        points), top_k and local_experts; None without expert parallel."""
        if not self.answers:
            return None
        received = fit(pairs_per_point)
        if received is None:
            raise ExportError(["the rows sent to the experts follow the batch or sequence non-linearly"],
                              "cannot export the model")
        return {"received": received, "top_k": self.top_k, "local_experts": self.local_experts}

    def describe(self) -> Optional[str]:
        if not self.answers:
            return None
        pairs, split = self.answers[0]
        ranks = len(split)
        return (f"expert parallel over {ranks} ranks: the all-to-alls' split sizes assumed (every rank sends its "
                f"tokens x top_k rows evenly over the {ranks} ranks, {split} at the recorded size; the rows a rank's "
                f"experts receive are ep_rows, as many under an even routing, expert_skew times that on the GPU "
                f"shown)")
