# vramscope plan: gpt2-xl batch=4 seq=1024 on sim:rtx4090 -> checkpoint 39 modules
# predicted: max allocated 22.59 GiB, 23.54 GiB in nvidia-smi's view, 10.3% of the step recomputed
# `model` is your model (built); `optimizer` below replaces yours.
import torch
import functools
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl, apply_activation_checkpointing, checkpoint_wrapper)

CHECKPOINTED = {"transformer.h.0.attn", "transformer.h.1.attn", "transformer.h.2.attn", "transformer.h.3.attn",
    "transformer.h.4.attn", "transformer.h.5.attn", "transformer.h.6.attn", "transformer.h.7.attn",
    "transformer.h.8.attn", "transformer.h.9.attn", "transformer.h.10.attn", "transformer.h.11.attn",
    "transformer.h.12.attn", "transformer.h.13.attn", "transformer.h.14.attn", "transformer.h.15.attn",
    "transformer.h.16.attn", "transformer.h.17.attn", "transformer.h.18.attn", "transformer.h.19.attn",
    "transformer.h.20.attn", "transformer.h.21.attn", "transformer.h.22.attn", "transformer.h.23.attn",
    "transformer.h.24.attn", "transformer.h.25.attn", "transformer.h.26.attn", "transformer.h.27.attn",
    "transformer.h.28.attn", "transformer.h.29.attn", "transformer.h.30.attn", "transformer.h.31.attn",
    "transformer.h.32.attn", "transformer.h.33.attn", "transformer.h.34.attn", "transformer.h.35.attn",
    "transformer.h.36.attn", "transformer.h.37.attn", "transformer.h.38.attn"}
names = {module: name for name, module in model.named_modules()}
apply_activation_checkpointing(
    model,
    checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT),
    check_fn=lambda module: names.get(module) in CHECKPOINTED)
params = [p for p in model.parameters() if p.requires_grad]
optimizer = torch.optim.Adam(params, lr=0.001)
