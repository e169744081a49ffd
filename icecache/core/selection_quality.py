"""Selection quality: how much of a decode step's exact attention the tokens a method attended hold.

With ``measure_selection`` on, every decode step of every sparsified layer is measured after the layer has run:
the exact softmax attention of each query head over every token the sequence has seen, from a copy of all keys
that the meter keeps itself on the model's device (a method may have evicted, offloaded or never stored some of
them), and, of that distribution,

* ``mass``: the share the method's attended set holds (``LayerKV.last_attended``, traced by every method);
* ``oracle_mass``: the share the best set of the same size holds, per head: its top-``k`` probabilities with ``k``
  the number of tokens that head attended at that step (so the oracle is never below the method, and a method
  that attends fewer tokens than its budget is compared with the best set of what it actually attended; the
  count itself is reported beside it);
* ``attended``: that number of tokens.

Each is averaged over query heads and decode steps per layer (``summary``). The measurement only reads: it never
changes what a layer stores or returns, so a measured run generates the tokens an unmeasured one does. It makes
the layers trace their selection. Everything it does at a decode step is device work of fixed shapes: the keys go
in at the step's device-side position, the exact attention is taken over the whole key buffer with the positions
not yet seen masked out, and the sums (steps included) stay on the device. So a measured step can be captured in
a CUDA graph like an unmeasured one, when the method's layers build their trace in a way the graph repeats too
(``Method.traces_in_graph``: the trace has ``SequenceContext.trace_width`` columns at every step); otherwise the
generation loop keeps the measured steps eager. Its dense pass costs one ``[Hq, width]`` score row, a sort and a
few reductions per layer and step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from .layer import storage_capacity

if TYPE_CHECKING:
    from .layer import LayerKV, SequenceContext


class SelectionMeter:
    """Measures the layers ``first_layer .. n_layers - 1`` (the sparsified ones) of one sequence."""

    def __init__(self, seq: SequenceContext, n_layers: int, first_layer: int):
        self.seq = seq
        self.first_layer = first_layer
        self.n_layers = n_layers
        self._keys: dict[int, torch.Tensor] = {}  # layer -> [Hkv, capacity, D], the model's dtype
        self._length: dict[int, int] = {}  # tokens the prefill wrote (decode steps write at the device position)
        # Per layer: sums over (step, head) of mass, oracle mass and attended count, and the number of steps, kept
        # on the device so that a step reads nothing back to the host (and a replayed graph adds to them); float64
        # so that a sum over thousands of steps stays exact enough for the oracle >= method comparison.
        self._sums: dict[int, torch.Tensor] = {}
        self._heads = 0

    def forward(self, layer: LayerKV, query, key, value, attention_mask, scaling) -> torch.Tensor:
        """``layer.forward`` with the step measured (a decode step of a sparsified layer) or the keys recorded."""
        index = layer.layer_idx
        if index < self.first_layer:
            return layer.forward(query, key, value, attention_mask, scaling)
        decoding = query.shape[-2] == 1 and layer.seq_len > 0  # LayerKV.forward's own test
        if not decoding:
            out = layer.forward(query, key, value, attention_mask, scaling)
            self._append_prompt(index, key[0])
            return out
        position = layer.decode_position(query.device)  # before the layer counts its new token
        layer.last_attended = None  # a method that does not trace this step must not pass off the last one
        out = layer.forward(query, key, value, attention_mask, scaling)
        stored = self._room(index, key[0], layer.seq_len)
        stored.index_copy_(1, position.to(stored.device), key[0])
        self._measure(layer, query[0, :, 0], position, scaling)
        return out

    def _room(self, index: int, like: torch.Tensor, needed: int) -> torch.Tensor:
        """Layer ``index``'s key buffer, grown (outside a captured step: the announced length covers every step of
        a generation) to hold ``needed`` tokens."""
        stored = self._keys.get(index)
        if stored is None or needed > stored.shape[1]:
            capacity = storage_capacity(self.seq, needed, 0 if stored is None else stored.shape[1])
            grown = like.new_zeros(like.shape[0], capacity, like.shape[2])
            if stored is not None:
                grown[:, : stored.shape[1]] = stored
            stored = self._keys[index] = grown
        return stored

    def _append_prompt(self, index: int, key: torch.Tensor) -> None:
        """``key [Hkv, S, D]``, a prompt chunk, after the layer's earlier ones."""
        length = self._length.get(index, 0)
        needed = length + key.shape[1]
        self._room(index, key, needed)[:, length:needed] = key
        self._length[index] = needed

    def _measure(self, layer: LayerKV, query: torch.Tensor, position: torch.Tensor, scaling: float) -> None:
        index = layer.layer_idx
        n_tokens = layer.seq_len  # the new token counted
        attended = layer.last_attended
        if attended is None or attended.dim() != 2 or attended.shape[0] != query.shape[0] \
                or attended.shape[1] < n_tokens:
            got = None if attended is None else tuple(attended.shape)
            raise RuntimeError(
                f"measure_selection: layer {index} ({type(layer).__name__}) traced {got} at a decode step, not a "
                f"bool [{query.shape[0]}, >= {n_tokens}] of the positions each query head attended (last_attended "
                f"under seq.trace_selection, docs/design.md)"
            )
        keys = self._keys[index]
        width = keys.shape[1]
        attended = attended.to(keys.device)
        if attended.shape[1] > width:  # columns past the key buffer are past the tokens seen: all False
            attended = attended[:, :width]
        elif attended.shape[1] < width:
            attended = torch.nn.functional.pad(attended, (0, width - attended.shape[1]))
        seen = torch.arange(width, device=keys.device) <= position.to(keys.device)
        probs = attention_probabilities(query, keys, scaling, seen)
        mass, oracle, count = captured_mass(probs, attended & seen)
        sums = self._sums.get(index)
        if sums is None:
            sums = self._sums[index] = torch.zeros(4, dtype=torch.float64, device=probs.device)
        sums += torch.stack([mass.sum(), oracle.sum(), count.sum(), torch.ones((), dtype=torch.float64,
                                                                               device=probs.device)])
        self._heads = query.shape[0]

    def summary(self) -> dict[str, Any] | None:
        """Per measured layer, the means over query heads and decode steps; None when no step was measured."""
        layers = sorted(self._sums)
        if not layers:
            return None
        sums = torch.stack([self._sums[i] for i in layers]).cpu()
        steps = sums[:, 3]
        means = sums[:, :3] / (steps * self._heads)[:, None]
        mass, oracle, attended = (means[:, j].tolist() for j in range(3))
        return {
            "layers": layers,
            "steps": int(steps[0]),
            "mass": [round(v, 6) for v in mass],
            "oracle_mass": [round(v, 6) for v in oracle],
            "attended": [round(v, 3) for v in attended],
            "mean_mass": round(sum(mass) / len(mass), 6),
            "mean_oracle_mass": round(sum(oracle) / len(oracle), 6),
            "mean_attended": round(sum(attended) / len(attended), 3),
        }


def attention_probabilities(query: torch.Tensor, keys: torch.Tensor, scaling: float,
                            seen: torch.Tensor | None = None) -> torch.Tensor:
    """Exact softmax attention ``[Hq, T]`` (float64) of ``query [Hq, D]`` over ``keys [Hkv, T, D]``; query head
    ``h`` reads KV head ``h // (Hq / Hkv)``. With ``seen`` (bool ``[T]``) the positions outside it get 0."""
    n_heads, head_dim = query.shape
    n_kv_heads = keys.shape[0]
    grouped = query.float().view(n_kv_heads, n_heads // n_kv_heads, head_dim)
    scores = (torch.matmul(grouped, keys.float().transpose(1, 2)).reshape(n_heads, -1) * scaling).double()
    if seen is not None:
        scores = scores.masked_fill(~seen, float("-inf"))
    return torch.softmax(scores, dim=-1)


def captured_mass(probs: torch.Tensor, attended: torch.Tensor):
    """Per head: (the mass ``attended`` holds, the mass of the top-``k`` tokens with ``k`` its attended count,
    the count), from ``probs [H, T]`` and ``attended`` bool ``[H, T]``. Sorting the whole row (rather than a
    ``topk`` of the largest count) needs no host read of the counts."""
    mass = (probs * attended).sum(-1)
    count = attended.sum(-1)
    best = torch.sort(probs, dim=-1, descending=True).values.cumsum(-1)
    oracle = torch.where(count > 0, best.gather(-1, (count - 1).clamp(min=0)[:, None])[:, 0], 0.0)
    return mass, oracle, count.double()
