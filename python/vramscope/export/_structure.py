"""The op graph -> the model file's nested layers: per module call, a chain cut at its
dominators whose fork-joins are Residual / Parallel blocks."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from ._graph import Graph, Op
from ._trace import is_region


def _module_of(scope) -> str:
    """The module whose forward a scope runs in: its innermost entry that is not a
    checkpointed region (a region is code of the enclosing forward, named as it)."""
    for qualname, _ in reversed(scope):
        if not is_region(qualname):
            return qualname
    return ""


class Structure:
    """Turns the op graph into the model file's nested layers: each module call is a
    container (a Sequential, or the Residual / Parallel its forward is), each fork-join a
    Residual or Parallel; code between modules is inline."""

    def __init__(self, graph: Graph, marks: Optional[Dict[str, Any]] = None):
        self.g = graph
        self.marks = marks or {}  # module path -> checkpoint mark (checkpoint(self.block, x) in forward)
        self.problems: List[str] = []
        self.model = graph.model
        self.modules = graph.modules
        # Classes whose forward is a fork-join at its own level somewhere: blocks, never
        # expanded into the top-level sequence.
        self.block_classes: set = set()
        # Remove aliases (MHA's [0]) so that ops read the real producer.
        alias = {}
        for op in graph.ops:
            op.inputs = [alias.get(id(i), i) for i in op.inputs]
            if op.spec is not None and op.spec.get("type") == "_Alias":
                alias[id(op)] = op.inputs[0]
        graph.ops = [op for op in graph.ops if not (op.spec is not None and op.spec.get("type") == "_Alias")]
        if graph.output is not None:
            graph.output = alias.get(id(graph.output), graph.output)
        self.users: Dict[int, List[Op]] = {}
        for op in graph.ops:
            for i in op.inputs:
                self.users.setdefault(id(i), []).append(op)

    def build(self) -> List[dict]:
        g = self.g
        live = self._live()
        for op in g.ops:
            if id(op) not in live:
                self.problems.append(f"{op.where}: computes a tensor that the output does not use "
                                     "(remove it, or return it)")
        ops = [op for op in g.ops if id(op) in live]
        items = self._region((), g.source, ops, g.output)
        return self._expand(items)

    def _live(self) -> set:
        return _ancestors(self.g.output, None, lambda op: op.inputs)

    # A region: the ops run inside one module call (scope), from `entry` to `exit`.
    def _region(self, scope, entry: Op, ops: List[Op], exit_op: Op) -> List[Any]:
        depth = len(scope)
        groups: Dict[Tuple[str, int], List[Op]] = {}
        rep: Dict[int, Any] = {}
        for op in ops:
            if len(op.scope) > depth:
                key = op.scope[depth]
                groups.setdefault(key, []).append(op)
                rep[id(op)] = ("call", key)
            else:
                rep[id(op)] = op
        inside = {id(op) for op in ops}
        # The level's nodes: direct ops and one node per child module call.
        nodes: Dict[Any, "LevelNode"] = {}
        source = LevelNode(("source",), -1)
        nodes[("source",)] = source

        def node_of(op):
            r = rep[id(op)]
            key = r if isinstance(r, tuple) else ("op", id(op))
            if key not in nodes:
                nodes[key] = LevelNode(key, op.index, op if not isinstance(r, tuple) else None)
            n = nodes[key]
            n.index = max(n.index, op.index)
            return n

        for op in ops:
            node_of(op)
        for op in ops:
            n = node_of(op)
            for i in op.inputs:
                if i is entry:
                    src = source
                elif id(i) in inside:
                    src = node_of(i)
                else:
                    self.problems.append(f"{op.where}: reads a tensor from outside its module "
                                         f"'{scope[-1][0] if scope else ''}' other than the module's input "
                                         "(a module with several tensor inputs is not modelled)")
                    return []
                if src is n:
                    continue
                if src not in n.preds:
                    n.preds.append(src)
                    n.pred_ops.append(i)
        # Each child call: one input (from this level), one output.
        for key, members in groups.items():
            n = nodes[("call", key)]
            mine = {id(m) for m in members}
            outside = [i for m in members for i in m.inputs if id(i) not in mine]
            distinct = list({id(i): i for i in outside}.values())
            if len(distinct) != 1:
                self.problems.append(f"module '{key[0]}': takes {len(distinct)} tensors (one input per module "
                                     "is modelled)")
                return []
            n.entry = distinct[0]
            exits = [m for m in members if m is exit_op or any(id(u) not in mine and id(u) in inside
                                                                for u in self.users.get(id(m), []))]
            if len(exits) != 1:
                self.problems.append(f"module '{key[0]}': returns {len(exits)} tensors used outside it (one is "
                                     "modelled)")
                return []
            n.exit = exits[0]
            n.members = members
        end = node_of(exit_op) if exit_op is not entry else source
        order = sorted(nodes.values(), key=lambda n: n.index)
        idom: Dict[Any, LevelNode] = {}
        pos = {id(n): k for k, n in enumerate(order)}

        def intersect(a, b):
            while a is not b:
                while pos[id(a)] > pos[id(b)]:
                    a = idom[id(a)]
                while pos[id(b)] > pos[id(a)]:
                    b = idom[id(b)]
            return a

        for n in order:
            if n is source:
                continue
            d = None
            for p in n.preds:
                if id(p) not in idom and p is not source:
                    continue
                d = p if d is None else intersect(d, p)
            idom[id(n)] = d if d is not None else source
        idom[id(source)] = source
        self._idom = idom
        return self._parse(source, end, scope)

    @staticmethod
    def _relative(qualname: str, scope) -> str:
        """A module's name in the container of `scope`: dotted when the forward calls a
        child's child (`self.blocks[0](x)`, a ModuleList's element)."""
        parent = _module_of(scope)
        if not parent:
            return qualname
        if qualname.startswith(parent + "."):
            return qualname[len(parent) + 1:]
        return qualname.rsplit(".", 1)[-1]  # called from outside its parent: its own name

    def _group(self, items: List[Any], parent: str) -> List[Any]:
        """Dotted names become the containers they name: consecutive `blocks.0`, `blocks.1`
        are the Sequential `blocks` (a ModuleList's path in PyTorch) with children 0 and 1."""
        import torch.nn as nn
        out: List[Any] = []
        for it in items:
            name = it.get("name", "")
            if "." not in name:
                out.append(it)
                continue
            head, rest = name.split(".", 1)
            inner = dict(it, name=rest)
            if out and out[-1].get("_wrapper") == head:
                out[-1]["layers"].append(inner)
                continue
            full = f"{parent}.{head}" if parent else head
            if any(o.get("name") == head for o in out):
                self.problems.append(f"module '{full}': its children are called apart from each other, with "
                                     "other code between them; a model file keeps a container's children together")
            cls = type(self.modules[full]) if full in self.modules else nn.Sequential
            out.append({"name": head, "type": "Sequential", "layers": [inner], "_class": cls, "_wrapper": head,
                        "_index": it.get("_index")})
        for it in out:
            if "_wrapper" in it:
                it["layers"] = self._group(it["layers"], f"{parent}.{it['name']}" if parent else it["name"])
        return out

    def _parse(self, src, end, scope) -> List[Any]:
        """The items computing `end` from `src` (src dominates end)."""
        chain = []
        n = end
        while n is not src:
            chain.append(n)
            n = self._idom[id(n)]
        chain.reverse()
        items: List[Any] = []
        prev = src
        for n in chain:
            items.extend(self._step(prev, n, scope))
            prev = n
        return self._group(items, _module_of(scope))

    @staticmethod
    def _reach(src, end) -> set:
        return _ancestors(end, src, lambda n: n.preds)

    def _step(self, prev, n, scope) -> List[Any]:
        if n.members is not None:
            return [self._call(n, scope)]
        op = n.op
        if op.join is None:
            return [self._leaf(op, scope)]
        # A join: one branch per input, from `prev`.
        branches, seen = [], set()
        ordered = []  # in the join's argument order (torch.cat([a, b]), a @ b)
        for i in op.inputs:
            pn = self._level_node_of(i, n, prev)
            if pn not in ordered:
                ordered.append(pn)
        for pn in ordered:
            reach = self._reach(prev, pn) if pn is not prev else set()
            if reach & seen:
                self.problems.append(f"{op.where}: its inputs share computation other than their common "
                                     "start (the graph is not series-parallel)")
            seen |= reach
            branches.append(self._parse(prev, pn, scope) if pn is not prev else [])
        return [self._join(op, branches, ordered, prev)]

    def _level_node_of(self, i: Op, n, prev):
        for p, o in zip(n.preds, n.pred_ops):
            if o is i:
                return p
        return prev  # the join reads its own source directly

    def _join(self, op: Op, branches, ordered, prev) -> dict:
        if op.join == "add" and len(branches) == 2:
            body, shortcut = branches
            if not body and shortcut:
                body, shortcut = shortcut, body
                if op.inplace:
                    self.problems.append(f"{op.where}: an in-place add into the block's input "
                                         "(`x += f(x)`) is not modelled; write `x = x + f(x)`")
            elif body and shortcut and not op.inplace:
                if self._first_index(shortcut) < self._first_index(body):
                    body, shortcut = shortcut, body  # the branch PyTorch runs first
            item = {"type": "Residual", "inline": True}
            if op.inplace:
                item["inplace"] = True
            item["body"] = body
            if shortcut:
                item["shortcut"] = shortcut
            return item
        item = {"type": "Parallel", "inline": True, "join": op.join, "branches": branches}
        if op.join == "concat" and op.dim != 1:
            item["dim"] = op.dim
        return item

    @staticmethod
    def _first_index(items) -> int:
        for it in items:
            if "_index" in it:
                return it["_index"]
        return 1 << 60

    def _leaf(self, op: Op, scope) -> dict:
        spec = dict(op.spec)
        if op.module is not None:
            name = self._relative(op.module, scope)
        else:
            enclosing = _module_of(scope)
            owner = self.modules[enclosing] if enclosing else self.model
            taken = dict(owner.named_children())
            taken.update(dict(owner.named_parameters(recurse=False)))
            name = op.name
            while name in taken:
                name += "_"
        spec = {"name": name, **spec, "_index": op.index, "_module": op.module}
        if op.module in self.marks:
            spec["checkpoint"] = self.marks[op.module]
        return spec

    def _call(self, n, scope) -> dict:
        key = n.key[1]
        qualname = key[0]
        items = self._region(scope + (key,), n.entry, n.members, n.exit)
        if is_region(qualname):
            # checkpoint() of a method or a function: its ops as an inline Sequential under
            # one checkpoint, named as the enclosing module's.
            return {"type": "Sequential", "inline": True, "checkpoint": self.marks[qualname], "layers": items,
                    "_index": n.index}
        m = self.modules[qualname]
        name = self._relative(qualname, scope)
        cls = type(m).__name__
        joins = [it for it in items if it.get("type") in ("Residual", "Parallel") and it.get("inline")]
        if joins:
            self.block_classes.add(type(m))
        first = items[0] if items else None
        if first is not None and first.get("inline") and first["type"] in ("Residual", "Parallel") and (
                len(items) == 1 or (first["type"] == "Residual" and all("inline" not in it for it in items[1:]))):
            item = {"name": name, "type": first["type"], "class": cls}
            item.update((k, v) for k, v in first.items() if k not in ("type", "inline"))
            if len(items) > 1:
                item["then"] = items[1:]
        else:
            item = {"name": name, "type": "Sequential", "layers": items, "_class": type(m), "_index": n.index}
        if qualname in self.marks:
            item["checkpoint"] = self.marks[qualname]
        return item

    # The top-level sequence: containers that are plain nn.Sequential, and modules whose
    # forward is a chain of other modules (not a block), hand their children up.
    def _expand(self, items) -> List[dict]:
        import torch.nn as nn
        out = []
        for it in items:
            cls = it.get("_class")
            if it.get("type") == "Sequential" and cls is not None and "checkpoint" not in it and (
                    cls is nn.Sequential or (not issubclass(cls, nn.Sequential) and cls not in self.block_classes)):
                out.append({"name": it["name"], "type": "Sequential", "expand": True,
                            "layers": self._expand(it["layers"])})
            else:
                out.append(it)
        return out


def _ancestors(start, stop, parents) -> set:
    """The ids of `start` and everything it reaches through `parents`, short of `stop`."""
    seen, stack = set(), [start]
    while stack:
        n = stack.pop()
        if n is None or n is stop or id(n) in seen:
            continue
        seen.add(id(n))
        stack.extend(parents(n))
    return seen


@dataclass(eq=False)
class LevelNode:
    key: Any
    index: int
    op: Optional[Op] = None
    preds: List[Any] = field(default_factory=list)
    pred_ops: List[Op] = field(default_factory=list)
    entry: Optional[Op] = None
    exit: Optional[Op] = None
    members: Optional[List[Op]] = None


def finish(items, declared: Optional[Dict[str, str]] = None) -> List[Any]:
    """Drops the private keys; a module its container already ran becomes {"use": name}
    (`declared`: the container's names, shared by a Residual's parts and a Parallel's branches)."""
    declared = {} if declared is None else declared
    out = []
    for it in items:
        it = dict(it)
        module = it.pop("_module", None)
        for k in ("_index", "_class", "_wrapper"):
            it.pop(k, None)
        name = it.get("name")
        if module is not None and declared.get(name) == module:
            out.append({"use": name})
            continue
        if module is not None:
            declared[name] = module
        if it.get("type") == "Residual":
            shared: Dict[str, str] = {}
            for key in ("body", "shortcut", "then"):
                if key in it:
                    it[key] = finish(it[key], shared)
        elif it.get("type") == "Parallel":
            shared = {}
            it["branches"] = [finish(b, shared) for b in it["branches"]]
        elif "layers" in it:
            it["layers"] = finish(it["layers"], {})
        out.append(it)
    return out
