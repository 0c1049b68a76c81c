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
from typing import List, Optional, Sequence

from ._errors import ExportError
from ._graph import Graph
from ._layers import leaves
from ._model import build_model, load_factory, meta_device
from ._structure import Structure, finish
from ._trace import propagate_shapes, trace

__all__ = ["ExportError", "LOSSES", "build_model", "export", "load_factory", "meta_device"]

LOSSES = ("cross_entropy", "mse", "bce_with_logits", "sum", "none")
MAX_SIZE = 2 ** 40  # per dimension: far beyond any GPU, and far from int64's overflow


def export(model, input_shape: Sequence[int], *, name: str = "model", input_dtype: str = "float",
           loss: Optional[str] = None, description: str = "", source: str = "") -> dict:
    """The model file (a dict) of `model` for an input of `input_shape` (batch first)."""
    import torch
    shape = [int(s) for s in input_shape]
    if not shape or any(s <= 0 for s in shape):
        raise ExportError([f"--input {input_shape}: expected positive sizes, the batch first"], "bad input")
    # Sizes torch holds in int64, with room for the batch + 1 the second pass runs.
    if any(s > MAX_SIZE for s in shape) or math.prod([shape[0] + 1] + shape[1:]) >= 2 ** 63:
        raise ExportError([f"--input {input_shape}: sizes too large (at most 2**40 per dimension, fewer than "
                           "2**63 elements in all)"], "bad input")
    if input_dtype not in ("float", "int64"):
        raise ExportError([f"--input-dtype {input_dtype!r}: expected float or int64"], "bad input")
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
