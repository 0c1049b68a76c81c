#!/usr/bin/env python3
"""check_export.py VRAMSCOPE: the exporter (python3 -m vramscope.export) against PyTorch.

1. Round trip. Each model is exported through the command, then the bytes its modules save
   for backward are measured twice: on PyTorch (CPU) with torch.autograd.graph.saved_tensors_hooks
   during one forward, and on vramscope with `trace --saved` on the exported file. Both count
   each storage once, under the innermost module running when it is first saved, parameters
   and buffers left out. They must be equal, module by module, byte for byte.
2. The exported torchvision files equal the zoo's files: parameter count and every row of a
   sweep (f32 and amp, every segment count). Every exported file validates against
   docs/model-file.schema.json (with python3-jsonschema).
3. What cannot be exported is listed in one error, each item with its place in the source; a
   transformers model is pointed to --hf-config with its config written, which the command reads.

Three differences between PyTorch on this CPU (today's release, from scripts/stack_env.sh; or
Debian's 1.13 where that is what there is) and PyTorch 2.x on a GPU, which
vramscope models, are taken out of the PyTorch measurement, and said where:
- Dropout: on CUDA, F.dropout runs the fused native_dropout, which saves a bool mask
  (aten/src/ATen/native/Dropout.cpp, is_fused_kernel_acceptable: CUDA and 0 < p < 1); on the
  CPU it multiplies by a float noise tensor and saves that (4x the bytes). The measurement
  calls torch.native_dropout, the CUDA path, which the CPU has too.
- A 1x1 adaptive average pool is a mean; 1.13's MeanBackward1 saves its input, 2.x's saves
  sizes only (derivatives.yaml: mean_backward(grad, self.sym_sizes(), dim, self.sym_numel(),
  keepdim)). The measurement computes it as sum / n, which saves nothing either.
- nn.MultiheadAttention: 1.13 has no scaled_dot_product_attention (2.0 added it) and saves the
  math path's tensors; 2.x on the CPU runs SDPA's CPU flash kernel, whose f32 output follows
  q's layout and whose logsumexp is unpadded, where CUDA runs the memory-efficient kernel
  ([B, S, H, d] output, so out_proj's input is a copy; logsumexp padded to 32). Its bytes are
  reported but not compared (the runtime's tests derive CUDA's by hand). Its out_proj counts
  as part of it, as in PyTorch's functional path.

Exit 77 (skipped) without torch and torchvision.
"""
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from saved_bytes import torch_saved_per_module, vramscope_saved_per_module

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent


def has_torchvision(python: str) -> bool:
    return subprocess.run([python, "-c", "import torch, torchvision"], capture_output=True).returncode == 0


def reexec_with_torch() -> None:
    try:
        import torch  # noqa: F401
        import torchvision  # noqa: F401
        return
    except ImportError:
        pass
    system = "/usr/bin/python3"
    if Path(system).exists() and Path(sys.executable).resolve() != Path(system).resolve() and has_torchvision(system):
        sys.exit(subprocess.run([system, __file__, *sys.argv[1:]]).returncode)
    if os.environ.get("VRAMSCOPE_REQUIRE_STACK") == "1":
        sys.exit("FAIL check_export: no torch and torchvision (python=$(scripts/stack_env.sh) makes them)")
    print("check_export: skipped, no torch and torchvision (python=$(scripts/stack_env.sh) makes them)")
    sys.exit(77)


# name, the export command's model argument and options, the batch of the round trip
TORCHVISION = ["resnet18", "resnet50", "vgg11_bn", "mobilenet_v2", "vit_b_16"]
CUSTOM = [
    ("ResidualCNN", ["--input", "4,3,32,32"]),
    ("SmallTransformer", ["--input", "4,32", "--input-dtype", "int64"]),
    ("forum_cnn", ["--input", "4,20,19,22", "--loss", "mse"]),
    ("MeanCNN", ["--input", "4,3,16,16"]),
]
ZOO = {"resnet18": "resnet18", "resnet50": "resnet50", "vgg11_bn": "vgg11_bn", "mobilenet_v2": "mobilenet_v2",
       "vit_b_16": "vit_b_16", "forum_cnn": "forum-cnn"}


def export(target: str, options, out: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "python"))
    done = subprocess.run([sys.executable, "-m", "vramscope.export", target, *options, "-o", str(out)],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    if done.returncode != 0:
        raise SystemExit(f"FAIL export {target}: exit {done.returncode}\n{done.stderr}")
    doc = json.loads(out.read_text())
    try:
        import jsonschema
    except ImportError:
        return doc
    jsonschema.validate(doc, json.loads((ROOT / "docs" / "model-file.schema.json").read_text()))
    return doc


def torch_saved(model, x):
    """Bytes saved for backward per module during one forward, on PyTorch."""
    import torch
    import torch.nn.functional as F
    attention = {n for n, m in model.named_modules() if isinstance(m, torch.nn.MultiheadAttention)}

    def owner(name: str) -> str:
        for a in attention:  # out_proj's F.linear runs inside the attention's forward
            if name.startswith(a + "."):
                return a
        return name

    dropout, pool = F.dropout, F.adaptive_avg_pool2d

    def cuda_dropout(input, p=0.5, training=True, inplace=False):
        if training and 0 < p < 1 and not inplace:
            return torch.native_dropout(input, p, True)[0]
        return dropout(input, p, training, inplace)

    def mean_pool(input, output_size):
        size = output_size if isinstance(output_size, (tuple, list)) else (output_size, output_size)
        if tuple(size) == (1, 1):
            return input.sum((-2, -1), keepdim=True) / (input.shape[-1] * input.shape[-2])
        return pool(input, output_size)

    F.dropout, F.adaptive_avg_pool2d = cuda_dropout, mean_pool
    try:
        with torch_saved_per_module(model, owner=owner) as saved:
            model(x)
    finally:
        F.dropout, F.adaptive_avg_pool2d = dropout, pool
    return saved, attention


def vramscope_saved(exe: str, path: Path, batch: int, torch_names: set, scratch: Path) -> dict:
    """The same from `vramscope trace --saved`, each module mapped to its PyTorch module (code
    outside modules, such as torch.flatten in forward, runs in the enclosing one)."""
    out = scratch / "saved.csv"
    done = subprocess.run([exe, "trace", "--model-file", str(path), "--batch", str(batch), "--saved", str(out),
                           "--max-depth", "1", "--no-pre"], capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise SystemExit(f"FAIL vramscope trace {path.name}: exit {done.returncode}\n{done.stderr}")
    return vramscope_saved_per_module(out, torch_names)


def round_trip(exe: str, name: str, model, doc_path: Path, doc: dict, scratch: Path) -> int:
    import torch
    torch.manual_seed(0)
    model.train()
    shape = [doc["options"]["batch"]] + doc["input"]["shape"][1:]
    if doc["input"].get("dtype") == "int64":
        x = torch.randint(0, doc["input"]["high"], shape)
    else:
        x = torch.randn(shape)
    measured, attention = torch_saved(model, x)
    names = {n for n, _ in model.named_modules()}
    names -= {n for n in names for a in attention if n.startswith(a + ".")}
    ours = vramscope_saved(exe, doc_path, shape[0], names, scratch)
    failures, compared = 0, 0
    for module in sorted(set(measured) | set(ours)):
        if module in attention:
            print(f"  {name}: {module} (MultiheadAttention, not compared): PyTorch {torch.__version__} on the CPU "
                  f"{measured.get(module, 0):,} B, vramscope (CUDA's SDPA) {ours.get(module, 0):,} B")
            continue
        compared += 1
        if measured.get(module, 0) != ours.get(module, 0):
            failures += 1
            print(f"FAIL {name}: module '{module}' saves {measured.get(module, 0):,} B on PyTorch, "
                  f"{ours.get(module, 0):,} B on vramscope")
    total = sum(v for k, v in measured.items() if k not in attention)
    if compared == 0 or total == 0:
        failures += 1
        print(f"FAIL {name}: nothing to compare (no module saved anything)")
    print(f"{name}: {compared} modules, {total:,} B saved for backward at batch {shape[0]}, "
          f"{'equal' if not failures else f'{failures} differ'}")
    return failures


def zoo_equal(exe: str, name: str, doc_path: Path) -> int:
    zoo = ZOO[name]

    def models_line(args):
        out = subprocess.run([exe, "models", *args], capture_output=True, text=True, check=True).stdout
        return [ln.split()[1:3] for ln in out.splitlines() if ln.startswith("  ") and "," in ln][0]

    def sweep_rows(args):
        out = subprocess.run([exe, "sweep", *args, "--batch", "8", "--dtype", "f32,amp", "--brief"],
                             capture_output=True, text=True, check=True).stdout
        return [ln for ln in out.splitlines() if ln.startswith(("  f32 ", "  amp "))]

    failures = 0
    ours, theirs = models_line(["--model-file", str(doc_path)]), models_line(["--model", zoo])
    if ours != theirs:
        failures += 1
        print(f"FAIL {name}: parameters {ours} exported, {theirs} in the zoo's {zoo}")
    ours, theirs = sweep_rows(["--model-file", str(doc_path)]), sweep_rows(["--model", zoo])
    if ours != theirs or not ours:
        failures += 1
        print(f"FAIL {name}: the sweep differs from the zoo's {zoo}:\n" + "\n".join(ours) + "\nvs\n" + "\n".join(theirs))
    else:
        print(f"{name}: equal to the zoo's {zoo} (parameters and {len(ours)} sweep rows)")
    return failures


UNEXPORTABLE = '''
import torch
import torch.nn as nn

class Odd(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.rnn = nn.LSTM(8, 8)

    def forward(self, x):
        x = torch.sin(self.fc(x))
        x = x + 2.0
        return self.rnn(x)[0]

class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        if x.sum() > 0:
            return self.fc(x)
        return x
'''


def errors(scratch: Path) -> int:
    src = scratch / "unexportable.py"
    src.write_text(UNEXPORTABLE)
    env = dict(os.environ, PYTHONPATH=str(ROOT / "python"))
    failures = 0
    cases = [
        ("Odd", ["cannot export Odd: 3 things cannot be mapped", "call_function sin", "unexportable.py:12",
                 "arithmetic with a number", "unexportable.py:13", "module 'rnn'", "unexportable.py:14",
                 "LSTM: no model-file layer"]),
        ("Branchy", ["torch.fx cannot trace the model", "unexportable.py:22", "--hf-config"]),
    ]
    python = {fn: sys.executable for fn, _ in cases}
    # A transformers model (this interpreter's, or the current-stack environment's): pointed to
    # --hf-config, with its config written for it, which the command then reads.
    venv = Path(sys.executable)
    if subprocess.run([str(venv), "-c", "import transformers"], capture_output=True).returncode != 0:
        venv = Path(os.environ.get("VRAMSCOPE_STACK_PYTHON") or "/nonexistent")
    if venv.exists() and subprocess.run([str(venv), "-c", "import transformers"], capture_output=True).returncode == 0:
        src_hf = scratch / "hf_model.py"
        src_hf.write_text(HF_MODEL)
        cases.append(("tiny_llama", ["LlamaForCausalLM is a transformers model", "vramscope sweep --hf-config",
                                     "never.config.json"]))
        python["tiny_llama"] = str(venv)
    else:
        print("tiny_llama: skipped (no transformers here nor in VRAMSCOPE_STACK_PYTHON)")
    for fn, wanted in cases:
        module = scratch / ("hf_model.py" if fn == "tiny_llama" else "unexportable.py")
        # The layer form's refusals (--level layers); the default falls back to operators, below.
        done = subprocess.run([python[fn], "-m", "vramscope.export", f"{module}:{fn}", "--input", "2,8", "--level",
                               "layers", "-o", str(scratch / "never.json")], capture_output=True, text=True, env=env,
                              timeout=120)
        missing = [w for w in wanted if w not in done.stderr]
        if done.returncode != 2 or missing or (scratch / "never.json").exists():
            failures += 1
            print(f"FAIL {fn}: exit {done.returncode}, missing {missing} in:\n{done.stderr}")
            continue
        print(f"{fn}: refused with exit 2, {len(done.stderr.splitlines())} lines naming each problem")
        if fn == "tiny_llama":
            config = scratch / "never.config.json"
            run = subprocess.run([sys.argv[1], "models", "--hf-config", str(config)], capture_output=True, text=True)
            if run.returncode != 0 or "78,144" not in run.stdout:
                failures += 1
                print(f"FAIL tiny_llama: the written config does not load: {run.stdout}{run.stderr}")
        # By default what the layers cannot hold is recorded as operators, and sweeps.
        out = scratch / f"{fn}.ops.json"
        shape = "2,8:int64" if fn == "tiny_llama" else "2,8"
        done = subprocess.run([python[fn], "-m", "vramscope.export", f"{module}:{fn}", "--input", shape, "-o", str(out)],
                              capture_output=True, text=True, env=env, timeout=300)
        if fn == "Odd":
            # The LSTM's first dimension is time here (an unbatched sequence): its step count
            # follows what vramscope varies as the batch, and the recording says so.
            if done.returncode != 2 or "other operators at batch 3" not in done.stderr:
                failures += 1
                print(f"FAIL Odd: the operator form: exit {done.returncode}: {done.stderr.strip()}")
            else:
                print("Odd: the operator form refused: its graph changes with the batch")
            continue
        sweep = subprocess.run([sys.argv[1], "sweep", "--model-file", str(out), "--brief"], capture_output=True,
                               text=True) if done.returncode == 0 else None
        if done.returncode != 0 or "operators in" not in done.stderr or sweep is None or sweep.returncode != 0:
            failures += 1
            print(f"FAIL {fn}: the operator form: exit {done.returncode}: {done.stderr.strip()}"
                  + (f"; sweep: {sweep.stderr.strip()}" if sweep is not None else ""))
        else:
            print(f"{fn}: recorded as operators ({done.stderr.strip().splitlines()[0]}), and swept")
    return failures


HF_MODEL = '''
import transformers

def tiny_llama():
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=32, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2))
'''


def main() -> int:
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    reexec_with_torch()
    import torch
    import torchvision
    sys.path.insert(0, str(HERE))
    import export_models
    exe = sys.argv[1]
    failures = 0
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        jobs = [(n, f"torchvision.models:{n}", ["--input", "2,3,224,224"], lambda n=n: getattr(torchvision.models, n)())
                for n in TORCHVISION if hasattr(torchvision.models, n)]
        jobs += [(n, f"tests/models/export_models.py:{n}", opts, getattr(export_models, n)) for n, opts in CUSTOM]
        for name, target, options, make in jobs:
            started = time.perf_counter()
            path = scratch / f"{name}.json"
            doc = export(target, options, path)
            failures += round_trip(exe, name, make(), path, doc, scratch)
            if name in ZOO:
                failures += zoo_equal(exe, name, path)
            print(f"  ({time.perf_counter() - started:.1f} s)")
        failures += errors(scratch)
    print(f"check_export: torch {torch.__version__}, torchvision {torchvision.__version__}: "
          f"{'all equal' if not failures else f'{failures} failures'}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
