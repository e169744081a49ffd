"""Greedy generation with explicit positions, and the latency measurements of docs/design.md (Measurement protocol).

TTFT runs from the prompt ids on the host to the first generated id on the host (index building included);
TT2T adds the first decode step; TPOT is the median of decode steps 2..N. Per-step phases come from the cache's
``PhaseTimer`` when it is enabled; ``model`` is the rest of the step (attention kernels and the other layers).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from .cache import HarnessCache
from .graphs import GraphedDecodeStep
from .host_memory import to_device_without_waiting
from .layer_inputs import previous_layer_inputs
from .timing import synchronize


@dataclass
class GenerationRequest:
    input_ids: Sequence[int]
    max_new_tokens: int
    eos_token_ids: Sequence[int] = ()
    min_new_tokens: int = 0  # EOS is suppressed until this many tokens exist (LongBench samsum)
    stop_strings: Sequence[str] = ()
    suffix_ids: Sequence[int] = ()  # fed one by one as decode steps after the prompt (Quest / ArkVale protocols)


def default_eos_token_ids(tokenizer: Any, generation_config: Any = None) -> list[int]:
    """The ids generation stops on when a sample names none: the tokenizer's EOS and every EOS id of the model's
    generation config (Llama-3.1-Instruct lists three; ``generate`` in the reference scripts stops on that list),
    in that order, without repeats."""
    ids: list[int] = []
    configured = getattr(generation_config, "eos_token_id", None)
    for token_id in [getattr(tokenizer, "eos_token_id", None),
                     *(configured if isinstance(configured, (list, tuple)) else [configured])]:
        if token_id is not None and int(token_id) not in ids:
            ids.append(int(token_id))
    return ids


@dataclass
class GenerationResult:
    token_ids: list[int]
    stop_reason: str  # "eos", "stop_string" or "length"
    prompt_tokens: int
    ttft_s: float
    tt2t_s: float | None
    tpot_s: float | None
    step_times_s: list[float] = field(default_factory=list)
    step_phases: list[dict[str, float]] = field(default_factory=list)
    prefill_phases: dict[str, float] = field(default_factory=dict)  # timed phases of the prompt (in TTFT)
    counters: dict[str, Any] = field(default_factory=dict)
    gpu_kv_bytes: int = 0
    cpu_kv_bytes: int = 0
    offloaded_kv_bytes: int = 0  # the offloaded keys and values at the model's dtype (LayerKV.offloaded_kv_bytes)
    peak_gpu_bytes: int | None = None
    logits: list[torch.Tensor] | None = None
    selection: dict[str, Any] | None = None  # with measure_selection: SelectionMeter.summary()

    def phase_breakdown(self) -> dict[str, float]:
        """Median seconds per phase over decode steps 2..N, with ``model`` the remainder of the step."""
        steps = list(zip(self.step_times_s, self.step_phases))[1:]
        if not steps:
            return {}
        names = sorted({name for _, phases in steps for name in phases})
        rows = []
        for total, phases in steps:
            row = {name: phases.get(name, 0.0) for name in names}
            row["model"] = total - sum(row.values())
            rows.append(row)
        return {name: statistics.median(r[name] for r in rows) for name in rows[0]}

    def summary(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "new_tokens": len(self.token_ids),
            "stop_reason": self.stop_reason,
            "ttft_s": self.ttft_s,
            "tt2t_s": self.tt2t_s,
            "tpot_s": self.tpot_s,
            "phases_s": self.phase_breakdown(),
            "prefill_phases_s": self.prefill_phases,
            "gpu_kv_bytes": self.gpu_kv_bytes,
            "cpu_kv_bytes": self.cpu_kv_bytes,
            "offloaded_kv_bytes": self.offloaded_kv_bytes,
            "peak_gpu_bytes": self.peak_gpu_bytes,
            **self.counters,
        }


def _forward(model, ids: torch.Tensor, start: int, cache: HarnessCache) -> torch.Tensor:
    positions = torch.arange(start, start + ids.shape[-1], device=ids.device)[None]
    cache.seq.position = positions[0]
    out = model(input_ids=ids[None], position_ids=positions, past_key_values=cache, use_cache=True, logits_to_keep=1)
    return out.logits[0, -1]


def capturable(cache) -> bool:
    """Whether the decode steps of ``cache`` (one sequence's, or a batch's) may be captured: the method captures
    them, and a traced run (measure_selection among them) only where the method declares ``traces_in_graph`` (a
    trace that Python builds from the host's state at the step would be frozen at the captured one)."""
    traced = any(seq.trace_selection for seq in cache.sequences)
    return cache.method.captures_decode_step and (not traced or cache.method.traces_in_graph)


def prefill_sequence(model, cache: HarnessCache, request: GenerationRequest, reserved_new_tokens: int,
                     prefill_chunk_size: int | None, layer_by_layer: bool, residual_on_host: bool
                     ) -> tuple[torch.Tensor, int]:
    """The prompt and the suffix of ``request`` into ``cache``, with room announced for ``reserved_new_tokens``
    generated ones; returns the logits of the first generated token and the position of the next."""
    device = model.device
    prompt = to_device_without_waiting(torch.tensor(list(request.input_ids), dtype=torch.long), device)
    n_prompt = prompt.shape[0]
    chunk = prefill_chunk_size or n_prompt
    cache.seq.max_total_tokens = n_prompt + len(request.suffix_ids) + reserved_new_tokens
    if cache.seq.trace_selection:  # one trace shape for the whole sequence (LayerKV.trace_width)
        cache.seq.trace_width = cache.seq.max_total_tokens
    if layer_by_layer:
        logits = _prefill_layer_by_layer(model, prompt, cache, chunk, residual_on_host)
    else:
        for begin in range(0, n_prompt, chunk):
            cache.seq.more_prefill_chunks = begin + chunk < n_prompt
            logits = _forward(model, prompt[begin : begin + chunk], begin, cache)
        cache.seq.more_prefill_chunks = False
    position = n_prompt
    for token in request.suffix_ids:
        logits = _forward(model, torch.tensor([token], device=device), position, cache)
        position += 1
    return logits, position


def _prefill_layer_by_layer(
    model, prompt: torch.Tensor, cache: HarnessCache, chunk: int, residual_on_host: bool = False
) -> torch.Tensor:
    """The prompt through one decoder layer at a time, in chunks: the same computation as a chunked prefill (each
    layer sees its chunks in order, each chunk attends to the layer's earlier ones), reordered so that only one
    layer's prompt keys and values need be on the device at once (a method that offloads moves them out when its
    layer's last chunk is done) and activations stay at one chunk's. Peak memory at 128k tokens is then the weights,
    one ``[T, hidden]`` residual stream, one layer's prompt KV and one chunk's activations. With
    ``residual_on_host`` the residual stream lives in (pinned) host memory and each chunk goes to the device and
    back around its layer: the same values, 1 GiB less device memory at 128k tokens of Llama-3.1-8B, for two copies
    of the stream per layer. Returns the last position's logits."""
    decoder = model.model
    device = prompt.device
    n_prompt = prompt.shape[0]
    positions = torch.arange(n_prompt, device=device)[None]
    chunks = [slice(begin, min(begin + chunk, n_prompt)) for begin in range(0, n_prompt, chunk)]
    if residual_on_host:
        hidden = torch.empty(1, n_prompt, model.config.hidden_size, dtype=decoder.embed_tokens.weight.dtype,
                             pin_memory=device.type == "cuda")
        for piece in chunks:
            hidden[:, piece].copy_(decoder.embed_tokens(prompt[None, piece]), non_blocking=True)
        like = torch.empty(1, 1, 1, dtype=hidden.dtype, device=device)  # the rotary embedding reads only these
    else:
        hidden = decoder.embed_tokens(prompt[None])
        like = hidden[:, :1]
    rotary = [decoder.rotary_emb(like, positions[:, piece]) for piece in chunks]
    for layer in decoder.layers[: model.config.num_hidden_layers]:
        for piece, position_embeddings in zip(chunks, rotary):
            cache.seq.more_prefill_chunks = piece.stop < n_prompt
            cache.seq.position = positions[0, piece]
            # In place: later chunks of this layer read only its cache, and the next layer reads this output. On the
            # host, both copies are queued on the stream of the layer's kernels, so a chunk's next read waits for
            # its last write.
            out = layer(
                hidden[:, piece].to(device, non_blocking=True), attention_mask=None,
                position_embeddings=position_embeddings, position_ids=positions[:, piece], past_key_values=cache,
                use_cache=True,
            )
            hidden[:, piece].copy_(out, non_blocking=True)
    cache.seq.more_prefill_chunks = False
    return model.lm_head(decoder.norm(hidden[:, -1:].to(device)))[0, -1]


@torch.inference_mode()
def greedy_generate(
    model,
    cache: HarnessCache,
    request: GenerationRequest,
    *,
    prefill_chunk_size: int | None = None,
    tokenizer=None,
    keep_logits: bool = False,
    cuda_graph: bool = True,
    layer_by_layer: bool = False,
    residual_on_host: bool = False,
) -> GenerationResult:
    """Batch-1 greedy decoding on ``cache``; ``tokenizer`` is needed only for stop strings.

    On CUDA, decode steps of a method that ``captures_decode_step`` replay a CUDA graph (``cuda_graph=False``
    turns that off); the first decode step, which TT2T includes, always runs eagerly. ``layer_by_layer`` runs the
    prefill one decoder layer at a time (``_prefill_layer_by_layer``): same result, bounded memory;
    ``residual_on_host`` keeps its residual stream in host memory (needs ``layer_by_layer``)."""
    if residual_on_host and not layer_by_layer:
        raise ValueError("residual_on_host needs layer_by_layer (the residual stream only exists between layers there)")
    device = model.device
    if request.stop_strings and tokenizer is None:
        raise ValueError("stop strings need a tokenizer")
    is_cuda = device.type == "cuda"
    if is_cuda:
        torch.cuda.reset_peak_memory_stats(device)
    with previous_layer_inputs(model, cache.layer_kvs):
        return _generate(model, cache, request, device, prefill_chunk_size, tokenizer, keep_logits, cuda_graph,
                         layer_by_layer, residual_on_host)


def _generate(model, cache: HarnessCache, request: GenerationRequest, device: torch.device,
              prefill_chunk_size: int | None, tokenizer, keep_logits: bool, cuda_graph: bool, layer_by_layer: bool,
              residual_on_host: bool) -> GenerationResult:
    is_cuda = device.type == "cuda"
    timer = cache.seq.timer
    logits_kept: list[torch.Tensor] = []
    synchronize(device)
    start = time.perf_counter()
    graphed = GraphedDecodeStep(model, cache) if is_cuda and cuda_graph and capturable(cache) else None
    logits, position = prefill_sequence(model, cache, request, request.max_new_tokens, prefill_chunk_size,
                                        layer_by_layer, residual_on_host)
    n_prompt = len(request.input_ids)
    prefill_phases = timer.take_step()
    if keep_logits:
        logits_kept.append(logits.float().cpu())
    generated = [pick_token(logits, request, 0)]
    ttft = time.perf_counter() - start
    # The first token needs none of the prompt's copies to host memory; the first decode step does (a wait on the
    # device, after the first token: the copies' tail, if any, counts in TT2T).
    cache.seq.prompt_copies.join()

    step_times: list[float] = []
    step_phases: list[dict[str, float]] = []
    try:
        while (stopped := why_stopped(request, generated, tokenizer)) is None:
            step_start = time.perf_counter()
            if graphed is not None:
                logits = graphed(generated[-1], position)
            else:
                logits = _forward(model, torch.tensor([generated[-1]], device=device), position, cache)
            position += 1
            generated.append(pick_token(logits, request, len(generated)))
            step_times.append(time.perf_counter() - step_start)
            step_phases.append(timer.take_step())
            if keep_logits:
                logits_kept.append(logits.float().cpu())
    finally:  # the graph and its host functions go now, not when the garbage collector runs
        if graphed is not None:
            graphed.close()

    return GenerationResult(
        token_ids=generated,
        stop_reason=stopped,
        prompt_tokens=n_prompt + len(request.suffix_ids),
        ttft_s=ttft,
        tt2t_s=ttft + step_times[0] if step_times else None,
        tpot_s=statistics.median(step_times[1:]) if len(step_times) > 1 else None,
        step_times_s=step_times,
        step_phases=step_phases,
        prefill_phases=prefill_phases,
        counters={**cache.seq.counters.as_dict(), **(graphed.counters() if graphed else {})},
        gpu_kv_bytes=cache.gpu_kv_bytes(),
        cpu_kv_bytes=cache.cpu_kv_bytes(),
        offloaded_kv_bytes=cache.offloaded_kv_bytes(),
        peak_gpu_bytes=torch.cuda.max_memory_allocated(device) if is_cuda else None,
        logits=logits_kept if keep_logits else None,
        selection=cache.seq.selection_meter.summary() if cache.seq.selection_meter is not None else None,
    )


def pick_token(logits: torch.Tensor, request: GenerationRequest, n_generated: int) -> int:
    """The greedy token of ``logits [V]``, the request's EOS ids suppressed until ``min_new_tokens`` exist."""
    if n_generated < request.min_new_tokens and request.eos_token_ids:
        logits = logits.clone()
        logits[list(request.eos_token_ids)] = float("-inf")
    return int(torch.argmax(logits).item())


def why_stopped(request: GenerationRequest, generated: list[int], tokenizer) -> str | None:
    """Why a sequence with ``generated`` tokens stops before its next step (``"eos"``, ``"stop_string"``,
    ``"length"``), or None; an EOS that stops it is taken off ``generated``."""
    if generated[-1] in set(request.eos_token_ids) and len(generated) > request.min_new_tokens:
        generated.pop()
        return "eos"
    if request.stop_strings and _hits_stop(tokenizer, generated, request.stop_strings):
        return "stop_string"
    if len(generated) >= request.max_new_tokens:
        return "length"
    return None


def _hits_stop(tokenizer, generated: list[int], stop_strings: Sequence[str]) -> bool:
    longest = max(len(s) for s in stop_strings)
    tail = tokenizer.decode(generated[-(longest + 8) :], skip_special_tokens=True)
    return any(s in tail for s in stop_strings)
