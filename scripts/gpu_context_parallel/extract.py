#!/usr/bin/env python3
"""extract.py DIR OUT.json: the ring-attention part of cp_probe.py's traces (run.sh's op_*.json
in DIR) as signed request sizes (+ alloc, - free), forward and backward, for the C++ test
tests/runtime/context_parallel_test.cpp. The probe's own tensors (the loss and its seed
gradient) are left out; the saved tensors freed after the backward stay in."""
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


if __name__ == "__main__":
    main(*sys.argv[1:])
