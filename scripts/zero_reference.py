#!/usr/bin/env python3
r"""zero_reference.py: the buffers DeepSpeed's ZeRO stages 1, 2 and 3 allocate on one rank, on the CPU.

The reference for `vramscope --parallel zero1:N|zero2:N` (issue 32), and for a ZeRO-3 model to
come. Each configuration runs in a fresh process: rank r of world size 8 on PyTorch's fake
process group (no other process, the collectives do nothing), DeepSpeed on its CPU accelerator
(DS_ACCELERATOR=cpu), bf16, the optimizer from the config (AdamW -> DeepSpeed's FusedAdam),
three steps of `loss = engine(x).float().pow(2).mean(); engine.backward(loss); engine.step()` on
Sequential(Linear(40, 64), ReLU, Linear(64, 48), ReLU, Linear(48, 3)): 5,891 parameters, which
do not split evenly over 8 ranks (groups_padding on the last) and straddle the partitions.

A TorchDispatchMode records every storage the ops create and a weakref finalizer its free; the
allocations made in DeepSpeed's ZeRO code (stage_1_and_2.py, fused_adam.py, the flattening in
runtime/utils.py) are kept, named by their call site, with the phase they were made in
(construction, step N backward, step N optimizer) and when they were freed. The CPU has no
streams: what overlap_comm moves to the reduction stream shows here on the one timeline.

    DS_ACCELERATOR=cpu python3 scripts/zero_reference.py --json zero_reference.json

With --zero3 it records DeepSpeedZeroOptimizer_Stage3 instead (CONFIGS3): the MLP above at the
defaults (every parameter is "persistent", <= 1e5 elements), with reduce_bucket_size=4000 and
with stage3_param_persistence_threshold=0; and a bigger MLP whose two weights are not persistent,
at the defaults, with reduce_bucket_size=500000 (under a weight's size), and without prefetch
or reuse distance.

    DS_ACCELERATOR=cpu python3 scripts/zero_reference.py --zero3 --json zero3_reference.json

Stage 3 needs one patch here: the parameter coordinator checks its recorded trace with
assert_ints_same_as_other_ranks (runtime/zero/utils.py), which broadcasts rank 0's list and
compares; the fake group's broadcast does nothing, so any rank but 0 keeps its -1 placeholder
and raises. The script gives that module a `dist` whose get_rank() is 0: every rank then makes
rank 0's tensors (the same sizes) and the check passes. Its record keeps more than stages 1
and 2: the phases include "step N forward"; a buffer is named by the innermost DeepSpeed frame
that made it (SITES3: file under deepspeed/, function, a piece of the statement), so the
all-gathers, the whole gradients that LinearFunctionForZeroStage3 (the F.linear zero.Init
installs) hands to autograd, the reduce-scatter's buffers and the grad-norm temporaries are
named; any other storage made in the ZeRO-3 files is kept as "other (function)". Each buffer
also carries its parameters (from the frame's locals), the ZeRO-3 calls that made and freed it
(fetch, prefetch, release of module M, release_and_reset_all, ...), and alloc_seq/free_seq, one
counter over the kept allocations and frees, so their interleaving can be replayed exactly. Per
step the record notes which parameters are gathered (ds_status AVAILABLE) after forward, after
backward and after the step, and the coordinator's module trace. What the CPU shows
differently from a GPU: defragment() builds the flat bf16 partition buffer on the host and
copies it to the device, a no-op here (so the host buffer shows, made before the parameters'
partitions are freed; on a GPU the device copy is made after); the engine's module.to(device)
is a no-op too (on a GPU the whole bf16 parameters it makes are what zero.Init frees); no
streams.

needs torch and deepspeed importable (pip install deepspeed, or its sources on PYTHONPATH).
"""
import argparse
import json
import linecache
import os
import re
import subprocess
import sys
import traceback
import weakref

WORLD = 8
STEPS = 3
CONFIGS = {  # name -> (stage, rank, reduce_bucket_size, overlap_comm, offload_optimizer to the CPU)
    "zero1-r0": (1, 0, 5e8, None, False), "zero1-r3-b4000": (1, 3, 4000, None, False),
    "zero1-r7": (1, 7, 5e8, None, False),
    "zero2-r0": (2, 0, 5e8, None, False), "zero2-r3-b4000": (2, 3, 4000, None, False),
    "zero2-r7": (2, 7, 5e8, None, False),
    # offload_optimizer {"device": "cpu"} (DeepSpeedCPUAdam, built by DeepSpeed's op builder):
    # on the CPU accelerator host and device are one, so what is compared is each buffer's
    # size, order and lifetime, the host ones named so by their statement.
    "zero1-r0-offload": (1, 0, 5e8, None, True), "zero2-r3-b4000-offload": (2, 3, 4000, None, True),
    "zero2-r7-offload": (2, 7, 5e8, None, True),
}
# DeepSpeed call sites (file:function) -> the name vramscope's buffer log gives the tensor.
SITES = [
    ("fused_adam.py", "__init__", "FusedAdam overflow flag"),
    ("utils.py", "align_dense_tensors", "flat padding"),
    ("stage_1_and_2.py", "flatten_dense_tensors_aligned", None),  # the flat parameters, or step's flat gradient
    ("stage_1_and_2.py", "setup_buckets", "gradient bucket (IPG buffer)"),
    ("stage_1_and_2.py", "allreduce_bucket", "bucket all-reduce copy (torch.cat of its slices)"),
    ("stage_1_and_2.py", "copy_grads_in_partition", "grads_in_partition"),
    ("stage_1_and_2.py", "get_flat_partition", "gradient padding zeros"),
    ("fused_adam.py", "step", None),  # exp_avg, exp_avg_sq
]

# Stage 3: name -> (model, rank, zero_optimization settings beside "stage": 3). The models are
# Sequential(Linear(a, b), ReLU, Linear(b, c), ReLU, Linear(c, d)) for (a, b, c, d); "big" has two
# weights over the default stage3_param_persistence_threshold (1e5 elements) and sizes that do not
# divide by 8, so its gathers pad.
MODELS3 = {"mlp": (40, 64, 48, 3), "big": (1001, 1201, 999, 3)}
# A two-layer Llama (transformers' LlamaForCausalLM, sdpa, bf16) of the config below: its
# decoder layers' projections, norms, rotary embedding and head as DeepSpeed hooks them; the
# embedding (32,064 elements) is over a persistence threshold of 3e4, the rest under, so that
# both kinds show in a model this small. vramscope reads the same config (--hf-config).
LLAMA3 = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 501, "hidden_size": 64,
          "intermediate_size": 176, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "max_position_embeddings": 128, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
          "torch_dtype": "bfloat16"}
LLAMA3_SEQ = 16
CONFIGS3 = {
    "zero3-r0": ("mlp", 0, {}), "zero3-r7": ("mlp", 7, {}),
    # offload_optimizer {"device": "cpu"}: the master, its gradient and CPU Adam's moments on the
    # host (one memory with the device on the CPU accelerator), each gradient partition's norm
    # and fp32 copy in the backward.
    "zero3-r0-offload": ("mlp", 0, {"offload_optimizer": {"device": "cpu", "pin_memory": True}}),
    "zero3big-r0-offload": ("big", 0, {"offload_optimizer": {"device": "cpu", "pin_memory": True}}),
    "zero3-r3-b4000": ("mlp", 3, {"reduce_bucket_size": 4000}),
    "zero3-r0-p0": ("mlp", 0, {"stage3_param_persistence_threshold": 0}),
    "zero3-r7-p0": ("mlp", 7, {"stage3_param_persistence_threshold": 0}),
    "zero3big-r0": ("big", 0, {}), "zero3big-r7": ("big", 7, {}),
    "zero3big-r3-b500000": ("big", 3, {"reduce_bucket_size": 500000}),
    "zero3big-r0-reuse0": ("big", 0, {"stage3_max_reuse_distance": 0}),
    "zero3big-r0-prefetch0": ("big", 0, {"stage3_prefetch_bucket_size": 0}),
    "zero3big-r0-prefetch0-reuse0": ("big", 0, {"stage3_prefetch_bucket_size": 0, "stage3_max_reuse_distance": 0}),
    "zero3llama-r0": ("llama", 0, {"stage3_param_persistence_threshold": 30000}),
    "zero3llama-r5-b20000": ("llama", 5, {"stage3_param_persistence_threshold": 30000, "reduce_bucket_size": 20000}),
    "zero3llama-r0-reuse0": ("llama", 0, {"stage3_param_persistence_threshold": 30000, "stage3_max_reuse_distance": 0,
                                          "stage3_prefetch_bucket_size": 20000}),
    "zero3llamatied-r0": ("llama-tied", 0, {"stage3_param_persistence_threshold": 30000}),
    "zero3llamagc-r0": ("llama-gc", 0, {"stage3_param_persistence_threshold": 30000}),
    "zero3llamalora-r0": ("llama-lora", 0, {"stage3_param_persistence_threshold": 30000}),
    "zero3llama-r0-sg3000": ("llama", 0, {"stage3_param_persistence_threshold": 30000, "sub_group_size": 3000}),
    "zero3llama-r0-offload": ("llama", 0, {"stage3_param_persistence_threshold": 30000, "sub_group_size": 3000,
                                           "offload_optimizer": {"device": "cpu", "pin_memory": True}}),
    # offload_param {"device": "cpu"} (ZeRO-Infinity's parameters on the host): each partition made
    # there, the trained ones moved into a pinned flat buffer (_create_param_groups_fp16_flat_cpu_memory).
    # Its ds_tensor.to(device) before every gather is a no-op on the CPU accelerator: not recorded.
    "zero3big-r0-offloadparam": ("big", 0, {"offload_param": {"device": "cpu", "pin_memory": True}}),
    "zero3llama-r0-offloadboth": ("llama", 0, {"stage3_param_persistence_threshold": 30000, "sub_group_size": 3000,
                                               "offload_param": {"device": "cpu", "pin_memory": True},
                                               "offload_optimizer": {"device": "cpu", "pin_memory": True}}),
}
# Stage 3 call sites: (file under deepspeed/, function, a piece of the statement or None, name).
# The innermost DeepSpeed frame of the allocation decides (utils/nvtx.py's wrapper skipped); the
# first row that fits names it. A name may be a dict from the aten op to the name.
SITES3 = [
    ("runtime/engine.py", "_cast_module_mixed_precision", None,
     "whole bf16 parameter (the engine's cast; zero.Init partitions and frees it)"),
    ("ops/adam/fused_adam.py", "__init__", None, "FusedAdam overflow flag"),
    ("ops/adam/fused_adam.py", "step", "exp_avg_sq", "exp_avg_sq"),
    ("ops/adam/fused_adam.py", "step", "exp_avg", "exp_avg"),
    ("ops/adam/cpu_adam.py", "step", "exp_avg_sq", "exp_avg_sq"),
    ("ops/adam/cpu_adam.py", "step", "exp_avg", "exp_avg"),
    ("runtime/zero/partition_parameters.py", "_partition_param", None, "bf16 parameter partition (ds_tensor)"),
    ("runtime/zero/stage3.py", "__init__", "inf_or_nan_tracker", "inf_or_nan_tracker"),
    ("runtime/zero/utils.py", "defragment", None, "bf16 flat partition buffer (lp_param_buffer)"),
    ("runtime/zero/stage3.py", "_create_param_groups_fp16_flat_cpu_memory", None,
     "bf16 flat partition buffer (param_groups_fp16_flat_cpu_memory)"),
    ("runtime/zero/stage3.py", "_create_fp32_partitions", ".clone()", "fp32 master partition"),
    ("runtime/zero/stage3.py", "_create_fp32_partitions", ".to(", "fp32 master conversion (before its clone)"),
    ("runtime/zero/stage3.py", "initialize_optimizer_states", "subgroup_gradient_buffer",
     "fp32 gradient partition (host)"),
    ("runtime/zero/stage3.py", "initialize_optimizer_states", None,
     "fp32 gradient placeholder (initialize_optimizer_states)"),
    ("runtime/zero/stage3.py", "_setup_for_real_optimizer", "bucket.buffer", "IPG bucket (reduce_bucket_size)"),
    ("runtime/zero/stage3.py", "_setup_for_real_optimizer", "grad_partitions_flat_buffer",
     "gradient partitions (grad_partitions_flat_buffer)"),
    ("runtime/zero/partition_parameters.py", "_allgather_params_sequential", None,
     "gathered parameter (blocking all_gather, N x partition)"),
    ("runtime/zero/partition_parameters.py", "_allgather_params_coalesced", None,
     "gathered parameter (blocking coalesced all_gather, N x partition)"),
    ("runtime/zero/partition_parameters.py", "_all_gather_dtype", None,
     "all-gather flat buffer (N x sum of partitions)"),
    ("runtime/zero/partition_parameters.py", "wait", "torch.cat", "gathered parameter (copy out of the flat buffer)"),
    ("runtime/zero/partition_parameters.py", "_all_gather_sequential", None,
     "gathered parameter (all_gather buffer, N x partition)"),
    ("runtime/zero/linear.py", "backward", "grad_weight =", "weight gradient (whole, bf16)"),
    ("runtime/zero/linear.py", "backward", "grad_bias =", "bias gradient (whole, bf16)"),
    ("runtime/comm/coalesced_collectives.py", "reduce_scatter_coalesced", "torch.empty", "reduce-scatter padding"),
    ("runtime/comm/coalesced_collectives.py", "reduce_scatter_coalesced", "torch.cat",
     "reduce-scatter buffer (N x sum of partitions, interleaved)"),
    ("runtime/zero/utils.py", "assert_lst_len_same_as_other_ranks", None, "trace check temporary"),
    ("runtime/zero/utils.py", "get_lst_from_rank0", None, "trace check temporary"),
    ("runtime/zero/stage3.py", "get_grad_norm_direct", ".double().norm(2)",
     {"_to_copy": "fp64 gradient partition (grad norm)", "*": "grad norm of a partition"}),
    ("runtime/zero/stage3.py", "get_grad_norm_direct", None, "grad norm scalar"),
    ("runtime/zero/stage3.py", "_constant_buffered_norm2", None,
     {"_to_copy": "fp64 gradient partition (grad norm)", "*": "grad norm of a partition"}),
    ("runtime/zero/stage3.py", "_offload_grad_partition_at_boundary", None, "fp32 gradient partition (to the host)"),
    ("runtime/zero/stage3.py", "complete_grad_norm_calculation_for_cpu_offload", None, "grad norm scalar"),
    ("runtime/zero/stage3.py", "step", None, "grad norm scalar"),
    ("runtime/zero/stage3.py", "_prepare_fp32_grad_for_sub_group", None,
     {"cat": "flat bf16 gradient (flatten of the partitions)", "*": "fp32 gradient partition"}),
    ("runtime/zero/stage3.py", "unscale_and_clip_grads", None, "clip scalar"),
]
# The names whose buffers belong to parameters: the record lists them ("params").
PER_PARAM = ("whole bf16 parameter", "bf16 parameter partition", "gathered parameter", "all-gather flat buffer",
             "weight gradient", "bias gradient", "fp64 gradient partition", "grad norm of a partition", "other")
# Any other storage made in these files is kept as "other (function)".
ZERO3_FILES = ("runtime/zero/stage3.py", "runtime/zero/partition_parameters.py",
               "runtime/zero/partitioned_param_coordinator.py", "runtime/zero/parameter_offload.py",
               "runtime/zero/utils.py", "runtime/comm/coalesced_collectives.py")


def created_storages(func, args, kwargs, out, live):
    """(tensor, storage) for each storage an op made: a view's storage is its input's, an empty
    or already followed one is not new. (lift_fresh moves a constant made outside the mode,
    IntTensor([0]): a new tensor.)"""
    import torch
    from torch.utils._pytree import tree_leaves
    inputs = set() if func is torch.ops.aten.lift_fresh.default else {
        a.untyped_storage().data_ptr() for a in tree_leaves((args, kwargs or {})) if isinstance(a, torch.Tensor)}
    for t in tree_leaves(out):
        if not isinstance(t, torch.Tensor):
            continue
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if storage.nbytes() == 0 or key in live or key in inputs:
            continue
        yield t, storage


def one(name):
    stage, rank, bucket, overlap, offload = CONFIGS[name]
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from torch.utils._python_dispatch import TorchDispatchMode
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT="29511")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=WORLD)
    import deepspeed

    phase = ["construction"]
    events = []  # [name, bytes, allocated phase, freed phase, site]
    live = set()

    def site(stack):
        """The DeepSpeed statement that made a tensor: (file, line, name) or None."""
        for frame in reversed(stack):
            base = os.path.basename(frame.filename)
            if "deepspeed" not in frame.filename:
                continue
            if offload and base == "stage_1_and_2.py" and frame.name == "copy_grads_in_partition":
                # The offload branch (1651-1668): each call it makes, named by the call.
                for call, label in (("set_norm_for_param_grad_in_gpu", "norm"),
                                    ("update_offload_overflow_tracker", "inf/NaN check of the whole gradient"),
                                    ("async_inplace_copy_grad_to_fp32", "fp32 copy of the gradient slice (to the host)")):
                    if call in (frame.line or ""):
                        return base, frame.lineno, label
            for file, function, label in SITES:
                if base == file and frame.name == function:
                    if function == "flatten_dense_tensors_aligned":
                        label = ("bit16 flat parameters (bit16_groups_flat)" if phase[0] == "construction"
                                 else "flat gradient partition")
                    if file == "fused_adam.py" and function == "step":
                        label = "exp_avg" if "exp_avg_sq" not in (frame.line or "") else "exp_avg_sq"
                    return base, frame.lineno, label
            # Statements of DeepSpeedZeroOptimizer's own methods: the master weights'
            # .clone().to(fp32) in __init__, the step's flatten and .to(fp32).
            text = frame.line or ""
            if base == "stage_1_and_2.py" and frame.name == "__init__" and ".clone()" in text:
                return base, frame.lineno, "master"
            # offload_optimizer's host buffers, the GPU's staging buffer and CPU Adam's moments.
            if offload and base == "stage_1_and_2.py" and frame.name == "__init__":
                for needle, label in (("torch.full(", "bit16 partition buffer (host)"),
                                      ("temp_grad_buffer_for_cpu_offload =", "temp_grad_buffer_for_cpu_offload (host)"),
                                      ("temp_grad_buffer_for_gpu_offload =", "temp_grad_buffer_for_gpu_offload")):
                    if needle in text:
                        return base, frame.lineno, label
            if offload and base == "stage_1_and_2.py" and frame.name == "initialize_optimizer_states":
                return base, frame.lineno, "fp32 gradient partition (host)"
            if offload and base == "cpu_adam.py" and frame.name == "step" and "exp_avg" in text:
                return base, frame.lineno, "exp_avg (host)" if "exp_avg_sq" not in text else "exp_avg_sq (host)"
            if base == "stage_1_and_2.py" and frame.name == "step" and "flatten" in text:
                return base, frame.lineno, "flat gradient partition"
            if base == "stage_1_and_2.py" and frame.name == "step" and ".to(" in text:
                return base, frame.lineno, "fp32 gradient partition"
        return None

    def freed(index):
        events[index][3] = phase[0]

    class Track(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t, storage in created_storages(func, args, kwargs, out, live):
                key = storage.data_ptr()
                where = site(traceback.extract_stack()[:-1])
                if where is None:
                    continue
                base, line, label = where
                if label == "norm":  # the slice's fp64 copy, then its 0-dim norm
                    label = ("gradient norm (fp64, kept until the step)" if t.dim() == 0
                             else "gradient slice in fp64 (for its norm)")
                live.add(key)
                events.append([label, storage.nbytes(), phase[0], "", f"{base}:{line}"])
                weakref.finalize(storage, lambda i=len(events) - 1, k=key: (freed(i), live.discard(k)))
            return out

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(40, 64), torch.nn.ReLU(), torch.nn.Linear(64, 48), torch.nn.ReLU(),
                                torch.nn.Linear(48, 3))
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": stage, "reduce_bucket_size": bucket}}
    if overlap is not None:
        cfg["zero_optimization"]["overlap_comm"] = overlap
    if offload:
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    mode = Track()
    mode.__enter__()
    engine, _, _, _ = deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())
    info = {"partition_size": int(engine.optimizer.partition_size[0]),
            "groups_padding": int(engine.optimizer.groups_padding[0]),
            "flat_numel": int(engine.optimizer.bit16_groups_flat[0].numel()),
            "optimizer": type(engine.optimizer).__name__, "basic_optimizer": type(engine.basic_optimizer).__name__,
            "deepspeed": deepspeed.__version__}
    for step in range(1, STEPS + 1):
        x = torch.randn(4, 40, dtype=torch.bfloat16)
        loss = engine(x).float().pow(2).mean()
        phase[0] = f"step {step} backward"
        engine.backward(loss)
        phase[0] = f"step {step} optimizer"
        engine.step()
    mode.__exit__(None, None, None)
    # The master clone is recognised by its statement: relabel the pair made at __init__.
    for e in events:
        if e[0] == "master":
            e[0] = ("master weights' bit16 clone" if e[1] == info["partition_size"] * 2
                    else "fp32 master partition" + (" (host)" if offload else ""))
    return {"stage": stage, "rank": rank, "world_size": WORLD, "reduce_bucket_size": bucket, "overlap_comm": overlap,
            "offload_optimizer": offload,
            **info, "buffers": [{"buffer": e[0], "bytes": e[1], "allocated": e[2], "freed": e[3], "site": e[4]}
                                for e in events]}


def one3(name):
    """One ZeRO stage 3 configuration of CONFIGS3, recorded as the module docstring says."""
    model_name, rank, zero = CONFIGS3[name]
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from torch.utils._python_dispatch import TorchDispatchMode
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT="29511")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=WORLD)
    import deepspeed
    import deepspeed.runtime.zero.utils as zero_utils
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    class Rank0:
        """runtime/zero/utils.py's dist, but get_rank() is 0 (the docstring's one patch)."""
        def __init__(self, comm):
            self.comm = comm

        def __getattr__(self, name):
            return getattr(self.comm, name)

        def get_rank(self, group=None):
            return 0

    zero_utils.dist = Rank0(zero_utils.dist)

    torch.manual_seed(0)
    if model_name.startswith("llama"):  # "llama-tied": the head tied to the embedding
        from transformers import LlamaConfig, LlamaForCausalLM
        config = dict(LLAMA3, tie_word_embeddings=model_name == "llama-tied")
        model = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in config.items() if k != "architectures"},
                                             attn_implementation="sdpa")).to(torch.bfloat16)
        if model_name in ("llama-gc", "llama-lora"):  # every decoder layer checkpointed, as transformers 5 does it
            model.gradient_checkpointing_enable()
            model.train()
        if model_name == "llama-lora":  # PEFT's LoRA, rank 8 on q_proj and v_proj (its default)
            from peft import LoraConfig, get_peft_model
            model.enable_input_require_grads()
            model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,
                                                     target_modules=["q_proj", "v_proj"]))
        a = None
    else:
        a, b, c, d = MODELS3[model_name]
        model = torch.nn.Sequential(torch.nn.Linear(a, b), torch.nn.ReLU(), torch.nn.Linear(b, c), torch.nn.ReLU(),
                                    torch.nn.Linear(c, d))
    param_names = {id(p): n for n, p in model.named_parameters()}
    module_names = {id(m): n or "(root)" for n, m in model.named_modules()}

    phase = ["construction"]
    seq = [0]
    events = []  # dicts, in allocation order
    live = set()

    def rel(filename):
        return filename.rsplit("/deepspeed/", 1)[1] if "/deepspeed/" in filename else None

    def names_of(value):
        if isinstance(value, torch.nn.Parameter) and id(value) in param_names:
            return [param_names[id(value)]]
        if isinstance(value, (list, tuple, set)) and value and all(isinstance(v, torch.nn.Parameter) for v in value):
            return sorted(param_names.get(id(v), "?") for v in value)
        return None

    def params_near(frame, label):
        """The parameters a per-parameter buffer belongs to, from the locals of its site (of the
        reduce-scatter's caller for its buffers); None for the others."""
        keys = ("param", "p", "params")
        if label.startswith("weight gradient"):
            keys = ("weight", )
        elif label.startswith("bias gradient"):
            keys = ("bias", )
        elif label.startswith("reduce-scatter"):
            while frame is not None and frame.f_code.co_name != "__avg_scatter_grads":
                frame = frame.f_back
            keys = ("params_to_reduce", )
        elif not label.startswith(PER_PARAM):
            return None
        for key in keys:
            found = names_of(frame.f_locals.get(key)) if frame is not None else None
            if found:
                return found
        return None

    def module_of(value):
        return module_names.get(id(value), type(value).__name__)

    def context(frame):
        """The ZeRO-3 calls on the stack, outermost first: who made (or freed) a storage."""
        parts = []
        while frame is not None:
            path, fn, loc = rel(frame.f_code.co_filename), frame.f_code.co_name, frame.f_locals
            line = linecache.getline(frame.f_code.co_filename, frame.f_lineno)
            part = None
            if path == "runtime/zero/partitioned_param_coordinator.py":
                way = "forward" if loc.get("forward") else "backward"
                if fn == "_fetch_sub_module_impl":
                    what = ("prefetch at" if "params_to_prefetch" in line else
                            "fetch wait at" if ".wait(" in line else "fetch of")
                    part = f"{what} module {module_of(loc.get('current_submodule'))} ({way})"
                elif fn == "release_sub_module":
                    part = f"release of module {module_of(loc.get('submodule'))} ({way})"
                elif fn in ("release_and_reset_all", "release_backward_leftovers", "reset_step"):
                    part = fn
            elif path == "runtime/zero/stage3.py":
                if fn == "reduce_independent_p_g_buckets_and_remove_grads":
                    part = "gradient hook of " + ",".join(names_of(loc.get("param")) or ["?"])
                elif fn in ("__reduce_and_partition_ipg_grads", "independent_gradient_partition_epilogue",
                            "create_reduce_and_remove_grad_hooks", "_post_step", "_prepare_sub_group",
                            "_optimizer_step", "_release_sub_group", "_get_norm_groups",
                            "_create_fp16_partitions_with_defragmentation", "_setup_for_real_optimizer"):
                    part = fn
            elif path == "runtime/zero/partition_parameters.py" and fn == "_zero_init_param":
                part = "zero.Init partitioning of " + ",".join(names_of(loc.get("param")) or ["?"])
            elif path == "runtime/zero/linear.py" and fn == "backward":
                part = "LinearFunctionForZeroStage3.backward"
            if part and (not parts or parts[-1] != part):
                parts.append(part)
            frame = frame.f_back
        return " > ".join(reversed(parts))

    def site(frame, op):
        """The innermost DeepSpeed frame's SITES3 row: (frame, 'file:line', name) or None."""
        while frame is not None:
            path = rel(frame.f_code.co_filename)
            if path is not None and path != "utils/nvtx.py":
                break
            frame = frame.f_back
        if frame is None:
            return None
        fn = frame.f_code.co_name
        text = linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()
        where = f"{path}:{frame.f_lineno}"
        for file, function, piece, label in SITES3:
            if file == path and function == fn and (piece is None or piece in text):
                if isinstance(label, dict):
                    label = label.get(op, label["*"])
                return frame, where, label
        return (frame, where, f"other ({fn})") if path in ZERO3_FILES else None

    def freed(event):
        seq[0] += 1
        event.update(freed=phase[0], free_seq=seq[0], freed_by=context(sys._getframe(1)))

    class Track(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t, storage in created_storages(func, args, kwargs, out, live):
                key = storage.data_ptr()
                where = site(sys._getframe(1), func.overloadpacket.__name__)
                if where is None:
                    continue
                frame, line, label = where
                live.add(key)
                seq[0] += 1
                event = {"buffer": label, "bytes": storage.nbytes(), "dtype": str(t.dtype).replace("torch.", ""),
                         "allocated": phase[0], "freed": "", "site": line, "params": params_near(frame, label),
                         "made_by": context(frame), "freed_by": "", "alloc_seq": seq[0], "free_seq": None}
                if event["params"] is None:
                    del event["params"]
                events.append(event)
                weakref.finalize(storage, lambda e=event, k=key: (freed(e), live.discard(k)))
            return out

    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 3, **zero}}
    mode = Track()
    mode.__enter__()
    engine, _, _, _ = deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())

    def gathered():
        return [n for n, p in model.named_parameters() if p.ds_status == ZeroParamStatus.AVAILABLE]

    snapshots = {"construction": gathered()}
    for step in range(1, STEPS + 1):
        phase[0] = f"step {step} forward"
        if a is None:  # the causal LM's own loss, as a training loop takes it
            ids = torch.randint(0, LLAMA3["vocab_size"], (4, LLAMA3_SEQ))
            loss = engine(input_ids=ids, labels=ids).loss
        else:
            x = torch.randn(4, a, dtype=torch.bfloat16)
            loss = engine(x).float().pow(2).mean()
        snapshots[f"step {step} after forward"] = gathered()
        phase[0] = f"step {step} backward"
        engine.backward(loss)
        snapshots[f"step {step} after backward"] = gathered()
        phase[0] = f"step {step} optimizer"
        engine.step()
        snapshots[f"step {step} after step"] = gathered()
    mode.__exit__(None, None, None)
    buffers = [dict(e) for e in events]  # frees after this point (process exit) are not part of the record

    opt = engine.optimizer
    coordinator = opt.parameter_offload.get_param_coordinator()
    trace = getattr(coordinator, "_PartitionedParameterCoordinator__submodule_order", ())
    return {
        "stage": 3, "rank": rank, "world_size": WORLD, "model": model_name,
        "layers": (["LlamaForCausalLM", dict(LLAMA3, tie_word_embeddings=model_name == "llama-tied"),
                    f"batch 4, seq {LLAMA3_SEQ}"] if a is None else
                   [f"Linear({a}, {b})", "ReLU", f"Linear({b}, {c})", "ReLU", f"Linear({c}, {d})"]),
        "zero_optimization": cfg["zero_optimization"],
        "settings": {"reduce_bucket_size": engine.zero_reduce_bucket_size(),
                     "prefetch_bucket_size": engine.zero_prefetch_bucket_size(),
                     "max_live_parameters": engine.zero_max_live_parameters(),
                     "max_reuse_distance": engine.zero_max_reuse_distance(),
                     "param_persistence_threshold": engine.zero_param_persistence_threshold(),
                     "model_persistence_threshold": engine.zero_model_persistence_threshold(),
                     "contiguous_gradients": engine.zero_contiguous_gradients(),
                     "reduce_scatter": engine.zero_reduce_scatter(), "overlap_comm": engine.zero_overlap_comm(),
                     "communication_data_type": str(engine.communication_data_type).replace("torch.", ""),
                     "gradient_accumulation_dtype": str(opt.gradient_accumulation_dtype).replace("torch.", ""),
                     "gradient_clipping": engine.gradient_clipping()},
        "params": [{"name": n, "numel": p.ds_numel, "partition_numel": p.ds_tensor.ds_numel,
                    "persistent": bool(p.ds_persist), "ds_id": p.ds_id} for n, p in model.named_parameters()],
        "partition_size": sum(p.ds_tensor.ds_numel for p in model.parameters()),
        # Under offload_param the flat buffer is the host's (param_groups_fp16_flat_cpu_memory).
        "lp_param_buffer_numel": (opt.lp_param_buffer.numel() if hasattr(opt, "lp_param_buffer")
                                  else sum(t.numel() for t in opt.param_groups_fp16_flat_cpu_memory)),
        "grad_partitions_numel": opt.grad_partitions_flat_buffer.numel(),
        "module_trace": [module_of(m) for m in trace],
        "gathered": snapshots,
        "optimizer": type(opt).__name__, "basic_optimizer": type(engine.basic_optimizer).__name__,
        "deepspeed": deepspeed.__version__, "buffers": buffers}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", required=True)
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--only", help="comma-separated configuration names")
    ap.add_argument("--zero3", action="store_true", help="record the stage 3 configurations (CONFIGS3)")
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one3(args.one) if args.one in CONFIGS3 else one(args.one)))
        return 0
    names = args.only.split(",") if args.only else list(CONFIGS3 if args.zero3 else CONFIGS)
    out = {"world_size": WORLD, "steps": STEPS, "configs": {}}
    for name in names:
        run = subprocess.run([sys.executable, __file__, "--json", "-", "--one", name], capture_output=True, text=True,
                             env=dict(os.environ, DS_ACCELERATOR="cpu"), timeout=600)
        lines = [ln for ln in run.stdout.splitlines() if ln.startswith("{")]
        out["configs"][name] = json.loads(lines[-1]) if run.returncode == 0 and lines else {
            "error": (run.stderr or run.stdout)[-2000:]}
    import torch
    out["versions"] = {"torch": torch.__version__.split("+")[0]}
    with open(args.json, "w") as f:
        if not args.zero3:
            json.dump(out, f, indent=1)
        else:  # some 200 buffers a configuration: one line each
            rows = []
            for config in out["configs"].values():
                for i, buf in enumerate(config.get("buffers", [])):
                    config["buffers"][i] = f"@row{len(rows)}@"
                    rows.append(json.dumps(buf))
            f.write(re.sub(r'"@row(\d+)@"', lambda m: rows[int(m.group(1))], json.dumps(out, indent=1)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
