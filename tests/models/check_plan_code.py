#!/usr/bin/env python3
"""check_plan_code.py VRAMSCOPE: the PyTorch code `vramscope plan --code` writes runs on today's
PyTorch, transformers and PEFT (the CPU reference), and its checkpoint marks land on the modules
the plan names.

For three models, a device small enough that the plan must checkpoint some of the modules:
- the chain of tests/data/plan-chain.json, written here as the nn.Module it describes: the
  wrapped modules are exactly b1 and tail.w0 (what the C++ test expects too), and a training
  step with the code applied gives the same loss and gradients as without it (checkpointing
  recomputes, it changes no number);
- torchvision's resnet18 and vit_b_16 (vramscope's zoo files of them): every name the plan gives
  is a module of torchvision's model, and exactly those are wrapped; a training step runs;
- a four-layer Llama with LoRA (transformers + PEFT): gradient_checkpointing_enable, then only
  the planned layers keep the flag; a training step runs;
- an operator-level recording of eight MLP blocks on the first device where the best plan is
  selective checkpointing: its code wraps exactly the planned blocks with
  create_selective_checkpoint_contexts, and a step gives identical loss and gradients.

Exit 77 (skipped) without torch and transformers, unless VRAMSCOPE_REQUIRE_STACK=1 (CI).
"""
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from stack_python import reexec_on_stack

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "tests" / "data"


def plan(vramscope, args, code_path):
    # The devices here are sized for the plans they test: to the last MiB (--headroom 0).
    out = subprocess.run([vramscope, "plan", *args, "--search", "none", "--headroom", "0", "--format", "json",
                          "--code", str(code_path)],
                         capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"FAIL: vramscope plan {' '.join(args)}: {out.stderr.strip()}")
    result = json.loads(out.stdout)
    best = result["plans"][result["best"]]
    return best, code_path.read_text()


def apply(code, model):
    scope = {"model": model}
    exec(compile(code, "plan.py", "exec"), scope)  # noqa: S102 (our own output, under test)
    return scope


def wrapped_names(model):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
    return {name for name, m in model.named_modules() if isinstance(m, CheckpointWrapper)}


def chain_model():
    import torch.nn as nn
    from collections import OrderedDict

    class Narrow(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(256, 256)

        def forward(self, x):
            return self.fc(x) + x

    class Wide(nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.act, self.down = nn.Linear(256, 4096), nn.ReLU(), nn.Linear(4096, 256)

        def forward(self, x):
            return self.down(self.act(self.up(x))) + x

    return nn.Sequential(OrderedDict(b0=Narrow(), b1=Wide(), b2=Narrow(),
                                     tail=nn.Sequential(OrderedDict(w0=Wide(), w1=Wide()))))


def step(model, x, target):
    import torch.nn.functional as F
    model.zero_grad(set_to_none=True)
    loss = F.mse_loss(model(x), target)
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def same_step(label, plain, planned, x, target, failures):
    """One training step of each gives the same loss and gradients, bit for bit."""
    import torch
    loss_a, grads_a = step(plain, x, target)
    loss_b, grads_b = step(planned, x, target)
    # The wrapper adds a level to parameter names: compare in order.
    same = loss_a == loss_b and all(torch.equal(a, b) for a, b in zip(grads_a.values(), grads_b.values()))
    print(f"  {label}: loss {loss_a:.6f} / {loss_b:.6f}, gradients {'identical' if same else 'DIFFER'}")
    if not same or len(grads_a) != len(grads_b):
        failures.append(f"{label}: gradients")


def check_chain(vramscope, tmp, failures):
    import copy
    import torch
    best, code = plan(vramscope, ["--model-file", str(DATA / "plan-chain.json"),
                                  "--device", "sim:capacity=640MiB,context=0"], tmp / "chain.py")
    torch.manual_seed(0)
    plain = chain_model()
    planned = copy.deepcopy(plain)
    apply(code, planned)
    got = wrapped_names(planned)
    want = set(best["checkpoint_modules"])
    print(f"  chain: plan {sorted(want)}, wrapped {sorted(got)}")
    if got != want or want != {"b1", "tail.w0"}:
        failures.append("chain: wrapped modules")
    same_step("chain", plain, planned, torch.randn(64, 256), torch.randn(64, 256), failures)


def check_torchvision(vramscope, tmp, failures, name, args, image):
    """A zoo model written from torchvision's: every name its plan gives is a module of
    torchvision's own model (the ViTs' encoder.layers.encoder_layer_0 too), exactly those are
    wrapped, and a training step runs."""
    import torch
    import torch.nn.functional as F
    import torchvision
    best, code = plan(vramscope, ["--model", name, *args], tmp / f"{name}.py")
    want = set(best["checkpoint_modules"])
    model = getattr(torchvision.models, name)()
    missing = want - {n for n, _ in model.named_modules()}
    scope = apply(code, model)
    got = wrapped_names(model)
    print(f"  {name}: plan {sorted(want)} ({best['plan']}), wrapped {sorted(got)}")
    if not want or missing or got != want:
        failures.append(f"{name}: wrapped {sorted(got)}, missing in torchvision {sorted(missing)}")
    x, y = torch.randn(1, 3, image, image), torch.randint(0, 1000, (1,))
    F.cross_entropy(model(x), y).backward()
    scope["optimizer"].step()


def check_resnet18(vramscope, tmp, failures):
    check_torchvision(vramscope, tmp, failures, "resnet18",
                      ["--batch", "256", "--device", "sim:capacity=5GiB,context=300MiB"], 64)


def check_vit(vramscope, tmp, failures):
    check_torchvision(vramscope, tmp, failures, "vit_b_16",
                      ["--batch", "64", "--device", "sim:capacity=8GiB,context=300MiB"], 224)


def check_llama(vramscope, tmp, failures):
    import torch
    import transformers
    from peft import LoraConfig, get_peft_model
    config = json.loads((DATA / "h100-parallel-2026-11-26" / "ref-llama-2layer.json").read_text())
    config["num_hidden_layers"] = 4
    config["vocab_size"] = 2048  # the layers, not the logits, make the peak
    path = tmp / "llama-4layer.json"
    path.write_text(json.dumps(config))
    best, code = plan(vramscope, ["--hf-config", str(path), "--lora", "8", "--batch", "8", "--seq", "1024",
                                  "--dtype", "bf16", "--attn", "sdpa",
                                  "--device", "sim:capacity=1200MiB,context=300MiB"], tmp / "llama.py")
    want = set(best["checkpoint_modules"])
    cfg = transformers.LlamaConfig(**{k: v for k, v in config.items() if k not in ("architectures", "transformers_version")})
    cfg._attn_implementation = "sdpa"
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
    scope = apply(code, model)
    layers = {name.removeprefix("base_model.model."): m.gradient_checkpointing for name, m in model.named_modules()
              if type(m).__name__ == "LlamaDecoderLayer"}
    got = {name for name, on in layers.items() if on}
    print(f"  llama: plan {sorted(want)} ({best['plan']}), layers flagged {sorted(got)} of {len(layers)}")
    if not want or len(want) == len(layers) or got != want:
        failures.append("llama: layer flags")
    model.train()
    x = torch.randint(0, config["vocab_size"], (1, 32))
    model(input_ids=x, labels=x).loss.backward()
    scope["optimizer"].step()


def sac_model():
    """Eight pre-norm MLP blocks, the matrix products large against the pointwise work around
    them: where keeping the products' outputs (selective checkpointing) fits in less than the
    whole step and recomputes almost nothing."""
    import torch.nn as nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm, self.up, self.act, self.down = nn.LayerNorm(256), nn.Linear(256, 1024), nn.GELU(), \
                nn.Linear(1024, 256)

        def forward(self, x):
            return x + self.down(self.act(self.up(self.norm(x))))

    return nn.Sequential(*[Block() for _ in range(8)])


def check_selective(vramscope, tmp, failures):
    """An operator-level model (the exporter's recording of sac_model) on devices between what
    every block checkpointed and the whole step need: where the best plan is selective, its code
    wraps exactly the planned blocks under create_selective_checkpoint_contexts, and a training
    step gives the same loss and gradients as without it."""
    sys.path.insert(0, str(ROOT / "python"))
    from vramscope.export import InputSpec, export_ops
    doc = export_ops(sac_model(), [InputSpec([4096, 256], "float", None)], name="sac-chain", loss="mse")
    path = tmp / "sac.json"
    path.write_text(json.dumps(doc))
    found = calls = None
    for mib in range(680, 400, -8):  # from the step's need down: the first device where it is selective
        out = subprocess.run([vramscope, "plan", "--model-file", str(path), "--device", f"sim:capacity={mib}MiB,context=0",
                              "--search", "selective", "--headroom", "0", "--format", "json", "--code", str(tmp / "sac.py")],
                             capture_output=True, text=True)
        if out.returncode != 0:
            continue
        result = json.loads(out.stdout)
        index = result.get("best")  # the given configuration fits (a larger device): not a plan
        best = result["plans"][index] if isinstance(index, int) and 0 <= index < len(result["plans"]) else None
        if best and best.get("selective_scopes") and calls is None:
            calls = (mib, best, (tmp / "sac.py").read_text())
        if best and best.get("selective") and found is None:
            found = (mib, best, (tmp / "sac.py").read_text())
        if found and calls:
            break
    check_kept_calls(calls, failures)
    if found is None:
        failures.append("selective: no device between 400 and 680 MiB gives a selective plan")
        return
    run_sac_code("selective", found, "keep_costly", failures)


def run_sac_code(label, found, policy, failures):
    """The plan's code applied to sac_model: exactly the planned blocks wrapped, its policy
    function (`policy`) defined, and a training step with the same loss and gradients."""
    import copy
    import torch
    mib, best, code = found
    torch.manual_seed(0)
    plain = sac_model()
    planned = copy.deepcopy(plain)
    scope = apply(code, planned)
    got, want = wrapped_names(planned), set(best["checkpoint_modules"])
    print(f"  {label}: {mib} MiB: {best['plan']} ({best['recompute_share']:.2%} recomputed), wrapped {sorted(got)}")
    if got != want or policy not in scope:
        failures.append(f"{label}: wrapped modules")
    same_step(label, plain, planned, torch.randn(4096, 256), torch.randn(4096, 256), failures)


def check_kept_calls(calls, failures):
    """A call-by-call plan's code: exactly the planned blocks wrapped, each forward keeping as
    many operator calls as the plan says (its policy counted as PyTorch calls it), and a
    training step with the same loss and gradients as without it."""
    if calls is None:
        failures.append("kept calls: no device between 400 and 680 MiB gives a call-by-call plan")
        return
    import torch.utils.checkpoint as tuc
    best = calls[1]
    kept = []
    original = tuc.create_selective_checkpoint_contexts

    def counting(policy, *args, **kwargs):
        def counted(ctx, op, *a, **k):
            decision = policy(ctx, op, *a, **k)
            if not ctx.is_recompute and decision == tuc.CheckpointPolicy.MUST_SAVE:
                kept.append(str(op))
            return decision
        return original(counted, *args, **kwargs)

    tuc.create_selective_checkpoint_contexts = counting  # the plan's code imports it when it runs
    try:
        run_sac_code("kept calls", calls, "keeping_calls", failures)
    finally:
        tuc.create_selective_checkpoint_contexts = original
    print(f"  kept calls: PyTorch's forward kept {len(kept)} operator calls, the plan {best['kept_calls']}")
    if len(kept) != best["kept_calls"]:
        failures.append(f"kept calls: PyTorch kept {len(kept)}, the plan says {best['kept_calls']}")


def main():
    reexec_on_stack("check_plan_code")
    vramscope = sys.argv[1]
    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        for check in (check_chain, check_resnet18, check_vit, check_llama, check_selective):
            check(vramscope, Path(tmp), failures)
    if failures:
        sys.exit("FAIL: " + "; ".join(failures))
    print("ok: the plans' code runs and marks exactly the planned modules")


if __name__ == "__main__":
    main()
