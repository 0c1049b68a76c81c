"""_estimate.py: vramscope on the model in your notebook: estimate, sweep, max_batch and plan.

    import vramscope, torchvision
    r = vramscope.estimate(torchvision.models.resnet50(), (64, 3, 224, 224), device="sim:h100-80g", dtype="amp")
    r.max_allocated, r.max_reserved, r.nvidia_smi, r.fits, r.peak     # bytes, from the allocator
    p = vramscope.plan("meta-llama/Llama-3.1-8B", device="sim:rtx4090", dtype="bf16", batch=4, seq=2048, lora=16)
    p.best.code                                                       # what `vramscope plan --code` writes

A model is an nn.Module with example `inputs` (tensors, meta ones too, or shapes: exported at
the operator level by vramscope.export), a Hugging Face name found in the local cache or a
folder (--hf-model), a config.json (--hf-config), a model file, or a zoo name. Every other
keyword is the command's option of that name (`lora_targets="all"` is `--lora-targets all`;
True a flag; a list a comma list), and every figure is the command's `--format json` one, bit
for bit: the same library runs (libvramscope_planner.so, _planner.py).
"""
from __future__ import annotations

import json
import re
import tempfile
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Sequence

from . import _planner

PEAK_PARTS = ("weights", "gradients", "optimizer_state", "optimizer_temporaries", "activations", "workspaces",
              "logits", "communication", "other")


def _human(n: Optional[float]) -> str:
    if n is None:
        return "-"
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def _pandas():
    try:
        import pandas
    except ImportError:
        raise ImportError("to_pandas() needs pandas: pip install pandas") from None
    return pandas


def _options(options: Dict[str, Any]) -> List[str]:
    """Python keywords as the command's options."""
    out: List[str] = []
    for key, value in options.items():
        if value is None or value is False:
            continue
        flag = "--" + key.replace("_", "-")
        if key == "compile":
            # torch.compile's step: True is PyTorch's default partition; a list sweeps settings
            # ("eager", "on", an activation_memory_budget, "reduce-overhead" for CUDA graphs).
            settings = value if isinstance(value, (list, tuple)) else [value]
            out += ["--compile", ",".join("on" if v is True else str(v) for v in settings)]
            continue
        if key == "checkpoint":
            # Modules by path, a checkpoint_sequential segment count, or transformers' per-layer mode.
            if isinstance(value, int) and not isinstance(value, bool):
                out += ["--segments", str(value)]
            elif isinstance(value, str):
                out += ["--gradient-checkpointing", value]
            else:
                out += ["--checkpoint-modules", ",".join(value)]
        elif value is True:
            out.append(flag)
        elif isinstance(value, (list, tuple)):
            out += [flag, ",".join(str(v) for v in value)]
        else:
            out += [flag, str(value)]
    return out


def _input_specs(inputs):
    """Example inputs as the exporter's InputSpecs: a tensor (meta too), a shape, a sequence of
    them (positional), or a dict of them (keywords)."""
    import torch
    from .export import InputSpec

    def spec(value, keyword=None):
        if isinstance(value, torch.Tensor):
            kind = "float" if value.is_floating_point() else "int64"
            return InputSpec(list(value.shape), kind, keyword)
        if isinstance(value, (tuple, list)) and value and all(isinstance(d, int) for d in value):
            return InputSpec(list(value), "float", keyword)
        raise _planner.UsageError(f"inputs: expected tensors or shapes (tuples of ints), got {type(value).__name__}")

    if isinstance(inputs, dict):
        return [spec(v, k) for k, v in inputs.items()]
    if isinstance(inputs, torch.Tensor) or (isinstance(inputs, (tuple, list)) and inputs
                                            and all(isinstance(d, int) for d in inputs)):
        return [spec(inputs)]
    if isinstance(inputs, (tuple, list)) and inputs:
        return [spec(v) for v in inputs]
    raise _planner.UsageError("inputs: give the forward's example inputs (tensors or shapes) for an nn.Module")


def _model_options(model, inputs, work: Path, export: Dict[str, Any]) -> List[str]:
    if isinstance(model, (str, Path)):
        text = str(model)
        path = Path(text)
        if path.is_file() and path.suffix == ".json":
            # A model file says so near its start; anything else is taken for a config.json (the
            # command then says what is wrong with it). An exported model may be a gigabyte.
            try:
                with open(path, "rb") as f:
                    head = f.read(4096).decode("utf-8", errors="replace")
            except OSError as e:
                raise _planner.UsageError(f"{text}: {e}") from None
            if re.search(r'"format"\s*:\s*"vramscope-model"', head):
                return ["--model-file", text]
            return ["--hf-config", text]
        if path.is_dir() or "/" in text:
            return ["--hf-model", text]
        return ["--model", text]
    try:
        import torch
    except ImportError:
        raise _planner.UsageError("a model object needs torch; give a name, a config or a model file") from None
    if not isinstance(model, torch.nn.Module):
        raise _planner.UsageError(f"model: expected an nn.Module, a name or a path, got {type(model).__name__}")
    if inputs is None and hasattr(model, "config") and hasattr(model.config, "to_json_file") \
            and any(c.__name__ == "PreTrainedModel" for c in type(model).__mro__):
        # A transformers model without example inputs: its config, as --hf-config reads one.
        file = work / "config.json"
        model.config.to_json_file(str(file))
        return ["--hf-config", str(file)]
    if inputs is None:
        raise _planner.UsageError("inputs: an nn.Module needs example inputs (tensors or shapes, batch first)")
    from .export import export as export_model, export_ops
    specs = _input_specs(inputs)
    name = export.get("name") or type(model).__name__
    # As `python -m vramscope.export` chooses: one plain input maps onto the model file's layers
    # where they hold the model (the form plan's module search and --segments work on), else
    # the operators are recorded.
    transformers = any(c.__name__ == "PreTrainedModel" for c in type(model).__mro__)
    simple = len(specs) == 1 and specs[0].keyword is None and not export.get("output") and not export.get("amp") \
        and not export.get("compile")
    if simple and not transformers and not export.get("seq_input"):
        doc = export_model(model, specs[0].shape, name=name, input_dtype=specs[0].dtype, loss=export.get("loss"),
                           level="auto")
    else:
        doc = export_ops(model, specs, name=name, loss=export.get("loss"), output_key=export.get("output"),
                         loss_inside=export.get("loss") == "none", seq=bool(export.get("seq_input")),
                         amp=export.get("amp"), compile=bool(export.get("compile")))
    file = work / "model.json"
    file.write_text(json.dumps(doc))
    return ["--model-file", str(file)]


class _Bar:
    """progress=True: a tqdm bar where tqdm is installed (nothing otherwise); a callable is told
    (runs done, runs expected or 0, what runs now) itself."""

    def __init__(self, progress):
        self.progress, self.bar = progress, None

    def __call__(self, done: int, total: int, item: str) -> None:
        if callable(self.progress):
            self.progress(done, total, item)
            return
        if self.bar is None:
            try:
                from tqdm.auto import tqdm
            except ImportError:
                self.progress = None
                return
            self.bar = tqdm(total=total or None, unit="run", leave=False)
        self.bar.set_description(item[:40], refresh=False)
        self.bar.update(done - self.bar.n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class _Work:
    """A folder for an exported model file, removed when its owner is collected (or at exit)."""

    def __init__(self):
        import shutil
        import weakref
        self.path = Path(tempfile.mkdtemp(prefix="vramscope-"))
        self._finalizer = weakref.finalize(self, shutil.rmtree, str(self.path), True)

    def cleanup(self) -> None:
        self._finalizer()


def _split(options: Dict[str, Any], model):
    """(progress, the exporter's options) taken out of `options`, which keeps the command's."""
    progress = options.pop("progress", None)
    export = {k: options.pop(k) for k in ("loss", "output", "name", "seq_input", "amp") if k in options}
    settings = options.get("compile")
    settings = settings if isinstance(settings, (list, tuple)) else [settings]
    if any(v not in (None, False, "eager") for v in settings) and not isinstance(model, (str, Path)):
        export["compile"] = True  # the joint graph torch.compile partitions, recorded with the operators
    if export and isinstance(model, (str, Path)):
        raise _planner.UsageError(f"{', '.join(export)}: export options, for an nn.Module; {model} is not one")
    return progress, export


def _run(command: List[str], model, inputs, options: Dict[str, Any], keep: bool = False):
    """(the document, the model's options, the folder of its export or None). An nn.Module is
    exported into a folder removed on return, unless `keep` (then its owner's)."""
    progress, export = _split(options, model)
    bar = _Bar(progress) if progress else None
    work = None if isinstance(model, (str, Path)) else _Work()  # named: no file to write
    done = False
    try:
        model_args = _model_options(model, inputs, work.path if work else Path("."), export)
        document = _planner.run(command + model_args + _options(options), bar)
        done = True
    finally:
        if bar is not None:
            bar.close()
        if work is not None and not (keep and done):
            work.cleanup()
    return document, model_args, work


class Row:
    """One configuration's figures, in bytes, as `vramscope sweep --format json` gives them."""

    def __init__(self, row: Dict[str, Any], document: Optional[Dict[str, Any]] = None):
        self.row, self.document = row, document or {}

    def __getattr__(self, name):
        try:
            return self.__dict__["row"][name]
        except KeyError:
            raise AttributeError(name) from None

    @property
    def nvidia_smi(self) -> int:
        """The most nvidia-smi would have shown for the process (context and driver rounding too)."""
        return self.row["max_nvidia_smi"]

    @property
    def peak(self) -> Dict[str, int]:
        """What the max allocated is made of, in bytes."""
        return {part: self.row.get(f"peak_{part}", 0) for part in PEAK_PARTS}

    def __repr__(self) -> str:
        fits = "fits" if self.row.get("fits") else "does not fit"
        if "max_batch" in self.row:
            fits = f"max batch {self.row['max_batch']}"
        label = self.row.get("label") or self.row.get("plan", "")
        return (f"<{type(self).__name__} {label}: max allocated {_human(self.row.get('max_allocated'))}, "
                f"max reserved {_human(self.row.get('max_reserved'))}, nvidia-smi {_human(self.row.get('max_nvidia_smi'))}, "
                f"{fits}>")


class Estimate(Row):
    """estimate(): one configuration's step through the caching allocator. .modules and .plot
    come from `vramscope trace` of the same configuration, run when first asked for."""

    def __init__(self, row: Dict[str, Any], document: Dict[str, Any], trace_args: List[str], work=None):
        super().__init__(row, document)
        # The model's options and the configuration's, as trace takes them; `work` holds an
        # exported model file for as long as this estimate lives.
        self.__dict__["_trace_args"], self.__dict__["_work"], self.__dict__["_trace"] = trace_args, work, None

    def __getstate__(self):
        # Pickled, it keeps its figures and the trace if it ran; not the exported file's folder.
        state = dict(self.__dict__)
        state["_work"] = None
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)

    @property
    def device(self) -> Dict[str, Any]:
        return self.document.get("device", {})

    @property
    def trace(self) -> Dict[str, Any]:
        """`vramscope trace`'s document for this configuration: the per-module log ("modules"),
        its figures, the memory plot ("plot", SVG) and the printed log ("text")."""
        if self.__dict__["_trace"] is None:
            self.__dict__["_trace"] = _planner.run(["trace"] + self.__dict__["_trace_args"], None)
        return self.__dict__["_trace"]

    @property
    def modules(self) -> List[Dict[str, Any]]:
        """The per-module log, a dict per line (hook, module, type, depth, allocated, change,
        peak_between, reserved, nvidia_smi; bytes), as `vramscope trace --log` writes it."""
        return self.trace["modules"]

    @property
    def plot(self) -> str:
        """Memory over the step as an SVG document (`vramscope trace --plot`)."""
        return self.trace["plot"]

    def to_pandas(self):
        """The per-module log as a pandas DataFrame (pandas needed)."""
        return _pandas().DataFrame(self.modules)

    def _repr_html_(self) -> str:
        r = self.row
        head = "".join(f"<th>{h}</th>" for h in ("max allocated", "max reserved", "nvidia-smi", "fits"))
        cells = "".join(f"<td>{v}</td>" for v in (_human(r.get("max_allocated")), _human(r.get("max_reserved")),
                                                   _human(r.get("max_nvidia_smi")), "yes" if r.get("fits") else "no"))
        peak = "".join(f"<tr><td>{part.replace('_', ' ')}</td><td>{_human(n)}</td></tr>"
                       for part, n in self.peak.items() if n)
        model = self.document.get("model", {}).get("name", "")
        try:
            plot = self.plot
        except _planner.VramscopeError as e:  # the figures above stand without the curve
            plot = f"<p>(no plot: {e})</p>"
        return (f"<div><b>{model}</b> on {self.device.get('name', '')}<table><tr>{head}</tr><tr>{cells}</tr></table>"
                f"<table><tr><th colspan=2>the peak holds</th></tr>{peak}</table>{plot}</div>")


class Rows:
    """sweep() and max_batch(): every configuration's row."""

    def __init__(self, document: Dict[str, Any], row=Row):
        self.document = document
        self.rows = [row(r, document) for r in document.get("rows", [])]

    def __iter__(self):
        return iter(self.rows)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]

    def to_pandas(self):
        """The rows as a pandas DataFrame (pandas needed)."""
        return _pandas().DataFrame([r.row for r in self.rows])

    def _repr_html_(self) -> str:
        keys = [k for k in ("label", "batch", "seq", "max_allocated", "max_reserved", "max_nvidia_smi", "fits")
                if any(k in r.row for r in self.rows)]
        head = "".join(f"<th>{k.replace('_', ' ')}</th>" for k in keys)
        body = "".join("<tr>" + "".join(f"<td>{_human(r.row.get(k)) if k.startswith('max') else r.row.get(k)}</td>"
                                        for k in keys) + "</tr>" for r in self.rows)
        return f"<table><tr>{head}</tr>{body}</table>"


class Plan(Row):
    """One plan of plan(): its changes and figures; the best one has its code."""

    @property
    def code(self) -> Optional[str]:
        """The PyTorch code `vramscope plan --code` writes for the best plan (None for the others)."""
        return self.__dict__.get("_code")

    def apply(self, model, **names) -> Dict[str, Any]:
        """Runs the plan's code on `model` in place (the wrapping --code writes: the checkpointed
        modules, and whatever else the plan changes) and returns what the code defined
        (`optimizer`, ...). `names` are further variables the code may read."""
        if self.code is None:
            raise _planner.UsageError("apply: only the best plan has code (Plans.best)")
        scope: Dict[str, Any] = {"model": model, **names}
        exec(compile(self.code, "<vramscope plan>", "exec"), scope)  # noqa: S102 (our own generated code)
        return {k: v for k, v in scope.items() if k not in ("model", "__builtins__") and k not in names}


class Plans:
    """plan(): the plans tried, ranked; .best is the first that fits (None if none does)."""

    def __init__(self, document: Dict[str, Any]):
        self.document = document
        self.plans = [Plan(p, document) for p in document.get("plans", [])]
        best = document.get("best")
        self.best = self.plans[best] if isinstance(best, int) and 0 <= best < len(self.plans) else None
        if self.best is not None:
            self.best.__dict__["_code"] = document.get("code")
        self.given = Row(document.get("given", {}), document)

    def __iter__(self):
        return iter(self.plans)

    def __len__(self) -> int:
        return len(self.plans)

    def to_pandas(self):
        """The plans as a pandas DataFrame (pandas needed)."""
        return _pandas().DataFrame([p.row for p in self.plans])

    def _repr_html_(self) -> str:
        rows = "".join(f"<tr><td>{'*' if p is self.best else ''}</td><td>{p.row.get('plan', '')}</td>"
                       f"<td>{_human(p.row.get('max_allocated'))}</td><td>{_human(p.row.get('max_nvidia_smi'))}</td>"
                       f"<td>{'yes' if p.row.get('fits') else 'no'}</td></tr>" for p in self.plans)
        return ("<table><tr><th></th><th>plan</th><th>max allocated</th><th>nvidia-smi</th><th>fits</th></tr>"
                f"{rows}</table>")


def estimate(model, inputs=None, **options) -> Estimate:
    """One configuration's training step on the device: `vramscope sweep` with one row
    (segments 0 unless `checkpoint` says otherwise); .modules and .plot trace it."""
    # One row: no checkpoint_sequential segments unless `checkpoint` is a segment count.
    if not (isinstance(options.get("checkpoint"), int) and not isinstance(options.get("checkpoint"), bool)):
        options.setdefault("segments", 0)
    options.setdefault("dtype", "f32")
    for key in ("batch", "seq", "dtype", "segments", "alloc_conf", "parallel"):
        if isinstance(options.get(key), (list, tuple)):
            raise _planner.UsageError(f"{key}: estimate takes one; sweep() takes a list")
    document, model_args, work = _run(["sweep"], model, inputs, options, keep=True)
    rows = document.get("rows", [])
    if len(rows) != 1:
        if work is not None:
            work.cleanup()
        raise _planner.RunFailed(f"estimate: the run gave {len(rows)} rows; sweep() takes several configurations")
    # The same configuration for trace: its steps as the sweep's (2 unless given); the sweep's
    # files (plot=) are the sweep's, not written again.
    trace_options = {k: v for k, v in options.items() if k not in ("plot",)}
    trace_options.setdefault("steps", 2)
    return Estimate(rows[0], document, model_args + _options(trace_options), work)


def sweep(model, inputs=None, **options) -> Rows:
    """`vramscope sweep`: a row per configuration (lists of batch, seq, dtype, segments, ...),
    with a progress bar where tqdm is installed (progress=False: none; a callable: told itself)."""
    options.setdefault("progress", True)
    return Rows(_run(["sweep"], model, inputs, options)[0])


def max_batch(model, inputs=None, **options) -> Rows:
    """`vramscope sweep --max-batch`: the largest batch that fits, per configuration."""
    options["max_batch"] = True
    options.setdefault("progress", True)
    return Rows(_run(["sweep"], model, inputs, options)[0])


def plan(model, inputs=None, **options) -> Plans:
    """`vramscope plan`: what makes the step fit, ranked; .best.code and .best.apply(model);
    a progress bar as sweep's."""
    options.setdefault("progress", True)
    return Plans(_run(["plan"], model, inputs, options)[0])
