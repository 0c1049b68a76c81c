"""doc_tables.py: the update/check main the table generators share (transformers_table.py,
gpu_reference_table.py): a document's tables between `<!-- table: NAME -->` and
`<!-- end table -->` markers, rewritten from the command's figures or checked against them."""
import re
import sys
from pathlib import Path


def render(text: str, generated: dict) -> str:
    """`text` with each named table replaced by its generated rows."""
    for name, table in generated.items():
        pattern = re.compile(rf"(<!-- table: {name} -->\n)(.*?)(<!-- end table -->)", re.S)
        if not pattern.search(text):
            raise SystemExit(f"no <!-- table: {name} --> ... <!-- end table --> block")
        text = pattern.sub(lambda m: m.group(1) + table + m.group(3), text)
    return text


def section(text: str, name: str) -> str:
    """The rows of table `name` as the document has them."""
    m = re.search(rf"<!-- table: {name} -->\n(.*?)<!-- end table -->", text, re.S)
    if not m:
        raise SystemExit(f"no <!-- table: {name} --> ... <!-- end table --> block")
    return m.group(1)


def main(tool: str, usage: str, default_doc: Path, tables) -> int:
    """`tool update|check VRAMSCOPE [DOC]`: `tables(exe)` gives {name: rows}."""
    if len(sys.argv) < 3 or sys.argv[1] not in ("update", "check"):
        print(usage)
        return 2
    exe = sys.argv[2]
    doc = Path(sys.argv[3]) if len(sys.argv) > 3 else default_doc
    text = doc.read_text()
    new = render(text, tables(exe))
    if sys.argv[1] == "update":
        doc.write_text(new)
        print(f"{tool}: {doc} {'rewritten' if new != text else 'unchanged'}")
        return 0
    if new != text:
        print(f"{tool}: the tables of {doc} differ from the command's figures; run "
              f"scripts/{tool}.py update {exe}")
        return 1
    print(f"{tool}: tables agree")
    return 0
