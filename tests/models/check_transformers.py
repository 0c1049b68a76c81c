#!/usr/bin/env python3
"""check_transformers.py: one decoder layer's saved-for-backward bytes, measured on the real
transformers LlamaForCausalLM (and PEFT's LoRA) with torch.autograd.graph.saved_tensors_hooks
on the CPU, against the formulas tests/runtime/decoder_test.cpp asserts on vramscope's runtime.

Exit 77 (skipped) without transformers. Looks for it in this interpreter, then in Debian's
python3 (python3-torch), then in .venv-transformers/ at the repository root, which .ci/run
makes (`pip install transformers==4.46.3`, the last release that runs on Debian's PyTorch 1.13).

Two differences between PyTorch 1.13 (what Debian ships) and the 2.x vramscope models are
taken out of the measurement, by walking the graph, not by arithmetic:
- PyTorch 1.13's MeanBackward1 saves its input; 2.x saves its sizes and numel only
  (derivatives.yaml: mean_backward(grad, self.sym_sizes(), dim, self.sym_numel(), keepdim)).
  RMSNorm's pow(2).mean(-1) would keep one more f32 [T, h] per norm on 1.13.
- `x * 0.5` or `x / 8.0` saves the Python number as a 0-dim f64 tensor: on CUDA a host
  scalar, no device memory.
"""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# The decoder of decoder_test.cpp: B = 2, S = 64 (T = 128), h = 64, 4 heads of 16 over 2 kv
# heads (Hd = 64), I = 128, vocab 32.
B, S, h, H, Hd, I = 2, 64, 64, 4, 64, 128
T = B * S


def expected(dtype, lora):
    """Bytes one layer keeps under eager attention, as decoder_test.cpp derives them."""
    if dtype == "float32":
        norms = 2 * (4 * T + 4 * T * h + 4 * T * h)   # rstd, x_hat, output; the input is x itself
        residual_and_output = 2 * 4 * T * h             # saved by the next norms' pow
        attention = 4 * 4 * T * Hd + 4 * B * H * S * S  # q copy, k, v, merged output; f32 probs once
        return norms + residual_and_output + attention + 4 * 4 * T * I
    norm = 4 * T * h + 4 * T + 2 * T * h + 2 * T * h
    attention = 4 * 2 * T * Hd + 4 * B * H * S * S + 2 * B * H * S * S
    if not lora:
        return 2 * norm + attention + 4 * 2 * T * I
    # LoRA r = 8 on q and v: frozen weights keep nothing for themselves; o_proj's input (the
    # merged output) is then kept by nobody.
    norms = 2 * (4 * T * h + 4 * T)
    adapters = 2 * (4 * T * h + 4 * T * 8)
    return norms + adapters + (attention - 2 * T * Hd) + 3 * 2 * T * I


def measure(torch, transformers, layers, dtype, lora):
    cfg = transformers.LlamaConfig(vocab_size=32, hidden_size=h, intermediate_size=I, num_hidden_layers=layers,
                                   num_attention_heads=H, num_key_value_heads=2, max_position_embeddings=256,
                                   use_cache=False, rms_norm_eps=1e-5)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to(getattr(torch, dtype)).train()
    if lora:
        import peft
        model = peft.get_peft_model(model, peft.LoraConfig(r=8, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                            lora_dropout=0.0))
    owned = {p.data_ptr() for p in model.parameters()} | {b.data_ptr() for b in model.buffers()}
    saved = {}

    def pack(t):
        storage = t.untyped_storage() if hasattr(t, "untyped_storage") else t.storage()
        if t.dim() > 0 and storage.data_ptr() not in owned:  # 0-dim: a wrapped Python number
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(input_ids=torch.randint(0, 32, (B, S))).logits
    # PyTorch 1.13's MeanBackward1 keeps its input (2.x does not): drop those storages.
    seen, stack = set(), [logits.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if type(node).__name__ == "MeanBackward1" and hasattr(node, "_saved_self"):
            s = node._saved_self
            saved.pop((s.untyped_storage() if hasattr(s, "untyped_storage") else s.storage()).data_ptr(), None)
        stack.extend(n for n, _ in node.next_functions)
    return sum(saved.values())


def run():
    try:
        import torch
        import transformers
    except ImportError:
        for python in ("/usr/bin/python3", str(ROOT / ".venv-transformers" / "bin" / "python")):
            if Path(python).exists() and Path(python).resolve() != Path(sys.executable).resolve() and \
                    not os.environ.get("CHECK_TRANSFORMERS_NESTED"):
                probe = subprocess.run([python, "-c", "import torch, transformers"], capture_output=True)
                if probe.returncode == 0:
                    env = dict(os.environ, CHECK_TRANSFORMERS_NESTED="1")
                    return subprocess.run([python, __file__], env=env).returncode
        print("check_transformers: skipped, no torch + transformers (.ci/run installs them in .venv-transformers)")
        return 77
    try:
        import peft  # noqa: F401
        cases = [("float32", False), ("bfloat16", False), ("bfloat16", True)]
    except ImportError:
        cases = [("float32", False), ("bfloat16", False)]
    failed = False
    for dtype, lora in cases:
        got = measure(torch, transformers, 2, dtype, lora) - measure(torch, transformers, 1, dtype, lora)
        want = expected(dtype, lora)
        tag = f"{dtype}{' LoRA q,v r=8' if lora else ''}, eager"
        print(f"check_transformers: {tag}: transformers {transformers.__version__} on torch {torch.__version__} "
              f"keeps {got} B per layer, vramscope {want} B")
        failed = failed or got != want
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(run())
