"""torch.nn modules -> model-file layers: each mapper reads a module's arguments."""
from __future__ import annotations

import functools
from typing import Any, Callable, Dict

from ._errors import Unsupported




def _single(value, what: str) -> int:
    """A square kernel / stride / padding: PyTorch's int or (a, a)."""
    if isinstance(value, (tuple, list)):
        if len(set(value)) != 1:
            raise Unsupported(f"{what} {tuple(value)} is not square (model files take one size)")
        value = value[0]
    if not isinstance(value, int):
        raise Unsupported(f"{what} {value!r} is not a size")
    return value


def _conv(m, kind):
    if m.padding_mode != "zeros":
        raise Unsupported(f"padding_mode={m.padding_mode!r} (zeros only)")
    if isinstance(m.padding, str):
        raise Unsupported(f"padding={m.padding!r} (give the sizes)")
    spec = {"type": kind, "in_channels": m.in_channels, "out_channels": m.out_channels,
            "kernel_size": _single(m.kernel_size, "kernel_size")}
    for key, default in (("stride", 1), ("padding", 0), ("dilation", 1)):
        v = _single(getattr(m, key), key)
        if v != default:
            spec[key] = v
    if kind == "ConvTranspose2d":
        op = _single(m.output_padding, "output_padding")
        if op:
            spec["output_padding"] = op
        if m.groups != 1:
            raise Unsupported("groups > 1 in ConvTranspose2d")
    elif m.groups != 1:
        spec["groups"] = m.groups
    if m.bias is None:
        spec["bias"] = False
    return spec


def _norm(m, kind):
    if not m.affine or not m.track_running_stats:
        raise Unsupported("affine=False or track_running_stats=False")
    spec = {"type": kind, "num_features": m.num_features}
    if m.eps != 1e-5:
        spec["eps"] = m.eps
    if m.momentum != 0.1 and m.momentum is not None:
        spec["momentum"] = m.momentum
    if m.momentum is None:
        raise Unsupported("momentum=None (a cumulative average)")
    return spec


def _pool(m, kind):
    if getattr(m, "ceil_mode", False):
        raise Unsupported("ceil_mode=True")
    spec = {"type": kind, "kernel_size": _single(m.kernel_size, "kernel_size")}
    stride = _single(m.stride if m.stride is not None else m.kernel_size, "stride")
    if stride != spec["kernel_size"]:
        spec["stride"] = stride
    padding = _single(m.padding, "padding")
    if padding:
        spec["padding"] = padding
    if kind == "MaxPool2d" and (_single(m.dilation, "dilation") != 1 or m.return_indices):
        raise Unsupported("dilation or return_indices")
    if kind == "AvgPool2d":
        if m.divisor_override is not None:
            raise Unsupported("divisor_override")
        if not m.count_include_pad:
            spec["count_include_pad"] = False
    return spec


def _layer_norm(m):
    if len(m.normalized_shape) != 1 or not m.elementwise_affine:
        raise Unsupported("normalized_shape over more than the last dimension, or elementwise_affine=False")
    spec = {"type": "LayerNorm", "normalized_shape": m.normalized_shape[0]}
    if m.eps != 1e-5:
        spec["eps"] = m.eps
    if getattr(m, "bias", True) is None:
        raise Unsupported("bias=False")
    return spec


def _rms_norm(m):
    if len(m.normalized_shape) != 1:
        raise Unsupported("normalized_shape over more than the last dimension")
    spec = {"type": "RMSNorm", "normalized_shape": m.normalized_shape[0]}
    if m.eps is not None:
        spec["eps"] = m.eps
    if not m.elementwise_affine:
        spec["elementwise_affine"] = False
    return spec


def _mha(m):
    if not m._qkv_same_embed_dim or m.bias_k is not None:
        raise Unsupported("kdim/vdim other than embed_dim, or add_bias_kv")
    spec = {"type": "MultiheadAttention", "embed_dim": m.embed_dim, "num_heads": m.num_heads}
    if m.dropout:
        spec["dropout"] = m.dropout
    if m.in_proj_bias is None:
        spec["bias"] = False
    if m.batch_first:
        spec["batch_first"] = True
    return spec


def _embedding(m):
    if m.max_norm is not None or m.sparse:
        raise Unsupported("max_norm or sparse")
    return {"type": "Embedding", "num_embeddings": m.num_embeddings, "embedding_dim": m.embedding_dim}


def _inplace(kind):
    return lambda m: {"type": kind, **({"inplace": True} if m.inplace else {})}


def _leaky(m):
    spec = {"type": "LeakyReLU"}
    if m.negative_slope != 0.01:
        spec["negative_slope"] = m.negative_slope
    if m.inplace:
        spec["inplace"] = True
    return spec


def _hardtanh(m):
    import torch
    if type(m) is torch.nn.ReLU6:
        return _inplace("ReLU6")(m)
    spec = {"type": "Hardtanh", "min_val": m.min_val, "max_val": m.max_val}
    if m.inplace:
        spec["inplace"] = True
    return spec


def _softmax(m):
    return {"type": "Softmax", "dim": -1}  # which dimension m.dim names is checked against the input's rank


@functools.lru_cache(maxsize=None)
def leaves() -> Dict[type, Callable[[Any], dict]]:
    """torch.nn module classes -> the function that writes their model-file layer."""
    import torch.nn as nn
    table = {
        nn.Linear: lambda m: {"type": "Linear", "in_features": m.in_features, "out_features": m.out_features,
                              **({} if m.bias is not None else {"bias": False})},
        nn.Conv2d: lambda m: _conv(m, "Conv2d"),
        nn.Conv1d: lambda m: _conv(m, "Conv1d"),
        nn.ConvTranspose2d: lambda m: _conv(m, "ConvTranspose2d"),
        nn.BatchNorm2d: lambda m: _norm(m, "BatchNorm2d"),
        nn.BatchNorm1d: lambda m: _norm(m, "BatchNorm1d"),
        nn.GroupNorm: lambda m: {"type": "GroupNorm", "num_groups": m.num_groups, "num_channels": m.num_channels,
                                 **({} if m.eps == 1e-5 else {"eps": m.eps}),
                                 **({} if m.affine else {"affine": False})},
        nn.LayerNorm: _layer_norm,
        nn.ReLU: _inplace("ReLU"),
        nn.ReLU6: _hardtanh,
        nn.Hardtanh: _hardtanh,
        nn.LeakyReLU: _leaky,
        nn.SiLU: _inplace("SiLU"),
        nn.Sigmoid: lambda m: {"type": "Sigmoid"},
        nn.Tanh: lambda m: {"type": "Tanh"},
        nn.GELU: lambda m: {"type": "GELU", **({"approximate": "tanh"} if m.approximate == "tanh" else {})},
        nn.Softmax: _softmax,
        nn.Dropout: lambda m: {"type": "Dropout", "p": m.p},
        nn.Identity: lambda m: {"type": "Identity"},
        nn.MaxPool2d: lambda m: _pool(m, "MaxPool2d"),
        nn.AvgPool2d: lambda m: _pool(m, "AvgPool2d"),
        nn.AdaptiveAvgPool2d: lambda m: {"type": "AdaptiveAvgPool2d", "output_size": _output_size(m.output_size)},
        nn.Flatten: lambda m: _flatten_spec(m.start_dim, m.end_dim),
        nn.Embedding: _embedding,
        nn.MultiheadAttention: _mha,
    }
    if hasattr(nn, "RMSNorm"):
        table[nn.RMSNorm] = _rms_norm
    return table


def _output_size(size):
    if isinstance(size, (tuple, list)):
        if None in size:
            raise Unsupported("output_size with None")
        return size[0] if size[0] == size[1] else list(size)
    return size


def _flatten_spec(start, end):
    if end != -1:
        raise Unsupported(f"end_dim={end} (model files flatten to the last dimension)")
    return {"type": "Flatten", **({"start_dim": start} if start != 1 else {})}
