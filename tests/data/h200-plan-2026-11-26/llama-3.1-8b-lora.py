# vramscope plan: llama-3.1-8b batch=1 seq=2048 lora=16 attn=sdpa built_on=gpu on sim:rtx4090 -> checkpoint 21 of 32 blocks
# predicted: max allocated 21.96 GiB, 23.64 GiB in nvidia-smi's view, 29.2% of the step recomputed
# `model` is your model (built); `optimizer` below replaces yours.
import torch
from transformers.modeling_layers import GradientCheckpointingLayer

CHECKPOINTED = {"model.layers.0", "model.layers.2", "model.layers.3", "model.layers.5",
    "model.layers.6", "model.layers.8", "model.layers.9", "model.layers.11",
    "model.layers.12", "model.layers.14", "model.layers.16", "model.layers.17",
    "model.layers.19", "model.layers.20", "model.layers.22", "model.layers.23",
    "model.layers.25", "model.layers.26", "model.layers.28", "model.layers.29",
    "model.layers.31"}
# (newer transformers name it activation_checkpointing_enable)
model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
model.enable_input_require_grads()  # as TRL does for a PEFT model with checkpointing
for name, module in model.named_modules():  # then only the planned layers keep it
    if isinstance(module, GradientCheckpointingLayer):
        module.gradient_checkpointing = name.removeprefix("base_model.model.") in CHECKPOINTED
params = [p for p in model.parameters() if p.requires_grad]
optimizer = torch.optim.Adam(params, lr=0.001)
