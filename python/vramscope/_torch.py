"""_torch.py: vramscope under PyTorch: the pluggable allocator, and module hooks that open a
vramscope scope per module and phase, so every CUDA allocation is attributed.

torch is imported only when these functions are called.
"""
from __future__ import annotations

import threading
from typing import Any, Callable, List, Optional

from ._native import check, encode, library, library_path

MALLOC_SYMBOL = "vramscope_torch_malloc"
FREE_SYMBOL = "vramscope_torch_free"

_enabled_allocator: Any = None  # kept alive: PyTorch holds only a raw pointer to its functions


def enable(device: Optional[str] = None, alloc_conf: Optional[str] = None) -> None:
    """Makes vramscope PyTorch's CUDA allocator. Call it before the first CUDA allocation
    of the process (PyTorch cannot swap an allocator that has served one).

    `device` defaults to "cuda" (every GPU, by PyTorch's device index); `alloc_conf` takes
    PYTORCH_CUDA_ALLOC_CONF's syntax."""
    global _enabled_allocator
    import torch  # noqa: PLC0415 (optional dependency)

    if _enabled_allocator is not None:
        return
    if not torch.cuda.is_available():
        raise RuntimeError("vramscope.enable(): PyTorch sees no CUDA GPU, so there is no CUDA "
                           "allocator to replace; use vramscope.init('sim:...') and the C API "
                           "functions to study the allocator without one")
    check(library().vramscope_init(encode(device or "cuda"), encode(alloc_conf)))
    allocator = torch.cuda.memory.CUDAPluggableAllocator(str(library_path()), MALLOC_SYMBOL,
                                                         FREE_SYMBOL)
    try:
        torch.cuda.memory.change_current_allocator(allocator)
    except RuntimeError as e:
        raise RuntimeError("vramscope.enable() must run before the first CUDA allocation of "
                           f"the process (PyTorch said: {e})") from e
    _enabled_allocator = allocator


class _ThreadState(threading.local):
    def __init__(self) -> None:
        # (module name, phase, graph task) of the scopes this tracker opened on this thread,
        # innermost last; the graph task tells a backward scope from an earlier pass's
        self.stack: List[tuple] = []
        self.forward_depth = 0     # module forwards running on this thread
        self.owner: dict = {}      # id(node) -> (node, module name), during one forward pass
        self.boundary: dict = {}   # module name -> {id(node): node} of its inputs, while it runs


class ModuleTracker:
    """Hooks that open a vramscope scope named by the module's qualified name
    ("layer1.0.conv1") around everything the module does:

    - forward: a forward pre-hook opens (name, "forward"), or (name, "recompute") when it
      runs inside a backward pass (activation checkpointing); the forward hook closes it.
    - backward: when a module's forward returns, the autograd nodes it created (found by
      walking back from its outputs to its inputs; a child's nodes stay the child's) get a
      pre-hook and a hook that open and close (name, "backward") around each node's
      execution. So every backward allocation is charged to the module whose forward
      created the op, in-place modules (ReLU(inplace=True)) included, with no full
      backward hooks (which PyTorch refuses around in-place ops).

    A forward or backward that raises (an out-of-memory caught and retried) leaves no scope
    behind: the next outermost forward, or the next backward node on that thread, closes
    what it left. Remove the hooks with remove(), or use the tracker as a context manager.
    """

    def __init__(self, model: Any, prefix: str = "") -> None:
        self._lib = library()
        self._state = _ThreadState()
        self._handles: list = []
        self._root = prefix or type(model).__name__
        for name, module in model.named_modules():
            full = ".".join(p for p in (prefix, name) if p) or type(model).__name__
            self._handles.append(_register_pre(module, self._forward_pre(full)))
            self._handles.append(_register_post(module, self._forward_post(full)))

    def _forward_pre(self, name: str) -> Callable:
        def hook(module: Any, args: Any, kwargs: Any = None) -> None:
            state = self._state
            in_backward = self._in_backward()
            if (name == self._root or state.forward_depth == 0) and not in_backward:
                # A new outermost forward: whatever an earlier one left (it raised, and torch
                # < 2.1 runs no forward hook then) goes.
                while state.stack and state.stack[-1][1] in ("forward", "recompute"):
                    self._pop_top()
                state.forward_depth = 0
                state.owner.clear()
                state.boundary.clear()
            state.forward_depth += 1
            self._push(name, "recompute" if in_backward else "forward")
            # The input nodes themselves are kept: only a live wrapper keeps its id.
            state.boundary[name] = {id(t.grad_fn): t.grad_fn
                                    for t in _tensors((args, kwargs)) if t.grad_fn is not None}
        return hook

    def _forward_post(self, name: str) -> Callable:
        def hook(module: Any, args: Any, *rest: Any) -> None:
            output = rest[-1]  # (output,) or (kwargs, output)
            state = self._state
            state.forward_depth = max(0, state.forward_depth - 1)
            if not isinstance(output, BaseException):
                self._claim_nodes(name, output)
            state.boundary.pop(name, None)
            self._pop(name)
            if state.forward_depth == 0:
                state.owner.clear()  # the outermost forward ended: hold no graph nodes
        return hook

    def _claim_nodes(self, name: str, output: Any) -> None:
        state = self._state
        boundary = state.boundary.get(name, {})
        todo = [t.grad_fn for t in _tensors(output) if t.grad_fn is not None]
        visited = set()
        while todo:
            node = todo.pop()
            if node is None or id(node) in visited or id(node) in boundary:
                continue
            visited.add(id(node))
            if id(node) not in state.owner:  # else a child's (it returned first)
                state.owner[id(node)] = (node, name)
                node.register_prehook(self._backward_enter(name))
                node.register_hook(self._backward_exit(name))
            todo.extend(next_node for next_node, _ in node.next_functions)

    def _backward_enter(self, name: str) -> Callable:
        def hook(grad_outputs: Any) -> None:
            task = _graph_task()
            stack = self._state.stack
            # Scopes of an earlier backward pass that raised on this (worker) thread.
            while (task is not None and stack and stack[-1][1] == "backward"
                   and stack[-1][2] != task):
                self._pop_top()
            self._push(name, "backward", task)
        return hook

    def _backward_exit(self, name: str) -> Callable:
        def hook(grad_inputs: Any, grad_outputs: Any) -> None:
            stack = self._state.stack
            if stack and stack[-1][:2] == (name, "backward"):
                self._pop_top()
        return hook

    def _in_backward(self) -> bool:
        task = _graph_task()
        if task is not None:
            return task != -1
        return any(phase == "backward" for _, phase, _ in self._state.stack)

    # --- the scope stack ----------------------------------------------------------------
    def _push(self, name: str, phase: str, task: Optional[int] = None) -> None:
        check(self._lib.vramscope_scope_push(name.encode(), phase.encode()))
        self._state.stack.append((name, phase, task))

    def _pop_top(self) -> None:
        self._state.stack.pop()
        check(self._lib.vramscope_scope_pop())

    def _pop(self, name: str) -> None:
        """Closes `name`'s innermost scope and any opened inside it; nothing if it is not open."""
        stack = self._state.stack
        for i in range(len(stack) - 1, -1, -1):
            if stack[i][0] == name:
                while len(stack) > i:
                    self._pop_top()
                return

    def remove(self) -> None:
        """Removes the module hooks and closes the scopes left open on this thread. (Hooks
        already on autograd nodes go away with their graph.)"""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._state.owner.clear()
        self._state.boundary.clear()
        while self._state.stack:
            self._pop_top()

    def __enter__(self) -> "ModuleTracker":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()


def _graph_task() -> Optional[int]:
    """The running backward pass's id (-1 outside one), or None where torch cannot say (< 2.0)."""
    import torch  # noqa: PLC0415

    task = getattr(torch._C, "_current_graph_task_id", None)
    return task() if task is not None else None


def _register_pre(module: Any, hook: Callable) -> Any:
    try:  # keyword arguments too (transformers passes hidden states by keyword)
        return module.register_forward_pre_hook(hook, with_kwargs=True)
    except TypeError:  # torch < 2.0
        return module.register_forward_pre_hook(hook)


def _register_post(module: Any, hook: Callable) -> Any:
    try:  # also when forward raises (torch >= 2.1): the scope closes at once
        return module.register_forward_hook(hook, always_call=True)
    except TypeError:
        return module.register_forward_hook(hook)


def track_modules(model: Any, prefix: str = "") -> ModuleTracker:
    """Attributes the allocations of every submodule of `model` to its name and phase."""
    return ModuleTracker(model, prefix)


def _tensors(value: Any) -> list:
    import torch  # noqa: PLC0415

    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []
