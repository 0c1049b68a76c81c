"""gpu_compile_memory.py: on a CUDA GPU, three training steps of an MLP compiled by torch.compile,
the default mode and mode="reduce-overhead" (CUDA graphs), each in a fresh process: max allocated
and reserved, what is allocated and reserved after the last step, and the bytes of the segments in
private pools (the CUDA graphs' pool, by the snapshot's segment_pool_id). Writes
$OUT/cudagraphs.json. The same model through vramscope (docs/VALIDATION.md):

    python3 -m vramscope.export scripts/gpu_compile_memory.py:make --input 4096,1024 --compile -o mlp.json
    vramscope sweep --model-file mlp.json --dtype bf16 --segments 0 --device sim:h200 --steps 3 \
        --compile on,reduce-overhead
"""
import json, os, subprocess, sys
import torch
from torch import nn
import torch.nn.functional as F

BATCH, IN, HID, OUT = 4096, 1024, 4096, 1000


def make():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(IN, HID), nn.GELU(), nn.LayerNorm(HID), nn.Linear(HID, OUT))


def run(mode):
    torch.cuda.init()
    model = make().to("cuda", torch.bfloat16)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    kw = {} if mode == "default" else {"mode": mode}
    step = torch.compile(lambda x, y: F.cross_entropy(model(x), y), **kw)
    torch.cuda.reset_peak_memory_stats()
    for i in range(3):
        opt.zero_grad(set_to_none=True)
        x = torch.randn(BATCH, IN, device="cuda", dtype=torch.bfloat16)
        y = torch.randint(0, OUT, (BATCH,), device="cuda")
        loss = step(x, y)
        loss.backward()
        opt.step()
        del loss, x, y
    torch.cuda.synchronize()
    segs = torch.cuda.memory_snapshot()
    pool = sum(s["total_size"] for s in segs if tuple(s.get("segment_pool_id", (0, 0))) != (0, 0))
    free, total = torch.cuda.mem_get_info()
    return {"mode": mode, "torch": torch.__version__, "max_allocated": torch.cuda.max_memory_allocated(),
            "max_reserved": torch.cuda.max_memory_reserved(), "reserved_end": torch.cuda.memory_reserved(),
            "allocated_end": torch.cuda.memory_allocated(), "pool_reserved": pool,
            "device_used": total - free, "gpu": torch.cuda.get_device_name()}


if __name__ == "__main__":
    if len(sys.argv) > 1:
        print(json.dumps(run(sys.argv[1])))
    else:
        out = []
        for mode in ("default", "reduce-overhead"):
            r = subprocess.run([sys.executable, __file__, mode], capture_output=True, text=True, timeout=280)
            out.append(json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 else {"mode": mode, "error": r.stderr[-2000:]})
        path = os.path.join(os.environ.get("OUT", "."), "cudagraphs.json")
        open(path, "w").write(json.dumps(out, indent=1))
        print(json.dumps(out, indent=1))
