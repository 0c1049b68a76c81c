#!/usr/bin/env python3
"""check_files.py: model files from outside the C++ code.

    check_files.py schema            # the zoo and the documented example validate against
                                     # docs/model-file.schema.json (python3-jsonschema)
    check_files.py bad VRAMSCOPE     # each malformed file of bad_files.json: exit 2 and one
                                     # line on stderr holding its message
"""
import copy
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def documented_example() -> dict:
    text = (ROOT / "docs" / "MODEL_FILES.md").read_text()
    m = re.search(r"<!-- file: small-cnn.json -->\n```json\n(.*?)```", text, re.S)
    return json.loads(m.group(1))


def schema() -> int:
    try:
        import jsonschema
    except ImportError:
        # CMake's python may lack it where Debian's has it (python3-jsonschema, from .ci/run).
        system = Path("/usr/bin/python3")
        if system.exists() and Path(sys.executable).resolve() != system.resolve():
            return subprocess.run([str(system), __file__, "schema"]).returncode
        print("check_files schema: skipped, no jsonschema module (apt-get install python3-jsonschema)")
        return 77
    spec = json.loads((ROOT / "docs" / "model-file.schema.json").read_text())
    files = {p.name: json.loads(p.read_text()) for p in sorted((ROOT / "models" / "zoo").glob("*.json"))}
    files["MODEL_FILES.md example"] = documented_example()
    # The exporter's files: operator graphs, with and without a compiled step.
    for data in ("compiled-mlp.json", "selective-blocks.json"):
        files[data] = json.loads((ROOT / "tests" / "data" / data).read_text())
    for name, doc in files.items():
        jsonschema.validate(doc, spec)
    # The schema is not vacuous: a misspelt key fails it.
    bad = copy.deepcopy(documented_example())
    bad["layers"][2]["kernal_size"] = 3
    try:
        jsonschema.validate(bad, spec)
        print("FAIL: the schema accepted a misspelt key")
        return 1
    except jsonschema.ValidationError:
        pass
    print(f"check_files schema: {len(files)} files valid")
    return 0


def patched(base: dict, patch: dict) -> dict:
    doc = copy.deepcopy(base)
    for path, value in patch.items():
        steps = path.split(".")
        at = doc
        for i, step in enumerate(steps):
            m = re.fullmatch(r"(\w+)(?:\[(\d+)\])?", step)
            key, index = m.group(1), m.group(2)
            last = i + 1 == len(steps)
            if last and index is None:
                if value is None:
                    at.pop(key, None)
                else:
                    at[key] = value
                break
            at = at[key]
            if index is not None:
                if last:
                    at[int(index)] = value
                    break
                at = at[int(index)]
    return doc


def bad(exe: str) -> int:
    cases = json.loads((HERE / "bad_files.json").read_text())
    failures = 0
    with tempfile.TemporaryDirectory() as scratch:
        for case in cases["cases"]:
            text = case["text"] if "text" in case else json.dumps(patched(cases["base"], case["patch"]))
            path = Path(scratch) / f"{case['name']}.json"
            path.write_text(text)
            p = subprocess.run([exe, "models", "--model-file", str(path)], capture_output=True, text=True, timeout=60)
            lines = p.stderr.strip().split("\n")
            if p.returncode != 2 or len(lines) != 1 or case["message"] not in p.stderr:
                failures += 1
                print(f"FAIL {case['name']}: exit {p.returncode}, stderr {p.stderr.strip()!r}")
    print(f"check_files bad: {len(cases['cases'])} files, {failures} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    if len(sys.argv) >= 2 and sys.argv[1] == "schema":
        sys.exit(schema())
    if len(sys.argv) >= 3 and sys.argv[1] == "bad":
        sys.exit(bad(sys.argv[2]))
    print(__doc__, file=sys.stderr)
    sys.exit(2)
