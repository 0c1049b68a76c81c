"""_routing.py: an assumed routing for the per-expert loop of a mixture of experts.

transformers 5 runs a model's experts as its config's `experts_implementation` says: grouped
(`grouped_mm`, the default), batched, or "eager", a Python loop over the experts hit
(`integrations/moe.py`; the loop in e.g. `models/qwen3_moe/modeling_qwen3_moe.py`):

    expert_mask = one_hot(top_k_index, num_experts + 1).permute(2, 1, 0)
    expert_hit = (expert_mask.sum(dim=(-1, -2)) > 0).nonzero()
    for expert_idx in expert_hit:
        if expert_idx == num_experts: continue
        top_k_pos, token_idx = torch.where(expert_mask[expert_idx])
        ...                              # each expert's rows: gather, gate_up, act, down

Which tokens reach which expert is data, and meta tensors have none, so the loop's `nonzero`
calls have no size. The recording answers them: every expert is hit, and expert e's rows are
a sentinel size, ROWS + STEP * e, the same at every recorded batch and sequence. The model file
writes a dimension of that size as the name `expert_rows_<e>`, and the runtime computes it from
the file's "routing" (tokens x top_k over experts) and the option `expert_skew` (models'
op_model routing). Comparisons with the expert ids read from the hit list (`expert_idx ==
num_experts`) are answered from those ids.
"""
import operator
from typing import Any, Dict, List, Optional, Tuple

ROWS = 1 << 40  # no real dimension of a recording is this large
STEP = 1009
MAX_EXPERTS = 1 << 16


def expert_of(size: int) -> Optional[int]:
    """The expert whose rows a recorded size stands for; None for an ordinary size."""
    if size < ROWS or (size - ROWS) % STEP != 0 or (size - ROWS) // STEP >= MAX_EXPERTS:
        return None
    return (size - ROWS) // STEP


class AssumedRouting:
    """Scoped to the forward of an experts module running its eager loop."""

    def __init__(self, torch):
        self.torch = torch
        aten = torch.ops.aten
        self.nonzero = aten.nonzero.default
        self.item = aten._local_scalar_dense.default
        self.compare = {aten.eq.Scalar: operator.eq, aten.ne.Scalar: operator.ne, aten.lt.Scalar: operator.lt,
                        aten.le.Scalar: operator.le, aten.gt.Scalar: operator.gt, aten.ge.Scalar: operator.ge}
        self.module = None
        self.seen: List[Tuple[int, int, int]] = []  # (experts, top_k, tokens) of each loop

    @staticmethod
    def runs_eager_loop(module) -> bool:
        # @use_experts_implementation gives the class _apply_gate and is_concatenated, and
        # dispatches on config._experts_implementation.
        config = getattr(module, "config", None)
        return (hasattr(module, "_apply_gate") and hasattr(module, "is_concatenated")
                and isinstance(getattr(module, "num_experts", None), int)
                and getattr(config, "_experts_implementation", None) == "eager")

    def enter(self, module, args) -> None:
        if self.module is not None or not self.runs_eager_loop(module):
            return
        if len(args) < 2 or not isinstance(args[1], self.torch.Tensor) or args[1].dim() != 2:
            return  # not (hidden_states, top_k_index, top_k_weights): left to fail as data
        tokens, top_k = args[1].shape
        self.module, self.hit, self.hit_ids, self.values, self.current, self.next = module, None, [], {}, None, 0
        self.seen.append((module.num_experts, int(top_k), int(tokens)))

    def leave(self, module) -> None:
        if module is self.module:
            self.module = None

    def answer(self, func, args, kwargs) -> Tuple[bool, Any]:
        """(True, the operator's result under the assumption), or (False, None) to run it."""
        if self.module is None or not args or not isinstance(args[0], self.torch.Tensor):
            return False, None
        t = args[0]
        if func is self.nonzero:
            if self.hit is None:  # expert_hit: every expert (the one_hot's extra class E is never hit)
                self.hit_ids = list(range(self.module.num_experts))
                out = self.torch.empty((len(self.hit_ids), t.dim()), dtype=self.torch.int64, device=t.device)
                # Kept alive while the loop runs: its address cannot go to another storage.
                self.hit_storage = out.untyped_storage()
                self.hit = self.hit_storage._cdata
                return True, out
            expert = self.current if self.current is not None else self.hit_ids[min(self.next, len(self.hit_ids) - 1)]
            self.current, self.next = None, expert + 1
            return True, self.torch.empty((ROWS + STEP * expert, t.dim()), dtype=self.torch.int64, device=t.device)
        known = self.value_of(t)
        if known is None:
            return False, None
        if func is self.item:
            if not isinstance(known, bool):
                self.current = known  # expert_mask[expert_idx], gate_up_proj[expert_idx]
            return True, known
        if func in self.compare and t.numel() == 1:
            out = func(*args, **(kwargs or {}))
            self.values[id(out)] = (self.compare[func](known, args[1]), out)
            return True, out
        return False, None

    def value_of(self, t) -> Any:
        if self.hit is not None and t.numel() == 1 and not t.is_floating_point() \
                and t.untyped_storage()._cdata == self.hit:
            # The hit list is [experts, 1]: element e, at offset e, is expert e's id.
            offset = t.storage_offset()
            return self.hit_ids[offset] if offset < len(self.hit_ids) else None
        entry = self.values.get(id(t))
        return entry[0] if entry is not None and entry[1] is t else None


def routing_document(seen_per_point: Dict[Tuple[int, int], List[Tuple[int, int, int]]], fit) -> Optional[Dict[str, Any]]:
    """The file's "routing": {"experts", "top_k", "tokens": formula}, from what each recorded
    point's loops saw; `fit(values)` turns per-point token counts into a formula."""
    ran = [bool(loops) for loops in seen_per_point.values()]
    if not any(ran):
        return None
    if not all(ran):
        return {"error": "the experts' per-expert loop runs at some recorded sizes and not at others"}
    kinds = {(e, k) for loops in seen_per_point.values() for e, k, _ in loops}
    if len(kinds) != 1:
        return {"error": f"experts of {len(kinds)} kinds (experts, top_k: {sorted(kinds)}); vramscope assumes one "
                         "routing per model"}
    tokens = {point: {t for _, _, t in loops} for point, loops in seen_per_point.items()}
    if any(len(t) != 1 for t in tokens.values()):
        return {"error": "experts loops see different numbers of tokens in one forward"}
    formula = fit({point: next(iter(t)) for point, t in tokens.items()})
    if formula is None:
        return {"error": "the experts' tokens follow the batch or sequence non-linearly"}
    experts, top_k = next(iter(kinds))
    return {"experts": experts, "top_k": top_k, "tokens": formula}
