"""The constant-size token cache of the shared core (``core.token_slots``) with its generic attention: a subclass
that keeps a per-head rotating set of slots, checked against dense attention masked to what the slots hold."""

from __future__ import annotations

import torch

from icecache.core.layer import ModelInfo, SequenceContext
from icecache.core.token_slots import TokenSlotsKV

INFO = ModelInfo(n_layers=1, n_heads=4, n_kv_heads=2, head_dim=8)


class RotatingSlots(TokenSlotsKV):
    """Keeps the prompt's last ``budget - 1`` tokens; then head ``h``'s token at position ``t`` replaces slot
    ``(t + h) % budget``: different slots per head, so the generic attention over arbitrary valid slots is used."""

    def place_prompt(self, n_prompt):
        n_keep = min(n_prompt, self.budget - 1)
        kept = torch.arange(n_prompt - n_keep, n_prompt).expand(INFO.n_kv_heads, -1)
        slots = torch.remainder(kept + torch.arange(INFO.n_kv_heads)[:, None], self.budget)
        return kept, slots

    def next_slot(self, position):
        return torch.remainder(position + torch.arange(INFO.n_kv_heads), self.budget)


def test_generic_slot_attention_equals_dense_attention_masked_to_the_held_tokens():
    gen = torch.Generator().manual_seed(0)
    layer = RotatingSlots(0, INFO, SequenceContext(trace_selection=True), budget=12)
    keys, values = torch.randn(1, 2, 30, 8, generator=gen), torch.randn(1, 2, 30, 8, generator=gen)
    layer.forward(torch.randn(1, 4, 30, 8, generator=gen), keys, values, None, 0.3)
    for _ in range(15):
        query, key, value = (torch.randn(1, h, 1, 8, generator=gen) for h in (4, 2, 2))
        keys, values = torch.cat([keys, key], dim=2), torch.cat([values, value], dim=2)
        out = layer.forward(query, key, value, None, 0.3)
        held = layer.kept_positions()  # [Hkv, n]: what the slots hold after the step's write
        assert held.shape == (2, 12)
        for head in range(4):
            kv = head // 2
            scores = (keys[0, kv, held[kv]] @ query[0, head, 0]) * 0.3
            expected = torch.softmax(scores, dim=0) @ values[0, kv, held[kv]]
            torch.testing.assert_close(out[0, 0, head], expected, rtol=1e-5, atol=1e-6)
        n_tokens = keys.shape[2]
        expected_mask = torch.zeros(2, n_tokens, dtype=torch.bool)
        expected_mask.scatter_(1, held, True)
        assert torch.equal(layer.last_attended, expected_mask.repeat_interleave(2, dim=0))
    assert layer.seq.counters.as_dict()["mean_attended_tokens"] == 12.0
