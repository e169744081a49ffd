"""Full cache: every token of every layer kept on the model's device, dense attention. Ignores the budget."""

from __future__ import annotations

from icecache.core.method import METHODS, DenseKV, Method


@METHODS.register("full")
class FullCache(Method):
    uses_budget = False

    def make_layer(self, layer_idx, seq):
        return DenseKV(layer_idx, self.model, seq)

    def make_sparse_layer(self, layer_idx, seq):
        return DenseKV(layer_idx, self.model, seq)
