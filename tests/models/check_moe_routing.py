#!/usr/bin/env python3
"""check_moe_routing.py VRAMSCOPE: a mixture of experts run by its per-expert loop (transformers'
"eager" experts) against PyTorch with a router made deterministic: saved-for-backward bytes
equal module by module, with the tokens spread evenly and skewed.

The router's choice is data, so vramscope assumes it (models/src/expert_routing.hpp): the
experts' tokens x top_k assignments spread evenly, or the busiest expert (the last) given
expert_skew times its even share, at most every token. Here PyTorch runs the model for real on
the CPU (tiny configs, eager attention) with each experts module's top-k indices replaced by
an assignment giving every expert exactly those rows, each token to top_k distinct experts.

Exit 77 (skipped) without torch and transformers, unless VRAMSCOPE_REQUIRE_STACK=1 (CI).
"""
import json
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT / "python"))

from saved_bytes import torch_saved_per_module, vramscope_saved_per_module  # noqa: E402
from stack_python import reexec_on_stack  # noqa: E402

COMMON = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512, "max_position_embeddings": 512,
          "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "experts_implementation": "eager"}
MODELS = {
    "qwen3_moe": {"moe_intermediate_size": 32, "num_experts": 8, "num_experts_per_tok": 2},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
}
BATCH, SEQ = 2, 32
SKEWS = (1, 3)


def assumed_rows(experts, top_k, tokens, skew):
    """The rule vramscope states: even shares, the remainder to the first experts; under a
    skew the busiest (last) gets ceil(skew x tokens x top_k / experts), at least its even share
    and at most every token, the rest spread evenly over the others."""
    total = tokens * top_k
    busiest = min(tokens, max(-(-total // experts), -(-total * skew // experts)))
    if experts == 1:
        return [total]
    q, r = divmod(total - busiest, experts - 1)
    return [q + (e < r) for e in range(experts - 1)] + [busiest]


def assignment(torch, rows, tokens, top_k):
    """[tokens, top_k] expert indices: expert e in exactly rows[e] tokens, no token twice to one
    expert (greedy on the most rows left, which succeeds whenever no expert needs more than
    every token)."""
    left = list(rows)
    index = []
    for t in range(tokens):
        chosen = sorted(range(len(left)), key=lambda e: (-left[e], e))[:top_k]
        for e in chosen:
            left[e] -= 1
        index.append(sorted(chosen))
    assert all(n == 0 for n in left), left
    return torch.tensor(index, dtype=torch.int64)


def torch_side(model_type, config_path, skew):
    import torch
    import transformers
    values = json.loads(config_path.read_text())
    values.pop("model_type")
    config = transformers.AutoConfig.for_model(model_type, **values)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").train()
    loops = [m for m in model.modules() if hasattr(m, "_apply_gate") and hasattr(m, "is_concatenated")]
    assert loops, "no experts module"

    def route(module, args):
        hidden, index, weights = args[0], args[1], args[2]
        rows = assumed_rows(module.num_experts, index.shape[1], index.shape[0], skew)
        return (hidden, assignment(torch, rows, index.shape[0], index.shape[1]), weights) + tuple(args[3:])

    hooks = [m.register_forward_pre_hook(route) for m in loops]
    ids = torch.randint(3, 512, (BATCH, SEQ))
    with torch_saved_per_module(model) as saved:
        out = model(input_ids=ids, labels=ids, use_cache=False)
        out.loss.backward()
    for h in hooks:
        h.remove()
    # nll_loss saves its total_weight, a 0-dim f32 tensor on the device on CUDA (LossNLL.cpp's
    # nll_loss_forward_out_cuda_template), which a CPU run holds as a host scalar and
    # saved_bytes leaves out: counted here by the CUDA rule, as check_ops' meta run counts it.
    saved[""] = saved.get("", 0) + 4
    return saved, {n for n, _ in model.named_modules()}


def main() -> int:
    reexec_on_stack("check_moe_routing")
    import torch  # noqa: F401
    from vramscope.export import export_hf_config
    exe = sys.argv[1]
    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for model_type, extra in MODELS.items():
            config = work / f"{model_type}.json"
            config.write_text(json.dumps({"model_type": model_type, **COMMON, **extra}))
            doc = export_hf_config(str(config), batch=BATCH, seq=SEQ, attn="eager")
            routing = doc["graph"].get("routing")
            if routing is None or doc["options"].get("expert_skew") != 1:
                failures.append(f"{model_type}: the file has no routing")
                continue
            path = work / f"{model_type}-model.json"
            path.write_text(json.dumps(doc))
            for skew in SKEWS:
                theirs, names = torch_side(model_type, config, skew)
                csv = work / f"{model_type}-{skew}.csv"
                run = subprocess.run([exe, "trace", "--model-file", str(path), "--batch", str(BATCH), "--dtype", "f32",
                                      "--model-options", f"expert_skew={skew}", "--saved", str(csv),
                                      "--device", "sim:capacity=1TiB,context=0"],
                                     capture_output=True, text=True, timeout=600)
                if run.returncode != 0:
                    failures.append(f"{model_type} skew {skew}: vramscope trace failed: {run.stderr.strip()[-300:]}")
                    continue
                ours = vramscope_saved_per_module(csv, names)
                rows = assumed_rows(routing["experts"], routing["top_k"], BATCH * SEQ, skew)
                stated = f"the busiest expert gets {rows[-1]} rows" if skew > 1 else "rows each"
                if stated not in run.stdout:
                    failures.append(f"{model_type} skew {skew}: the routing is not stated under the table")
                differ = [f"{k or '(top level)'}: PyTorch {theirs.get(k, 0):,} B, vramscope {ours.get(k, 0):,} B"
                          for k in sorted(set(theirs) | set(ours)) if theirs.get(k, 0) != ours.get(k, 0)]
                verdict = "equal" if not differ else "DIFFER"
                print(f"  {model_type}, expert_skew={skew} (rows {rows}): saved {sum(theirs.values()):,} B in PyTorch, "
                      f"{sum(ours.values()):,} B in vramscope: {verdict}")
                for line in differ[:8]:
                    print(f"    {line}")
                if differ:
                    failures.append(f"{model_type} skew {skew}")
    print("check_moe_routing: " + ("saved bytes equal module by module under every routing" if not failures
                                   else "differ: " + "; ".join(failures)))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
