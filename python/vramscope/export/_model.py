"""Loading the user's model: the factory named on the command line, built on the meta device."""
from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any, Callable, Optional, Tuple

from .._stack import installed_stack
from ._errors import ExportError
from ._trace import user_location


def load_factory(target: str) -> Tuple[Callable[[], Any], str]:
    """`path/to/file.py:func` or `package.module:func` -> (the callable, its name)."""
    if ":" not in target:
        raise ExportError([f"{target!r}: expected FILE.py:FUNCTION or module:FUNCTION (for example "
                           "my_model.py:make_model or torchvision.models:resnet50)"], "bad model argument")
    where, name = target.rsplit(":", 1)
    if where.endswith(".py") or os.sep in where:
        path = Path(where)
        if not path.is_file():
            raise ExportError([f"{where}: no such file"], "bad model argument")
        spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(spec)
        sys.path.insert(0, str(path.resolve().parent))  # its own imports, as `python3 file.py` has them
        try:
            spec.loader.exec_module(module)
        finally:
            sys.path.pop(0)
    else:
        module = importlib.import_module(where)
    factory = module
    for part in name.split("."):
        if not hasattr(factory, part):
            raise ExportError([f"{where} has no {name!r}"], "bad model argument")
        factory = getattr(factory, part)
    if not callable(factory):
        raise ExportError([f"{where}:{name} is not callable (give a function or class that returns the model)"],
                          "bad model argument")
    return factory, name.split(".")[-1]


@contextlib.contextmanager
def meta_device():
    """Builds modules without allocating their weights: PyTorch 2's torch.device("meta")
    context, or on 1.13 a TorchFunctionMode that sends every factory function there."""
    import torch
    if hasattr(torch, "get_default_device") or hasattr(torch, "set_default_device"):
        with torch.device("meta"):
            yield
        return
    from torch.overrides import TorchFunctionMode
    factories = {torch.empty, torch.zeros, torch.ones, torch.full, torch.rand, torch.randn, torch.randint,
                 torch.tensor, torch.as_tensor, torch.arange, torch.eye, torch.linspace, torch.empty_strided}

    class Meta(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = dict(kwargs or {})
            if func in factories:
                kwargs["device"] = "meta"
            return func(*args, **kwargs)

    with Meta():
        yield


HF_TYPES = ("llama", "mistral", "qwen2", "gpt2")  # what `vramscope --hf-config` reads


def build_model(factory: Callable[[], Any]):
    import torch
    try:
        with meta_device():
            model = factory()
    except Exception as e:  # noqa: BLE001
        raise ExportError([f"{user_location(e.__traceback__)}: {type(e).__name__}: {e}"],
                          "building the model failed") from None
    if not isinstance(model, torch.nn.Module):
        raise ExportError([f"the factory returned {type(model).__name__}, not a torch.nn.Module"])
    model.train()
    return model


def refuse_transformers(model, output: Optional[str]) -> None:
    """A Hugging Face transformers model: torch.fx cannot follow its forward (masks, caches,
    Python branches on shapes), and vramscope reads its config.json directly instead."""
    if not any(c.__name__ == "PreTrainedModel" for c in type(model).__mro__) or not hasattr(model, "config"):
        return
    model_type = getattr(model.config, "model_type", "?")
    if model_type not in HF_TYPES:
        raise ExportError([f"{type(model).__name__} is a transformers model (model_type {model_type!r}); vramscope "
                           f"models transformers from their config.json, for model types {', '.join(HF_TYPES)}"],
                          "not exported")
    config = Path(output).with_suffix(".config.json") if output else Path(f"{model_type}.config.json")
    model.config.to_json_file(str(config))
    stack = installed_stack()
    command = f"vramscope sweep --hf-config {config}" + (f" --stack {stack}" if stack else "")
    raise ExportError([f"{type(model).__name__} is a transformers model: vramscope models it from its config "
                       f"(attention, checkpointing, LoRA and QLoRA as transformers and PEFT run them); its config "
                       f"is in {config}: run `{command}` (the versions installed here; docs/TRANSFORMERS.md)"],
                      "not exported")
