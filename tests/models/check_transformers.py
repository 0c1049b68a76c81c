#!/usr/bin/env python3
"""check_transformers.py VRAMSCOPE: what the real transformers (and PEFT) decoders save for
backward under today's PyTorch, module by module, against `vramscope trace --saved` of the
same config under the stack it finds installed (--stack torch=X,transformers=Y,peft=Z).

Runs on the current-stack environment (scripts/stack_env.sh; its python is passed in
VRAMSCOPE_STACK_PYTHON, or this interpreter if it has torch and transformers). A one-layer
model of each family (llama, mistral, qwen2) is measured on the CPU with
torch.autograd.graph.saved_tensors_hooks during one forward: each storage once, under the
innermost module running when it is first saved, parameters and buffers left out. Cases:
f32 and bf16 with eager attention and with SDPA (the CPU's flash kernel keeps what CUDA's
keeps in bytes: q, k, v, the output and an f32 logsumexp [B, H, S]), and bf16 SDPA with LoRA
on q and v and on every projection. Every module's bytes must be equal. GPT-2 too (eager and
SDPA, use_cache=False, dropout 0: the CPU's dropout keeps a float mask where CUDA's keeps a bool
one; SDPA's output is in q's [B, S, H, d] order, so c_proj keeps no copy of it), whose
NewGELUActivation keeps four tensors of the MLP's width, and with activation_function
gelu_pytorch_tanh or gelu (GELUTanh, GELUActivation: F.gelu) its input only (f32: the CPU's bf16 layer_norm keeps
bf16 statistics where CUDA's, and vramscope's, are f32).

Exit 77 (skipped) without torch and transformers, unless VRAMSCOPE_REQUIRE_STACK=1 (CI),
which makes a missing environment a failure.
"""
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from saved_bytes import torch_saved_per_module, vramscope_saved_per_module
from stack_python import reexec_on_stack

B, S, HIDDEN, HEADS, KV_HEADS, INTERMEDIATE, VOCAB = 2, 64, 64, 4, 2, 128, 32
FAMILIES = ("llama", "mistral", "qwen2")
# f32 only: in bf16 the CPU's layer_norm keeps its mean and rstd in bf16 where CUDA's keeps
# them in f32, as vramscope does.
# "gpt2:ACT": activation_function ACT (transformers' GELUTanh and GELUActivation keep their input
# only, where gelu_new's NewGELUActivation keeps four tensors).
GPT2_CASES = [("gpt2", "float32", "eager", None), ("gpt2:gelu_pytorch_tanh", "float32", "eager", None),
              ("gpt2:gelu", "float32", "eager", None), ("gpt2", "float32", "sdpa", None)]
CASES = [  # dtype, attention, LoRA targets
    ("float32", "eager", None), ("bfloat16", "eager", None), ("float32", "sdpa", None),
    ("bfloat16", "sdpa", None), ("bfloat16", "sdpa", ["q_proj", "v_proj"]),
    ("bfloat16", "sdpa", ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
]


def minor(version: str) -> str:
    return ".".join(version.split("+")[0].split(".")[:2])


ROOT = Path(__file__).resolve().parents[2]


def build(family: str, dtype: str, attention: str, lora):
    import torch
    import transformers
    if family.startswith("gpt2"):
        activation = family.partition(":")[2] or "gelu_new"
        cfg = transformers.GPT2Config(vocab_size=VOCAB, n_embd=HIDDEN, n_layer=1, n_head=HEADS, n_positions=256,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, activation_function=activation,
                                      use_cache=False)  # as vramscope reads every config (hf_config.cpp)
        cfg._attn_implementation = attention
        torch.manual_seed(0)
        return cfg, transformers.GPT2LMHeadModel(cfg).to(getattr(torch, dtype)).train()
    config_class = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
                    "qwen2": transformers.Qwen2Config}[family]
    extra = {"sliding_window": None} if family != "llama" else {}
    cfg = config_class(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=1,
                       num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=256,
                       rms_norm_eps=1e-5, tie_word_embeddings=False, **extra)
    cfg._attn_implementation = attention
    torch.manual_seed(0)
    model_class = {"llama": transformers.LlamaForCausalLM, "mistral": transformers.MistralForCausalLM,
                   "qwen2": transformers.Qwen2ForCausalLM}[family]
    model = model_class(cfg).to(getattr(torch, dtype)).train()
    if lora:
        import peft
        model = peft.get_peft_model(model, peft.LoraConfig(r=8, lora_alpha=16, target_modules=lora, lora_dropout=0.0))
    return cfg, model


def torch_saved(model) -> dict:
    import torch
    names = {m: n.removeprefix("base_model.model.") for n, m in model.named_modules()}
    x = torch.randint(0, VOCAB, (B, S))
    with torch_saved_per_module(model, names) as saved:
        model(input_ids=x)  # no labels: the loss runs outside the modules
    saved.pop("", None)
    return saved


def vramscope_saved(exe: str, cfg, dtype: str, attention: str, lora, stack: str, scratch: Path, names: set) -> dict:
    config = scratch / "config.json"
    doc = json.loads(cfg.to_json_string(use_diff=True))  # what save_pretrained writes
    doc.setdefault("architectures", [type(cfg).__name__.replace("Config", "ForCausalLM")])
    if cfg.model_type == "gpt2":  # the published config's keys, at these sizes
        doc = json.loads((ROOT / "models" / "zoo" / "hf" / "gpt2.json").read_text())
        doc.update(vocab_size=VOCAB, n_embd=HIDDEN, n_layer=1, n_head=HEADS, n_positions=256, n_ctx=256,
                   resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, activation_function=cfg.activation_function)
    config.write_text(json.dumps(doc))
    out = scratch / "saved.csv"
    command = [exe, "trace", "--hf-config", str(config), "--batch", str(B), "--seq", str(S),
               "--dtype", {"float32": "f32", "bfloat16": "bf16"}[dtype], "--attn", attention, "--stack", stack,
               "--steps", "1", "--saved", str(out), "--max-depth", "1", "--no-pre"]
    if lora:
        command += ["--lora", "8", "--lora-targets", "+".join(lora)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise SystemExit(f"FAIL vramscope {' '.join(command)}: exit {done.returncode}\n{done.stdout}{done.stderr}")
    return vramscope_saved_per_module(out, names, skip=("loss", "input", ""))

def main() -> int:
    reexec_on_stack("check_transformers")
    import torch
    import transformers
    try:
        import peft
        peft_version = minor(peft.__version__)
    except ImportError:
        peft, peft_version = None, None
    exe = sys.argv[1]
    stack = f"torch={minor(torch.__version__)},transformers={minor(transformers.__version__)}"
    if peft_version:
        stack += f",peft={peft_version}"
    print(f"check_transformers: torch {torch.__version__}, transformers {transformers.__version__}, "
          f"peft {peft.__version__ if peft else 'absent'}: vramscope --stack {stack}")
    failures = 0
    with tempfile.TemporaryDirectory() as tmp:
        for family, dtype, attention, lora in [(f, *c) for f in FAMILIES for c in CASES] + GPT2_CASES:
            if lora and peft is None:
                continue
            cfg, model = build(family, dtype, attention, lora)
            measured = torch_saved(model)
            names = {n.removeprefix("base_model.model.") for n, _ in model.named_modules()}
            ours = vramscope_saved(exe, cfg, dtype, attention, lora, stack, Path(tmp), names)
            tag = f"{family} {dtype} {attention}" + (f" LoRA {'+'.join(lora)}" if lora else "")
            differ = [m for m in sorted(set(measured) | set(ours)) if measured.get(m, 0) != ours.get(m, 0)]
            for m in differ:
                print(f"FAIL {tag}: '{m}' saves {measured.get(m, 0):,} B on PyTorch, {ours.get(m, 0):,} B on vramscope")
            if not measured:
                differ.append("nothing measured")
            print(f"check_transformers: {tag}: {len(measured)} modules, {sum(measured.values()):,} B, "
                  f"{'equal' if not differ else f'{len(differ)} differ'}")
            failures += len(differ)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
