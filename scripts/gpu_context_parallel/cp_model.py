#!/usr/bin/env python
"""cp_model.py W RANK OUT.json [--seq S] [--kv-heads K] [--layers L]: one rank of a transformers
Llama under context parallel as torchtitan applies it (FSDP2 over the cp mesh, every decoder
layer and the root; context_parallel() over input_ids and labels, sequence dim 1, neither
restored), on the fake process group with one CUDA GPU. Two AdamW steps; the CUDA caching
allocator's trace of both, with phase markers."""
import argparse
import json
import os
import sys
import traceback

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cp_probe import dump_trace, import_cp, import_fake_store, make_mesh, rec_start, rec_stop, trace_len  # noqa: E402


def apply_tensor_parallel(model, mesh):
    """torchtitan's Llama plan as tests/models/check_tensor_parallel.py applies it (its layer_plan),
    lm_head's output left sharded on the vocabulary for loss_parallel."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests", "models"))
    from check_tensor_parallel import layer_plan
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module
    parallelize_module(model.model, mesh, {
        "embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel()})
    parallelize_module(model, mesh, {"lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1),
                                                                 use_local_output=False)})
    for layer in model.model.layers:
        parallelize_module(layer, mesh, layer_plan())


def loss_parallel_if(on):
    import contextlib
    from torch.distributed.tensor.parallel import loss_parallel
    return loss_parallel() if on else contextlib.nullcontext()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("world_size", type=int)
    p.add_argument("rank", type=int)
    p.add_argument("out")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--rotate", default="allgather")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--config", help="a transformers config.json to build instead of the tiny Llama")
    p.add_argument("--checkpointing", action="store_true", help="gradient_checkpointing_enable(use_reentrant=False)")
    p.add_argument("--no-trace", action="store_true", help="figures only (a large model's trace is long)")
    p.add_argument("--tp", type=int, default=1,
                   help="tensor parallel inside (torchtitan's plan, loss_parallel), on a (cp, tp) mesh; RANK is global")
    a = p.parse_args()
    from torch.distributed.fsdp import fully_shard
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM

    A, context_parallel = import_cp()
    torch.cuda.set_device(0)
    dist.init_process_group("fake", store=import_fake_store()(), rank=a.rank, world_size=a.world_size * a.tp)
    if a.tp > 1:
        from torch.distributed.device_mesh import init_device_mesh
        mesh2d = init_device_mesh("cuda", (a.world_size, a.tp), mesh_dim_names=("cp", "tp"))
        mesh, tp_mesh = mesh2d["cp"], mesh2d["tp"]
    else:
        mesh = make_mesh("cuda", a.world_size)
    if hasattr(A, "set_rotate_method"):
        A.set_rotate_method(a.rotate)
    res = {"torch": torch.__version__, "transformers": transformers.__version__, "world_size": a.world_size,
           "rank": a.rank, "args": vars(a), "cp_options": repr(A._cp_options), "phases": {}, "mem": {}}
    if a.config:
        cfg = LlamaConfig.from_json_file(a.config)
    else:
        cfg = LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=a.layers, num_attention_heads=4,
                          num_key_value_heads=a.kv_heads, head_dim=64, vocab_size=1000, max_position_embeddings=a.seq,
                          tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    res["config"] = cfg.to_dict()
    try:
        with torch.device("meta"):
            model = LlamaForCausalLM(cfg).to(torch.bfloat16)
        if a.checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if a.tp > 1:
            apply_tensor_parallel(model, tp_mesh)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        model.to_empty(device="cuda")
        with torch.no_grad():
            for prm in model.parameters():
                prm.normal_(0, 0.02)
            for name, buf in model.named_buffers():
                if "inv_freq" in name:
                    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
                    buf.copy_(1.0 / 10000.0 ** (torch.arange(0, d, 2, device="cuda", dtype=torch.float32) / d))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        if not a.no_trace:
            rec_start(400000)

        def phase(name):
            res["phases"][name] = 0 if a.no_trace else trace_len(0)
            torch.cuda.synchronize()
            res["mem"][name] = {"allocated": torch.cuda.memory_allocated(),
                                "max_allocated": torch.cuda.max_memory_allocated(),
                                "reserved": torch.cuda.memory_reserved()}

        phase("start")
        for step in range(a.steps):
            ids = torch.randint(0, cfg.vocab_size, (a.batch, a.seq), device="cuda")
            labels = ids.clone()
            phase(f"step{step}_batch")
            with context_parallel(mesh, buffers=[ids, labels], buffer_seq_dims=[1, 1],
                                  no_restore_buffers={ids, labels}):
                phase(f"step{step}_sharded")
                with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                                  SDPBackend.CUDNN_ATTENTION]), loss_parallel_if(a.tp > 1):
                    # Under sequence parallel the caller passes the positions (transformers would
                    # take them from the tensor-parallel shard); in order, so no packed-sequence mask.
                    kw = {"position_ids": torch.arange(ids.shape[1], device="cuda")[None]} if a.tp > 1 else {}
                    loss = model(input_ids=ids, labels=labels, **kw).loss
                    phase(f"step{step}_forward")
                    loss.backward()
                phase(f"step{step}_backward")
                del loss
            phase(f"step{step}_exited")
            opt.step()
            phase(f"step{step}_optimizer")
            opt.zero_grad(set_to_none=True)
            del ids, labels
            phase(f"step{step}_end")
        if not a.no_trace:
            res["trace"] = dump_trace(0)
            rec_stop()
    except Exception as e:
        res["error"] = f"{type(e).__name__}: {e}"
        res["traceback"] = traceback.format_exc()
        try:
            res["trace"] = dump_trace(0)
        except Exception:
            pass
    with open(a.out, "w") as f:
        json.dump(res, f)
    print(f"[model W={a.world_size} r={a.rank} kv={a.kv_heads}] err={res.get('error')} mem={res['mem'].get('step1_backward')}",
          file=sys.stderr)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
