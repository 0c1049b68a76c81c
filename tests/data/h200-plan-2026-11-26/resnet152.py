# vramscope plan: resnet152 batch=256 on sim:a100-40g -> checkpoint 3 modules
# predicted: max allocated 37.96 GiB, 39.21 GiB in nvidia-smi's view, 2.0% of the step recomputed
# `model` is your model (built); `optimizer` below replaces yours.
import torch
import functools
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl, apply_activation_checkpointing, checkpoint_wrapper)

CHECKPOINTED = {"layer1.0", "layer1.1", "layer1.2"}
names = {module: name for name, module in model.named_modules()}
apply_activation_checkpointing(
    model,
    checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT),
    check_fn=lambda module: names.get(module) in CHECKPOINTED)
params = [p for p in model.parameters() if p.requires_grad]
optimizer = torch.optim.Adam(params, lr=0.001)
