#!/usr/bin/env python3
"""check_expert_parallel.py VRAMSCOPE: expert parallel under transformers' DistributedConfig against
`vramscope trace --parallel ep:N` on the exporter's recording of one rank, on the CPU.

PyTorch runs rank 0 of N (2 and 4) on its fake process group with simulate_uniform_ranks (every
rank sends what this one does): a two-layer Qwen3-MoE of odd sizes whose 8 experts
transformers shards over the N ranks (apply_expert_parallelism with DistributedConfig(ep_size=N):
AllToAllEP, grouped_mm experts), the router made deterministic and even (each experts module's
top-k indices replaced by an assignment that gives every expert, and so every rank, the same
rows), the assumption the recording makes; eager attention (the CPU's SDPA kernels keep other
logsumexp rows than CUDA's, which the recording models). The file is `python3 -m vramscope.export --hf-config
... --expert-parallel N`. Compared:

- what the forward saves for backward, module by module (parameters left out by storage: a
  DTensor parameter's storage is its local shard's), with the rows received as the even routing
  gives them and twice as many (the count exchange's result doubled: `--model-options
  expert_skew=2`);
- every buffer the all-to-alls make, forward and backward, in order, at both: the CPU profiler's
  allocations inside _c10d_functional::all_to_all_single against vramscope's --buffers rows of
  the recording's collectives;
- FSDP2 as transformers applies it (apply_fully_sharded_data_parallelism: the experts over the
  efsdp mesh, each layer, the embedding, fully_shard([norm, lm_head]) kept gathered, the root):
  one step of DistributedConfig(fsdp_size=M, ep_size=N) on the CPU, M = 2N and N, every
  all-gather's output, group by group in order (backward prefetching included; the experts'
  groups of one rank gather nothing), against vramscope's under fsdp:M with ep_size=N, which
  shards as the file's recorded fully_shard calls say;
- the experts' FSDP2 shards over efsdp = M / N ranks: transformers' apply_fully_sharded_data_
  parallelism on the meta device with DistributedConfig(fsdp_size=M, ep_size=N), each experts
  module's padded shard bytes, against vramscope's "<experts> shards" rows under fsdp:M with
  ep_size=N (M = 2N, and M = N: each expert whole on one rank).

Each world size runs in a process of its own (`--side N` prints PyTorch's side as JSON).
Exit 77 (skipped) without torch and transformers, unless VRAMSCOPE_REQUIRE_STACK=1 (CI).
"""
import json
import os
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

from stack_python import reexec_on_stack

ROOT = Path(__file__).resolve().parents[2]
CONFIG = {"model_type": "qwen3_moe", "vocab_size": 160, "hidden_size": 72, "intermediate_size": 136,
          "moe_intermediate_size": 40, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "head_dim": 18, "num_experts": 8, "num_experts_per_tok": 2, "max_position_embeddings": 512,
          "pad_token_id": 0}
BATCH, SEQ = 2, 24
RANKS = (2, 4)
# transformers' other mixtures of experts with an expert-parallel plan (check_ops.py's tiny
# configs): what they save and their all-to-alls' buffers at ep:2. phimoe is left out: its
# router's max indices die inside the router in vramscope a few operators earlier than PyTorch
# counts them (1 KiB per router, OPERATORS.md), a counting difference outside expert parallel.
_SMALL = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512, "max_position_embeddings": 512,
          "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "num_experts_per_tok": 2}
FAMILIES = {
    "mixtral": {**_SMALL, "model_type": "mixtral", "num_local_experts": 4},
    "qwen2_moe": {**_SMALL, "model_type": "qwen2_moe", "moe_intermediate_size": 32,
                  "shared_expert_intermediate_size": 64, "num_experts": 8},
    "olmoe": {**_SMALL, "model_type": "olmoe", "num_experts": 8},
    "granitemoe": {**_SMALL, "model_type": "granitemoe", "num_local_experts": 4},
    "gpt_oss": {**_SMALL, "model_type": "gpt_oss", "num_local_experts": 4,
                "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 128},
    # as many key-value heads as heads: transformers' eager MLA attention takes no fewer
    "deepseek_v3": {**_SMALL, "model_type": "deepseek_v3", "num_key_value_heads": 4, "head_dim": 8,
                    "moe_intermediate_size": 32, "n_routed_experts": 8, "n_group": 2, "topk_group": 1,
                    "kv_lora_rank": 16, "q_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8,
                    "v_head_dim": 16, "first_k_dense_replace": 1},
}


def build(torch, transformers, device, dtype):
    config = transformers.AutoConfig.for_model(**CONFIG)
    with warnings.catch_warnings(), torch.device(device):
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    return model.to(dtype).train()


def process_group(world: int) -> None:
    """Rank 0 of a fake process group of `world` ranks, each sending what this one does
    (transformers' mesh takes the whole world: one group per size)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeProcessGroup, FakeStore
    if dist.is_initialized():
        dist.destroy_process_group()
    os.environ.update(WORLD_SIZE=str(world), RANK="0", LOCAL_RANK="0")
    options = FakeProcessGroup.Options()
    options.simulate_uniform_ranks = True
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world, pg_options=options)


def even_routing(torch):
    """A forward pre-hook for CONFIG's experts modules: pair j of the [tokens, top_k] choices goes
    to expert j % E, so every expert gets tokens x top_k / E rows, a token's choices distinct."""
    top_k = CONFIG["num_experts_per_tok"]
    experts = next(CONFIG[k] for k in ("num_experts", "num_local_experts", "n_routed_experts") if k in CONFIG)

    def even(module, args):
        tokens = args[1].shape[0]
        return (args[0], (torch.arange(tokens * top_k) % experts).view(tokens, top_k)) + tuple(args[2:])

    return even


def torch_side(ranks: int) -> dict:
    import torch
    import transformers
    from transformers.distributed import DistributedConfig
    sys.path.insert(0, str(Path(__file__).parent))
    even = even_routing(torch)

    # The experts' FSDP2 shards: the whole DistributedConfig, on the meta device, at fsdp 2N and N.
    shards = {}
    for fsdp in (2 * ranks, ranks):
        process_group(fsdp)
        meta = build(torch, transformers, "meta", torch.bfloat16)
        config, _, meshes = meta.prepare_distribute_model(DistributedConfig(fsdp_size=fsdp, ep_size=ranks))
        meta = meta.maybe_distribute_model(meta, config, meshes)
        shards[fsdp] = {}
        for name, m in meta.named_modules():
            if getattr(m, "_is_expert_parallel", False):
                group = m._get_fsdp_state()._fsdp_param_group
                shards[fsdp][name] = sum(p._sharded_param_data.numel() * p._sharded_param_data.element_size()
                                         for p in group.fsdp_params)

    # One step of the whole DistributedConfig(fsdp_size=M, ep_size=N), M = 2N and N, in f32 on
    # the CPU: each FSDP2 group's all-gather outputs, in order (what vramscope's --buffers names
    # them; a group of one rank gathers nothing).
    import torch.distributed.fsdp._fully_shard._fsdp_collectives as collectives
    import torch.distributed.fsdp._fully_shard._fsdp_param_group as param_group
    original_gather = collectives.foreach_all_gather
    gathers = {}
    for fsdp in (2 * ranks, ranks):
        process_group(fsdp)
        torch.manual_seed(0)
        model = build(torch, transformers, "cpu", torch.float32)
        config, _, meshes = model.prepare_distribute_model(DistributedConfig(fsdp_size=fsdp, ep_size=ranks))
        model = model.maybe_distribute_model(model, config, meshes)
        names, logged, stage = {}, [], ["step 1 forward"]
        for name, m in model.named_modules():
            state = m._get_fsdp_state() if hasattr(m, "_get_fsdp_state") else None
            group = getattr(state, "_fsdp_param_group", None) if state is not None else None
            if group is not None and id(group.fsdp_params[0]) not in names:
                members = [n for n, x in model.named_modules() if x in getattr(state, "_modules", (m,))]
                names[id(group.fsdp_params[0])] = "+".join(members) if name else "root"

        def gather(fsdp_params, group, *args, names=names, logged=logged, stage=stage, **kwargs):
            result = original_gather(fsdp_params, group, *args, **kwargs)
            output = result.all_gather_output
            logged.append([stage[0], names[id(fsdp_params[0])], output.numel() * output.element_size()])
            return result

        collectives.foreach_all_gather = param_group.foreach_all_gather = gather
        try:
            for m in model.modules():
                if getattr(m, "_is_expert_parallel", False):
                    m.register_forward_pre_hook(even)
            ids = torch.randint(3, CONFIG["vocab_size"], (BATCH, SEQ))
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            stage[0] = "step 1 backward"
            loss.backward()
        finally:
            collectives.foreach_all_gather = param_group.foreach_all_gather = original_gather
        gathers[str(fsdp)] = logged
    process_group(ranks)

    # One step of expert parallel alone (FSDP2 is vramscope's part), in f32 on the CPU, with the
    # rows received as the even routing gives them, and twice as many: the count exchange's
    # result doubled (a router that sends this GPU's experts twice their share).
    import transformers.distributed.expert_parallel as expert_parallel
    exchange = expert_parallel.all_to_all_single
    steps = {}
    for skew in (1, 2):
        def skewed(output, input, group=None, skew=skew):
            work = exchange(output, input, group=group)
            output.mul_(skew)
            return work

        expert_parallel.all_to_all_single = skewed
        try:
            steps[str(skew)] = ep_step(torch, transformers, ranks, even)
        finally:
            expert_parallel.all_to_all_single = exchange
    return {"steps": steps, "shards": {str(k): v for k, v in shards.items()}, "gathers": gathers}


def ep_step(torch, transformers, ranks, even) -> dict:
    """One step of apply_expert_parallelism's model on the CPU: what its forward saves, module by
    module, and each all-to-all's buffer, forward and backward."""
    from torch.distributed.tensor import DTensor
    from torch.profiler import ProfilerActivity, profile
    from transformers.distributed import DistributedConfig
    from transformers.distributed.expert_parallel import apply_expert_parallelism
    from saved_bytes import torch_saved_per_module
    torch.manual_seed(0)
    model = build(torch, transformers, "cpu", torch.float32)
    config, _, meshes = model.prepare_distribute_model(DistributedConfig(fsdp_size=ranks, ep_size=ranks))
    _, plan, _ = model._resolve_parallel_plans(config)
    model = apply_expert_parallelism(model, meshes.get_mesh("ep"), meshes.get_mesh("tp"), plan)

    for m in model.modules():
        if getattr(m, "_is_expert_parallel", False):
            m.register_forward_pre_hook(even)
    plain = model.parameters
    model.parameters = lambda *a, **k: (p._local_tensor if isinstance(p, DTensor) else p for p in plain(*a, **k))
    ids = torch.randint(3, CONFIG["vocab_size"], (BATCH, SEQ))
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with torch_saved_per_module(model) as saved:
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
    saved[""] = saved.get("", 0) + 4  # nll_loss's total_weight, a device tensor on CUDA (as check_moe_routing)
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text())["traceEvents"]
    ops = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "user_annotation")]
    backward_start = min(o["ts"] for o in ops if o["name"].startswith("autograd::engine::evaluate_function"))

    def inside_all_to_all(ts, tid):
        return any(o["ts"] <= ts <= o["ts"] + o["dur"] and o["tid"] == tid and
                   o["name"] == "_c10d_functional::all_to_all_single" for o in ops)

    buffers = []
    for e in sorted((e for e in events if e.get("name") == "[memory]"), key=lambda e: e["ts"]):
        if e["args"]["Bytes"] > 0 and inside_all_to_all(e["ts"], e["tid"]):
            buffers.append(["backward" if e["ts"] >= backward_start else "forward", e["args"]["Bytes"]])
    return {"saved": saved, "modules": [n for n, _ in model.named_modules()], "buffers": buffers}


def export(ranks: int, tmp: Path) -> Path:
    config = tmp / "qwen3_moe.json"
    config.write_text(json.dumps(CONFIG))
    out = tmp / f"qwen3_moe-ep{ranks}.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT / "python"))
    subprocess.run([sys.executable, "-m", "vramscope.export", "--hf-config", str(config), "--expert-parallel",
                    str(ranks), "--batch", str(BATCH), "--seq", str(SEQ), "--attn", "eager", "-o", str(out)],
                   check=True, capture_output=True, text=True, env=env)
    return out


def ours(exe: str, model: Path, mesh: str, options: str, tmp: Path, dtype: str, model_options: str = "") -> tuple:
    saved, buffers = tmp / f"{mesh}-{options}-{model_options}.csv", tmp / f"{mesh}-{options}-{model_options}.json"
    command = [exe, "trace", "--model-file", str(model), "--batch", str(BATCH), "--dtype", dtype, "--steps", "1",
               "--device", "sim:capacity=1TiB,context=0", "--parallel", mesh, "--saved", str(saved),
               "--buffers", str(buffers)]
    if model_options:
        command += ["--model-options", model_options]
    if options:
        command += ["--parallel-options", options]
    subprocess.run(command, check=True, capture_output=True, text=True)
    rows = json.loads(buffers.read_text())
    return saved, rows


def family_side(name: str) -> dict:
    """One step of ep:2 on another family, as torch_side's, even routing."""
    global CONFIG
    import torch
    import transformers
    sys.path.insert(0, str(Path(__file__).parent))
    CONFIG = FAMILIES[name]
    process_group(2)
    return ep_step(torch, transformers, 2, even_routing(torch))


def main() -> int:
    global CONFIG
    if len(sys.argv) == 3 and sys.argv[1] == "--side":
        print(json.dumps(torch_side(int(sys.argv[2]))))
        return 0
    if len(sys.argv) == 3 and sys.argv[1] == "--family":
        print(json.dumps(family_side(sys.argv[2])))
        return 0
    reexec_on_stack("check_expert_parallel")
    import torch
    sys.path.insert(0, str(Path(__file__).parent))
    from saved_bytes import vramscope_saved_per_module
    exe = sys.argv[1]
    failures = []
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        for ranks in RANKS:
            run = subprocess.run([sys.executable, __file__, "--side", str(ranks)], capture_output=True, text=True,
                                 timeout=600)
            if run.returncode != 0:
                failures.append(f"ep:{ranks}: PyTorch's run failed: {run.stderr.strip().splitlines()[-1:]}")
                continue
            theirs = json.loads(run.stdout.strip().splitlines()[-1])
            model = export(ranks, tmp)
            for skew, step in theirs["steps"].items():
                run_name = f"ep:{ranks}" + (f" expert_skew={skew}" if skew != "1" else "")
                saved_csv, rows = ours(exe, model, f"ep:{ranks}", "", tmp, "f32", f"expert_skew={skew}")
                mine = vramscope_saved_per_module(saved_csv, set(step["modules"]))
                differ = [k for k in sorted(set(step["saved"]) | set(mine)) if step["saved"].get(k, 0) != mine.get(k, 0)]
                print(f"  {run_name}: saved {sum(step['saved'].values()):,} B in PyTorch, {sum(mine.values()):,} B in "
                      f"vramscope: {'equal module by module' if not differ else 'DIFFER in ' + ', '.join(differ[:5])}")
                if differ:
                    failures.append(f"{run_name} saved bytes")
                buffers = [["backward" if r["allocated"].endswith("backward") else "forward", r["bytes"]]
                           for r in rows if r["buffer"].startswith("_c10d_functional.all_to_all_single")]
                same = buffers == step["buffers"]
                print(f"  {run_name}: {len(step['buffers'])} all-to-all buffers in PyTorch, {len(buffers)} in "
                      f"vramscope: {'equal, in order' if same else 'DIFFER'}")
                if not same:
                    print(f"    PyTorch {step['buffers']}\n    vramscope {buffers}")
                    failures.append(f"{run_name} all-to-all buffers")
            for fsdp, expected in theirs["gathers"].items():
                _, rows = ours(exe, model, f"fsdp:{fsdp}", f"ep_size={ranks}", tmp, "f32")
                gathers = [[r["allocated"], r["buffer"][:-len(" all-gather output")], r["bytes"]] for r in rows
                           if r["buffer"].endswith(" all-gather output")]
                same = gathers == expected
                print(f"  fsdp:{fsdp} ep_size={ranks}: {len(expected)} FSDP2 all-gathers in transformers' engine, "
                      f"{len(gathers)} in vramscope: {'equal, group by group in order' if same else 'DIFFER'}")
                if not same:
                    for i, (x, y) in enumerate(zip(expected + [None] * len(gathers), gathers + [None] * 99)):
                        if x != y:
                            print(f"    first difference at {i}: PyTorch {x}, vramscope {y}")
                            break
                    failures.append(f"fsdp:{fsdp} ep_size={ranks} all-gathers")
            # The command records an --hf-config itself when --parallel says ep: the same run.
            config = tmp / "qwen3_moe.json"
            direct = tmp / f"direct-{ranks}.json"
            subprocess.run([exe, "trace", "--hf-config", str(config), "--attn", "eager", "--batch", str(BATCH), "--seq",
                            str(SEQ), "--dtype", "f32", "--steps", "1", "--device", "sim:capacity=1TiB,context=0",
                            "--parallel", f"ep:{ranks}", "--buffers", str(direct)], check=True, capture_output=True,
                           text=True, env=dict(os.environ, VRAMSCOPE_PYTHON=sys.executable))
            _, from_file = ours(exe, model, f"ep:{ranks}", "", tmp, "f32")
            same = json.loads(direct.read_text()) == from_file
            print(f"  ep:{ranks}: `trace --hf-config` records it as the exporter does: {'same buffers' if same else 'DIFFER'}")
            if not same:
                failures.append(f"ep:{ranks} --hf-config")
            for fsdp, expected in theirs["shards"].items():
                _, rows = ours(exe, model, f"fsdp:{fsdp}", f"ep_size={ranks}", tmp, "bf16")
                got = {r["buffer"][:-len(" shards")]: r["bytes"] for r in rows
                       if r["buffer"].endswith(" shards") and r["buffer"][:-len(" shards")] in expected}
                same = got == expected
                print(f"  fsdp:{fsdp} ep_size={ranks}: the experts' shards {sorted(set(expected.values()))} B in "
                      f"PyTorch, {sorted(set(got.values()))} B in vramscope: {'equal' if same else 'DIFFER'}")
                if not same:
                    failures.append(f"fsdp:{fsdp} ep_size={ranks} experts' shards")
        qwen3_moe = CONFIG
        for name, config in FAMILIES.items():
            run = subprocess.run([sys.executable, __file__, "--family", name], capture_output=True, text=True,
                                 timeout=600)
            if run.returncode != 0:
                failures.append(f"{name}: PyTorch's run failed: {run.stderr.strip().splitlines()[-1:]}")
                continue
            step = json.loads(run.stdout.strip().splitlines()[-1])
            CONFIG = config
            family = tmp / name
            family.mkdir()
            saved_csv, rows = ours(exe, export(2, family), "ep:2", "", family, "f32")
            mine = vramscope_saved_per_module(saved_csv, set(step["modules"]))
            differ = [k for k in sorted(set(step["saved"]) | set(mine)) if step["saved"].get(k, 0) != mine.get(k, 0)]
            buffers = [["backward" if r["allocated"].endswith("backward") else "forward", r["bytes"]]
                       for r in rows if r["buffer"].startswith("_c10d_functional.all_to_all_single")]
            same = buffers == step["buffers"] and not differ
            print(f"  {name} ep:2: saved {sum(step['saved'].values()):,} B in PyTorch, {sum(mine.values()):,} B in "
                  f"vramscope, {len(step['buffers'])} all-to-all buffers: {'equal' if same else 'DIFFER'}"
                  + (f" in {', '.join(differ[:5])}" if differ else ""))
            if not same:
                failures.append(f"{name} ep:2")
        CONFIG = qwen3_moe
        # plan --parallel auto records the config again for each expert-parallel size it tries.
        run = subprocess.run([exe, "plan", "--hf-config", str(tmp / "qwen3_moe.json"), "--attn", "eager", "--parallel",
                              "auto", "--gpus", "4", "--batch", "8", "--seq", str(SEQ), "--dtype", "bf16", "--device",
                              "sim:h100-80g", "--format", "json"], capture_output=True, text=True,
                             env=dict(os.environ, VRAMSCOPE_PYTHON=sys.executable))
        layouts = {l["parallel"]: l for l in json.loads(run.stdout)["layouts"]} if run.returncode == 0 else {}
        ran = [name for name in ("ep:4", "fsdp:4 ep_size=2") if layouts.get(name, {}).get("fits")]
        print(f"  plan --parallel auto --gpus 4: expert-parallel layouts run: {', '.join(ran) or 'none'}")
        if len(ran) != 2:
            failures.append("plan --parallel auto's expert-parallel layouts" + (f": {run.stderr.strip()}" if run.stderr else ""))
    print(f"check_expert_parallel: torch {torch.__version__}: "
          f"{'every figure equal' if not failures else 'differ: ' + ', '.join(failures)}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
