"""vramscope.from_training_args: a transformers TrainingArguments (and its DeepSpeed config) read
into the command's options, its estimate equal to the equivalent command line's."""
from __future__ import annotations

import json
import warnings

import pytest

import vramscope
from test_planner import command_json, same_rows

LLAMA = {"architectures": ["LlamaForCausalLM"], "hidden_act": "silu", "hidden_size": 256, "intermediate_size": 512,
         "max_position_embeddings": 512, "model_type": "llama", "num_attention_heads": 8, "num_hidden_layers": 4,
         "num_key_value_heads": 2, "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "tie_word_embeddings": False,
         "vocab_size": 1000}


def training_args(tmp_path, **kw):
    transformers = pytest.importorskip("transformers")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # use_cpu: this machine has no GPU, and transformers refuses bf16 on a CPU without it.
        return transformers.TrainingArguments(output_dir=str(tmp_path / "out"), report_to=[], use_cpu=True, **kw)


def test_lora_gradient_checkpointing_bf16_and_8bit_adam(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(LLAMA))
    args = training_args(tmp_path, per_device_train_batch_size=2, gradient_accumulation_steps=2, bf16=True,
                         gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": False},
                         optim="adamw_bnb_8bit")
    ours = vramscope.from_training_args(args, str(config), seq=256, lora=16, device="sim:h100-80g")
    theirs = command_json("sweep", "--hf-config", str(config), "--seq", "256", "--batch", "2", "--accumulation", "2",
                          "--dtype", "amp-bf16", "--gradient-checkpointing", "non-reentrant", "--optimizer", "adam8bit",
                          "--lora", "16", "--device", "sim:h100-80g", "--segments", "0")
    same_rows([ours.row], theirs["rows"])
    assert ours.options["accumulation"] == 2 and ours.options["checkpoint"] == "non-reentrant"
    assert any("max_grad_norm" in u for u in ours.unmodelled)


def test_a_deepspeed_zero3_config(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(LLAMA))
    args = training_args(tmp_path, per_device_train_batch_size=4, bf16=True, optim="adamw_torch", max_grad_norm=0)
    # Set after construction: TrainingArguments checks that DeepSpeed is installed, and it is not here.
    args.deepspeed = {"zero_optimization": {"stage": 3, "reduce_bucket_size": 5e8, "stage3_prefetch_bucket_size": 5e7,
                                            "offload_optimizer": {"device": "cpu"}, "contiguous_gradients": True,
                                            "offload_param": {"device": "cpu"}},
                      "bf16": {"enabled": True}}
    ours = vramscope.from_training_args(args, str(config), gpus=8, seq=256, device="sim:h100-80g")
    theirs = command_json("sweep", "--hf-config", str(config), "--seq", "256", "--batch", "4", "--dtype", "bf16",
                          "--parallel", "zero3:8", "--parallel-options",
                          "reduce_bucket_size=500000000,stage3_prefetch_bucket_size=50000000,offload_optimizer=cpu,"
                          "offload_param=cpu",
                          "--optimizer", "adam",
                          "--device", "sim:h100-80g", "--segments", "0")
    same_rows([ours.row], theirs["rows"])
    assert ours.options["parallel"] == "zero3:8"
    assert ours.options["parallel_options"].endswith("offload_optimizer=cpu,offload_param=cpu")
    assert not any(u.startswith("deepspeed zero_optimization.offload_") for u in ours.unmodelled)
    assert any("contiguous_gradients" in u for u in ours.unmodelled)
    assert not any("max_grad_norm" in u for u in ours.unmodelled)


def test_one_process_over_several_gpus_is_data_parallel(tmp_path):
    # Trainer wraps the model in nn.DataParallel when one process sees several GPUs (n_gpu > 1,
    # no launcher) and feeds it per_device_train_batch_size x n_gpu samples a step.
    config = tmp_path / "config.json"
    config.write_text(json.dumps(LLAMA))
    args = training_args(tmp_path, per_device_train_batch_size=2, bf16=True, max_grad_norm=0)
    args._n_gpu = 2  # what _setup_devices finds on a machine with two GPUs; this one has none
    ours = vramscope.from_training_args(args, str(config), seq=128, device="sim:h100-80g")
    assert ours.options["parallel"] == "dp:2" and ours.options["batch"] == 4
    assert ours.options["parallel_options"] == "gpu=0"
    theirs = command_json("sweep", "--hf-config", str(config), "--seq", "128", "--batch", "4", "--dtype", "amp-bf16",
                          "--parallel", "dp:2", "--parallel-options", "gpu=0", "--optimizer", "adam",
                          "--device", "sim:h100-80g", "--segments", "0")
    same_rows([ours.row], theirs["rows"])


def test_use_liger_kernel_is_the_fused_loss(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(LLAMA))
    args = training_args(tmp_path, per_device_train_batch_size=2, bf16=True, max_grad_norm=0)
    args.use_liger_kernel = True  # set after construction, as liger-kernel is not installed here
    ours = vramscope.from_training_args(args, str(config), seq=256, device="sim:h100-80g")
    theirs = command_json("sweep", "--hf-config", str(config), "--seq", "256", "--batch", "2", "--dtype", "amp-bf16",
                          "--model-options", "loss=liger-flce", "--optimizer", "adam", "--device", "sim:h100-80g",
                          "--segments", "0")
    same_rows([ours.row], theirs["rows"])
    assert any("use_liger_kernel" in u and "RMSNorm" in u for u in ours.unmodelled)
    args.use_liger_kernel = False
    plain = vramscope.from_training_args(args, str(config), seq=256, device="sim:h100-80g")
    assert ours.max_allocated < plain.max_allocated  # no logits, no f32 copy of them


def test_torch_compile_under_autocast_is_named_and_estimated_eager(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(LLAMA))
    args = training_args(tmp_path, per_device_train_batch_size=2, bf16=True, max_grad_norm=0)
    args.torch_compile, args.torch_compile_mode = True, "reduce-overhead"  # after construction: no dynamo check
    ours = vramscope.from_training_args(args, str(config), seq=256, device="sim:h100-80g")
    assert "compile" not in ours.options
    assert any(u.startswith("torch_compile under autocast") for u in ours.unmodelled)
    args.torch_compile = False
    same_rows([ours.row], [vramscope.from_training_args(args, str(config), seq=256, device="sim:h100-80g").row])
