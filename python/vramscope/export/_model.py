"""Loading the user's model: the factory named on the command line, built on the meta device."""
from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import sys
import warnings
from pathlib import Path
from typing import Any, Callable, Optional, Tuple

from .._stack import installed_stack
from ._errors import ExportError, debugging, one_line
from ._trace import user_location


def load_factory(target: str) -> Tuple[Callable[[], Any], str]:
    """`path/to/file.py:func` or `package.module:func` -> (the callable, its name)."""
    usage = "expected FILE.py:FUNCTION or module:FUNCTION (for example my_model.py:make_model or " \
            "torchvision.models:resnet50)"
    if ":" not in target:
        raise ExportError([f"{target!r}: {usage}"], "bad model argument")
    where, name = target.rsplit(":", 1)
    if not where.strip() or not name.strip() or "" in name.split("."):
        raise ExportError([f"{target!r}: {usage}"], "bad model argument")
    if where.endswith(".py") or os.sep in where:
        path = Path(where)
        if not path.is_file():
            raise ExportError([f"{where}: no such file"], "bad model argument")
        run = lambda: _exec_file(path)  # noqa: E731
    else:
        run = lambda: _import(where)  # noqa: E731
    module = _run_user_code(run, f"importing {where} failed", f"{where} called {{exit}} while being imported")
    factory = module
    for part in name.split("."):
        if not hasattr(factory, part):
            raise ExportError([f"{where} has no {name!r}"], "bad model argument")
        factory = getattr(factory, part)
    if not callable(factory):
        raise ExportError([f"{where}:{name} is not callable (give a function or class that returns the model)"],
                          "bad model argument")
    return factory, name.split(".")[-1]


def _exec_file(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(path.resolve().parent))  # its own imports, as `python3 file.py` has them
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.pop(0)
    return module


def _import(where: str):
    try:
        return importlib.import_module(where)
    except ModuleNotFoundError as e:
        # The module named on the command line, not one that it imports: say which.
        if e.name and (where == e.name or where.startswith(e.name + ".")):
            raise ExportError([f"no module named {e.name!r} (give FILE.py:FUNCTION for a file, or a module that "
                               f"`python3 -c 'import {where}'` finds)"], "bad model argument") from None
        raise


def _run_user_code(run: Callable[[], Any], failed: str, exited: str) -> Any:
    """Runs the user's code: whatever it raises, sys.exit included, becomes one line with its
    place in their source under the headline `failed` (or `exited`, its "{exit}" filled in);
    VRAMSCOPE_EXPORT_DEBUG=1 lets it through."""
    try:
        return run()
    except ExportError:
        raise
    except SyntaxError as e:  # no frame of its own: the file and line are the error's
        if debugging():
            raise
        where = f"{e.filename}:{e.lineno}" if e.filename else "?"
        raise ExportError([f"{where}: {type(e).__name__}: {e.msg}"], failed) from None
    except (Exception, SystemExit) as e:  # noqa: BLE001 (the user's code: reported, never a traceback)
        if debugging():
            raise
        where = user_location(e.__traceback__)
        if isinstance(e, SystemExit):  # sys.exit in a model file: no model, and no silent exit status
            raise ExportError([where or "(no frame outside torch)"], exited.format(exit=one_line(e))) from None
        raise ExportError([f"{where}: {one_line(e)}" if where else one_line(e)], failed) from None


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


def build_model(factory: Callable[[], Any], label: str = "the factory"):
    """`factory()` on the meta device; `label` (FILE:FUNCTION) names it in the errors."""
    import torch

    def build():
        with warnings.catch_warnings(), meta_device():
            # torch's note on a zero-size layer: the exporter refuses that layer by name instead.
            warnings.filterwarnings("ignore", "Initializing zero-element tensors")
            try:
                return factory()
            except (RuntimeError, NotImplementedError) as e:
                if "meta" not in str(e):
                    raise
        # A constructor that reads values (regnet's .tolist()) cannot run on the meta device:
        # built on the CPU (its weights allocated there once), then moved to meta.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "Initializing zero-element tensors")
            return factory().to("meta")

    model = _run_user_code(build, "building the model failed", f"{label} called {{exit}} while building the model")
    if not isinstance(model, torch.nn.Module):
        raise ExportError([f"{label} returned {type(model).__name__}, not a torch.nn.Module"])
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
