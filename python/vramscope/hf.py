"""vramscope.hf: vramscope inside the Hugging Face Trainer.

    from vramscope.hf import MemoryCallback
    trainer = Trainer(model, args, train_dataset=..., callbacks=[MemoryCallback(seq=2048, device="sim:h100-80g")])

Before training it prints the prediction for the Trainer's setup (vramscope.from_training_args:
the batch, accumulation, precision, checkpointing, optimizer, DeepSpeed or FSDP2 config), and
after the first steps on a GPU it prints what PyTorch measured beside it
(torch.cuda.max_memory_allocated and max_memory_reserved) and by how much they differ.
"""
from __future__ import annotations

from typing import Any, Dict, Optional

try:
    from transformers import TrainerCallback
except ImportError:  # the callback needs transformers; the rest of vramscope does not
    TrainerCallback = object  # type: ignore[misc,assignment]


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


class MemoryCallback(TrainerCallback):
    """Prints vramscope's prediction at on_train_begin and, on CUDA, PyTorch's measured peaks
    after `steps` optimizer steps. `options` are from_training_args' (seq=..., device=...,
    lora=...). The prediction and the comparison stay on the callback (`.prediction`,
    `.measured`)."""

    def __init__(self, steps: int = 2, inputs=None, printer=print, **options: Any):
        if TrainerCallback is object:
            raise ImportError("vramscope.hf.MemoryCallback needs transformers: pip install transformers")
        self.steps, self.inputs, self.print, self.options = steps, inputs, printer, options
        self.prediction = None
        self.measured: Optional[Dict[str, int]] = None

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        from ._training_args import from_training_args
        options = dict(self.options)
        target = model
        base = getattr(model, "get_base_model", None)
        if callable(base) and self.inputs is None:
            # PEFT: the base model's config, with its LoRA rank and targets as the options say them.
            target = base()
            lora = getattr(model, "peft_config", {}).get("default")
            if lora is not None and "lora" not in options:
                options["lora"] = lora.r
                targets = lora.target_modules
                if targets and "lora_targets" not in options:
                    options["lora_targets"] = "+".join(sorted(targets)) if not isinstance(targets, str) else targets
        self.prediction = p = from_training_args(args, target, self.inputs, **options)
        self.print(f"vramscope: predicted for this Trainer setup ({' '.join(f'{k}={v}' for k, v in p.options.items())}): "
                   f"max allocated {_gib(p.max_allocated)}, max reserved {_gib(p.max_reserved)}, "
                   f"nvidia-smi {_gib(p.nvidia_smi)} on {p.device.get('name', '')}: "
                   f"{'fits' if p.fits else 'does not fit'}")
        for line in p.unmodelled:
            self.print(f"vramscope: not modelled: {line}")

    def on_step_end(self, args, state, control, **kwargs):
        if self.prediction is None or self.measured is not None or state.global_step < self.steps:
            return
        import torch
        if not torch.cuda.is_available():
            return
        self.measured = {"max_allocated": torch.cuda.max_memory_allocated(),
                         "max_reserved": torch.cuda.max_memory_reserved()}
        for key, label in (("max_allocated", "max allocated"), ("max_reserved", "max reserved")):
            predicted, measured = getattr(self.prediction, key), self.measured[key]
            self.print(f"vramscope: {label} after {state.global_step} steps: measured {_gib(measured)}, predicted "
                       f"{_gib(predicted)} ({100 * (predicted - measured) / max(measured, 1):+.1f}%)")
