#!/usr/bin/env python3
"""extract.py DIR OUT_DIR: ring_attention.json, the ring-attention part of cp_probe.py's traces (run.sh's op_*.json
in DIR) as signed request sizes (+ alloc, - free), forward and backward, for the C++ test
tests/runtime/context_parallel_test.cpp. The probe's own tensors (the loss and its seed
gradient) are left out; the saved tensors freed after the backward stay in. model_steps.json: cp_model.py's
runs as figures. DIR holds run.sh's files from both runs (the op traces came from the second)."""
import glob, json, os, sys


def signed(config, begin, end):
    out = []
    for e in config["trace"][config["phases"][begin]:config["phases"][end]]:
        if e["action"] not in ("alloc", "free_requested"):
            continue
        if e["cp"] is None and e["user"] is not None:
            continue  # out.sum() and its gradient seed
        out.append(e["size"] if e["action"] == "alloc" else -e["size"])
    return out


def main(src, dst):
    configs = []
    for path in sorted(glob.glob(os.path.join(src, "op_*.json"))):
        run = json.load(open(path))
        for c in run["configs"]:
            if c.get("error"):
                continue
            configs.append({"world": run["world_size"], "rank": run["rank"], "backend": run.get("backend", "flash"),
                            "kv_heads": run.get("kv_heads", run["global_shape"][1]), "rotate": c["rotate"],
                            "load_balance": c["lb_effective"], "forward": signed(c, "sharded", "after_fwd"),
                            "backward": signed(c, "after_fwd", "after_bwd")})
    json.dump({"torch": run["torch"], "gpu": run["device_name"], "global_shape": run["global_shape"],
               "dtype": "bf16", "is_causal": True, "configs": configs}, open(dst, "w"), indent=0)
    print(len(configs), "configs")




def models(src, dst):
    """cp_model.py's runs as figures: per run the model's config, the ring's size ("world"), the
    tensor-parallel size inside, the global rank (its place in the ring: rank // tp) and PyTorch's
    max_memory_allocated, memory_allocated after the last optimizer step, memory_reserved."""
    runs = []
    for path in sorted(glob.glob(os.path.join(src, "model_*.json")) + glob.glob(os.path.join(src, "llama8b_*.json")) +
                       glob.glob(os.path.join(src, "tp_*.json"))):
        run = json.load(open(path))
        if run.get("error"):
            continue
        mem = run["mem"]
        last = run["args"]["steps"] - 1
        figures = {"world": run["world_size"], "tp": run["args"].get("tp", 1), "rank": run["rank"],
                   "batch": run["args"]["batch"],
                   "seq": run["args"]["seq"], "steps": run["args"]["steps"],
                   "checkpointing": "non-reentrant" if run["args"].get("checkpointing") else "none",
                   "max_allocated": mem[f"step{last}_backward"]["max_allocated"],
                   "allocated_after_optimizer": mem[f"step{last}_optimizer"]["allocated"],
                   "reserved": mem[f"step{last}_end"]["reserved"]}
        if run["args"].get("config"):  # a zoo model's config.json (run_8b.sh)
            runs.append({"zoo": os.path.basename(run["args"]["config"])[:-len(".json")], **figures})
            continue
        keys = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings", "tie_word_embeddings",
                "rms_norm_eps")
        run_config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                      **{k: run["config"][k] for k in keys}}
        runs.append({"config": run_config, **figures})
    json.dump({"torch": run["torch"], "transformers": run["transformers"], "dtype": "bf16", "runs": runs}, open(dst, "w"), indent=1)
    print(len(runs), "model runs")


if __name__ == "__main__":
    main(sys.argv[1], os.path.join(sys.argv[2], "ring_attention.json"))
    models(sys.argv[1], os.path.join(sys.argv[2], "model_steps.json"))
