"""vramscope.hf.MemoryCallback in a real Trainer run on the CPU: the prediction printed before
training is from_training_args' for the same arguments (on a GPU it compares with PyTorch's
measured peaks after the first steps)."""
from __future__ import annotations

import warnings

import pytest

import vramscope
from test_training_args import LLAMA, training_args


def test_the_callback_predicts_the_trainers_setup(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    from vramscope.hf import MemoryCallback
    config = transformers.LlamaConfig(**{k: v for k, v in LLAMA.items() if k not in ("architectures", "model_type")})
    model = transformers.AutoModelForCausalLM.from_config(config)
    args = training_args(tmp_path, per_device_train_batch_size=2, max_steps=2, gradient_checkpointing=True,
                         logging_steps=100, save_strategy="no")
    data = [{"input_ids": torch.randint(3, 1000, (64,)), "labels": torch.randint(3, 1000, (64,))} for _ in range(8)]
    said = []
    callback = MemoryCallback(seq=64, device="sim:h100-80g", printer=said.append)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        transformers.Trainer(model=model, args=args, train_dataset=data, callbacks=[callback]).train()
    expected = vramscope.from_training_args(args, model, seq=64, device="sim:h100-80g")
    assert callback.prediction.row == {**expected.row, "step_ms": callback.prediction.row["step_ms"]}
    assert said[0].startswith("vramscope: predicted for this Trainer setup (batch=2 dtype=f32 checkpoint=on")
    assert f"max allocated {expected.max_allocated / 2**30:.2f} GiB" in said[0]
    assert any("max_grad_norm" in line for line in said[1:])
    assert callback.measured is None  # no GPU here: nothing measured to compare
