"""python3 -m vramscope.export FILE.py:FUNCTION --input N,... -o net.json (see __init__)."""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Optional, Sequence

from .._hub import find_hf_config
from . import LEVELS, LOSSES, ExportError, InputSpec, build_model, export, export_hf_config, export_ops, load_factory
from ._errors import debugging, one_line
from ._model import refuse_transformers


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python3 -m vramscope.export",
        description="Write a vramscope model file from a PyTorch nn.Module, or from a Hugging Face config.json: "
                    "built on the meta device (no weights, no GPU, nothing downloaded), your module names kept. "
                    "The layer form maps the model onto the model file's layers (torch.fx); the operator form "
                    "records PyTorch's operators as one training forward runs them, with what autograd keeps "
                    "for backward (any model PyTorch runs).",
        epilog="examples:\n"
               "  python3 -m vramscope.export my_model.py:make_model --input 8,3,224,224 -o net.json\n"
               "  python3 -m vramscope.export torchvision.models:resnet50 --input 32,3,224,224 -o resnet50.json\n"
               "  python3 -m vramscope.export timm:create_model --arg convnext_tiny --input 32,3,224,224 -o c.json\n"
               "  python3 -m vramscope.export lm.py:TinyLM --input 4,128 --input-dtype int64 -o lm.json\n"
               "  python3 -m vramscope.export --hf-config config.json --batch 4 --seq 2048 -o qwen3.json\n"
               "  python3 -m vramscope.export unet.py:make --input 2,4,64,64 --input t=2 --input ctx=2,77,768 "
               "--output-key sample --loss mse -o unet.json\n"
               "then: vramscope sweep --model-file net.json --dtype f32,bf16\n"
               "errors are one line each; VRAMSCOPE_EXPORT_DEBUG=1 shows the traceback behind one",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", help="FILE.py:FUNCTION or module:FUNCTION returning the nn.Module "
                                                 "(a class works)")
    parser.add_argument("--arg", action="append", default=[], metavar="VALUE",
                        help="a positional argument for FUNCTION (repeat for more; numbers stay numbers)")
    parser.add_argument("--input", action="append", metavar="[NAME=]N,D,...[:int64]",
                        help="an input's shape, batch first; repeat for several inputs; NAME= passes it as a "
                             "keyword argument; :int64 for token ids (the batch stays an option of the file)")
    parser.add_argument("--input-dtype", default="float", choices=("float", "int64"),
                        help="the first input's dtype: float (the run's precision) or int64 token ids")
    parser.add_argument("--loss", choices=LOSSES,
                        help="the loss (default: cross_entropy over the output's last dimension; none when the "
                             "model returns its loss)")
    parser.add_argument("--output-key", metavar="KEY", help="the output the loss starts from, when the model returns "
                                                       "several (a dict key, attribute or index)")
    parser.add_argument("--level", choices=LEVELS, default="auto",
                        help="layers (torch.fx onto the model file's layers), ops (PyTorch's operators), or auto: "
                             "layers where they map, else ops (default)")
    parser.add_argument("--hf-config", metavar="CONFIG.json",
                        help="a transformers config.json: AutoModelForCausalLM.from_config, its loss on labels")
    parser.add_argument("--hf-model", metavar="NAME",
                        help="a Hugging Face model by name (org/name) from the local cache ($HF_HUB_CACHE, $HF_HOME/hub "
                             "or ~/.cache/huggingface/hub; nothing is downloaded) or a folder with its config.json, as "
                             "--hf-config")
    parser.add_argument("--batch", type=int, default=2, help="--hf-config: the batch recorded (default 2: a batch of "
                                                             "1 takes other paths in some models)")
    parser.add_argument("--seq", type=int, default=128, help="--hf-config: the sequence length recorded (default "
                                                             "128); both stay options of the file")
    parser.add_argument("--attn", default="sdpa", choices=("sdpa", "eager"),
                        help="--hf-config: transformers' attn_implementation (default sdpa)")
    parser.add_argument("--amp", choices=("bf16", "f16"),
                        help="record the operators under CUDA's autocast in this half type, with f32 weights (the "
                             "file then runs with --dtype amp-bf16 or amp; the layer form runs under any --dtype "
                             "and needs no --amp)")
    parser.add_argument("--lora", type=int, default=0, metavar="RANK",
                        help="--hf-config: PEFT's LoRA adapters of this rank (get_peft_model), base weights frozen")
    parser.add_argument("--lora-targets", metavar="P+P...",
                        help="--hf-config with --lora: the adapted modules, q_proj+v_proj, or all (PEFT's all-linear); "
                             "default: PEFT's for the model type")
    parser.add_argument("--gradient-checkpointing", metavar="MODE", choices=("on", "reentrant", "non-reentrant"),
                        help="--hf-config: model.gradient_checkpointing_enable() (on: transformers' default), "
                             "every decoder layer recorded as a checkpointed call")
    parser.add_argument("--compile", action="store_true",
                        help="also record the training step as torch.compile partitions it (the joint graph AOTAutograd's "
                             "partitioner sees, on fake CPU tensors): `vramscope sweep --compile eager,on,0.5` runs it "
                             "(operator level only; at the recorded batch and dtype)")
    parser.add_argument("--expert-parallel", type=int, default=0, metavar="N",
                        help="--hf-config of a mixture of experts: one rank of transformers' expert parallel over N "
                             "ranks (DistributedConfig(ep_size=N): num_experts / N experts per rank, tokens sent to "
                             "them by all-to-all, even routing assumed); run it with --parallel ep:N")
    parser.add_argument("--name", help="the model's name in tables (default: the function's name)")
    parser.add_argument("-o", "--output", dest="out", metavar="FILE.json",
                        help="where to write (default: standard output)")
    given, argv = list(sys.argv[1:] if argv is None else argv), []
    # `--input -1,8`: a value that starts with '-' is argparse's option otherwise (its usage text
    # instead of our one line saying what is wrong with the sizes).
    while given:
        a = given.pop(0)
        if a in ("--input", "--arg") and given and given[0].startswith("-"):
            a = f"{a}={given.pop(0)}"
        argv.append(a)
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:
        return 2 if e.code not in (0, None) else 0
    try:
        _check_output(args)
        if args.hf_model:
            if args.hf_config:
                raise ExportError(["--hf-model and --hf-config each name a config; give one"], "bad arguments")
            try:
                args.hf_config = str(find_hf_config(args.hf_model))
            except ValueError as e:
                raise ExportError([f"--hf-model {e}"], "cannot find the config") from None
        if args.hf_config:
            if args.model:
                raise ExportError(["give a model or --hf-config, not both"], "bad arguments")
            if args.batch <= 0 or args.seq <= 0:
                raise ExportError(["--batch and --seq must be positive"], "bad arguments")
            doc = export_hf_config(args.hf_config, batch=args.batch, seq=args.seq, name=_name(args.name), attn=args.attn,
                                   amp=args.amp, lora=args.lora, lora_targets=args.lora_targets,
                                   gradient_checkpointing=args.gradient_checkpointing, compile=args.compile,
                                   expert_parallel=args.expert_parallel)
            params = None
        else:
            if not args.model:
                raise ExportError(["give FILE.py:FUNCTION (or module:FUNCTION), or --hf-config CONFIG.json"],
                                  "bad arguments")
            if args.expert_parallel:
                raise ExportError(["--expert-parallel applies to --hf-config (transformers' DistributedConfig)"],
                                  "bad arguments")
            if args.lora or args.lora_targets:
                raise ExportError(["--lora applies to --hf-config; apply PEFT in your factory for other models "
                                   "(get_peft_model(model, LoraConfig(...)) before returning it)"], "bad arguments")
            if not args.input:
                raise ExportError(["--input N,D,... is required: the shape of the model's input, batch first"],
                                  "bad arguments")
            inputs = [_input_spec(text, args.input_dtype if i == 0 else None) for i, text in enumerate(args.input)]
            factory, fname = load_factory(args.model)
            if args.arg:
                base = factory
                factory = lambda: base(*[_value(a) for a in args.arg])  # noqa: E731
            model = build_model(factory, args.model)
            # timm:create_model --arg convnext_tiny is convnext_tiny.
            named_by_arg = args.arg and isinstance(_value(args.arg[0]), str)
            name = _name(args.name) or (args.arg[0] if named_by_arg else fname)
            source = f"exported by `python3 -m vramscope.export {args.model}` from " \
                     f"{type(model).__module__}.{type(model).__name__}"
            simple = len(inputs) == 1 and inputs[0].keyword is None and args.output_key is None and not args.amp
            if args.level == "layers" and args.amp:
                raise ExportError(["--amp records operators; the layer form runs under any --dtype (drop --amp, "
                                   "or use --level ops)"], "bad arguments")
            if args.compile and args.level == "layers":
                raise ExportError(["--compile records operators: give --level ops (or auto)"], "bad arguments")
            if args.level == "layers" or (simple and args.level == "auto" and not _is_transformers(model)
                                          and not args.compile):
                if args.level == "layers":
                    refuse_transformers(model, args.out)
                doc = export(model, inputs[0].shape, name=name, input_dtype=inputs[0].dtype, loss=args.loss,
                             source=source, level=args.level)
            else:
                doc = export_ops(model, inputs, name=name, loss=args.loss, source=source, output_key=args.output_key,
                                 amp=args.amp, compile=args.compile)
            params = sum(p.numel() for p in model.parameters())
    except ExportError as e:
        print(f"vramscope.export: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 (the user's code is caught where it runs: this is the exporter's bug)
        if debugging():
            raise
        print(f"vramscope.export: internal error: {one_line(e)} (VRAMSCOPE_EXPORT_DEBUG=1 shows the traceback; "
              "please report it)", file=sys.stderr)
        return 2
    text = json.dumps(doc, indent=1) + "\n"
    if not args.out:
        sys.stdout.write(text)
        return 0
    try:
        Path(args.out).write_text(text)
    except OSError as e:
        print(f"vramscope.export: cannot write {args.out}: {e.strerror}", file=sys.stderr)
        return 2
    print(summary(doc, args.out, params), file=sys.stderr)
    return 0


def summary(doc: dict, out: str, params: Optional[int]) -> str:
    loss = doc["loss"]
    shape = ", ".join(str(d) for d in doc["input"]["shape"])
    what = (f"{len(doc['graph']['ops'])} operators in {len(doc['graph']['calls'])} module calls"
            if "graph" in doc else
            f"{top_level(doc['layers'])} top-level module{'s' if top_level(doc['layers']) != 1 else ''}")
    counted = params if params is not None else sum(
        _numel(t["shape"], doc["options"]) for t in doc["graph"]["tensors"] if t["kind"] == "param")
    line = (f"{out}: {doc['name']}, {counted:,} parameters, {what}, input [{shape}] with batch "
            f"{doc['options']['batch']}, {loss['type']}" + (f" over {loss['classes']} classes" if "classes" in loss else ""))
    for note in doc.get("graph", {}).get("assumed", []):
        line += f"\n  assumed: {note}"
    return line


def _numel(shape, options) -> int:
    """A parameter's elements (its sizes never follow the batch)."""
    n = 1
    for d in shape:
        n *= d if isinstance(d, int) else 0
    return n


def top_level(layers) -> int:
    """The modules checkpoint_sequential splits: expanded containers count their children."""
    return sum(top_level(it["layers"]) if it.get("expand") else 1 for it in layers)


def _check_output(args) -> None:
    """Never write over an input: the model's file or the config (the command refuses it too)."""
    if not args.out:
        return
    out = Path(args.out)
    sources = [args.hf_config] if args.hf_config else []
    if args.model and ":" in args.model:
        sources.append(args.model.rsplit(":", 1)[0])
    for source in sources:
        try:
            if out.exists() and Path(source).exists() and os.path.samefile(out, source):
                raise ExportError([f"-o {args.out} is the model's own source; give another file"], "bad arguments")
        except OSError:
            continue


def _name(name: Optional[str]) -> Optional[str]:
    if name is None:
        return None
    if not name or len(name) > 200 or any(not c.isprintable() for c in name):
        raise ExportError([f"--name {name!r}: expected 1 to 200 printable characters"], "bad arguments")
    return name


def _value(text: str):
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def _input_spec(text: str, dtype: Optional[str]) -> InputSpec:
    keyword = None
    if "=" in text:
        keyword, text = text.split("=", 1)
        if not keyword.isidentifier():
            raise ExportError([f"--input {keyword}=...: {keyword!r} is not an argument name"], "bad input")
    if text.endswith(":int64"):
        text, dtype = text[:-6], "int64"
    try:
        shape = [int(s) for s in text.split(",")]
    except ValueError:
        raise ExportError([f"--input {text!r}: expected sizes separated by commas, such as 8,3,224,224"],
                          "bad input") from None
    return InputSpec(shape, dtype or "float", keyword)  # checks the sizes


def _is_transformers(model) -> bool:
    return any(c.__name__ == "PreTrainedModel" for c in type(model).__mro__)


if __name__ == "__main__":
    sys.exit(main())
