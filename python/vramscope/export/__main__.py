"""python3 -m vramscope.export FILE.py:FUNCTION --input N,... -o net.json (see __init__)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional, Sequence

from . import LOSSES, ExportError, build_model, export, load_factory
from ._errors import debugging, one_line
from ._model import refuse_transformers


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python3 -m vramscope.export",
        description="Write a vramscope model file from a PyTorch nn.Module: built on the meta device (no "
                    "weights, no GPU, nothing downloaded), traced with torch.fx, your module names kept.",
        epilog="examples:\n"
               "  python3 -m vramscope.export my_model.py:make_model --input 8,3,224,224 -o net.json\n"
               "  python3 -m vramscope.export torchvision.models:resnet50 --input 32,3,224,224 -o resnet50.json\n"
               "  python3 -m vramscope.export lm.py:TinyLM --input 4,128 --input-dtype int64 -o lm.json\n"
               "then: vramscope sweep --model-file net.json --segments auto --dtype f32,amp\n"
               "errors are one line each; VRAMSCOPE_EXPORT_DEBUG=1 shows the traceback behind one",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="FILE.py:FUNCTION or module:FUNCTION returning the nn.Module (a class works)")
    parser.add_argument("--input", required=True, metavar="N,D,...",
                        help="the input's shape, batch first (the batch stays an option of the file)")
    parser.add_argument("--input-dtype", default="float", choices=("float", "int64"),
                        help="float (the run's precision) or int64 token ids for an nn.Embedding")
    parser.add_argument("--loss", choices=LOSSES,
                        help="the loss (default: cross_entropy over the output's last dimension)")
    parser.add_argument("--name", help="the model's name in tables (default: the function's name)")
    parser.add_argument("-o", "--output", metavar="FILE.json", help="where to write (default: standard output)")
    args = parser.parse_args(argv)
    try:
        try:
            shape = [int(s) for s in args.input.split(",")]
        except ValueError:
            raise ExportError([f"--input {args.input!r}: expected sizes separated by commas, such as 8,3,224,224"],
                              "bad input") from None
        factory, fname = load_factory(args.model)
        model = build_model(factory, args.model)
        refuse_transformers(model, args.output)
        doc = export(model, shape, name=args.name or fname, input_dtype=args.input_dtype, loss=args.loss,
                     source=f"exported by `python3 -m vramscope.export {args.model} --input {args.input}` "
                            f"from {type(model).__module__}.{type(model).__name__}")
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
    if not args.output:
        sys.stdout.write(text)
        return 0
    try:
        Path(args.output).write_text(text)
    except OSError as e:
        print(f"vramscope.export: cannot write {args.output}: {e.strerror}", file=sys.stderr)
        return 2
    params = sum(p.numel() for p in model.parameters())
    loss = doc["loss"]
    n = top_level(doc["layers"])
    print(f"{args.output}: {doc['name']}, {params:,} parameters, {n} top-level module{'s' if n != 1 else ''}, "
          f"input [{', '.join(str(d) for d in doc['input']['shape'])}] with batch {shape[0]}, {loss['type']}"
          + (f" over {loss['classes']} classes" if "classes" in loss else ""), file=sys.stderr)
    return 0


def top_level(layers) -> int:
    """The modules checkpoint_sequential splits: expanded containers count their children."""
    return sum(top_level(it["layers"]) if it.get("expand") else 1 for it in layers)




if __name__ == "__main__":
    sys.exit(main())
