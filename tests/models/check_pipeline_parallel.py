#!/usr/bin/env python3
"""check_pipeline_parallel.py VRAMSCOPE [--all]: pipeline parallel under today's PyTorch against
`vramscope trace --parallel pp:N --buffers`, what each stage holds and when.

PyTorch runs on the CPU, one rank of world size N on its fake process group: a four-layer bf16
Llama (tests/data/h100-parallel-2026-11-26's, transformers' LlamaForCausalLM, SDPA) split as
torchtitan splits it (generate_llm_fqn_per_model_part: the embedding and the final norm with
lm_head count as a layer each), each stage a PipelineStage with static metadata, run by
ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B (rank r holding stages r, r + N, ...:
each of its stages is a PipelineStage and events name the stage too), or the zero-bubble
ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble and ScheduleDualPipeV (these two: rank r
holding r and 2N - 1 - r), with
transformers' ForCausalLMLoss as loss_fn, two steps of
AdamW (foreach), plain or with every decoder layer checkpointed (gradient_checkpointing_enable,
non-reentrant). The stage's forward is LlamaModel.forward's for its layers: cache_position
and position_ids, the rotary embedding's cos and sin, then the layers (the last stage also
the norm and lm_head).

What the schedule holds is followed with weak references, each event labelled with the action
(forward_one_chunk or backward_one_chunk of a micro-batch) begun last: every receive buffer
(_RecvInfo.allocate_buffer, activations before a forward, gradients before a backward), each
output (sent on until release_fwd_send_outputs; on the last stage the output chunk kept for
step()'s return), each input gradient sent back (stage.bwd_cache), and the merged output step()
returns, and how many times a checkpointed decoder layer is rerun in backward (the rotary
embedding's calls inside a graph task; vramscope's timeline's "pre-recompute" rows of a layer).
Under a zero-bubble schedule the backward is split: backward_one_chunk(full_backward=False)
("backward input") and backward_weight_one_chunk ("backward weight"); what stage_backward_input
stashed for W (each intermediate's incoming gradients, backward_state's param_groups) is followed
too, and what the V's turn hands between two stages of one rank ("pass activations", "pass
gradients"). Each must equal vramscope's buffer log: what, micro-batch, bytes, and the actions it was
made and dropped in. Equal logs mean the same actions in the same order on the rank, the same
micro-batches in flight, and the same buffers for as long.

With fsdp in the mesh (pp:3xfsdp:2, pp:2xfsdp:2xtp:2) each stage is fully_shard'ed as
torchtitan's apply_fsdp does under pp (each decoder layer, then the stage, reshard_after_forward
False) and FSDP2's buffers are followed too: each all-gather output, each group's unsharded
parameters (_to_unsharded to _to_sharded), the gradients kept on them across micro-batches
(set_requires_gradient_sync(False)), and the reduce-scatter input and output of
perform_reduce_grad's finalization after the last backward. vramscope runs with --stack at the
installed torch (FSDP2 in a stage is modelled as torch 2.15's PipelineStage finalizes it).

Each configuration runs in a process of its own (`--rank ...` prints PyTorch's side as JSON).
Exit 77 (skipped) without torch and transformers, unless VRAMSCOPE_REQUIRE_STACK=1 (CI).
"""
import contextlib
import json
import re
import subprocess
import sys
import tempfile
import weakref
from pathlib import Path

from check_tensor_parallel import layer_plan
from stack_python import reexec_on_stack

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "tests" / "data" / "h100-parallel-2026-11-26" / "ref-llama-2layer.json"
LAYERS, BATCH, SEQ, STEPS = 4, 4, 128, 2


def batch_of(microbatches):
    """The batch: BATCH, or one sample per micro-batch where a schedule needs more (DualPipeV
    runs at least as many micro-batches as stages)."""
    return max(BATCH, microbatches)
# (ranks, fsdp, tensor parallel, schedule, micro-batches, return_outputs, checkpointed, f32
# parameters, stages per rank): each rank of each is checked. CI runs the first ten (every kind
# of stage under the six schedules, tensor parallel and FSDP2 inside the stages); `--all`
# (ctest models.pipeline_parallel_all, label coverage) the rest too.
RUNS = (
    (3, 1, 1, "1f1b", 4, True, False, False, 1),  # stages of 1 + embedding, 2, and 1 + norm and lm_head
    (4, 1, 1, "gpipe", 2, False, True, False, 1),  # every decoder layer checkpointed (non-reentrant)
    (2, 1, 2, "1f1b", 4, True, False, False, 1),  # pp:2xtp:2, loss parallel: each stage's tensor-parallel rank 0
    # pp:3xfsdp:2, FSDP2 inside each stage as torchtitan applies it, with its mixed precision (f32
    # parameters, bf16 compute, f32 reduction: the gradients accumulate in f32)
    (3, 2, 1, "1f1b", 4, True, False, True, 1),
    # interleaved 1F1B: 2 ranks of 2 stages (torchtitan's default), the runtime's lowered actions
    (2, 1, 1, "interleaved1f1b", 4, True, False, False, 2),
    # pp:2xfsdp:2 interleaved: each stage its own FSDP root, unsharded by the runtime's UNSHARD and
    # reduce-scattered by its REDUCE_GRAD after the stage's last backward
    (2, 2, 1, "interleaved1f1b", 4, True, False, True, 2),
    # the zero-bubble schedules: each backward split into I and W, the stash of each projection's
    # output gradient between them; ZBV's V (rank 0 holds the first and the last stage, the last
    # rank hands over between its two without a send), under tensor parallel
    (3, 1, 1, "interleavedzerobubble", 4, True, False, False, 2),
    (2, 1, 2, "zbvzerobubble", 4, True, False, False, 2),
    # a forward and a whole backward overlapped; checkpointed: W reruns a layer once per weight group
    (2, 1, 1, "dualpipev", 4, True, True, False, 2),
    # FSDP2 inside ZBV's stages: rank 0's two stages each a root of its own (the embedding's, the
    # norm's and lm_head's), the weights' gradients accumulated at W, reduced after the last W
    (2, 2, 1, "zbvzerobubble", 4, True, False, True, 2),
    (2, 1, 1, "1f1b", 4, True, False, False, 1),
    (2, 1, 1, "gpipe", 4, True, False, False, 1),
    (4, 1, 1, "1f1b", 4, True, False, False, 1),
    (4, 1, 1, "1f1b", 4, True, True, False, 1),
    (2, 1, 2, "gpipe", 2, True, True, False, 1),
    (3, 2, 1, "1f1b", 4, True, False, False, 1),  # FSDP2 on bf16 parameters
    (2, 2, 1, "gpipe", 4, False, False, False, 1),
    (2, 2, 1, "1f1b", 2, True, True, True, 1),
    (2, 2, 2, "1f1b", 2, True, False, True, 1),  # pp:2xfsdp:2xtp:2, torchtitan's 3-D layout
    (3, 1, 1, "interleaved1f1b", 4, False, True, False, 2),  # stages of the embedding alone and of lm_head alone
    (2, 1, 1, "interleaved1f1b", 4, True, False, False, 3),  # layers_per_stage=1: 3 stages per rank
    (3, 1, 1, "interleaved1f1b", 2, True, False, False, 2),  # fewer micro-batches than ranks (one round)
    (2, 1, 2, "interleaved1f1b", 2, True, False, False, 2),  # pp:2xtp:2 interleaved
    (2, 2, 1, "interleaved1f1b", 4, True, False, False, 3),  # FSDP2 over 3 stages per rank, bf16 parameters
    (2, 2, 1, "interleaved1f1b", 4, False, True, True, 2),  # FSDP2 interleaved, checkpointed
    (2, 2, 2, "interleaved1f1b", 2, True, False, True, 2),  # pp:2xfsdp:2xtp:2 interleaved
    (3, 2, 1, "interleaved1f1b", 4, True, False, True, 2),  # a middle rank without the root's parameters
    (2, 2, 1, "interleaved1f1b", 4, True, False, True, 4),  # 4 stages per rank: the runtime reshards and gathers again
    (2, 2, 1, "interleaved1f1b", 4, False, True, False, 5),  # 5 per rank, bf16 parameters, checkpointed
    (2, 1, 1, "interleavedzerobubble", 4, False, True, False, 3),  # checkpointed: I recomputes, W reads it
    (2, 1, 2, "interleavedzerobubble", 2, True, False, False, 2),
    (3, 1, 1, "zbvzerobubble", 2, True, False, False, 2),  # fewer micro-batches than ZBV's 2P - 1
    (4, 1, 1, "zbvzerobubble", 4, False, True, False, 2),
    (3, 1, 1, "dualpipev", 6, True, False, False, 2),
    (2, 1, 2, "dualpipev", 4, False, True, False, 2),
    (2, 2, 1, "interleavedzerobubble", 4, True, False, True, 2),
    (3, 2, 1, "interleavedzerobubble", 4, True, False, True, 2),
    (2, 2, 1, "interleavedzerobubble", 4, True, False, False, 3),  # bf16 parameters, 3 stages per rank
    (2, 2, 1, "dualpipev", 4, False, True, False, 2),
    (2, 2, 2, "zbvzerobubble", 4, True, False, True, 2),  # pp:2xfsdp:2xtp:2 in a V
)
# FSDP2's buffers in a stage, as vramscope's --buffers names them.
FSDP_KINDS = ("all-gather output", "unsharded parameters", "unsharded gradients (accumulated)",
              "reduce-scatter input", "reduce-scatter output (sharded gradients)")


def layers_of(stages, virtual):
    """The decoder's layers: LAYERS, or one per stage when the schedule has more stages."""
    return max(LAYERS, stages * virtual - 2)


def split(stages, layers):
    """torchtitan's generate_llm_fqn_per_model_part(stages, layers, 1, 1), as layer ranges
    (torchtitan/distributed/pipeline_parallel.py)."""
    effective = layers + 2
    per, extra = divmod(effective, stages)
    out, current = [], 0
    for s in range(stages):
        count = per + (1 if s < extra else 0) - (1 if s in (0, stages - 1) else 0)
        out.append((current, min(layers, current + count)))
        current = min(layers, current + count)
    return out


def freed_when_gone(entry, tensors, now):
    """Marks `entry` freed in the action begun last (`now[0]`) when the last of `tensors` goes."""
    left = [len(tensors)]

    def gone():
        left[0] -= 1
        if left[0] == 0:
            entry["freed"] = now[0]
    for t in tensors:
        weakref.finalize(t, gone)


def fsdp_events(module, mesh, first_layer, log, now, mixed):
    """fully_shard on each decoder layer, then on the stage (torchtitan's apply_fsdp under pp:
    reshard_after_forward=False), with FSDP2's buffers followed into `log`: each all-gather
    output, each group's unsharded parameters (from _to_unsharded to _to_sharded), its gradients
    kept on the unsharded parameters between micro-batches, its reduce-scatter input and output
    (the sharded gradients view it), each labelled with the action begun last."""
    import weakref
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    import torch.distributed.fsdp._fully_shard._fsdp_param_group as param_group

    def local(t):
        return getattr(t, "_local_tensor", t)

    def nbytes(t):
        return local(t).untyped_storage().nbytes()

    def entry(what, size):
        log.append({"buffer": what, "bytes": size, "allocated": now[0], "freed": ""})
        return log[-1]

    def freed_with(e, tensors):
        freed_when_gone(e, tensors, now)

    # One rank may hold several stages, each its own FSDP root: FSDP's classes are patched once,
    # every stage's groups named in the same table.
    if _FSDP_NAMES is not None:
        _register_fsdp(module, mesh, first_layer, mixed, _FSDP_NAMES)
        return
    names, unsharded, gradients = {}, {}, {}
    globals()["_FSDP_NAMES"] = names
    group_class = param_group.FSDPParamGroup
    gather, reduce = param_group.foreach_all_gather, param_group.foreach_reduce
    to_unsharded, to_sharded, post_backward = group_class._to_unsharded, group_class._to_sharded, group_class.post_backward

    def all_gather(fsdp_params, *a, **k):
        result = gather(fsdp_params, *a, **k)
        freed_with(entry(f"{names[id(fsdp_params[0])]} all-gather output", nbytes(result.all_gather_output)),
                   [result.all_gather_output])
        return result

    def unshard(self):
        if not self.is_unsharded:
            size = sum(t.untyped_storage().nbytes() for p in self.fsdp_params for t in p.all_gather_outputs)
            unsharded[id(self)] = entry(f"{names[id(self.fsdp_params[0])]} unsharded parameters", size)
        to_unsharded(self)

    def reshard(self):
        if self.is_unsharded and id(self) in unsharded:
            unsharded.pop(id(self))["freed"] = now[0]
        to_sharded(self)

    def after_backward(self, *a):
        post_backward(self, *a)
        if self.reduce_grads or id(self) in gradients:
            return
        grads = [local(p.unsharded_param.grad) for p in self.fsdp_params
                 if hasattr(p, "_unsharded_param") and p.unsharded_param.grad is not None]
        if grads:
            e = gradients[id(self)] = entry(f"{names[id(self.fsdp_params[0])]} unsharded gradients (accumulated)",
                                            sum(map(nbytes, grads)))
            freed_with(e, grads)

    def reduce_scatter(fsdp_params, *a, **k):
        result = reduce(fsdp_params, *a, **k)
        name = names[id(fsdp_params[0])]
        gradients.pop(id(fsdp_params[0]._group), None)
        freed_with(entry(f"{name} reduce-scatter input", nbytes(result[0])), [result[0]])
        sharded = [local(p.sharded_param.grad) for p in fsdp_params if p.sharded_param.grad is not None]
        freed_with(entry(f"{name} reduce-scatter output (sharded gradients)", nbytes(sharded[0])), sharded)
        return result

    param_group.foreach_all_gather, param_group.foreach_reduce = all_gather, reduce_scatter
    group_class._to_unsharded, group_class._to_sharded, group_class.post_backward = unshard, reshard, after_backward
    _register_fsdp(module, mesh, first_layer, mixed, names)


_FSDP_NAMES = None  # fsdp_events' table of group names, once FSDP's classes are patched


def _register_fsdp(module, mesh, first_layer, mixed, names):
    """fully_shard on the stage's layers, then on the stage, their groups named in `names`."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    options = {"reshard_after_forward": False}
    if mixed:
        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in module.layers:
        fully_shard(layer, mesh=mesh, **options)
    fully_shard(module, mesh=mesh, **options)
    for i, layer in enumerate(module.layers):
        for group in layer._get_fsdp_state()._fsdp_param_groups:
            names[id(group.fsdp_params[0])] = f"model.layers.{first_layer + i}"
            for p in group.fsdp_params:
                p._group = group
    for group in module._get_fsdp_state()._fsdp_param_groups:
        names[id(group.fsdp_params[0])] = "root"
        for p in group.fsdp_params:
            p._group = group


def torch_side(stages, fsdp, tp, schedule, microbatches, return_outputs, checkpointed, mixed, rank, virtual=1):
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleDualPipeV, ScheduleGPipe,
                                              ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble,
                                              ScheduleZBVZeroBubble)
    from torch.distributed.pipelining import _recv_buffers
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.loss.loss_utils import ForCausalLMLoss

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, SequenceParallel, loss_parallel,
                                                   parallelize_module)

    # The mesh (pp, dp, tp): this process is the stage's data- and tensor-parallel rank 0.
    dist.init_process_group("fake", rank=rank * fsdp * tp, world_size=stages * fsdp * tp, store=FakeStore())
    mesh = init_device_mesh("cpu", (stages, fsdp, tp), mesh_dim_names=("pp", "dp", "tp"))
    layers = layers_of(stages, virtual)
    cfg = LlamaConfig.from_dict({**json.loads(CONFIG.read_text()), "use_cache": False, "num_hidden_layers": layers})
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    torch.set_default_dtype(torch.float32 if mixed else torch.bfloat16)
    full = LlamaForCausalLM(cfg)
    torch.set_default_dtype(torch.float32)
    if checkpointed:
        full.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    full.train()
    # Interleaved schedules hold `virtual` stages per rank, stage rank + k * stages (loop style);
    # ZBV two, rank and 2 * stages - 1 - rank (the V).
    total = stages * virtual
    indices = ([rank, 2 * stages - 1 - rank] if schedule in ("zbvzerobubble", "dualpipev")
               else [rank + k * stages for k in range(virtual)])
    ranges = split(total, layers)

    class Stage(nn.Module):
        """LlamaModel.forward for the stage's layers (and the embedding, or norm and lm_head)."""

        def __init__(self, index):
            super().__init__()
            self.first, self.last = index == 0, index == total - 1
            lo, hi = ranges[index]
            self.embed_tokens = full.model.embed_tokens if self.first else None
            self.rotary_emb = full.model.rotary_emb
            self.layers = nn.ModuleList(full.model.layers[lo:hi])
            self.norm = full.model.norm if self.last else None
            self.lm_head = full.lm_head if self.last else None

        def forward(self, x):
            h = self.embed_tokens(x) if self.first else x
            cache_position = torch.arange(h.shape[1])
            # Sequence parallel: the caller's position_ids of the whole sequence.
            position_ids = cache_position.unsqueeze(0) if tp == 1 else torch.arange(SEQ)[None]
            position_embeddings = self.rotary_emb(h, position_ids)
            for layer in self.layers:
                h = layer(h, position_embeddings=position_embeddings, position_ids=position_ids)
            return self.lm_head(self.norm(h)) if self.last else h

    modules = [Stage(i) for i in indices]
    del full
    rows = batch_of(microbatches) // microbatches
    hidden = (rows, SEQ // tp, cfg.hidden_size)
    log, now, recv_kind = [], ["construction"], []
    step_no = [0]

    def label(index, action, mb):
        # A rank of one stage names the micro-batch alone; an interleaved rank the stage too.
        return f"step {step_no[0]} {action} {mb}" if virtual == 1 else f"step {step_no[0]} stage {index} {action} {mb}"

    def track(tensor, what, index, mb):
        tensor = getattr(tensor, "_local_tensor", tensor)  # a DTensor's local shard, which it holds
        where = f"micro-batch {mb}" if virtual == 1 else f"stage {index}, micro-batch {mb}"
        entry = {"buffer": f"{what} ({where})", "bytes": tensor.untyped_storage().nbytes(),
                 "allocated": now[0], "freed": ""}
        log.append(entry)
        weakref.finalize(tensor, lambda: entry.__setitem__("freed", now[0]))

    def track_all(tensors, what, index, mb):
        where = f"micro-batch {mb}" if virtual == 1 else f"stage {index}, micro-batch {mb}"
        entry = {"buffer": f"{what} ({where})", "bytes": sum(t.untyped_storage().nbytes() for t in tensors),
                 "allocated": now[0], "freed": ""}
        log.append(entry)
        freed_when_gone(entry, tensors, now)

    allocate = _recv_buffers._RecvInfo.allocate_buffer

    def allocate_buffer(self, device):
        buffer = allocate(self, device)
        track(buffer, *recv_kind[-1])
        return buffer

    _recv_buffers._RecvInfo.allocate_buffer = allocate_buffer
    pipeline_stages = []
    for index, module in zip(indices, modules):
        first, last = module.first, module.last
        inputs = (torch.empty(rows, SEQ, dtype=torch.long, device="meta") if first
                  else torch.empty(hidden, dtype=torch.bfloat16, device="meta", requires_grad=True))
        outputs = torch.empty((rows, SEQ, cfg.vocab_size) if last else hidden, dtype=torch.bfloat16, device="meta",
                              requires_grad=True)
        grads = {}
        if tp > 1:
            # torchtitan's plan on the stage's modules (check_tensor_parallel.py's, applied to a part),
            # with loss_parallel: lm_head's logits stay a vocabulary-sharded DTensor.
            group = mesh["tp"]
            plan = {}
            if first:
                plan["embed_tokens"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
            if last:
                plan["norm"] = SequenceParallel()
                plan["lm_head"] = ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1),
                                                  use_local_output=False)
            if plan:
                parallelize_module(module, group, plan)
            for layer in module.layers:
                parallelize_module(layer, group, layer_plan())
            if last:
                # A DTensor stage output needs its gradient's metadata too (static metadata on the fake group).
                def logits(grad):
                    local = torch.empty(rows, SEQ, cfg.vocab_size // tp, dtype=torch.bfloat16, device="meta",
                                        requires_grad=grad)
                    return DTensor.from_local(local, group, [Shard(2)], run_check=False)
                outputs = logits(True)
                grads = {"output_grads": logits(False),
                         "input_grads": torch.empty(hidden, dtype=torch.bfloat16, device="meta")}
        if fsdp > 1:
            fsdp_events(module, mesh["dp"], ranges[index][0], log, now, mixed)
        stage = PipelineStage(module, index, total, torch.device("cpu"), input_args=inputs, output_args=outputs,
                              group=mesh["pp"].get_group(), **grads)
        for name, what in (("get_fwd_recv_ops", "receive activations"), ("get_bwd_recv_ops", "receive gradients")):
            original = getattr(stage, name)

            def recv_ops(mb, *a, _original=original, _what=what, _index=index, **k):
                recv_kind.append((_what, _index, mb))
                return _original(mb, *a, **k)

            setattr(stage, name, recv_ops)

        def forward(mb, *a, _stage=stage, _forward=stage.forward_one_chunk, **k):
            now[0] = label(_stage.stage_index, "forward", mb)
            out = _forward(mb, *a, **k)
            # The V's turn (stages P - 1 and P on one rank) hands over without a send.
            passes = _stage.stage_index + 1 in indices
            what = (("output chunk" if return_outputs else "output") if _stage.is_last
                    else "pass activations" if passes else "send activations")
            track(out, what, _stage.stage_index, mb)
            return out

        def backward(mb, *a, _stage=stage, _backward=stage.backward_one_chunk, **k):
            split = k.get("full_backward", True) is False
            now[0] = label(_stage.stage_index, "backward input" if split else "backward", mb)
            result = _backward(mb, *a, **k)
            if split and not _stage.is_first:
                # What stage_backward_input stashed for W: each intermediate's incoming gradients.
                stash = {}
                for group in _stage.backward_state[mb][1]:
                    for grads in group.get("grads") or ():
                        for g in grads or ():
                            if g is not None:
                                g = getattr(g, "_local_tensor", g)  # a DTensor's local shard
                                g = getattr(g, "elem", g)  # AsyncCollectiveTensor (funcol): its tensor
                                stash.setdefault(g.untyped_storage().data_ptr(), g)
                if stash:
                    track_all(list(stash.values()), "stashed gradients", _stage.stage_index, mb)
            passes = _stage.stage_index - 1 in indices
            for grad in _stage.bwd_cache.get(mb, ()):
                if grad is not None and not _stage.is_first:
                    track(grad, "pass gradients" if passes else "send gradients", _stage.stage_index, mb)
            return result

        def backward_weight(mb, *a, _stage=stage, _weight=stage.backward_weight_one_chunk, **k):
            now[0] = label(_stage.stage_index, "backward weight", mb)
            return _weight(mb, *a, **k)

        stage.forward_one_chunk, stage.backward_one_chunk = forward, backward
        stage.backward_weight_one_chunk = backward_weight
        pipeline_stages.append(stage)

    def loss_fn(logits, labels):
        return ForCausalLMLoss(logits, labels, cfg.vocab_size)

    if virtual > 1:
        kind = {"interleavedzerobubble": ScheduleInterleavedZeroBubble, "zbvzerobubble": ScheduleZBVZeroBubble,
                "dualpipev": ScheduleDualPipeV}.get(schedule, ScheduleInterleaved1F1B)
        pipe = kind(pipeline_stages, microbatches, loss_fn=loss_fn)
    else:
        kind = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
        pipe = kind(pipeline_stages[0], microbatches, loss_fn=loss_fn)
    opt = torch.optim.AdamW([p for m in modules for p in m.parameters()], lr=1e-3, foreach=True)
    first, last = 0 in indices, total - 1 in indices  # ZBV: rank 0 holds the last stage too
    # Each checkpointed layer's reruns: its attention applies the rotary embedding once a call,
    # and a rerun runs inside a backward's graph task (torch.utils.checkpoint reruns once per
    # task: a zero-bubble W runs one per weight group).
    from transformers.models.llama import modeling_llama
    rotary, reruns = modeling_llama.apply_rotary_pos_emb, [0]

    def counted(*a, **k):
        reruns[0] += torch._C._current_graph_task_id() != -1
        return rotary(*a, **k)
    modeling_llama.apply_rotary_pos_emb = counted
    ids = torch.randint(0, cfg.vocab_size, (batch_of(microbatches), SEQ))
    for step in range(1, STEPS + 1):
        step_no[0] = step
        opt.zero_grad(set_to_none=True)
        args = (ids,) if first else ()
        with loss_parallel() if tp > 1 else contextlib.nullcontext():
            merged = pipe.step(*args, target=ids if last else None, return_outputs=return_outputs)
        if merged is not None and last:
            merged = merged.to_local() if hasattr(merged, "to_local") else merged
            log.append({"buffer": "merged output", "bytes": merged.untyped_storage().nbytes(), "allocated": now[0],
                        "freed": now[0]})
        del merged
        opt.step()
    log.append({"buffer": "decoder layers recomputed", "bytes": reruns[0], "allocated": "", "freed": ""})
    return log


def mesh_of(stages, fsdp, tp):
    return f"pp:{stages}" + (f"xfsdp:{fsdp}" if fsdp > 1 else "") + (f"xtp:{tp}" if tp > 1 else "")


def ours(exe, stages, fsdp, tp, schedule, microbatches, return_outputs, checkpointed, mixed, virtual, rank, tmp, stack):
    out = Path(tmp) / f"pp{stages}x{fsdp}x{tp}-{schedule}-{microbatches}-{checkpointed}-{mixed}-{virtual}-{rank}.json"
    options = f"schedule={schedule},microbatches={microbatches},stage={rank},return_outputs={str(return_outputs).lower()}"
    if virtual > 2:
        # torchtitan's pipeline_parallel_layers_per_stage: ceil((L + 2) / N) stages in all.
        layers = layers_of(stages, virtual)
        per_stage = -(-(layers + 2) // (stages * virtual))
        assert -(-(layers + 2) // per_stage) == stages * virtual
        options += f",layers_per_stage={per_stage}"
    if mixed:
        options += ",param_dtype=bf16,reduce_dtype=f32"
    config = Path(tmp) / "llama-4layer.json"
    config.write_text(json.dumps({**json.loads(CONFIG.read_text()), "num_hidden_layers": layers_of(stages, virtual)}))
    run = subprocess.run([exe, "trace", "--hf-config", str(config), "--batch", str(batch_of(microbatches)), "--seq", str(SEQ), "--attn", "sdpa",
                    "--dtype", "f32" if mixed else "bf16", "--device", "sim:h100-80g", "--steps", str(STEPS),
                    "--stack", stack, "--parallel", mesh_of(stages, fsdp, tp), "--parallel-options", options,
                    "--buffers", str(out),
                    *(["--gradient-checkpointing", "non-reentrant"] if checkpointed else [])],
                   check=True, capture_output=True, text=True)
    log = [{k: r[k] for k in ("buffer", "bytes", "allocated", "freed")} for r in json.loads(out.read_text())]
    # The timeline's reruns of decoder layers ("pre-recompute  model.layers.N (...)").
    reruns = len(re.findall(r"^pre-recompute +model\.layers\.\d+ ", run.stdout, re.MULTILINE))
    return log + [{"buffer": "decoder layers recomputed", "bytes": reruns, "allocated": "", "freed": ""}]


def comparable(log):
    """The pipeline's buffers, then FSDP's (tensor parallel's are check_tensor_parallel.py's), each
    in the order they were made in; those alive when the run ends ("" freed) are the last step's
    output chunks and sharded gradients in both."""
    def row(r):
        return (r["buffer"], r["bytes"], r["allocated"], r["freed"] or "")
    pipeline = [row(r) for r in log if re.search(r"\((stage \d+, )?micro-batch \d+\)$", r["buffer"])
                or r["buffer"] in ("merged output", "decoder layers recomputed")]
    group = re.compile(r"^(root|model\.layers\.\d+) (" + "|".join(map(re.escape, FSDP_KINDS)) + ")$")
    return pipeline + [row(r) for r in log if group.match(r["buffer"])]


def main() -> int:
    if len(sys.argv) == 12 and sys.argv[1] == "--rank":
        stages, fsdp, tp, schedule, mbs = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5], int(sys.argv[6])
        flags = [a == "True" for a in sys.argv[7:10]]
        print(json.dumps(torch_side(stages, fsdp, tp, schedule, mbs, *flags, int(sys.argv[11]), int(sys.argv[10]))))
        return 0
    reexec_on_stack("check_pipeline_parallel")
    import torch
    exe = sys.argv[1]
    runs = RUNS if "--all" in sys.argv[2:] else RUNS[:10]
    # FSDP2 in a stage is modelled as torch 2.15's PipelineStage finalizes it: the stack checked.
    stack = f"torch={'.'.join(torch.__version__.split('+')[0].split('.')[:2])},transformers=5.24"
    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        for stages, fsdp, tp, schedule, mbs, ret, ckpt, mixed, virtual in runs:
            for rank in range(stages):
                label = (f"{mesh_of(stages, fsdp, tp)} {schedule}{f' V={virtual}' if virtual > 1 else ''} M={mbs}"
                         f"{'' if ret else ' return_outputs=False'}{' checkpointed' if ckpt else ''}"
                         f"{' param_dtype=bf16' if mixed else ''} stage {rank}")
                run = subprocess.run([sys.executable, __file__, "--rank", str(stages), str(fsdp), str(tp), schedule,
                                      str(mbs), str(ret), str(ckpt), str(mixed), str(virtual), str(rank)], capture_output=True,
                                     text=True, timeout=600)
                if run.returncode != 0:
                    failures.append(f"{label}: PyTorch's run failed: {run.stderr.strip().splitlines()[-1:]}")
                    continue
                theirs = comparable(json.loads(run.stdout.strip().splitlines()[-1]))
                mine = comparable(ours(exe, stages, fsdp, tp, schedule, mbs, ret, ckpt, mixed, virtual, rank, tmp, stack))
                same = theirs == mine
                print(f"  {label}: {len(theirs)} buffers in PyTorch, {len(mine)} in vramscope: "
                      f"{'equal, in order, made and dropped in the same actions' if same else 'DIFFER'}")
                if not same:
                    for i, (a, b) in enumerate(zip(theirs + [None] * len(mine), mine + [None] * len(theirs))):
                        if a != b:
                            print(f"    first difference at {i}: PyTorch {a}, vramscope {b}")
                            break
                    failures.append(label)
    print(f"check_pipeline_parallel: torch {torch.__version__}: "
          f"{'every buffer equal' if not failures else 'differ: ' + ', '.join(failures)}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
