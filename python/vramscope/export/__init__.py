"""Export a vramscope model file (docs/MODEL_FILES.md) from your PyTorch code.

    python3 -m vramscope.export my_model.py:make_model --input 8,3,224,224 -o net.json
    vramscope sweep --model-file net.json --segments auto --dtype f32,amp

`my_model.py:make_model` is a file (or an importable module, `torchvision.models:resnet50`)
and a callable in it that returns your nn.Module. The model is built on the meta device (no
weights are allocated, nothing is downloaded, no GPU is needed), traced with torch.fx, and
every module and function is mapped onto the model file's layers. The file keeps your
module names (vramscope's per-module logs use them), frozen parameters, in-place flags and
the loss. Whatever cannot be mapped is listed in one error, each with its place in your
source; nothing is dropped silently. An exception of your code (importing the file, building
the model, its forward) or an input the model does not take is one line with its place too;
VRAMSCOPE_EXPORT_DEBUG=1 lets the original exception through, with its traceback.

The graph must be series-parallel: a chain of layers where a tensor may fork into branches
that join again (a residual add, a concatenation, a gate, a matmul). Sizes are those of
--input; the first dimension is the batch, which stays an option of the file (--batch).
"""
from __future__ import annotations

import copy
import math
import warnings
from typing import List, Optional, Sequence

from .._hub import find_hf_config, name_from_path
from ._errors import ExportError, one_line
from ._graph import Graph
from ._layers import leaves
from ._model import build_model, load_factory, meta_device
from ._structure import Structure, finish
from ._trace import propagate_shapes, trace

__all__ = ["ExportError", "LOSSES", "LEVELS", "build_model", "export", "export_hf_config", "export_ops", "load_factory",
           "meta_device"]

LEVELS = ("auto", "layers", "ops")  # auto: the layer form where it maps, else the operator graph

LOSSES = ("cross_entropy", "mse", "bce_with_logits", "sum", "none")
MAX_SIZE = 2 ** 40  # per dimension: far beyond any GPU, and far from int64's overflow


def export(model, input_shape: Sequence[int], *, name: str = "model", input_dtype: str = "float",
           loss: Optional[str] = None, description: str = "", source: str = "", level: str = "layers") -> dict:
    """The model file (a dict) of `model` for an input of `input_shape` (batch first).
    `level`: "layers" maps the model onto the model file's layers (torch.fx), "ops" records its
    operators (the "graph" form), "auto" (the command's default) tries layers and records
    operators where they cannot hold the model."""
    if level not in LEVELS:
        raise ExportError([f"--level {level!r}: expected one of {', '.join(LEVELS)}"], "bad option")
    spec = InputSpec(list(input_shape), input_dtype)  # checks the sizes and the dtype, for both forms
    if level == "ops":
        return export_ops(model, [spec], name=name, loss=loss, description=description, source=source)
    try:
        return _export_layers(model, spec.shape, name=name, input_dtype=spec.dtype, loss=loss,
                              description=description, source=source)
    except ExportError as layer_error:
        if level == "layers" or layer_error.headline in ("bad input", "bad loss", "no loss"):
            raise
        try:
            return export_ops(model, [spec], name=name, loss=loss, description=description, source=source)
        except ExportError as op_error:
            # What the layer form could not hold, the operators' reason says more; an error of the
            # model itself (its forward raising, an input it does not take) the layer form's does.
            if "cannot be mapped" in layer_error.headline or "torch.fx cannot trace" in layer_error.headline:
                raise ExportError(op_error.problems, op_error.headline + " (as operators; the layer form: "
                                  + layer_error.headline + ")") from None
            raise layer_error from None


def _check_shape(input_shape: Sequence[int]) -> None:
    """Positive sizes, batch first, that torch holds in int64 with room for the batch + 2 the
    last recording (and the layer form's second pass, batch + 1) runs."""
    shape = [int(s) for s in input_shape]
    if not shape or any(s <= 0 for s in shape):
        raise ExportError([f"--input {input_shape}: expected positive sizes, the batch first"], "bad input")
    if any(s > MAX_SIZE for s in shape) or math.prod([shape[0] + 2] + shape[1:]) >= 2 ** 63:
        raise ExportError([f"--input {input_shape}: sizes too large (at most 2**40 per dimension, fewer than "
                           "2**63 elements in all)"], "bad input")


class InputSpec:
    """One input of the forward: its shape (batch first), dtype (float or int64) and keyword
    (None: positional)."""

    def __init__(self, shape: List[int], dtype: str = "float", keyword: Optional[str] = None):
        if dtype not in ("float", "int64"):
            raise ExportError([f"--input-dtype {dtype!r}: expected float or int64"], "bad input")
        _check_shape(shape)
        self.shape, self.dtype, self.keyword = [int(s) for s in shape], dtype, keyword


def export_ops(model, inputs: Sequence["InputSpec"], *, name: str = "model", loss: Optional[str] = None,
               description: str = "", source: str = "", seq: bool = False, output_key: Optional[str] = None,
               loss_inside: bool = False, amp: Optional[str] = None, compile: bool = False) -> dict:
    """The operator-level model file of `model` (docs/EXPORT.md, "Operator graphs").
    `compile`: also the joint graph torch.compile partitions ("compiled", docs/OPERATORS.md).
    `seq`: the inputs' second dimension is a sequence length that becomes the file's `seq`.
    `amp` ("bf16", "f16"): recorded under CUDA's autocast, for --dtype amp-bf16 / amp."""
    import torch
    from ._opfile import export_graph
    model = _on_meta(model, amp)
    high = None
    if inputs[0].dtype == "int64":
        # Token ids are drawn below the embedding's size; other int64 inputs (a diffusion
        # timestep, labels) only take memory.
        try:
            high = _embedding_size(model)
        except ExportError:
            high = 2
    batch = inputs[0].shape[0]
    seq_len = inputs[0].shape[1] if seq else None

    def make_inputs(b: int, s: int):
        args, kwargs = [], {}
        for spec in inputs:
            shape = [b] + list(spec.shape[1:])
            if seq and len(shape) > 1:
                shape[1] = s
            if spec.dtype == "int64":
                t = torch.empty(shape, dtype=torch.int64, device="meta")
            else:
                t = torch.empty(shape, dtype=torch.float32 if amp else torch.bfloat16, device="meta")
            if spec.keyword:
                kwargs[spec.keyword] = t
            else:
                args.append(t)
        return tuple(args), kwargs

    def loss_of(shape_written, shape_now):
        if loss_inside:
            return {"type": "none"}
        return _loss(loss, list(shape_now), batch)

    note = None
    first = inputs[0]
    dims = ["batch"] + (["seq"] if seq and len(first.shape) > 1 else []) + list(first.shape[2 if seq else 1:])
    note = {"shape": dims}
    if first.dtype == "int64":
        note.update({"dtype": "int64", "high": high})
    doc = export_graph(model, make_inputs, name=name, batch=batch, seq=seq_len, loss_of=loss_of,
                       output_key=output_key, description=description, source=source, input_note=note,
                       autocast=amp)
    if compile:
        from ._compiled import compiled_document, step_with_loss
        from ._opfile import _pick
        if amp:
            raise ExportError(["--compile records the step in the run's dtype; autocast is not modelled with it yet "
                               "(drop --amp)"], "bad arguments")
        graph = doc["graph"]
        out_shape = graph["tensors"][graph["output"]]["shape"]
        step, with_target = step_with_loss(make_inputs, doc["loss"], _pick(output_key), out_shape)
        doc["compiled"] = compiled_document(model, with_target, batch, seq_len, step)
    return doc


def export_hf_config(config_path: str, *, batch: int = 1, seq: int = 128, name: Optional[str] = None,
                     attn: str = "sdpa", amp: Optional[str] = None, lora: int = 0,
                     lora_targets: Optional[str] = None, gradient_checkpointing: Optional[str] = None,
                     compile: bool = False, expert_parallel: int = 0) -> dict:
    """The operator-level model file of a transformers causal LM built from `config_path`
    (AutoModelForCausalLM.from_config on the meta device; nothing is downloaded). The loss is
    transformers' own (labels given), so the file's output is that loss. `expert_parallel` N > 1:
    rank 0 of transformers' expert parallel over N ranks (_expert_parallel.py), its experts
    modules named in the file's "expert_parallel"."""
    import json as _json
    from pathlib import Path as _Path
    import torch
    try:
        import transformers
    except ImportError:
        raise ExportError(["--hf-config needs transformers in this Python (pip install transformers)"],
                          "cannot export the model") from None
    try:
        text = _Path(config_path).read_text()
        values = _json.loads(text)
    except (OSError, ValueError) as e:
        raise ExportError([f"{config_path}: {e}"], "cannot read the config") from None
    if not isinstance(values, dict) or not isinstance(values.get("model_type"), str):
        raise ExportError([f"{config_path}: expected a config.json object with a model_type"], "cannot read the config")
    model_type = values.pop("model_type")
    try:
        config = transformers.AutoConfig.for_model(model_type, **values)
    except (ValueError, KeyError, TypeError) as e:
        raise ExportError([f"{config_path}: {one_line(e)}"], "transformers refuses the config") from None
    config._attn_implementation = attn
    try:
        with warnings.catch_warnings(), torch.device("meta"):
            warnings.simplefilter("ignore")
            model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn)
    except (ValueError, KeyError, TypeError, AttributeError, NotImplementedError) as e:
        raise ExportError([f"{config_path}: {one_line(e)}"], "transformers cannot build the model") from None
    # amp: f32 weights, as trained under autocast (a config's torch_dtype builds bf16 ones).
    model = model.to(torch.float32 if amp else torch.bfloat16).train()
    if lora:
        model = with_lora(model, lora, lora_targets)
    if gradient_checkpointing:
        enable_gradient_checkpointing(model, gradient_checkpointing)
    vocab = model.get_input_embeddings().num_embeddings
    experts, groups = [], []
    if expert_parallel:
        if amp or lora or compile:
            raise ExportError(["--expert-parallel records the run's dtype without --amp, --lora or --compile"],
                              "bad arguments")
        from ._expert_parallel import distribute
        experts, groups = distribute(model, expert_parallel)

    def make_inputs(b: int, s: int):
        ids = torch.empty((b, s), dtype=torch.int64, device="meta")
        return (), {"input_ids": ids, "labels": ids, "use_cache": False}

    from ._opfile import export_graph
    label = name or name_from_path(config_path)
    # At batch 1 transformers also looks for packed sequences in the position ids
    # (masking_utils.py, _preprocess_mask_arguments -> find_packed_sequence_indices), a branch
    # on the size: one graph for every batch is recorded from batch 2 up.
    doc = export_graph(model, make_inputs, name=label, batch=max(batch, 2), seq=seq,
                        loss_of=lambda written, now: {"type": "none"},
                        output_key="loss", description=f"{type(model).__name__} ({model_type}) from {config_path}",
                        source=f"exported by vramscope.export --hf-config with transformers {transformers.__version__}, "
                               f"attn_implementation={attn}" + (f", autocast {amp}" if amp else "") +
                               (f", PEFT LoRA r={lora} on {lora_targets or 'its default targets'}" if lora else "") +
                               (f", gradient checkpointing {gradient_checkpointing}" if gradient_checkpointing else "") +
                               (f", rank 0 of expert parallel over {expert_parallel} ranks (DistributedConfig(ep_size="
                                f"{expert_parallel}), AllToAllEP, PyTorch's fake process group)" if experts else ""),
                        input_note={"shape": ["batch", "seq"], "dtype": "int64", "high": vocab}, autocast=amp)
    if experts:
        doc["expert_parallel"] = {"ranks": expert_parallel, "modules": experts, "fsdp": groups,
                                  **doc.get("expert_parallel", {})}
    if compile:
        from ._compiled import compiled_document
        if amp or gradient_checkpointing:
            raise ExportError(["--compile records the step in the run's dtype without checkpointing (torch.compile's "
                               "partitioner decides what to recompute); drop --amp and --gradient-checkpointing"],
                              "bad arguments")
        doc["compiled"] = compiled_document(model, make_inputs, max(batch, 2), seq,
                                            lambda m, *a, **k: m(*a, **k).loss)
    if batch == 1:
        doc["options"]["batch"] = 1
        doc["graph"].setdefault("assumed", []).append(
            "recorded at batch 2 and up: at batch 1 transformers' packed-sequence check (masking_utils.py, "
            "find_packed_sequence_indices) runs other small operators on [1, seq] tensors, left out")
    return doc


def enable_gradient_checkpointing(model, mode: str) -> None:
    """model.gradient_checkpointing_enable() as a training script calls it: "on" takes the
    installed transformers' default (non-reentrant in 5.x), "reentrant" and "non-reentrant" say
    use_reentrant. Each decoder layer is then recorded as a checkpointed call."""
    if mode not in ("on", "reentrant", "non-reentrant"):
        raise ExportError([f"--gradient-checkpointing {mode!r}: expected on, reentrant or non-reentrant"], "bad arguments")
    kwargs = None if mode == "on" else {"use_reentrant": mode == "reentrant"}
    target = model.get_base_model() if hasattr(model, "get_base_model") else model
    if not getattr(target, "supports_gradient_checkpointing", False):
        raise ExportError([f"--gradient-checkpointing: {type(target).__name__} does not support it"], "bad arguments")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # 5.24 names it activation_checkpointing_enable too
        target.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def with_lora(model, rank: int, targets: Optional[str] = None):
    """PEFT's LoRA on `model`, as a fine-tuning script applies it: get_peft_model with
    LoraConfig(r=rank, lora_alpha=8, lora_dropout=0.0) (PEFT's defaults but r), the base
    weights frozen and the adapters on `targets` ("q_proj+v_proj"; "all" is PEFT's
    "all-linear"; None: PEFT's default for the model type). The adapters are made on the meta
    device, and PEFT keeps them in f32 beside half base weights (autocast_adapter_dtype)."""
    import torch
    try:
        import peft
    except ImportError:
        raise ExportError(["--lora needs peft in this Python (pip install peft)"], "cannot export the model") from None
    if rank <= 0 or rank > 65536:
        raise ExportError([f"--lora {rank}: expected a rank from 1 to 65536"], "bad arguments")
    chosen = None if not targets else "all-linear" if targets == "all" else targets.split("+")
    config = peft.LoraConfig(r=rank, lora_alpha=8, lora_dropout=0.0, target_modules=chosen)
    try:
        with warnings.catch_warnings(), torch.device("meta"):
            warnings.simplefilter("ignore")
            return peft.get_peft_model(model, config).train()
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        hint = [] if targets else ["give --lora-targets, for example q_proj+v_proj (PEFT has no default for this model)"]
        raise ExportError([f"--lora: {one_line(e)}"] + hint, "PEFT cannot adapt the model") from None


def _on_meta(model, amp: Optional[str] = None):
    """A copy of `model` on the meta device in bfloat16 (the recording's stand-in for the run's
    floating dtype, _ops.py), or in f32 for autocast: never the user's weights, and the user's
    model left as it was."""
    import torch
    model = copy.deepcopy(model).to("meta")
    model = model.to(torch.float32 if amp else torch.bfloat16)
    model.train()
    return model


def _export_layers(model, input_shape: Sequence[int], *, name: str = "model", input_dtype: str = "float",
                   loss: Optional[str] = None, description: str = "", source: str = "") -> dict:
    """The layer form (torch.fx onto the model file's layers)."""
    import torch
    shape = list(input_shape)  # checked by export() (InputSpec)
    dtype = torch.int64 if input_dtype == "int64" else torch.float32
    high = _embedding_size(model) if input_dtype == "int64" else 0
    tensors = list(model.parameters()) + list(model.buffers())
    if any(t.device.type != "meta" for t in tensors):
        model = copy.deepcopy(model).to("meta")  # shapes only: never the user's weights
    model.train()
    if type(model) in leaves():
        model = torch.nn.Sequential(model)  # torch.fx traces into the root: make the layer its child
    gm, marks, checkpoint_problems = trace(model)
    metas = propagate_shapes(gm, shape, dtype)
    # The file keeps the batch free: a second pass tells sizes that follow it from fixed ones.
    metas_next = propagate_shapes(gm, [shape[0] + 1] + shape[1:], dtype,
                                  f"the model runs on an input of shape {shape} but not with a batch of "
                                  f"{shape[0] + 1} (vramscope varies the batch: a size fixed in forward?)")
    graph = Graph(gm, model, metas, metas_next, shape[0])
    problems = checkpoint_problems + graph.problems
    if graph.output is None or graph.source is None:
        raise ExportError(problems or ["the model returns nothing traceable"], f"cannot export {name}")
    if graph.output is graph.source and not problems:
        raise ExportError(["the model has no layers: its forward returns its input (an empty nn.Sequential?)"],
                          f"cannot export {name}")
    structure = Structure(graph, marks)
    layers = []
    if not problems:
        try:
            layers = structure.build()
        except Exception as e:  # noqa: BLE001 (a graph this mapping did not foresee: say so, no traceback)
            problems.append(f"the graph's structure was not understood ({type(e).__name__}: {e}); please report it")
    problems += structure.problems
    if problems:
        raise ExportError(problems, f"cannot export {name}: {len(problems)} "
                                    f"thing{'s' if len(problems) != 1 else ''} cannot be mapped to a model file")
    layers = finish(layers)
    if not layers:  # a forward of sizes only, or of what the structure drops (aliases)
        raise ExportError(["the model has no layers a model file can hold"], f"cannot export {name}")
    out_shape = list(metas[graph.output.name].shape)
    doc = {"format": "vramscope-model", "version": 1, "name": name}
    if description:
        doc["description"] = description
    doc["source"] = source or f"exported by vramscope.export from {type(model).__name__}"
    doc["options"] = {"batch": shape[0]}
    doc["input"] = {"shape": ["batch"] + shape[1:]}
    if input_dtype == "int64":
        doc["input"].update({"dtype": "int64", "high": high})
    doc["loss"] = _loss(loss, out_shape, shape[0])
    doc["layers"] = layers
    return doc


def _embedding_size(model) -> int:
    import torch.nn as nn
    for m in model.modules():
        if isinstance(m, nn.Embedding):
            return m.num_embeddings
    raise ExportError(["--input-dtype int64 needs an nn.Embedding to read the token ids (its num_embeddings "
                       "bounds them)"], "bad input")


def _loss(loss: Optional[str], out_shape: List[int], batch: int) -> dict:
    if loss is None:
        if len(out_shape) >= 2:
            loss = "cross_entropy"
        else:
            raise ExportError([f"the model returns {out_shape}: give --loss (one of {', '.join(LOSSES)})"], "no loss")
    if loss not in LOSSES:
        raise ExportError([f"--loss {loss!r}: expected one of {', '.join(LOSSES)}"], "bad loss")
    if loss == "cross_entropy":
        if len(out_shape) < 2:
            raise ExportError([f"cross_entropy takes logits [..., classes]; the model returns {out_shape}"], "bad loss")
        return {"type": "cross_entropy", "classes": out_shape[-1]}
    if loss == "none" and out_shape:
        raise ExportError([f"--loss none takes a model that returns its loss (a scalar); it returns {out_shape}"],
                          "bad loss")
    return {"type": loss}
