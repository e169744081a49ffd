"""Batched decode: B sequences, each with its own method state and its own selection, decoded in one forward.

The transformer's own work (projections, MLPs, norms, the LM head) runs once for the batch, reading the weights
once for B tokens: that is what serving many sequences buys. Attention stays each sequence's: the batch's
``BatchKVHandle`` hands row ``b`` of the step's query, key and value to sequence ``b``'s ``LayerKV``, the same
batch-1 code that a single sequence runs, so every method that decodes one sequence decodes a batch, each row with
its own positions (ragged batches work) and its own selection, and a row's attention computes at batch B what it
computes alone. What may differ is the rounding of the batched matrix products (a GEMM over B rows need not sum
in the order of a matrix-vector product); the tests hold tokens equal at batch B and batch 1.

The sequences of a batch share the one stream they decode on, and so its hand-off channel
(``HarnessCache(host_functions=...)``): one host worker serves every row's host step in stream order, instead of B
workers spinning on the cores the host steps' own threads need.

A method may attend for every row at once instead (``LayerKV.decode_rows``): ShadowKV and ArkVale launch each of
their step's kernels once for the batch, each program finding its row's buffers through a
``kernels.row_table.RowTable``. With ``row_groups`` G > 1 the rows are cut into G groups of consecutive rows, each
attending through ``decode_rows`` on a stream of its own where the rows have streams (in turn otherwise): one
group's copies from host memory can then run under another's kernels, which one launch for all rows serialises.

With ``row_streams`` (``BatchCache``'s default; ``row_streams=False`` keeps the rows in turn on the model's
stream) each row's attention runs on a stream of its own on CUDA, forked from the model's stream and joined back
before the rows' outputs are concatenated, in eager steps and in captured ones alike: a sparse method's step is
mostly small dependent kernels, so rows one after another leave the GPU mostly idle, while rows side by side
overlap. A row computes what it computes alone, on any stream. Rows whose method hands work to the host (the
channel is in use: IceCache, MagicPIG) keep taking turns on the model's stream, since their one channel serves its
requests in stream order; so does every layer's first decode step, where a layer may make its host exchange (and
the channel is known to be in use only from then on).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache

from .cache import HarnessCache, HarnessCacheLayer, KVHandle
from .layer import LayerKV, SequenceContext


@dataclass
class BatchKVHandle(KVHandle):
    """``update``'s answer for a batch: every row's layer (``layers[b]``) and the step's keys and values."""

    layers: tuple[LayerKV, ...] = ()
    streams: tuple[torch.cuda.Stream, ...] | None = None  # one per row: the rows attend side by side
    row_groups: int = 1  # groups of rows that a method's decode_rows serves a launch each

    def attend(self, query: torch.Tensor, attention_mask: torch.Tensor | None, scaling: float) -> torch.Tensor:
        if query.shape[-2] != 1:
            raise ValueError("a batch decodes one token per row; prefill each sequence on its own HarnessCache")

        def attend_row(b: int) -> torch.Tensor:
            # A decode step attends to its own sequence only: no mask (padding never enters a row's cache).
            return KVHandle(self.layers[b], self.key[b : b + 1], self.value[b : b + 1]).attend(query[b : b + 1], None,
                                                                                              scaling)

        layers = self.layers
        kind = type(layers[0])
        if all(type(layer) is kind and layer.seq_len > 0 and layer.seq.selection_meter is None for layer in layers):
            if self.row_groups > 1:
                out = self.attend_groups(query, scaling, attend_row)
            else:  # the method's one launch per kernel for every row
                out = decode_rows(layers, query, self.key, self.value, scaling)
            if out is not None:
                return out
        if self.streams is None or layers[0].seq.host_functions.kind is not None:
            return torch.cat([attend_row(b) for b in range(len(layers))], dim=0)
        current = torch.cuda.current_stream(query.device)
        rows = []
        for b, stream in enumerate(self.streams):
            stream.wait_stream(current)
            with torch.cuda.stream(stream):
                row = attend_row(b)
            row.record_stream(current)  # made on the row's stream, read by the model's below
            rows.append(row)
        for stream in self.streams:
            for tensor in (query, self.key, self.value):  # the model's step may drop them while a row still reads
                tensor.record_stream(stream)
            current.wait_stream(stream)
        return torch.cat(rows, dim=0)

    def attend_groups(self, query: torch.Tensor, scaling: float, attend_row) -> torch.Tensor | None:
        """The rows in ``row_groups`` groups of consecutive rows, each through the method's ``decode_rows``, group
        ``g`` on row stream ``g`` when the rows have streams and no host work. None, with nothing done, when the
        method declines the first group (it has no batched step: the rows attend as without groups); a later group
        it declines attends row by row."""
        layers = self.layers
        streams = self.streams if self.streams is not None and layers[0].seq.host_functions.kind is None else None
        current = torch.cuda.current_stream(query.device) if streams is not None else None
        outs = []
        for g, rows in enumerate(row_groups(len(layers), self.row_groups)):
            stream = streams[g] if streams is not None else None
            if stream is not None:
                stream.wait_stream(current)
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                out = decode_rows(layers[rows], query[rows], self.key[rows], self.value[rows], scaling)
                if out is None and g == 0:
                    return None
                if out is None:
                    out = torch.cat([attend_row(b) for b in range(rows.start, rows.stop)], dim=0)
            if stream is not None:
                out.record_stream(current)  # made on the group's stream, read by the model's below
            outs.append(out)
        if streams is not None:
            for stream in streams[: len(outs)]:
                for tensor in (query, self.key, self.value):  # the model's step may drop them while a group reads
                    tensor.record_stream(stream)
                current.wait_stream(stream)
        return torch.cat(outs, dim=0)


def decode_rows(layers: tuple[LayerKV, ...], query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                scaling: float) -> torch.Tensor | None:
    """The rows' step through their method's ``decode_rows``, each row's length advanced when it took it; None (and
    nothing done) when the method declines."""
    out = type(layers[0]).decode_rows(layers, query, key, value, scaling)
    if out is not None:
        for layer in layers:
            layer.seq_len += 1
    return out


def row_groups(n_rows: int, n_groups: int) -> list[slice]:
    """``n_rows`` rows cut into at most ``n_groups`` groups of consecutive rows, the larger groups first."""
    n_groups = max(1, min(n_groups, n_rows))
    size, extra = divmod(n_rows, n_groups)
    bounds = [0]
    for g in range(n_groups):
        bounds.append(bounds[-1] + size + (g < extra))
    return [slice(a, b) for a, b in zip(bounds, bounds[1:])]


class BatchCacheLayer(HarnessCacheLayer):
    """One layer of every row of the batch (``kv`` is the first row's)."""

    def __init__(self, kvs: list[LayerKV], row_streams: "RowStreams | None" = None, row_groups: int = 1):
        super().__init__(kvs[0])
        self.kvs = tuple(kvs)
        self.row_streams = row_streams
        self.row_groups = row_groups
        self.decode_steps = 0  # steps of one token per row this layer has attended (captures count once)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if key_states.shape[0] != len(self.kvs):
            raise ValueError(f"a step of {key_states.shape[0]} rows on a batch of {len(self.kvs)} sequences")
        # A layer's first decode step takes turns too: it may make its host exchange there, and only then does the
        # sequence's channel say it is in use (BatchKVHandle.attend keeps such rows in turn).
        side_by_side = (self.row_streams is not None and key_states.is_cuda and len(self.kvs) > 1
                        and self.decode_steps > 0)
        if key_states.shape[-2] == 1:
            self.decode_steps += 1
        streams = self.row_streams.on(key_states.device) if side_by_side else None
        return BatchKVHandle(self.kv, key_states, value_states, layers=self.kvs, streams=streams,
                             row_groups=self.row_groups), None

    def get_seq_length(self) -> int:
        # Only the mask sizes read it (positions are explicit per row), and decode attends unmasked.
        return max(kv.seq_len for kv in self.kvs)

    def reset(self) -> None:
        raise NotImplementedError("make new HarnessCaches per batch instead of resetting one")


def forward_step(model, cache: HarnessCache | BatchCache, input_ids: torch.Tensor,
                 positions: torch.Tensor) -> torch.Tensor:
    """One decode step of every row of ``cache`` (one sequence's, or a batch's): ``input_ids`` and ``positions``
    ``[B, 1]``, each row's position handed to its sequence (what its layers read on the device); the logits
    ``[B, V]``."""
    for row, seq in enumerate(cache.sequences):
        seq.position = positions[row]
    out = model(input_ids=input_ids, position_ids=positions, past_key_values=cache, use_cache=True,
                logits_to_keep=1)
    return out.logits[:, -1]


class RowStreams:
    """A batch's streams, one per row, made on first use on a device and kept for the batch's life (a captured step
    replays on them)."""

    def __init__(self, n_rows: int):
        self.n_rows = n_rows
        self._streams: dict[torch.device, tuple[torch.cuda.Stream, ...]] = {}

    def on(self, device: torch.device) -> tuple[torch.cuda.Stream, ...]:
        if device not in self._streams:
            self._streams[device] = tuple(torch.cuda.Stream(device) for _ in range(self.n_rows))
        return self._streams[device]


class BatchCache(Cache):
    """The rows of a batch: one ``HarnessCache`` per sequence, each prefilled on its own, decoded together. Closing
    the batch closes every row. ``row_streams``: on CUDA, each row attends on a stream of its own; ``row_groups``:
    the groups of rows a method's ``decode_rows`` serves with a launch each (module docstring)."""

    def __init__(self, caches: list[HarnessCache], row_streams: bool = True, row_groups: int = 1):
        if not caches:
            raise ValueError("a batch needs at least one sequence")
        if row_groups < 1:
            raise ValueError(f"row_groups={row_groups}: give 1 (one launch for all rows) or more groups")
        n_layers = {len(cache.layers) for cache in caches}
        if len(n_layers) != 1:
            raise ValueError("the sequences of a batch must come from one model")
        if len({id(cache.method) for cache in caches}) != 1:
            raise ValueError("the sequences of a batch run one method: make their HarnessCaches from one Method")
        channels = {id(cache.seq.host_functions) for cache in caches}
        if len(channels) != 1:
            raise ValueError("the sequences of a batch share one hand-off channel: make their HarnessCaches with "
                             "host_functions=<one HostFunctions>")
        self.caches = list(caches)
        self.method = caches[0].method
        self.row_streams = RowStreams(len(caches)) if row_streams else None
        layers = [BatchCacheLayer([cache.layers[i].kv for cache in caches], self.row_streams, row_groups)
                  for i in range(n_layers.pop())]
        super().__init__(layers=layers)

    @property
    def sequences(self) -> list[SequenceContext]:
        return [cache.seq for cache in self.caches]

    @property
    def layer_kvs(self) -> list[LayerKV]:
        """Every row's layers, row by row."""
        return [kv for cache in self.caches for kv in cache.layer_kvs]

    def rows_layer_kvs(self) -> list[list[LayerKV]]:
        return [cache.layer_kvs for cache in self.caches]

    def close(self) -> None:
        for cache in self.caches:
            cache.close()

    def __enter__(self) -> "BatchCache":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
