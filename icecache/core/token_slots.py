"""A constant-size token cache with real eviction: ``budget`` slots per KV head, kept on the model's device.

StreamingLLM, SnapKV and H2O keep a fixed number of tokens and evict the rest for good; they differ only in which
tokens they keep. Here they share one layout that a CUDA graph can replay: every KV head has ``budget`` slots of
keys, values and positions (``-1`` for an empty slot), allocated once when the prompt is done. A decode step
writes its token into the slot the method names (``next_slot``, from the device-side position or from state the
method keeps on the device) and attends over the valid slots (``attend``, where a method whose eviction follows the
attention, H2O, also updates its state in place). Nothing in the step reads a host value that changes between
steps, so the step is the same computation eagerly and replayed.

Attention over the slots does not depend on their order. H2O needs the probabilities, so its attention is an
explicit float32 softmax; the ring methods fill their slots in order until the ring turns, so their valid slots are
always a prefix, and they attend with the core's paged kernel over the slot buffer seen as pages (one launch).
Budget: a step attends to at most ``budget`` tokens, the new one included.
"""

from __future__ import annotations

import torch

from .kernels.paged_decode_attention import PagedAttentionPlan, paged_decode_attention
from .kernels.slot_attention import slot_attention
from .layer import DenseKV, ModelInfo, SequenceContext, attended_from_positions

#: Tokens per page of the paged kernel's view of a ring's slots.
SLOT_PAGE_SIZE = 16


class TokenSlotsKV(DenseKV):
    """The prompt is stored densely while it arrives (prefill attention is dense and method-independent); after its
    last chunk the method picks the prompt tokens to keep and their slots (``place_prompt``), and the dense copy
    goes. Subclasses define ``place_prompt``, ``next_slot`` and optionally ``observe_prefill``, ``on_write``
    and ``attend`` (a method whose eviction follows the step's attention does it there, in place)."""

    def __init__(self, layer_idx: int, model: ModelInfo, seq: SequenceContext, budget: int):
        super().__init__(layer_idx, model, seq)
        self.budget = budget
        self.slot_keys: torch.Tensor | None = None  # [Hkv, budget, D]
        self.slot_values: torch.Tensor | None = None
        self.slot_positions: torch.Tensor | None = None  # [Hkv, budget] int64, -1 = empty
        self._attention_plan = PagedAttentionPlan()  # the ring methods' paged attention over the slots

    # --- what a method decides ---------------------------------------------------------------------------------
    def place_prompt(self, n_prompt: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(kept, slots)``, both ``[Hkv, n]`` int64: the prompt positions to keep and the slot of each."""
        raise NotImplementedError

    def next_slot(self, position: torch.Tensor) -> torch.Tensor:
        """The slot ``[Hkv]`` (int64, on the device) that the token at ``position`` (one-element tensor) goes to."""
        raise NotImplementedError

    def observe_prefill(self, query: torch.Tensor, scaling: float) -> None:
        """Called after each prompt chunk is stored (``self.keys`` holds the prompt so far)."""

    def on_prompt_placed(self, kept: torch.Tensor, slots: torch.Tensor) -> None:
        """Called once the slots hold the kept prompt tokens (before the dense copy goes)."""

    def on_write(self, slot: torch.Tensor) -> None:
        """Called when the step's token has been written to ``slot [Hkv]``, before the attention."""

    # --- the shared mechanics ----------------------------------------------------------------------------------
    def prefill(self, query, key, value, attention_mask, scaling):
        if query.shape[0] != 1:
            raise ValueError("sparse KV methods run with batch size 1")
        out = super().prefill(query, key, value, attention_mask, scaling)
        self.observe_prefill(query, scaling)
        if not self.seq.more_prefill_chunks:
            keys, values = self.keys[0], self.values[0]
            n_kv_heads, n_prompt, head_dim = keys.shape
            kept, slots = self.place_prompt(n_prompt)
            if kept.shape[1] > self.budget:
                raise AssertionError(f"{type(self).__name__} kept {kept.shape[1]} > budget {self.budget} tokens")
            self.slot_keys = keys.new_zeros(n_kv_heads, self.budget, head_dim)
            self.slot_values = values.new_zeros(n_kv_heads, self.budget, head_dim)
            self.slot_positions = torch.full((n_kv_heads, self.budget), -1, dtype=torch.long, device=keys.device)
            rows = kept[..., None].expand(-1, -1, head_dim)
            self.slot_keys.scatter_(1, slots[..., None].expand(-1, -1, head_dim), keys.gather(1, rows))
            self.slot_values.scatter_(1, slots[..., None].expand(-1, -1, head_dim), values.gather(1, rows))
            self.slot_positions.scatter_(1, slots, kept)
            self.on_prompt_placed(kept, slots)
            self._keys = self._values = None  # the dense copy of the prompt is not kept
            self.length = 0
        return out

    def decode(self, query, key, value, scaling):
        if query.shape[0] != 1:
            raise ValueError("sparse KV methods run with batch size 1")
        position = self.decode_position(key.device)
        slot = self.next_slot(position)  # [Hkv]
        self.write(slot, key[0], value[0], position)
        if self.seq.trace_selection:  # what the step attends: the slots after its write, before any eviction
            self.last_attended = self.attended_positions(self.trace_width())
        out = self.attend(query[0, :, 0], position, scaling)
        return out.view(1, 1, *out.shape).to(query.dtype)

    def write(self, slot: torch.Tensor, key: torch.Tensor, value: torch.Tensor, position: torch.Tensor) -> None:
        """The step's ``key``/``value [Hkv, 1, D]`` into ``slot [Hkv]``."""
        n_kv_heads, _, head_dim = self.slot_keys.shape
        index = slot[:, None]
        self.slot_keys.scatter_(1, index[..., None].expand(-1, -1, head_dim), key)
        self.slot_values.scatter_(1, index[..., None].expand(-1, -1, head_dim), value)
        self.slot_positions.scatter_(1, index, position.expand(n_kv_heads, 1))
        self.on_write(slot)

    def attend(self, query: torch.Tensor, position: torch.Tensor, scaling: float) -> torch.Tensor:
        """``query [Hq, D]`` over the valid slots -> ``out [Hq, D]``; records the attended count."""
        valid = self.slot_positions >= 0
        out, _ = slot_attention(query, self.slot_keys, self.slot_values, valid, scaling)
        self.seq.counters.record_on_device(valid.sum(-1).float().mean())
        return out

    def kept_order(self) -> torch.Tensor:
        """``[Hkv, n]``: the slots holding a token, in position order (every head holds as many; host-synchronising,
        for tests and analysis)."""
        n_kept = int((self.slot_positions[0] >= 0).sum())
        return self.slot_positions.argsort(dim=-1, stable=True)[:, -n_kept:] if n_kept else \
            self.slot_positions[:, :0]

    def kept_positions(self) -> torch.Tensor:
        """``[Hkv, n]`` ascending: the positions of the tokens held."""
        return self.slot_positions.gather(1, self.kept_order())

    def attended_positions(self, width: int) -> torch.Tensor:
        """bool ``[Hq, width]``: the positions held by valid slots, per query head."""
        positions = self.slot_positions
        return attended_from_positions(positions, positions >= 0, width, self.model.n_heads // positions.shape[0])

    def gpu_kv_bytes(self) -> int:
        if self.slot_keys is None or self.slot_keys.device.type != "cuda":
            return super().gpu_kv_bytes()
        return self.slot_keys.nbytes + self.slot_values.nbytes


class RingSlotsKV(TokenSlotsKV):
    """Slots ``[0, n_pinned)`` hold tokens kept for good; the others are a ring of the most recent tokens: the token
    at position ``t >= ring_start`` lives in slot ``n_pinned + (t - ring_start) % ring_size``, where it replaces the
    oldest one (a position below ``ring_start`` is its own slot: a prompt shorter than the pinned part). Subclasses
    set the three numbers in ``place_prompt``."""

    n_pinned: int = 0
    ring_start: int = 0
    ring_size: int = 1

    def pinned_then_recent(self, n_prompt: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``place_prompt`` for a method that keeps the prompt's first ``n_pinned`` tokens and as much of its end as
        the ring holds (the first step's token replaces the ring's oldest): ``(kept, slots)``, ``[Hkv, n]``. Made
        on the device: a copy from pageable host memory would make the model's thread wait for the layer's queued
        prefill, and the GPU for the thread, at every layer."""
        device = self.keys.device
        pinned = torch.arange(min(self.n_pinned, n_prompt), device=device)
        recent = torch.arange(max(self.n_pinned, n_prompt - self.ring_size), n_prompt, device=device)
        kept = torch.cat([pinned, recent]).expand(self.model.n_kv_heads, -1)
        return kept, self.ring_slots(kept)

    def ring_slots(self, positions: torch.Tensor) -> torch.Tensor:
        ring = self.n_pinned + torch.remainder(positions - self.ring_start, self.ring_size)
        return torch.where(positions < self.ring_start, positions, ring)

    def next_slot(self, position):
        return self.ring_slots(position).expand(self.model.n_kv_heads)

    def on_prompt_placed(self, kept, slots):
        # The paged kernel's view: whole pages of slots (the padding slots are never valid).
        n_kv_heads, _, head_dim = self.slot_keys.shape
        n_pages = -(-self.budget // SLOT_PAGE_SIZE)
        padded = n_pages * SLOT_PAGE_SIZE
        if padded > self.budget:
            grow = [torch.cat([t, t.new_zeros(n_kv_heads, padded - self.budget, head_dim)], dim=1)
                    for t in (self.slot_keys, self.slot_values)]
            self.slot_keys, self.slot_values = grow
            self.slot_positions = torch.cat(
                [self.slot_positions, self.slot_positions.new_full((n_kv_heads, padded - self.budget), -1)], dim=1)
        device = self.slot_keys.device
        self._page_table = torch.arange(n_pages, device=device, dtype=torch.int32).expand(n_kv_heads, n_pages)
        self._page_starts = torch.arange(0, padded, SLOT_PAGE_SIZE, device=device)

    def write(self, slot, key, value, position):
        # Every head's token goes to the same slot.
        self.slot_keys.index_copy_(1, slot[:1], key)
        self.slot_values.index_copy_(1, slot[:1], value)
        self.slot_positions.index_copy_(1, slot[:1], position.expand(self.slot_positions.shape[0], 1))

    def attend(self, query, position, scaling):
        # Slots fill in order until the ring turns, so the valid ones are the first min(tokens, budget).
        n_valid = (position + 1).clamp(max=self.budget)
        counts = (n_valid - self._page_starts).clamp(0, SLOT_PAGE_SIZE).expand_as(self._page_table)
        n_kv_heads, n_slots, head_dim = self.slot_keys.shape
        pages = [t.view(n_kv_heads, n_slots // SLOT_PAGE_SIZE, SLOT_PAGE_SIZE, head_dim).permute(1, 0, 2, 3)
                 for t in (self.slot_keys, self.slot_values)]
        out = paged_decode_attention(query, *pages, self._page_table, counts, scaling, self._attention_plan)
        self.seq.counters.record_on_device(n_valid)
        return out
