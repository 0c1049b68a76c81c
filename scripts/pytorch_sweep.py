#!/usr/bin/env python3
r"""pytorch_sweep.py — the training step of `vramscope sweep`, in real PyTorch on a real GPU.

vramscope predicts max allocated / max reserved without a GPU. This script measures the
same configurations with PyTorch's own caching allocator, so the prediction can be checked:

    python3 scripts/pytorch_sweep.py --model mlp --depth 256 --width 512 --batch 16384 \
        --segments 0,2,4,8,16 --dtype f32,f16 --csv torch.csv
    build/release/tools/vramscope sweep --model mlp --depth 256 --width 512 --batch 16384 \
        --segments 0,2,4,8,16 --dtype f32,f16 --device sim:h100-80g --format csv > vs.csv
    python3 scripts/pytorch_sweep.py --compare vs.csv torch.csv

The models are written the way vramscope's built-in ones are (runtime/src/nn/models.cpp and
blocks.cpp): the same modules in the same Sequential order, so checkpoint_sequential splits
them alike. The step is vramscope's too: zero_grad(set_to_none=True), a fresh batch and
target, forward (+ checkpoint_sequential, non-reentrant unless --checkpoint reentrant), loss,
backward, optimizer step (Adam with PyTorch's CUDA default, foreach). Every configuration
runs in a fresh process, as a vramscope configuration starts from an empty allocator.
Needs torch (and torchvision for the resnets).

`--allocator vramscope` runs the same steps with vramscope's allocator under PyTorch (the
pluggable allocator in libvramscope.so, through the python/ package; set VRAMSCOPE_LIBRARY)
and reads the figures from it: same policy, so max allocated and max reserved must equal
PyTorch's own, and step_ms says what the plugin costs.

    python3 scripts/pytorch_sweep.py --model resnet50 --segments 0 --csv torch.csv
    python3 scripts/pytorch_sweep.py --model resnet50 --segments 0 --allocator vramscope --csv plugin.csv

`--hf-config PATH` builds a decoder-only model with transformers from a config.json (random
weights, nothing downloaded; `use_cache=False`, no attention_mask, as vramscope assumes) and
runs `model(input_ids=x, labels=x).loss.backward()` then AdamW, with `--attn`,
`--gradient-checkpointing` and `--lora` / `--lora-targets` (PEFT) as vramscope takes them
(docs/TRANSFORMERS.md). QLoRA is not built here. Needs transformers (and peft for --lora):

    python3 scripts/pytorch_sweep.py --hf-config models/zoo/hf/llama-3.2-1b.json --seq 2048 \
        --dtype bf16 --segments 0 --attn sdpa --csv torch.csv
    build/release/tools/vramscope sweep --hf-config models/zoo/hf/llama-3.2-1b.json --seq 2048 \
        --dtype bf16 --attn sdpa --device sim:h100-80g --format csv > vs.csv
    python3 scripts/pytorch_sweep.py --compare vs.csv torch.csv
"""
import argparse
import csv
import json
import math
import os
import subprocess
import sys
import time

MIB = 1 << 20
COLUMNS = ["model", "batch", "dtype", "segments", "steps", "allocated_after_step", "max_allocated",
           "max_reserved", "reserved_after_step", "step1_max_allocated", "step1_after",
           "nvidia_smi_after_step", "context_bytes", "step_ms", "allocator", "oom", "error"]


# --- models, as vramscope builds them ---------------------------------------------------------

def build_mlp(nn, opts):
    depth, width, batch = opts.depth or 16, opts.width or 1024, opts.batch or 64
    layers = []
    for i in range(depth):
        layers.append(nn.Linear(width, width))
        layers.append(nn.ReLU(inplace=bool(opts.inplace)) if i + 1 < depth else nn.Sigmoid())
    return nn.Sequential(*layers), batch, ("float", (batch, width)), ("float", (batch, width)), "mse"


def apply_plan_code(model, path):
    """`vramscope plan --code`'s PyTorch code, run on `model` as a user pastes it."""
    with open(path) as f:
        exec(compile(f.read(), path, "exec"), {"model": model})  # noqa: S102 (vramscope's own output)


def build_resnet(nn, opts, name):
    import torchvision
    m = getattr(torchvision.models, name)(weights=None, num_classes=opts.classes or 1000)
    if opts.plan_code:  # the wrappers take their modules' places before the body is flattened
        apply_plan_code(m, opts.plan_code)
    body = [m.conv1, m.bn1, m.relu, m.maxpool]
    for layer in (m.layer1, m.layer2, m.layer3, m.layer4):
        body.extend(layer)
    body += [m.avgpool, nn.Flatten(1), m.fc]
    batch, image = opts.batch or 32, opts.image or 224
    return (nn.Sequential(*body), batch, ("float", (batch, 3, image, image)),
            ("class", (batch,), opts.classes or 1000), "ce")


def build_gpt2(torch, nn, opts, layers, embed, heads):
    """GPT-2 as transformers' eager GPT2 (Conv1D addmm, where-mask, softmax, .type, gelu_new
    as NewGELUActivation's Python), trained as GPT2LMHeadModel(input_ids, labels=input_ids)
    trains it (ForCausalLMLoss: f32 logits, shifted labels)."""
    F = torch.nn.functional
    vocab, positions = 50257, 1024
    batch, seq = opts.batch or 8, opts.seq or positions
    p = 0.1 if opts.dropout is None else opts.dropout

    class Conv1D(nn.Module):
        def __init__(self, nx, nf):
            super().__init__()
            self.weight = nn.Parameter(torch.empty(nx, nf).normal_(std=0.02))
            self.bias = nn.Parameter(torch.zeros(nf))

        def forward(self, x):
            out = torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight)
            return out.view(x.size()[:-1] + (self.weight.size(1),))

    masks = {}  # one causal mask per device, shared by every block (vramscope keeps none)

    def causal_mask(device):
        if device not in masks:
            masks[device] = torch.tril(torch.ones(positions, positions, dtype=torch.bool, device=device))
        return masks[device].view(1, 1, positions, positions)

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.c_attn, self.c_proj = Conv1D(embed, 3 * embed), Conv1D(embed, embed)
            self.attn_dropout, self.resid_dropout = nn.Dropout(p), nn.Dropout(p)

        def forward(self, x):
            b, t, c = x.shape
            d = c // heads
            q, k, v = self.c_attn(x).split(c, dim=2)
            q, k, v = (z.view(b, t, heads, d).permute(0, 2, 1, 3) for z in (q, k, v))
            att = torch.matmul(q, k.transpose(-1, -2))
            att = att / torch.full([], v.size(-1) ** 0.5, dtype=att.dtype, device=att.device)
            lowest = torch.finfo(att.dtype).min
            att = torch.where(causal_mask(att.device)[:, :, :t, :t], att,
                              torch.full([], lowest, dtype=att.dtype, device=att.device))
            att = F.softmax(att, dim=-1).type(v.dtype)
            att = self.attn_dropout(att)
            y = torch.matmul(att, v).permute(0, 2, 1, 3).contiguous().view(b, t, c)
            return self.resid_dropout(self.c_proj(y))

    class NewGELU(nn.Module):  # transformers/activations.py's NewGELUActivation
        def forward(self, x):
            return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))

    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.c_fc, self.c_proj = Conv1D(embed, 4 * embed), Conv1D(4 * embed, embed)
            self.act, self.dropout = NewGELU(), nn.Dropout(p)

        def forward(self, x):
            return self.dropout(self.c_proj(self.act(self.c_fc(x))))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln_1, self.attn = nn.LayerNorm(embed), Attention()
            self.ln_2, self.mlp = nn.LayerNorm(embed), MLP()

        def forward(self, x):
            h = self.attn(self.ln_1(x)) + x
            return h + self.mlp(self.ln_2(h))

    class Embeddings(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte, self.wpe, self.drop = nn.Embedding(vocab, embed), nn.Embedding(positions, embed), nn.Dropout(p)

        def forward(self, idx):
            pos = torch.arange(idx.size(1), device=idx.device).unsqueeze(0)
            return self.drop(self.wte(idx) + self.wpe(pos))

    class TiedHead(nn.Module):
        def __init__(self, wte):
            super().__init__()
            self.wte = [wte]  # a list, so the weight is not registered twice

        def forward(self, x):
            return F.linear(x, self.wte[0].weight)

    emb = Embeddings()
    body = nn.Sequential(emb, *[Block() for _ in range(layers)], nn.LayerNorm(embed), TiedHead(emb.wte))
    return body, batch, ("token", (batch, seq), vocab), None, "causal_lm_logits"


GPT2 = {"gpt2": (12, 768, 12), "gpt2-medium": (24, 1024, 16), "gpt2-large": (36, 1280, 20), "gpt2-xl": (48, 1600, 25)}


def causal_lm_loss(torch, logits, labels):
    """transformers' ForCausalLMLoss (loss/loss_utils.py): f32 logits, labels padded with -100
    and shifted by one, cross entropy over the vocabulary."""
    logits = logits.float()
    labels = torch.nn.functional.pad(labels, (0, 1), value=-100)
    shift_labels = labels[..., 1:].contiguous()
    return torch.nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), shift_labels.view(-1), ignore_index=-100)


def build(torch, opts):
    nn = torch.nn
    if opts.model == "mlp":
        return build_mlp(nn, opts)
    if opts.model in ("resnet18", "resnet34", "resnet50", "resnet101", "resnet152"):
        return build_resnet(nn, opts, opts.model)
    if opts.model in GPT2:
        return build_gpt2(torch, nn, opts, *GPT2[opts.model])
    sys.exit(f"pytorch_sweep: unknown model '{opts.model}'; expected mlp, resnet18, resnet50, " + ", ".join(GPT2))


def build_hf(torch, opts, param_dtype, dev):
    """A transformers causal LM from a config.json, as vramscope's --hf-config builds it."""
    import transformers
    with open(opts.hf_config) as f:
        config = json.load(f)
    model_type = config.pop("model_type")
    for key in ("architectures", "transformers_version", "torch_dtype"):
        config.pop(key, None)
    cfg = transformers.AutoConfig.for_model(model_type, **config)
    cfg.use_cache = False
    attn = "eager" if opts.attn == "eager" else "sdpa"
    if opts.built_on == "gpu":  # from_config under torch.device("cuda"): vramscope's built_on=gpu
        with dev:
            model = transformers.AutoModelForCausalLM.from_config(cfg, torch_dtype=param_dtype, attn_implementation=attn)
    else:
        model = transformers.AutoModelForCausalLM.from_config(cfg, torch_dtype=param_dtype, attn_implementation=attn)
    model = model.to(dev)
    if opts.lora:
        import peft
        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"] \
            if opts.lora_targets == "all" else opts.lora_targets.split("+")
        model = peft.get_peft_model(model, peft.LoraConfig(r=opts.lora, lora_alpha=opts.lora,
                                                           target_modules=targets, lora_dropout=0.0))
    if opts.gradient_checkpointing != "none":
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": opts.gradient_checkpointing == "reentrant"})
    if opts.plan_code:
        apply_plan_code(model, opts.plan_code)
    return model, cfg.vocab_size


def sdpa_backend(torch, attn):
    """The kernel vramscope's --attn names, forced with sdpa_kernel (sdpa: PyTorch's choice)."""
    import contextlib
    if attn not in ("sdpa-flash", "sdpa-efficient"):
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    return sdpa_kernel(SDPBackend.FLASH_ATTENTION if attn == "sdpa-flash" else SDPBackend.EFFICIENT_ATTENTION)


# --- one configuration, in this process -------------------------------------------------------

def run_one(opts, dtype_name, segments):
    import torch
    from torch.utils.checkpoint import checkpoint_sequential
    if opts.allocator == "vramscope":
        import vramscope  # pip install . (or PYTHONPATH=python)
        vramscope.enable()  # before the first CUDA allocation
        if opts.snapshot_dir:
            vramscope.record_memory_history(2_000_000)
        stats = vramscope
        oom_errors = (torch.cuda.OutOfMemoryError, MemoryError)
    else:
        stats = torch.cuda
        oom_errors = (torch.cuda.OutOfMemoryError,)
    torch.manual_seed(0)
    dev = torch.device("cuda")
    torch.cuda.init()
    torch.empty(0, device=dev)  # create the context before measuring it
    free, total = torch.cuda.mem_get_info()
    context = total - free - stats.memory_reserved()

    param_dtype = {"f16": torch.float16, "bf16": torch.bfloat16}.get(dtype_name, torch.float32)
    autocast = {"amp": torch.float16, "amp-bf16": torch.bfloat16}.get(dtype_name)
    if opts.hf_config:
        body, vocab = build_hf(torch, opts, param_dtype, dev)
        batch = opts.batch or 1
        inp = tgt = ("tokens", (batch, opts.seq or 2048), vocab)
        loss_kind = "causal_lm"
    else:
        body, batch, inp, tgt, loss_kind = build(torch, opts)
        body = body.to(device=dev, dtype=param_dtype)
    body = body.train()
    params = [p for p in body.parameters() if p.requires_grad]
    if opts.optimizer == "adam":
        optimizer = torch.optim.Adam(params)
    elif opts.optimizer == "sgd":
        optimizer = torch.optim.SGD(params, lr=0.01)  # PyTorch's default momentum 0, as vramscope's sgd
    elif opts.optimizer == "sgd-momentum":
        optimizer = torch.optim.SGD(params, lr=0.01, momentum=0.9)
    else:
        optimizer = None
    data_dtype = param_dtype

    def make(spec):
        if spec[0] == "float":
            return torch.rand(spec[1], device=dev, dtype=data_dtype)
        return torch.randint(0, spec[2], spec[1], device=dev, dtype=torch.int64)

    row = {"model": os.path.basename(opts.hf_config) if opts.hf_config else opts.model, "batch": batch, "dtype": dtype_name, "segments": segments, "steps": 0,
           "context_bytes": context, "allocator": opts.allocator, "oom": "", "error": ""}
    try:
        for step in range(1, opts.steps + 1):
            if optimizer is not None:
                optimizer.zero_grad(set_to_none=True)
            else:
                for prm in params:
                    prm.grad = None
            stats.reset_peak_memory_stats()
            torch.cuda.synchronize()
            started = time.perf_counter()
            x, y = make(inp), (make(tgt) if tgt else None)
            with torch.autocast("cuda", dtype=autocast, enabled=autocast is not None), sdpa_backend(torch, opts.attn):
                if loss_kind == "causal_lm":  # transformers computes its own loss; the output
                    out = None                  # object (logits) goes at once, as in Trainer
                    loss = body(input_ids=x, labels=x).loss
                elif loss_kind == "causal_lm_logits":  # the same loss of the logits, which go at once
                    out = None
                    loss = causal_lm_loss(torch, body(x) if segments == 0 else checkpoint_sequential(
                        body, segments, x, use_reentrant=opts.checkpoint == "reentrant"), x)
                elif segments == 0:
                    out = body(x)
                else:
                    out = checkpoint_sequential(body, segments, x, use_reentrant=opts.checkpoint == "reentrant")
                if loss_kind in ("causal_lm", "causal_lm_logits"):
                    pass
                elif loss_kind == "mse":
                    loss = torch.nn.functional.mse_loss(out, y)
                else:
                    loss = torch.nn.functional.cross_entropy(out.view(-1, out.size(-1)), y.view(-1))
            loss.backward()
            if optimizer is not None:
                optimizer.step()
            del x, y, out, loss
            torch.cuda.synchronize()
            row["step_ms"] = round((time.perf_counter() - started) * 1e3, 3)  # the last step's
            peak = stats.max_memory_allocated()
            row["max_allocated"] = max(row.get("max_allocated", 0), peak)
            row["max_reserved"] = max(row.get("max_reserved", 0), stats.max_memory_reserved())
            if step == 1:
                row["step1_max_allocated"] = peak
                row["step1_after"] = stats.memory_allocated()
            row["steps"] = step
        row["allocated_after_step"] = stats.memory_allocated()
        row["reserved_after_step"] = stats.memory_reserved()
        free, total = torch.cuda.mem_get_info()
        row["nvidia_smi_after_step"] = total - free
    except oom_errors as e:
        row["oom"] = str(e).split("\n")[0][:200]
        row["max_allocated"] = max(row.get("max_allocated", 0), stats.max_memory_allocated())
        row["max_reserved"] = max(row.get("max_reserved", 0), stats.max_memory_reserved())
    except RuntimeError as e:  # e.g. a saved tensor modified in place: the step cannot run
        if "CUDA out of memory" in str(e):  # vramscope's std::bad_alloc, as PyTorch re-raises it
            row["oom"] = str(e).split("\n")[0][:200]
            row["max_allocated"] = max(row.get("max_allocated", 0), stats.max_memory_allocated())
            row["max_reserved"] = max(row.get("max_reserved", 0), stats.max_memory_reserved())
        else:
            row["error"] = str(e).split(". Hint")[0][:300]
    if opts.snapshot_dir:
        os.makedirs(opts.snapshot_dir, exist_ok=True)
        path = os.path.join(opts.snapshot_dir, f"{opts.model}-{dtype_name}-seg{segments}.pickle")
        if opts.allocator == "vramscope":
            vramscope.snapshot(path)
        else:
            torch.cuda.memory._dump_snapshot(path)
    return row


# --- driver -----------------------------------------------------------------------------------

def fmt_bytes(n):
    if n in ("", None):
        return "—"
    n = int(n)
    for unit, size in (("GiB", 1 << 30), ("MiB", MIB), ("KiB", 1024)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def compare(vramscope_csv, torch_csv):
    """Prints vramscope's prediction beside PyTorch's measurement, per configuration."""
    def load(path):
        with open(path, newline="") as f:
            return {(r["dtype"], int(r["segments"])): r for r in csv.DictReader(f)}
    ours, theirs = load(vramscope_csv), load(torch_csv)

    def outcome(row):
        if row.get("error"):
            return "error"
        if row.get("oom") or row.get("fits") == "false":
            return "OOM"
        return "ok"

    keys = sorted(set(ours) & set(theirs), key=lambda k: (k[0], k[1]))
    if not keys:
        sys.exit("pytorch_sweep: the two files share no (dtype, segments) configuration")
    head = f"{'dtype':>8} {'seg':>4} | {'max alloc: vramscope':>21} {'pytorch':>11} {'diff':>11} | " \
           f"{'max reserved: vramscope':>24} {'pytorch':>11} {'diff':>11} | {'after step diff':>15} | outcome"
    print(head)
    print("-" * len(head))
    for k in keys:
        a, b = ours[k], theirs[k]
        def diff(col_a, col_b=None):
            va, vb = a.get(col_a) or "", b.get(col_b or col_a) or ""
            return "—" if va == "" or vb == "" else fmt_bytes(int(va) - int(vb))
        print(f"{k[0]:>8} {k[1]:>4} | {fmt_bytes(a['max_allocated']):>21} {fmt_bytes(b['max_allocated']):>11} "
              f"{diff('max_allocated'):>11} | {fmt_bytes(a['max_reserved']):>24} {fmt_bytes(b['max_reserved']):>11} "
              f"{diff('max_reserved'):>11} | {diff('allocated_after_step'):>15} | {outcome(a)} / {outcome(b)}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    ap.add_argument("--model", default="mlp")
    ap.add_argument("--batch", type=int, default=0)
    ap.add_argument("--depth", type=int, default=0)
    ap.add_argument("--width", type=int, default=0)
    ap.add_argument("--seq", type=int, default=0)
    ap.add_argument("--image", type=int, default=0)
    ap.add_argument("--classes", type=int, default=0)
    ap.add_argument("--dropout", type=float, default=None)
    ap.add_argument("--inplace", type=int, default=0, help="mlp: ReLU(inplace=True)")
    ap.add_argument("--segments", default="0,2,4,8", help="checkpoint_sequential segments (0 = none)")
    ap.add_argument("--dtype", default="f32", help="f32, f16, bf16, amp, amp-bf16 (comma list)")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--optimizer", default="adam", choices=["adam", "sgd", "sgd-momentum", "none"])
    ap.add_argument("--checkpoint", default="non-reentrant", choices=["non-reentrant", "reentrant"])
    ap.add_argument("--hf-config", help="a Hugging Face config.json (transformers builds the model)")
    ap.add_argument("--attn", default="sdpa", choices=["eager", "sdpa", "sdpa-flash", "sdpa-efficient"])
    ap.add_argument("--gradient-checkpointing", default="none", choices=["none", "reentrant", "non-reentrant"])
    ap.add_argument("--lora", type=int, default=0, help="LoRA rank (peft); 0: full fine-tune")
    ap.add_argument("--lora-targets", default="q_proj+v_proj")
    ap.add_argument("--built-on", default="cpu", choices=["cpu", "gpu"],
                    help="--hf-config: build on the CPU then move (from_pretrained's way) or on the GPU")
    ap.add_argument("--plan-code", help="apply `vramscope plan --code`'s file to the model (its checkpoint "
                                        "marks; the optimizer stays --optimizer's)")
    ap.add_argument("--csv", help="write the rows here as well")
    ap.add_argument("--allocator", default="torch", choices=["torch", "vramscope"],
                    help="PyTorch's own caching allocator, or vramscope's under it as a pluggable allocator")
    ap.add_argument("--snapshot-dir", help="dump a memory snapshot (history included) per configuration")
    ap.add_argument("--compare", nargs=2, metavar=("VRAMSCOPE_CSV", "TORCH_CSV"),
                    help="print vramscope's figures beside this script's and exit")
    ap.add_argument("--one", nargs=2, metavar=("DTYPE", "SEGMENTS"), help=argparse.SUPPRESS)
    opts = ap.parse_args()

    if opts.compare:
        return compare(*opts.compare)
    if opts.one:
        import torch
        if opts.snapshot_dir and opts.allocator == "torch":
            torch.cuda.memory._record_memory_history(max_entries=2_000_000, context=None, stacks="python")
        print(json.dumps(run_one(opts, opts.one[0], int(opts.one[1]))))
        return

    sink = open(opts.csv, "w", newline="") if opts.csv else None  # rows written as they come
    writer = csv.DictWriter(sink, fieldnames=COLUMNS, extrasaction="ignore") if sink else None
    if writer:
        writer.writeheader()
    passthrough = sys.argv[1:]
    for dtype_name in opts.dtype.split(","):
        for seg in opts.segments.split(","):
            out = subprocess.run([sys.executable, __file__, *passthrough, "--one", dtype_name, seg],
                                 capture_output=True, text=True)
            if out.returncode != 0:
                print(f"pytorch_sweep: {dtype_name} seg {seg} failed:\n{out.stderr[-3000:]}", file=sys.stderr)
                continue
            row = json.loads(out.stdout.strip().splitlines()[-1])
            if writer:
                writer.writerow(row)
                sink.flush()
            print(f"{row['model']:>10} {row['dtype']:>8} seg {row['segments']:>3}: max alloc "
                  f"{fmt_bytes(row.get('max_allocated')):>11}  max reserved {fmt_bytes(row.get('max_reserved')):>11}  "
                  f"after step {fmt_bytes(row.get('allocated_after_step')):>11}  {row['oom']}{row['error']}",
                  flush=True)
    if sink:
        sink.close()


if __name__ == "__main__":
    main()
