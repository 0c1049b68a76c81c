"""_training_args.py: vramscope.from_training_args: the estimate for the Hugging Face Trainer
setup you already have (a transformers.TrainingArguments, with its DeepSpeed or FSDP config).

What the Trainer does with each argument, and the command option that models it:
- per_device_train_batch_size: --batch; gradient_accumulation_steps: --accumulation;
- bf16 / fp16: the step under autocast with f32 weights (--dtype amp-bf16 / amp), or, under
  DeepSpeed, its bf16 / f16 engine (--dtype bf16 / f16);
- gradient_checkpointing (+ gradient_checkpointing_kwargs' use_reentrant): each decoder layer
  checkpointed (--gradient-checkpointing; transformers' default is non-reentrant in 5.x);
- optim: adamw_* is Adam (--optimizer adam), the 8-bit bitsandbytes ones adam8bit, sgd sgd;
- use_liger_kernel: the causal LM loss by Liger's fused linear cross entropy (--model-options
  loss=liger-flce), for the decoder families vramscope builds;
- deepspeed (a path or a dict): zero_optimization.stage 1/2/3 as --parallel zeroS:N with the
  bucket and stage3_ settings it models; fsdp with fsdp_config's fsdp_version 2 as fsdp:N.
What it cannot model is named in `.unmodelled`, never dropped silently.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from . import _planner

# transformers' OptimizerNames (training_args.py) -> the command's --optimizer.
_ADAM = {"adamw_torch", "adamw_torch_fused", "adamw_hf", "adamw", "adamw_torch_xla", "adamw_torch_npu_fused",
         "adamw_apex_fused", "adamw_anyprecision"}
_ADAM8 = {"adamw_bnb_8bit", "adamw_8bit", "adam_8bit", "paged_adamw_8bit", "paged_adam_8bit", "adamw_bnb_8bit_paged"}
# DeepSpeed zero_optimization keys the zero engines take (--parallel-options), by stage.
_ZERO_KEYS = {"reduce_bucket_size", "overlap_comm", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold",
              "stage3_model_persistence_threshold", "stage3_max_live_parameters", "stage3_max_reuse_distance",
              "sub_group_size"}


def _value(value):
    return str(value).lower() if isinstance(value, bool) else str(int(value)) if isinstance(value, float) else str(value)


def _deepspeed(config, gpus: int, unmodelled: List[str]) -> Tuple[Dict[str, Any], Optional[str]]:
    """(--parallel and --parallel-options, --dtype) of a DeepSpeed config."""
    if isinstance(config, (str, Path)):
        config = json.loads(Path(config).read_text())
    if not isinstance(config, dict):
        raise _planner.UsageError(f"deepspeed: expected a config dict or a JSON file, got {type(config).__name__}")
    zero = config.get("zero_optimization", {}) or {}
    stage = int(zero.get("stage", 0))
    if stage not in (1, 2, 3):
        unmodelled.append(f"deepspeed zero_optimization.stage {stage}: only stages 1, 2 and 3 are modelled")
        return {}, None
    options = []
    for key, value in zero.items():
        if key == "stage":
            continue
        if key in _ZERO_KEYS and value != "auto" and (stage == 3 or not key.startswith(("stage3_", "sub_group"))):
            options.append(f"{key}={_value(value)}")
        elif (key == "offload_optimizer" or (key == "offload_param" and stage == 3)) and isinstance(value, dict) \
                and value.get("device", "none") in ("cpu", "none"):
            # {"device": "cpu", "pin_memory": ...}: DeepSpeedCPUAdam with the master on the host;
            # ZeRO-3's parameter partitions on the host. vramscope has one pin_memory for both.
            if value.get("device") == "cpu":
                options.append(f"{key}=cpu")
                if value.get("pin_memory") is False and "pin_memory=false" not in options:
                    options.append("pin_memory=false")
            for sub_key in sorted(set(value) - {"device", "pin_memory"}):
                unmodelled.append(f"deepspeed zero_optimization.{key}.{sub_key}: not modelled")
        elif key.startswith("offload_"):
            unmodelled.append(f"deepspeed zero_optimization.{key}={value}: not modelled yet (offload_optimizer to "
                              "the CPU is, and offload_param under stage 3)")
        elif value != "auto":
            unmodelled.append(f"deepspeed zero_optimization.{key}={value}: not modelled")
    dtype = "bf16" if (config.get("bf16") or {}).get("enabled") in (True, "auto") else \
        "f16" if (config.get("fp16") or {}).get("enabled") in (True, "auto") else None
    parallel = {"parallel": f"zero{stage}:{gpus}"}
    if options:
        parallel["parallel_options"] = ",".join(options)
    return parallel, dtype


def from_training_args(args, model, inputs=None, *, gpus: Optional[int] = None, **options):
    """The estimate of one Trainer step of `model` under `args` (a TrainingArguments, or anything
    with its attributes): vramscope.estimate with the options the arguments stand for, which
    `.options` lists, and `.unmodelled` what they ask that is not modelled. `gpus`: the world
    size for DeepSpeed and FSDP (default: args.world_size); one process over args.n_gpu > 1 GPUs
    is nn.DataParallel (dp:N, GPU 0's figures). Keywords override or add options."""
    unmodelled: List[str] = []
    get = lambda name, default=None: getattr(args, name, default)  # noqa: E731
    mapped: Dict[str, Any] = {"batch": get("per_device_train_batch_size", 8)}
    if (get("gradient_accumulation_steps", 1) or 1) > 1:
        mapped["accumulation"] = get("gradient_accumulation_steps")
    world = gpus or get("world_size", 1) or 1
    # One process that sees several GPUs (no launcher): Trainer wraps the model in nn.DataParallel
    # (trainer.py _wrap_model: args.n_gpu > 1) and feeds it per_device_train_batch_size x n_gpu
    # samples a step (TrainingArguments.train_batch_size).
    replicas = (get("n_gpu", 1) or 1) if world == 1 else 1
    precision = "amp-bf16" if get("bf16") else "amp" if get("fp16") else "f32"
    ds = get("deepspeed")
    if ds:
        parallel, ds_dtype = _deepspeed(ds, world, unmodelled)
        mapped.update(parallel)
        precision = ds_dtype or ("bf16" if get("bf16") else "f16" if get("fp16") else precision)
    elif get("fsdp"):
        version = int((get("fsdp_config") or {}).get("fsdp_version", 1))
        if version == 2:
            mapped["parallel"] = f"fsdp:{world}"
            wanted = " ".join(get("fsdp")) if isinstance(get("fsdp"), (list, tuple)) else str(get("fsdp"))
            if "shard_grad_op" in wanted:
                mapped["parallel_options"] = "reshard_after_forward=false"
        else:
            unmodelled.append("fsdp with fsdp_version 1 (FullyShardedDataParallel): only FSDP2 (fsdp_version 2) "
                              "is modelled")
    elif world > 1:
        mapped["parallel"] = f"ddp:{world}"
    elif replicas > 1:
        mapped["parallel"] = f"dp:{replicas}"
        mapped["parallel_options"] = "gpu=0"  # the one that holds the module and the optimizer
        mapped["batch"] = mapped["batch"] * replicas
    mapped["dtype"] = precision
    if get("gradient_checkpointing"):
        reentrant = (get("gradient_checkpointing_kwargs") or {}).get("use_reentrant")
        mapped["checkpoint"] = "on" if reentrant is None else "reentrant" if reentrant else "non-reentrant"
    optim = str(getattr(get("optim", "adamw_torch"), "value", get("optim", "adamw_torch")))
    if optim in _ADAM:
        mapped["optimizer"] = "adam"
    elif optim in _ADAM8:
        mapped["optimizer"] = "adam8bit"
        if optim.startswith("paged"):
            unmodelled.append(f"optim {optim}: paging to the host under memory pressure is not modelled (its state "
                              "counts as resident)")
    elif optim == "sgd":
        mapped["optimizer"] = "sgd"
    else:
        unmodelled.append(f"optim {optim}: modelled as Adam")
        mapped["optimizer"] = "adam"
    if get("torch_compile"):
        # Trainer: model = torch.compile(model, backend=..., mode=...); inductor's list_mode_options
        # (torch/_inductor/__init__.py): reduce-overhead and max-autotune replay CUDA graphs.
        mode = get("torch_compile_mode")
        cudagraphs = mode in ("reduce-overhead", "max-autotune")
        blocker = ("under autocast (bf16 / fp16)" if precision.startswith("amp") else
                   "with gradient checkpointing" if get("gradient_checkpointing") else
                   "over several GPUs" if "parallel" in mapped else
                   "with gradient accumulation under CUDA graphs" if cudagraphs and "accumulation" in mapped else None)
        if blocker:
            unmodelled.append(f"torch_compile {blocker}: the compiled step is not modelled there (estimated eager)")
        else:
            mapped["compile"] = "reduce-overhead" if cudagraphs else "on"
            if (get("torch_compile_backend") or "inductor") != "inductor":
                unmodelled.append(f"torch_compile_backend {get('torch_compile_backend')}: modelled as inductor's")
            if mode in ("max-autotune", "max-autotune-no-cudagraphs"):
                unmodelled.append(f"torch_compile_mode {mode}: autotuning's benchmark buffers are not modelled")
    if (get("max_grad_norm") or 0) > 0:
        unmodelled.append(f"max_grad_norm {get('max_grad_norm')}: gradient clipping's temporaries are not modelled")
    liger = bool(get("use_liger_kernel"))
    if liger:
        # Trainer applies liger-kernel's patch for the model type: the loss by its fused linear
        # cross entropy (model option loss=liger-flce); its RoPE, RMSNorm and SwiGLU kernels too.
        mapped["model_options"] = "loss=liger-flce"
        unmodelled.append("use_liger_kernel: the fused linear cross entropy is modelled; Liger's RoPE, RMSNorm and "
                          "SwiGLU kernels are not (the layers keep what transformers' keep)")
    mapped.update(options)
    from ._estimate import estimate
    try:
        result = estimate(model, inputs, **mapped)
    except _planner.UsageError as e:
        if not liger or "loss" not in str(e) or mapped.get("model_options") != "loss=liger-flce":
            raise
        # A recorded model (not one of the built-in decoder families) takes no loss option.
        del mapped["model_options"]
        unmodelled[-1] = "use_liger_kernel: not modelled for this model (its recording computes transformers' loss)"
        result = estimate(model, inputs, **mapped)
    result.__dict__["options"] = mapped
    result.__dict__["unmodelled"] = unmodelled
    return result
