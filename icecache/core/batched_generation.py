"""Greedy decoding of a batch (``core.batch``): each prompt prefilled on its own, then one forward per step for
every row, replayed from a CUDA graph where the method captures its step.

A row is one sequence's progress (``DecodingRow``): the tokens it generated, its next position, why it stopped.
``decode_batch`` continues rows from where they are, so a caller can prefill rows one by one and decode batches of
growing size over them (the throughput benchmark does; its rows are then ragged by the steps they already ran).
A row that stops keeps stepping with its last token until every row of the batch has stopped (one graph serves
the batch); those steps write past its tokens, inside the room ``prefill_row`` announced, and are not returned.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from .batch import BatchCache, forward_step
from .cache import HarnessCache
from .cuda_driver import HostFunctions
from .generation import GenerationRequest, GenerationResult, capturable, pick_token, prefill_sequence, why_stopped
from .graphs import GraphedDecodeStep
from .layer_inputs import previous_layer_inputs
from .timing import synchronize

#: The range (``torch.profiler.record_function``) around each step of ``decode_batch``: a profile's steps.
STEP_RANGE = "decode_batch_step"


@dataclass
class DecodingRow:
    """One sequence of a batch: its request, what it generated, its next position and, once done, why."""

    request: GenerationRequest
    cache: HarnessCache
    generated: list[int]
    position: int
    ttft_s: float
    stop_reason: str | None = None
    logits: list[torch.Tensor] | None = None
    # What the row's cache reports after its latest decode_batch (read before the batch closes the caches).
    cache_report: dict[str, Any] = field(default_factory=dict)

    @property
    def prompt_tokens(self) -> int:
        return len(self.request.input_ids) + len(self.request.suffix_ids)

    def pick(self, logits: torch.Tensor) -> int:
        return pick_token(logits, self.request, len(self.generated))

    def result(self, batch: "BatchDecodeResult") -> GenerationResult:
        """The row as a ``GenerationResult``, as batch-1 generation reports a sequence: its tokens, stop reason and
        TTFT are its own; TT2T and TPOT are the batch's steps (one step decodes every row); ``counters`` and the KV
        sizes are its cache's (its counters count the steps it stepped along after it stopped too), with ``batch_size``
        among the counters."""
        report = self.cache_report
        first_step = batch.step_times_s[0] if batch.step_times_s else None
        return GenerationResult(
            token_ids=list(self.generated), stop_reason=self.stop_reason or "length", prompt_tokens=self.prompt_tokens,
            ttft_s=self.ttft_s, tt2t_s=self.ttft_s + first_step if first_step is not None else None,
            tpot_s=batch.tpot_s, step_times_s=list(batch.step_times_s),
            counters={**report.get("counters", {}), **batch.counters, "batch_size": batch.batch_size},
            gpu_kv_bytes=report.get("gpu_kv_bytes", 0), cpu_kv_bytes=report.get("cpu_kv_bytes", 0),
            offloaded_kv_bytes=report.get("offloaded_kv_bytes", 0), peak_gpu_bytes=batch.peak_gpu_bytes,
            logits=self.logits,
        )

    def check_stop(self, tokenizer) -> bool:
        """Whether the row is done (its reason kept in ``stop_reason``; a final EOS is not returned)."""
        if self.stop_reason is None:
            self.stop_reason = why_stopped(self.request, self.generated, tokenizer)
        return self.stop_reason is not None


@torch.inference_mode()
def prefill_row(model, cache: HarnessCache, request: GenerationRequest, *, reserved_new_tokens: int | None = None,
                prefill_chunk_size: int | None = None, layer_by_layer: bool = False, residual_on_host: bool = False,
                keep_logits: bool = False) -> DecodingRow:
    """Prefill one sequence of a batch and pick its first token. ``reserved_new_tokens`` (at least the request's
    ``max_new_tokens``): the generated tokens its buffers are sized for, which must cover the steps of every batch
    it will decode in (a row that stops early keeps stepping until its batch does)."""
    reserved = max(request.max_new_tokens, reserved_new_tokens or 0)
    with previous_layer_inputs(model, cache.layer_kvs):
        synchronize(model.device)
        start = time.perf_counter()
        logits, position = prefill_sequence(model, cache, request, reserved, prefill_chunk_size, layer_by_layer,
                                            residual_on_host)
        cache.seq.timer.take_step()
        row = DecodingRow(request, cache, [], position, 0.0, logits=[logits.float().cpu()] if keep_logits else None)
        row.generated.append(row.pick(logits))
        row.ttft_s = time.perf_counter() - start
    cache.seq.prompt_copies.join()
    return row


@dataclass
class BatchDecodeResult:
    """The steps of one ``decode_batch``: each one's wall time (all rows), and what the rows' caches report."""

    batch_size: int
    step_times_s: list[float] = field(default_factory=list)
    counters: dict[str, Any] = field(default_factory=dict)
    peak_gpu_bytes: int | None = None

    @property
    def tpot_s(self) -> float | None:
        """The median step after the first (which may run eagerly to warm up and capture)."""
        return statistics.median(self.step_times_s[1:]) if len(self.step_times_s) > 1 else None

    @property
    def tokens_per_s(self) -> float | None:
        """Decode throughput: one token per row per step."""
        return self.batch_size / self.tpot_s if self.tpot_s else None


@torch.inference_mode()
def decode_batch(model, batch: BatchCache, rows: list[DecodingRow], *, max_steps: int | None = None,
                 cuda_graph: bool = True, tokenizer=None) -> BatchDecodeResult:
    """Decode ``rows`` (``rows[b]`` on ``batch.caches[b]``) together until every row stops, or for at most
    ``max_steps`` steps; the rows advance in place. On CUDA, a method that captures its step replays one graph for
    the batch after its first steps (the first runs eagerly)."""
    if [row.cache for row in rows] != batch.caches:
        raise ValueError("rows[b] must be the row of batch.caches[b]")
    if any(row.request.stop_strings for row in rows) and tokenizer is None:
        raise ValueError("stop strings need a tokenizer")
    device = model.device
    is_cuda = device.type == "cuda"
    for row in rows:
        row.check_stop(tokenizer)
    remaining = max((row.request.max_new_tokens - len(row.generated) for row in rows if row.stop_reason is None),
                    default=0)
    n_steps = remaining if max_steps is None else min(remaining, max_steps)
    for row in rows:  # a stopped row steps too; its buffers must hold those steps
        room = (row.cache.seq.max_total_tokens or 0) - row.position
        if n_steps > room:
            raise ValueError(f"a row at position {row.position} has room for {room} more tokens and the batch runs "
                             f"up to {n_steps} steps: prefill its rows with reserved_new_tokens covering them")
    if is_cuda:
        torch.cuda.reset_peak_memory_stats(device)
    result = BatchDecodeResult(batch_size=len(rows))
    graphed = GraphedDecodeStep(model, batch) if is_cuda and cuda_graph and capturable(batch) else None
    try:
        with previous_layer_inputs(model, rows=batch.rows_layer_kvs()):
            for _ in range(n_steps):
                if all(row.stop_reason is not None for row in rows):
                    break
                tokens = [row.generated[-1] for row in rows]
                positions = [row.position for row in rows]
                start = time.perf_counter()
                # A named range per step, so that a profile can tell the steps apart (what a step's picks wait for
                # ends inside it). Nearly free when no profiler is on.
                with torch.profiler.record_function(STEP_RANGE):
                    if graphed is not None:
                        logits = graphed(tokens, positions)
                    else:
                        logits = forward_step(model, batch, torch.tensor(tokens, device=device)[:, None],
                                              torch.tensor(positions, device=device)[:, None])
                    for index, row in enumerate(rows):
                        row.position += 1
                        if row.stop_reason is None:
                            row.generated.append(row.pick(logits[index]))
                            if row.logits is not None:
                                row.logits.append(logits[index].float().cpu())
                result.step_times_s.append(time.perf_counter() - start)
                for row in rows:
                    row.cache.seq.timer.take_step()
                    row.check_stop(tokenizer)
    finally:
        if graphed is not None:
            result.counters.update(graphed.counters())
            graphed.close()
    result.peak_gpu_bytes = torch.cuda.max_memory_allocated(device) if is_cuda else None
    for row in rows:
        cache = row.cache
        row.cache_report = {"counters": cache.seq.counters.as_dict(), "gpu_kv_bytes": cache.gpu_kv_bytes(),
                            "cpu_kv_bytes": cache.cpu_kv_bytes(), "offloaded_kv_bytes": cache.offloaded_kv_bytes()}
    return result


def batched_greedy_generate(model, method, requests: list[GenerationRequest], *, tokenizer=None,
                            prefill_chunk_size: int | None = None, layer_by_layer: bool = False,
                            residual_on_host: bool = False, cuda_graph: bool = True, keep_logits: bool = False,
                            row_streams: bool = True, row_groups: int = 1,
                            **cache_options) -> tuple[list[DecodingRow], BatchDecodeResult]:
    """Greedy decoding of ``requests`` as one batch under ``method``: each prompt prefilled on its own
    ``HarnessCache`` (``cache_options`` passed to it), then decoded together (``row_streams``: each row attends on a
    CUDA stream of its own; ``row_groups``: the groups a method's ``decode_rows`` serves; ``core.batch``); the batch
    is closed at the end."""
    method.check_batch_size(len(requests))
    channel = HostFunctions()
    reserve = max(request.max_new_tokens for request in requests)
    caches = [HarnessCache(method, host_functions=channel, **cache_options) for _ in requests]
    with BatchCache(caches, row_streams=row_streams, row_groups=row_groups) as batch:
        rows = [prefill_row(model, cache, request, reserved_new_tokens=reserve, prefill_chunk_size=prefill_chunk_size,
                            layer_by_layer=layer_by_layer, residual_on_host=residual_on_host,
                            keep_logits=keep_logits)
                for cache, request in zip(caches, requests)]
        result = decode_batch(model, batch, rows, cuda_graph=cuda_graph, tokenizer=tokenizer)
    return rows, result
