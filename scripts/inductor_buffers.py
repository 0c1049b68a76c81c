#!/usr/bin/env python3
"""inductor_buffers.py update|check VRAMSCOPE [DOC]: vramscope's model of inductor's buffers
against the wrapper code inductor really writes, on the CPU.

For each model below, small enough to run for real on this machine's CPU:
1. `vramscope.export --compile` records the joint graph (fake tensors) and `vramscope sweep
   --compile on` plans its two graphs' buffers (compiled_step.cpp): the most bytes each graph
   holds at once, its own buffers and the activations it is given (the backward's saved values
   and tangent), parameters and the batch not counted;
2. PyTorch compiles the same step with inductor on real CPU tensors, and the generated wrapper
   (`call(args)`: empty_strided allocations, `# reuse` of a freed buffer, `# alias`, `del`, the
   outputs of extern kernels by their asserted sizes) is replayed to the same figure.

The two differ where inductor's CPU backend decides otherwise than the model (it fuses by its
own scheduler, reuses a freed buffer of the same size in place): the table says by how much.
The CUDA backend's kernels are not the CPU's; this compares the model with the one inductor
this machine runs.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "python"))
sys.path.insert(0, str(ROOT / "scripts"))

ITEMSIZE = {"torch.float32": 4, "torch.float16": 2, "torch.bfloat16": 2, "torch.int64": 8, "torch.int32": 4,
            "torch.bool": 1, "torch.uint8": 1, "torch.int8": 1, "torch.float64": 8}
TUPLE = r"\(([^()]*)\)"


def _ints(text: str):
    return [int(v) for v in text.replace(" ", "").split(",") if v]


def storage_bytes(shape, stride, dtype: str) -> int:
    if any(s == 0 for s in shape):
        return 0
    return (1 + sum((s - 1) * st for s, st in zip(shape, stride))) * ITEMSIZE[dtype]


def wrapper_peak(code: str, given: dict) -> int:
    """The most bytes the wrapper's `call` holds at once: its buffers, and its inputs named in
    `given` (name -> bytes) until their `del`."""
    body = code[code.index("def call(self, args):"):]
    body = body[:body.index("\n        return ")]
    owner = {}          # name -> storage id
    refs = {}           # storage id -> names holding it
    size = {}           # storage id -> bytes
    live = peak = 0
    args = re.search(r"\n        (.*) = args\n", body).group(1).split(", ")
    for name in args:
        name = name.strip().rstrip(",")
        if name in given:
            owner[name] = name
            refs[name] = {name}
            size[name] = given[name]
            live += given[name]
    peak = live

    def drop(name: str) -> None:
        nonlocal live
        sid = owner.pop(name, None)
        if sid is None:
            return
        refs[sid].discard(name)
        if not refs[sid]:
            live -= size.pop(sid)
            del refs[sid]

    pending = {}  # an extern kernel's tuple: element names wait for their asserted sizes
    for line in body.splitlines():
        line = line.strip()
        if m := re.match(r"(\w+) = empty_strided_\w+\(" + TUPLE + r", " + TUPLE + r", (torch\.\w+)\)", line):
            name, shape, stride, dtype = m.group(1), _ints(m.group(2)), _ints(m.group(3)), m.group(4)
            owner[name] = name
            refs[name] = {name}
            size[name] = storage_bytes(shape, stride, dtype)
            live += size[name]
            peak = max(peak, live)
        elif m := re.match(r"(\w+) = reinterpret_tensor\((\w+), .*", line):
            new, old = m.group(1), m.group(2)
            if old in owner:
                owner[new] = owner[old]
                refs[owner[old]].add(new)
            if "# reuse" in line:
                drop(old)
        elif m := re.match(r"(\w+) = (\w+); del (\w+)  # reuse", line):
            new, old = m.group(1), m.group(2)
            if old in owner:
                owner[new] = owner[old]
                refs[owner[old]].add(new)
            drop(old)
        elif m := re.match(r"(\w+) = (torch\.ops\.[\w.]+|extern_kernels\.\w+)\(", line):
            pending[m.group(1)] = True
        elif m := re.match(r"(\w+) = (\w+)\[\d+\]$", line):
            pending[m.group(1)] = True
        elif m := re.match(r"assert_(?:tensor_metadata|size_stride)\((\w+), " + TUPLE + r", " + TUPLE +
                           r"(?:, (torch\.\w+))?", line):
            name = m.group(1)
            if pending.pop(name, False) and m.group(4):
                owner[name] = name
                refs[name] = {name}
                size[name] = storage_bytes(_ints(m.group(2)), _ints(m.group(3)), m.group(4))
                live += size[name]
                peak = max(peak, live)
        elif line.startswith("del "):
            for name in line[4:].split("#")[0].split(","):
                drop(name.strip())
    return peak


def real_codes(build, make_inputs, step):
    """inductor's forward and backward wrapper code for `step` on real CPU tensors."""
    import torch
    import torch._dynamo
    from torch._inductor.utils import run_and_get_code
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = build()
    args, kwargs = make_inputs()
    compiled = torch.compile(lambda *a, **k: step(model, *a, **k))

    def run():
        loss = compiled(*args, **kwargs)
        loss.backward()
        return loss

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, codes = run_and_get_code(run)
    torch._dynamo.reset()
    if len(codes) != 2:
        raise RuntimeError(f"expected a forward and a backward wrapper, got {len(codes)}")
    return codes


def cases():
    import torch
    import torch.nn as nn
    import transformers
    from vramscope.export import InputSpec, export_ops, export_hf_config
    from vramscope.export._compiled import step_with_loss
    from vramscope.export._opfile import _pick

    def mlp():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(24, 40), nn.GELU(), nn.LayerNorm(40), nn.Linear(40, 10))

    def hf(values):
        def build():
            config = transformers.AutoConfig.for_model(**dict(values))
            return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").to(
                torch.bfloat16).train()
        return build

    def module_case(name, build, shape, folder):
        doc = export_ops(build(), [InputSpec(shape)], name=name, compile=True)
        graph = doc["graph"]
        step, with_target = step_with_loss(lambda b, s: ((torch.empty(shape, dtype=torch.bfloat16, device="meta"),), {}),
                                           doc["loss"], _pick(None), graph["tensors"][graph["output"]]["shape"])
        target = with_target(shape[0], 0)[1]["target"]

        def make_inputs():
            t = torch.randint(0, 10, target.shape) if target.dtype == torch.int64 else torch.randn(
                target.shape, dtype=torch.bfloat16)
            return (torch.randn(shape, dtype=torch.bfloat16),), {"target": t}
        return name, doc, lambda: build().to(torch.bfloat16).train(), make_inputs, step

    def decoder_case(name, values, folder):
        path = folder / f"{name}.json"
        path.write_text(json.dumps(values))
        doc = export_hf_config(str(path), batch=2, seq=64, compile=True)

        def make_inputs():
            ids = torch.randint(0, values["vocab_size"], (2, 64))
            return (), {"input_ids": ids, "labels": ids, "use_cache": False}
        return name, doc, hf(values), make_inputs, lambda m, *a, **k: m(*a, **k).loss

    def resnet():
        import torchvision
        torch.manual_seed(0)
        return torchvision.models.resnet18(num_classes=10)

    llama = {"model_type": "llama", "hidden_size": 96, "intermediate_size": 250, "num_hidden_layers": 2,
             "num_attention_heads": 6, "num_key_value_heads": 2, "vocab_size": 1000, "max_position_embeddings": 512}
    return [
        lambda folder: module_case("MLP (Linear, GELU, LayerNorm, Linear), batch 6", mlp, [6, 24], folder),
        lambda folder: module_case("resnet18, batch 2 x 3 x 64 x 64", resnet, [2, 3, 64, 64], folder),
        lambda folder: decoder_case("llama, 2 layers of 96, batch 2 x 64", llama, folder),
    ]


def table(binary: str) -> str:
    from vramscope.export._compiled import size_at
    rows = ["| model | graph | inductor's wrapper (CPU) | vramscope's plan | difference |",
            "|---|---|---:|---:|---:|"]
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        for make in cases():
            name, doc, build, make_inputs, step = make(folder)
            path = folder / "model.json"
            path.write_text(json.dumps(doc))
            out = subprocess.run([binary, "sweep", "--model-file", str(path), "--dtype", "bf16", "--segments", "0",
                                  "--compile", "on", "--steps", "1", "--format", "json"],
                                 capture_output=True, text=True, check=True)
            row = next(r for r in json.loads(out.stdout)["rows"] if r["compile"] is not None)
            planned = row["compiled"]
            at = {"batch": doc["compiled"]["batch"], "seq": doc["compiled"].get("seq", 0)}
            sizes = {n["name"]: size_at(n.get("bytes", 0), at["batch"], at["seq"])
                     for n in doc["compiled"]["graph"]["nodes"] if not n["name"].startswith("primals_")}
            forward, backward = real_codes(build, make_inputs, step)
            for graph, code, mine in (("forward", forward, planned["forward_buffer_peak"]),
                                      ("backward", backward, planned["backward_buffer_peak"])):
                theirs = wrapper_peak(code, sizes)
                diff = (mine - theirs) / theirs if theirs else 0.0
                rows.append(f"| {name} | {graph} | {theirs:,} B | {mine:,} B | {diff:+.1%} |")
            print(rows[-2], rows[-1], sep="\n", file=sys.stderr)
    return "\n".join(rows) + "\n"


USAGE = "usage: inductor_buffers.py update|check VRAMSCOPE [docs/OPERATORS.md]"


def rows_of(text: str):
    """{(model, graph): (inductor's bytes, vramscope's bytes)} of a table."""
    out = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 5 and cells[2].endswith(" B"):
            out[(cells[0], cells[1])] = (int(cells[2][:-2].replace(",", "")), int(cells[3][:-2].replace(",", "")))
    return out


def main() -> int:
    from doc_tables import render, section
    if len(sys.argv) < 3 or sys.argv[1] not in ("update", "check"):
        print(USAGE)
        return 2
    doc = Path(sys.argv[3]) if len(sys.argv) > 3 else ROOT / "docs" / "OPERATORS.md"
    text = doc.read_text()
    sys.path.insert(0, str(ROOT / "tests" / "models"))
    from stack_python import reexec_on_stack
    reexec_on_stack("inductor_buffers")  # today's torch: VRAMSCOPE_STACK_PYTHON, else skipped
    new = table(sys.argv[2])
    if sys.argv[1] == "update":
        doc.write_text(render(text, {"inductor_buffers": new}))
        print(f"inductor_buffers: {doc} rewritten")
        return 0
    # vramscope's plan to the byte; inductor's code within 2% (its CPU kernels follow this
    # machine's instruction set).
    shown, now = rows_of(section(text, "inductor_buffers")), rows_of(new)
    bad = [f"{key}: the document shows {shown.get(key)}, now {value}" for key, value in now.items()
           if key not in shown or shown[key][1] != value[1] or abs(shown[key][0] - value[0]) > 0.02 * value[0]]
    bad += [f"{key}: no longer measured" for key in shown if key not in now]
    for line in bad:
        print(f"inductor_buffers: {line}")
    if bad:
        print(f"inductor_buffers: run scripts/inductor_buffers.py update {sys.argv[2]}")
        return 1
    print("inductor_buffers: table agrees")
    return 0


if __name__ == "__main__":
    sys.exit(main())
