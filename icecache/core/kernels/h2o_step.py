"""H2O's decode step over its token slots, as one operation: attend, accumulate, choose the next victim.

Given the slots after the step's token was written (``slot_positions`` -1 where empty, the new slot's score 0),
``h2o_step`` attends the query over the valid slots, adds each query head's probabilities to its accumulated
``scores``, and chooses where the next token goes: once every slot is taken, the older slot (position at most
``position - (n_recent - 1)``) with the smallest score summed over the KV group's query heads, whose position it sets
to -1 (evicted); before that, the first empty slot. Everything stays on the device.

``h2o_step_reference`` is the PyTorch definition (CPU, and CUDA without Triton); ``h2o_step_triton`` does all of it
with one Triton program per KV head in two passes over the slots, where the reference takes some twenty small
kernels; ``h2o_step`` dispatches to it on CUDA when ``triton_runtime.available()``. Ties in the smallest score go to
the lowest slot in both. No launch state: every call goes through Triton's launch path.
"""

from __future__ import annotations

import math

import torch

from .slot_attention import slot_attention
from .triton_runtime import available as triton_available
from .triton_runtime import require_triton, tl, triton


def h2o_step_reference(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
                       scores: torch.Tensor, free_slot: torch.Tensor, position: torch.Tensor, scaling: float,
                       n_recent: int) -> torch.Tensor:
    """``query [Hq, D]``; ``keys``/``values [Hkv, S, D]``; ``positions [Hkv, S]`` int64; ``scores [Hq, S]`` float32
    and ``free_slot [Hkv]`` int64, both updated in place, as ``positions`` (the victim's). Returns float32
    ``[Hq, D]``."""
    n_kv_heads, n_slots = positions.shape
    valid = positions >= 0
    out, probs = slot_attention(query, keys, values, valid, scaling)
    scores.add_(probs)
    older = valid & (positions <= position - (n_recent - 1))
    kv_scores = scores.view(n_kv_heads, -1, n_slots).sum(dim=1)
    victim = kv_scores.masked_fill(~older, float("inf")).argmin(dim=-1)
    empty = ~valid
    full = ~empty.any(dim=-1)
    free_slot.copy_(torch.where(full, victim, empty.int().argmax(dim=-1)))
    evicted = torch.where(full, -1, positions.gather(1, victim[:, None])[:, 0])
    positions.scatter_(1, victim[:, None], evicted[:, None])
    return out


def h2o_step(query, keys, values, positions, scores, free_slot, position, scaling, n_recent) -> torch.Tensor:
    """Dispatch: the Triton kernel on CUDA when available, the PyTorch reference otherwise."""
    if query.is_cuda and triton_available():
        return h2o_step_triton(query, keys, values, positions, scores, free_slot, position, scaling, n_recent)
    return h2o_step_reference(query, keys, values, positions, scores, free_slot, position, scaling, n_recent)


if triton is not None:

    @triton.jit
    def _h2o_step_kernel(
        query_ptr, key_ptr, value_ptr, positions_ptr, scores_ptr, free_ptr, position_ptr, out_ptr,
        n_slots, qk_scale_log2, n_recent,
        stride_qh, stride_kh, stride_ks, stride_vh, stride_vs, stride_ph, stride_sh, stride_oh,
        GROUP: tl.constexpr, BLOCK_GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_DIM: tl.constexpr,
        BLOCK_T: tl.constexpr, IEEE_FP32: tl.constexpr,
    ):
        kv_head = tl.program_id(0).to(tl.int64)
        rows = tl.arange(0, BLOCK_GROUP)
        dims = tl.arange(0, BLOCK_DIM)
        heads = kv_head * GROUP + rows
        row_ok = rows < GROUP
        dim_ok = dims < HEAD_DIM
        query = tl.load(query_ptr + heads[:, None] * stride_qh + dims[None, :],
                        mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
        if IEEE_FP32:
            query = query.to(tl.float32)
        current = tl.load(position_ptr)

        running_max = tl.full([BLOCK_GROUP], float("-inf"), dtype=tl.float32)
        running_sum = tl.zeros([BLOCK_GROUP], dtype=tl.float32)
        for start in range(0, n_slots, BLOCK_T):
            slots = start + tl.arange(0, BLOCK_T)
            in_range = slots < n_slots
            held = tl.load(positions_ptr + kv_head * stride_ph + slots, mask=in_range, other=-1)
            valid = held >= 0
            keys = tl.load(key_ptr + kv_head * stride_kh + slots[:, None] * stride_ks + dims[None, :],
                           mask=valid[:, None] & dim_ok[None, :], other=0.0)
            if IEEE_FP32:
                logits = tl.dot(query, tl.trans(keys.to(tl.float32)), input_precision="ieee")
            else:
                logits = tl.dot(query, tl.trans(keys.to(query.dtype)))
            logits = tl.where(valid[None, :], logits * qk_scale_log2, float("-inf"))
            new_max = tl.maximum(running_max, tl.max(logits, 1))
            shift = tl.where(new_max == float("-inf"), 0.0, new_max)
            running_sum = running_sum * tl.exp2(running_max - shift) + tl.sum(tl.exp2(logits - shift[:, None]), 1)
            running_max = new_max
        shift = tl.where(running_max == float("-inf"), 0.0, running_max)
        denominator = tl.where(running_sum > 0, running_sum, 1.0)

        acc = tl.zeros([BLOCK_GROUP, BLOCK_DIM], dtype=tl.float32)
        best = float("inf")
        best_slot = 0
        n_held = 0
        first_empty = n_slots
        for start in range(0, n_slots, BLOCK_T):
            slots = start + tl.arange(0, BLOCK_T)
            in_range = slots < n_slots
            held = tl.load(positions_ptr + kv_head * stride_ph + slots, mask=in_range, other=-1)
            valid = held >= 0
            keys = tl.load(key_ptr + kv_head * stride_kh + slots[:, None] * stride_ks + dims[None, :],
                           mask=valid[:, None] & dim_ok[None, :], other=0.0)
            if IEEE_FP32:
                logits = tl.dot(query, tl.trans(keys.to(tl.float32)), input_precision="ieee")
            else:
                logits = tl.dot(query, tl.trans(keys.to(query.dtype)))
            logits = tl.where(valid[None, :], logits * qk_scale_log2, float("-inf"))
            probs = tl.exp2(logits - shift[:, None]) / denominator[:, None]
            probs = tl.where(valid[None, :] & row_ok[:, None], probs, 0.0)
            values = tl.load(value_ptr + kv_head * stride_vh + slots[:, None] * stride_vs + dims[None, :],
                             mask=valid[:, None] & dim_ok[None, :], other=0.0)
            if IEEE_FP32:
                acc += tl.dot(probs, values.to(tl.float32), input_precision="ieee")
            else:
                acc += tl.dot(probs, values.to(tl.float32))
            score_rows = scores_ptr + heads[:, None] * stride_sh + slots[None, :]
            score_ok = row_ok[:, None] & in_range[None, :]
            accumulated = tl.load(score_rows, mask=score_ok, other=0.0) + probs
            tl.store(score_rows, accumulated, mask=score_ok)
            kv_scores = tl.sum(tl.where(score_ok, accumulated, 0.0), 0)
            older = valid & (held <= current - (n_recent - 1))
            candidates = tl.where(older, kv_scores, float("inf"))
            tile_best = tl.min(candidates, 0)
            tile_slot = start + tl.argmin(candidates, 0)
            better = tile_best < best  # strictly: the lowest slot wins a tie, as in torch.argmin
            best_slot = tl.where(better, tile_slot, best_slot)
            best = tl.where(better, tile_best, best)
            n_held += tl.sum(valid.to(tl.int32), 0)
            first_empty = tl.minimum(first_empty, tl.min(tl.where(in_range & ~valid, slots, n_slots), 0))
        tl.store(out_ptr + heads[:, None] * stride_oh + dims[None, :], acc, mask=row_ok[:, None] & dim_ok[None, :])
        full = n_held == n_slots
        # With no older candidate (never the case once full) torch.argmin of all-inf picks slot 0; so does this.
        tl.store(free_ptr + kv_head, tl.where(full, best_slot, first_empty).to(tl.int64))
        victim_position = positions_ptr + kv_head * stride_ph + best_slot
        tl.store(victim_position, tl.full([], -1, tl.int64), mask=full)


def h2o_step_triton(query, keys, values, positions, scores, free_slot, position, scaling, n_recent) -> torch.Tensor:
    """The Triton version of ``h2o_step_reference`` (CUDA tensors, contiguous last dimensions)."""
    require_triton()
    n_heads, head_dim = query.shape
    n_kv_heads, n_slots = positions.shape
    for name, tensor in (("query", query), ("keys", keys), ("values", values), ("positions", positions),
                         ("scores", scores)):
        if tensor.stride(-1) != 1:
            raise ValueError(f"h2o_step: {name} must be contiguous in its last dimension")
    if scores.dtype != torch.float32 or positions.dtype != torch.int64 or free_slot.dtype != torch.int64:
        raise ValueError("h2o_step: scores float32, positions and free_slot int64")
    out = torch.empty(n_heads, head_dim, dtype=torch.float32, device=query.device)
    group = n_heads // n_kv_heads
    fp32 = query.dtype == torch.float32 or keys.dtype == torch.float32
    _h2o_step_kernel[(n_kv_heads,)](
        query, keys, values, positions, scores, free_slot, position, out,
        n_slots, float(scaling) * math.log2(math.e), n_recent,
        query.stride(0), keys.stride(0), keys.stride(1), values.stride(0), values.stride(1), positions.stride(0),
        scores.stride(0), out.stride(0),
        GROUP=group, BLOCK_GROUP=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        BLOCK_DIM=triton.next_power_of_2(head_dim), BLOCK_T=64, IEEE_FP32=fp32, num_warps=8 if fp32 else 4,
    )
    return out
