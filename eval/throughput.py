"""The throughput engine: decode tokens per second against batch size, for several methods, up to each one's memory
limit.

Per method and context length, one process prefills sequences one at a time (each on its own ``HarnessCache``,
all on one hand-off channel) and, whenever it holds ``B`` of them for the next batch size in ``batch_sizes``,
decodes the first ``B`` together for ``decode_steps`` steps (``core.batched_generation.decode_batch``; replayed
from one CUDA graph where the method captures its step). TPOT is the median step after the first, throughput
``B / TPOT``. Rows keep their state from one batch size to the next, so a batch's rows differ in length by the
steps the earlier batches ran (at most ``decode_steps`` times the number of batch sizes): ragged, as in serving.
The first out-of-memory error, on the GPU or in host memory, during a prefill or a step, is caught and recorded as
the method's limit, not raised. When a prefill ran out between two batch sizes (4 sequences fit, 8 were asked for),
the sequences that fit are decoded as one more batch, the method's largest (``at_memory_limit`` in its row): a best
throughput at the limit is not missed for want of a batch size. The method's sequences are then freed and the next
method runs.

Writes ``<out>/throughput_<host>_<date>.json`` (settings, provenance, one row per method, length and batch size,
the limits, the summary), rewritten after every row (``complete: false`` until the end). ``resume`` completes such
a file: a (method, length) whose sweep the file finished stands; an unfinished one is measured again from its first
batch (its partial rows replaced), so no row is lost or counted twice. ``scripts/bench/throughput.py`` is the
command line.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from icecache.errors import ConfigError

from .latency import allocation_failure, bench_methods, host_total_bytes, load_bench_model, resident_bytes

#: The reference every summary row is set against: the fast full cache's best throughput at the same length.
REFERENCE = "full_static"
MIN_DECODE_STEPS = 4


@dataclass
class ThroughputSettings:
    """What a throughput file measures. ``batch_sizes`` are tried in order until the first out-of-memory error."""

    model: str = "llama31_8b"  # a configs/model name (or a YAML path)
    source: str = "random"  # random: the real architecture with random weights (exact for time and memory)
    lengths: list[int] = field(default_factory=lambda: [32768])
    methods: list[str] = field(default_factory=lambda: ["full_static", "quest"])  # full_static added first
    budget: int = 256
    batch_sizes: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32])
    decode_steps: int = 16  # steps per batch size: TPOT is the median of steps 2..N
    threads: int | None = None  # torch CPU threads (None: torch's default)
    # Each layer's prompt in chunks: a whole 128k prompt's activations (3.5 GiB blocks) fragment the allocator,
    # and the fifth full-cache sequence at 128k then failed with 36 GiB reserved but free.
    prefill_chunk_size: int | None = 8192
    layer_by_layer: bool = True  # prefill one decoder layer at a time: what lets long prompts fit beside a batch
    residual_on_host: bool = False
    # Each row attends on a stream of its own (core.batch); False: the rows take turns on the model's stream. On the
    # H200 at 128k, side by side lifted full_static's best from 131 to 186 tokens/s and ArkVale's from 234 to 440.
    row_streams: bool = True
    # Groups of rows that a method with one launch for every row (LayerKV.decode_rows: ShadowKV, ArkVale) serves a
    # launch each, side by side on the rows' streams: one group's copies from host memory run under another's
    # kernels. 1: one launch for all rows.
    row_groups: int = 1
    set: list[str] = field(default_factory=list)  # METHOD.KEY=VALUE overrides of a method config
    device: str = "auto"
    dtype: str = "auto"
    seed: int = 0  # row r's random prompt at length L: seed + L + r
    # After each batch's timed steps, this many more under torch.profiler (0: none; kernels on CUDA only): per step,
    # how long some kernel ran on the GPU (the union over streams), the kernels' summed time and the leading kernels.
    # A step whose GPU is busy for most of its wall time is bound by the GPU; one whose GPU is mostly idle, by
    # launches, dependencies or the host.
    profile_steps: int = 0
    # On CUDA, before the model loads: how fast the GPU reads pinned host memory here (core.link_probe: the copy
    # engines' rate, and the methods' zero-copy block reads, scattered and consecutive), recorded as ``link``: what
    # bounds the host-resident methods' copies at large batches.
    link_probe: bool = True

    @classmethod
    def compose(cls, given: dict[str, Any]) -> "ThroughputSettings":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(given) - known)
        if unknown:
            raise ConfigError(f"unknown throughput settings: {', '.join(unknown)}")
        settings = cls(**{key: value for key, value in given.items() if value is not None})
        settings.methods = [REFERENCE, *(m for m in settings.methods if m != REFERENCE)]
        settings.check()
        return settings

    def check(self) -> None:
        if self.decode_steps < MIN_DECODE_STEPS:
            raise ConfigError(f"--decode-steps must be at least {MIN_DECODE_STEPS} (TPOT is the median of steps 2..N)")
        if not self.batch_sizes or any(b < 1 for b in self.batch_sizes) or self.batch_sizes != sorted(
                set(self.batch_sizes)):
            raise ConfigError(f"--batch-sizes {self.batch_sizes}: give increasing whole numbers, e.g. 1 2 4 8")
        if self.residual_on_host and not self.layer_by_layer:
            raise ConfigError("--residual-on-host needs --layer-by-layer")
        if self.row_groups < 1:
            raise ConfigError(f"--row-groups {self.row_groups}: give 1 (one launch for all rows) or more groups")
        if self.profile_steps < 0:
            raise ConfigError(f"--profile-steps {self.profile_steps}: give 0 (no profile) or more steps")

    @property
    def steps_per_batch(self) -> int:
        """The steps each batch decodes: the timed ones, then (when profiled) an eager one, the one that captures the
        graph again, and the profiled ones."""
        return self.decode_steps + (self.profile_steps + UNPROFILED_STEPS if self.profile_steps else 0)

    @property
    def reserved_new_tokens(self) -> int:
        """What every row's buffers are sized for: the first row steps in every batch."""
        return len(self.batch_sizes) * self.steps_per_batch + 1


# The settings a resumed command must share with the file it completes.
RESUME_SETTINGS = ("model", "source", "lengths", "methods", "budget", "batch_sizes", "decode_steps", "threads",
                   "prefill_chunk_size", "layer_by_layer", "residual_on_host", "row_streams", "row_groups", "set",
                   "device", "dtype", "seed", "profile_steps")


def read_unfinished(path: Path, settings: ThroughputSettings) -> dict[str, Any]:
    """The payload of the unfinished throughput file ``path``, refused in one line when it is finished, unreadable
    or measured with other settings."""
    try:
        payload = json.loads(Path(path).read_text())
    except (OSError, ValueError) as error:
        raise ConfigError(f"--resume {path}: cannot read it ({error})") from None
    if payload.get("kind") != "throughput":
        raise ConfigError(f"--resume {path}: not a throughput file")
    if payload.get("complete"):
        raise ConfigError(f"--resume {path}: the file is complete; start a new run instead")
    ours = dataclasses.asdict(settings)
    # A setting newer than the file is the default it ran with.
    defaults = dataclasses.asdict(ThroughputSettings())
    differ = [key for key in RESUME_SETTINGS if payload["settings"].get(key, defaults[key]) != ours[key]]
    if differ:
        raise ConfigError(f"--resume {path}: its settings differ in {', '.join(differ)}; resume with the file's")
    return payload


class HostMemoryForecast(MemoryError):
    """The next sequence would not fit in the host memory left: stopped before the kernel's out-of-memory killer
    would end the process."""


def busy_time(intervals: list[tuple[float, float]], window: tuple[float, float]) -> tuple[float, float]:
    """``(busy, summed)`` of the kernel ``intervals`` (start, end) clipped to ``window``: the time some kernel ran
    (their union) and the kernels' own times added up (over the union: how many ran side by side, on average)."""
    begin, end = window
    clipped = sorted((max(a, begin), min(b, end)) for a, b in intervals if b > begin and a < end)
    busy = summed = 0.0
    run_start = run_end = None
    for a, b in clipped:
        summed += b - a
        if run_end is None or a > run_end:
            if run_end is not None:
                busy += run_end - run_start
            run_start, run_end = a, b
        else:
            run_end = max(run_end, b)
    if run_end is not None:
        busy += run_end - run_start
    return busy, summed


def device_work(event) -> bool:
    """Whether a profiled event is work on the GPU (a kernel or a copy), not a range annotated on its timeline."""
    return event.device_type.name == "CUDA" and not getattr(event, "is_user_annotation", False)


#: Steps of a profiled ``decode_batch`` left out of its profile: a new graph's first step runs eagerly, its second
#: captures (``core.graphs.GraphedDecodeStep``).
UNPROFILED_STEPS = 2


def step_profile(events, top: int = 8, skip: int = UNPROFILED_STEPS) -> dict[str, Any] | None:
    """Per decode step of the profiled ``events`` (``prof.events()``), leaving out the first ``skip`` (eager,
    capturing): wall, GPU busy and summed kernel time in ms, kernels, and the ``top`` kernels by time. None when the
    profile holds no step after those or no kernel (a CPU run)."""
    from icecache.core.batched_generation import STEP_RANGE

    # A range also shows on the GPU's timeline (a user annotation over its kernels): the steps are its host side,
    # and the device's work is what is not an annotation.
    steps = sorted((e.time_range.start, e.time_range.end) for e in events
                   if e.name == STEP_RANGE and e.device_type.name == "CPU")[skip:]
    kernels = [e for e in events if device_work(e) and e.time_range.end > e.time_range.start]
    if not steps or not kernels:
        return None
    intervals = [(k.time_range.start, k.time_range.end) for k in kernels]
    wall = busy = summed = 0.0
    by_name: dict[str, list[float]] = {}
    for window in steps:
        step_busy, step_summed = busy_time(intervals, window)
        wall, busy, summed = wall + window[1] - window[0], busy + step_busy, summed + step_summed
    for kernel in kernels:
        if any(begin <= kernel.time_range.start < end for begin, end in steps):
            entry = by_name.setdefault(kernel.name[:90], [0.0, 0])
            entry[0] += kernel.time_range.end - kernel.time_range.start
            entry[1] += 1
    n = len(steps)
    leading = sorted(by_name.items(), key=lambda item: -item[1][0])[:top]
    return {"steps": n, "wall_ms": wall / n / 1e3, "gpu_busy_ms": busy / n / 1e3, "kernel_ms": summed / n / 1e3,
            "kernels": sum(count for _, count in by_name.values()) / n,
            "top_kernels": [{"kernel": name, "ms": total / n / 1e3, "launches": count / n}
                            for name, (total, count) in leading]}


@dataclass
class _MethodRun:
    """One method's sequences at one length while ``measure`` takes its batches: ``caches[i]`` holds row ``i``,
    ``decoding[i]`` its decoding state (a failed prefill leaves a cache without one), ``stage`` the work under way
    (``prefill``, ``decode``, ``profile``: where an out-of-memory error is recorded to have happened)."""

    context: int
    name: str
    label: str
    budget: int
    host_pool: Any
    config: dict[str, Any] = field(default_factory=dict)  # every setting it runs with (eval/report/variants.py)
    caches: list = field(default_factory=list)
    decoding: list = field(default_factory=list)
    stage: str = "prefill"


def summarise(rows: list[dict[str, Any]], limits: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (method, length): the largest batch measured, the first that did not fit, the best throughput and its
    batch, the first batch after which the next one adds less than 10% throughput, and the best throughput over the
    reference's best at that length."""
    summary = []
    keys = sorted({(r["context"], r["method"]) for r in rows} | {(lim["context"], lim["method"]) for lim in limits})
    best_reference = {}
    for context, method in keys:
        measured = sorted((r for r in rows if (r["context"], r["method"]) == (context, method)),
                          key=lambda r: r["batch_size"])
        limit = next((lim for lim in limits if (lim["context"], lim["method"]) == (context, method)), None)
        best = max(measured, key=lambda r: r["tokens_per_s"] or 0.0, default=None)
        flattens = next((before["batch_size"] for before, after in zip(measured, measured[1:])
                         if before["tokens_per_s"] and after["tokens_per_s"]
                         and after["tokens_per_s"] < 1.1 * before["tokens_per_s"]), None)
        entry = {"context": context, "method": method,
                 "method_label": measured[0]["method_label"] if measured else method,
                 "largest_batch": measured[-1]["batch_size"] if measured else 0,
                 "first_failed_batch": limit["batch_size"] if limit else None,
                 "failure": limit["kind"] if limit else None,
                 "best_tokens_per_s": best["tokens_per_s"] if best else None,
                 "best_batch": best["batch_size"] if best else None,
                 "tpot_at_batch_1_s": measured[0]["tpot_s"] if measured and measured[0]["batch_size"] == 1 else None,
                 "flattens_after_batch": flattens}
        if method == REFERENCE:
            best_reference[context] = entry["best_tokens_per_s"]
        summary.append(entry)
    for entry in summary:
        reference = best_reference.get(entry["context"])
        entry["best_over_reference"] = (entry["best_tokens_per_s"] / reference
                                        if reference and entry["best_tokens_per_s"] else None)
    return summary


def print_table(summary: list[dict[str, Any]], rows: list[dict[str, Any]]) -> None:
    batches = sorted({r["batch_size"] for r in rows})
    header = f"{'method':24s} {'context':>8s} " + " ".join(f"{'B=' + str(b):>8s}" for b in batches) + \
        f" {'best x ' + REFERENCE:>18s}  limit"
    print(header)
    for entry in summary:
        by_batch = {r["batch_size"]: r for r in rows
                    if (r["context"], r["method"]) == (entry["context"], entry["method"])}
        cells = " ".join(f"{by_batch[b]['tokens_per_s']:8.1f}" if b in by_batch else f"{'':8s}" for b in batches)
        ratio = entry["best_over_reference"]
        limit = (f"{entry['failure']} OOM at B={entry['first_failed_batch']}" if entry["failure"]
                 else f"none up to B={entry['largest_batch']}")
        print(f"{entry['method_label']:24s} {entry['context']:8d} {cells} "
              f"{(f'{ratio:.2f}x' if ratio else '-'):>18s}  {limit}")
    print("(decode tokens per second; a blank cell: not measured, at or past the limit)")


def bytes_loaded(caches) -> int:
    """The bytes the caches' decode steps have copied into GPU memory so far (``DecodeCounters.bytes_to_gpu``)."""
    return sum(cache.seq.counters.as_dict()["bytes_to_gpu"] or 0 for cache in caches)


def measure_link(settings: ThroughputSettings) -> dict[str, Any] | None:
    """The link probe's result (scripts/bench/link.py, in a process of its own so that its pinned store goes back to
    the system before the rows need host memory) on a CUDA device when asked for; a failure is recorded, not raised;
    None when not asked for or not on CUDA."""
    import torch

    if not settings.link_probe or settings.device == "cpu" or not torch.cuda.is_available():
        return None
    from icecache.core import link_probe

    device = settings.device if settings.device.startswith("cuda") else "cuda"
    done = link_probe.run_probe_process(["--json", "--device", device])
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        error = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        print(f"link probe failed: {error}", flush=True)
        return {"error": error}
    result = json.loads(lines[-1])
    print(link_probe.format_table(result), flush=True)
    return result


def measure(settings: ThroughputSettings, out: str | Path, resume: Path | None = None) -> Path:
    """Measure ``settings`` into a new throughput file in ``out`` (or complete the unfinished file ``resume``);
    print the table; return the file's path. Bad settings raise ``ConfigError`` before the model is built."""
    prior = read_unfinished(resume, settings) if resume else None
    if prior is not None:
        from eval.provenance import check_resume_machine

        check_resume_machine(resume, prior)
    import torch
    from tqdm import tqdm

    from eval import provenance
    from icecache.core.batch import BatchCache
    from icecache.core.batched_generation import decode_batch, prefill_row
    from icecache.core.cache import HarnessCache
    from icecache.core.cuda_driver import HostFunctions
    from icecache.core.generation import GenerationRequest
    from icecache.core.host_memory import HostPool, host_available_bytes
    from icecache.core.method import method_label

    spec, methods = bench_methods(settings)
    for method in methods.values():  # a method that cannot batch stops the run here, in one line
        method.check_batch_size(max(settings.batch_sizes))
    link = measure_link(settings) if prior is None else None
    model, device = load_bench_model(spec)
    is_cuda = device.type == "cuda"
    vocab = model.config.vocab_size

    recorded = dataclasses.asdict(settings)
    recorded.update({"model_name": spec.name, "device_resolved": str(device),
                     "dtype_resolved": str(spec.resolved_dtype()),
                     "gpu_total_bytes": torch.cuda.get_device_properties(device).total_memory if is_cuda else None,
                     "host_total_bytes": host_total_bytes(),
                     "cuda_alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
                     **({"link": link} if link is not None else {})})
    run_provenance = provenance.collect()
    # The (length, method) pairs the file finished stand; one it did not finish is measured again from its first
    # batch, its partial rows dropped.
    finished: list[list[Any]] = prior["finished"] if prior else []
    done = {tuple(pair) for pair in finished}
    if prior is None:
        rows: list[dict[str, Any]] = []
        limits: list[dict[str, Any]] = []
        out_path, first_provenance, processes = provenance.result_path(out, "throughput"), run_provenance, []
    else:
        rows = [r for r in prior["rows"] if (r["context"], r["method"]) in done]
        limits = [lim for lim in prior["limits"] if (lim["context"], lim["method"]) in done]
        out_path, first_provenance = Path(out) / Path(resume).name, prior["provenance"]
        processes = [*prior.get("resumed_by", []), {"provenance": run_provenance}]
        recorded = {**prior["settings"], "resumed": True}

    def payload(complete: bool) -> dict[str, Any]:
        return {"kind": "throughput", "settings": recorded, "provenance": first_provenance, "complete": complete,
                **({"resumed_by": processes} if processes else {}), "finished": finished,
                "rows": rows, "limits": limits, "summary": summarise(rows, limits)}

    def request(context: int, row: int) -> GenerationRequest:
        generator = torch.Generator().manual_seed(settings.seed + context + row)
        prompt = torch.randint(0, vocab, (context,), generator=generator).tolist()
        return GenerationRequest(input_ids=prompt, max_new_tokens=settings.reserved_new_tokens, eos_token_ids=())

    def measure_batch(run: "_MethodRun", batch_size: int, prefill_s: float, prefill_peak: int | None,
                      at_limit: bool) -> None:
        """Decode ``run``'s first ``batch_size`` rows (and profile them when asked) and record the batch's row."""
        run.stage = "decode"
        batch = BatchCache(run.caches[:batch_size], row_streams=settings.row_streams,
                           row_groups=settings.row_groups)
        loaded_before = bytes_loaded(run.caches[:batch_size])
        result = decode_batch(model, batch, run.decoding[:batch_size], max_steps=settings.decode_steps)
        # What a step copies into GPU memory for all rows (host-resident KV: PCIe's share of the step).
        loaded_per_step = (bytes_loaded(run.caches[:batch_size]) - loaded_before) / max(1, len(result.step_times_s))
        profiled = None
        if settings.profile_steps:  # on a CPU the profile has no kernels: None
            run.stage = "profile"
            from torch.profiler import ProfilerActivity, profile

            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if is_cuda else [])
            with profile(activities=activities) as prof:
                decode_batch(model, batch, run.decoding[:batch_size],
                             max_steps=settings.profile_steps + UNPROFILED_STEPS)
            profiled = step_profile(prof.events())
        rows.append({
            "context": run.context, "method": run.name, "method_label": run.label, "budget": run.budget,
            "method_config": run.config, "batch_size": batch_size, "tpot_s": result.tpot_s,
            "tokens_per_s": result.tokens_per_s,
            "step_times_s": result.step_times_s, "positions": [row.position for row in run.decoding[:batch_size]],
            "prefill_s_added": prefill_s,
            "peak_gpu_bytes": max(filter(None, [prefill_peak, result.peak_gpu_bytes]), default=None),
            "gpu_kv_bytes": sum(cache.gpu_kv_bytes() for cache in run.caches[:batch_size]),
            "cpu_kv_bytes": sum(cache.cpu_kv_bytes() for cache in run.caches[:batch_size]),
            "host_rss_bytes": resident_bytes(),
            "host_buffers_bytes": run.host_pool.allocated_bytes,
            "bytes_to_gpu_per_step": loaded_per_step,
            **{key: value for key, value in result.counters.items()
               if key in ("graph_replays", "graph_capture_error", "host_channel")},
            **({"profile": profiled} if settings.profile_steps else {}),
            **({"at_memory_limit": True} if at_limit else {}),
        })
        provenance.write_result(out, "throughput", payload(complete=False), path=out_path, quiet=True)

    def measure_largest_fit(run: "_MethodRun", fitted: int, prefill_s: float) -> None:
        """After a prefill ran out of memory between two batch sizes: the rows that fit, decoded as the method's
        largest batch (its best may lie there rather than at the last batch size given). The failed row's cache goes
        first; a batch that does not fit either is left unmeasured."""
        if len(run.caches) > fitted:
            run.caches.pop().close()
        gc.collect()
        if is_cuda:
            torch.cuda.empty_cache()
        try:
            measure_batch(run, fitted, prefill_s, None, at_limit=True)
        except Exception as error:  # noqa: BLE001  only allocation failures are expected here
            if allocation_failure(error) is None:
                raise
            print(f"{run.label} at {run.context}: the {fitted} rows that fit ran out of memory too", flush=True)

    for context in settings.lengths:
        for name, method in methods.items():
            if (context, name) in done:
                continue
            label = method_label(dataclasses.asdict(method.config))
            channel = HostFunctions()
            # The method's sequences all live at once: nothing to reuse between them in its host pool.
            run = _MethodRun(context, name, label, method.config.budget, HostPool(),
                             config=dataclasses.asdict(method.config))
            host_per_row = 0  # the host memory the last prefilled row took
            measured_batch = fitted = 0
            try:
                for batch_size in tqdm(settings.batch_sizes, desc=f"{label} at {context}", unit="batch"):
                    run.stage = "prefill"
                    prefill_start = time.perf_counter()
                    try:
                        if is_cuda:
                            torch.cuda.reset_peak_memory_stats(device)
                        while len(run.decoding) < batch_size:
                            available = host_available_bytes()
                            if available is not None and host_per_row and available < 1.2 * host_per_row:
                                raise HostMemoryForecast(
                                    f"{available / 2**30:.1f} GiB of host memory left, {host_per_row / 2**30:.1f} "
                                    f"GiB taken by the last sequence")
                            rss_before = resident_bytes() or 0
                            cache = HarnessCache(method, host_pool=run.host_pool, host_functions=channel)
                            run.caches.append(cache)
                            run.decoding.append(prefill_row(
                                model, cache, request(context, len(run.decoding)),
                                reserved_new_tokens=settings.reserved_new_tokens,
                                prefill_chunk_size=settings.prefill_chunk_size,
                                layer_by_layer=settings.layer_by_layer, residual_on_host=settings.residual_on_host))
                            host_per_row = max(0, (resident_bytes() or 0) - rss_before)
                        prefill_s = time.perf_counter() - prefill_start
                        prefill_peak = torch.cuda.max_memory_allocated(device) if is_cuda else None
                        measure_batch(run, batch_size, prefill_s, prefill_peak, at_limit=False)
                        measured_batch = batch_size
                    except Exception as error:  # noqa: BLE001  only allocation failures are a limit; others raise
                        kind = allocation_failure(error)
                        if kind is None:
                            raise
                        fitted = len(run.decoding) if run.stage == "prefill" else 0
                        limits.append({"context": context, "method": name, "method_label": label,
                                       "batch_size": batch_size, "kind": kind, "stage": run.stage,
                                       "rows_prefilled": fitted, "error": str(error).splitlines()[0][:300]})
                        print(f"{label} at {context}: {kind} memory exhausted at batch {batch_size} ({run.stage})",
                              flush=True)
                        break
                # Out of the handler: its exception's traceback holds the failed prefill's frames, and with them
                # its tensors (on a GPU, activations and the KV it was writing), until the handler ends.
                cache = None
                if fitted > measured_batch:
                    measure_largest_fit(run, fitted, time.perf_counter() - prefill_start)
            finally:
                for cache in run.caches:
                    cache.close()
                run.host_pool.clear()
                # Every name that holds a row goes: a method that ran out of memory must leave the next one the whole
                # GPU, not its largest batch. Caches can sit in reference cycles, so they are collected here rather
                # than at the next collection.
                run = cache = None
                gc.collect()
                if is_cuda:
                    torch.cuda.synchronize(device)
                    torch.cuda.empty_cache()
            finished.append([context, name])
            provenance.write_result(out, "throughput", payload(complete=False), path=out_path, quiet=True)

    final = payload(complete=True)
    print_table(final["summary"], rows)
    path = provenance.write_result(out, "throughput", final, path=out_path)
    try:
        figure(path)
    except ImportError as error:  # a GPU host without matplotlib: the file is what counts, the figure redrawn later
        print(f"no figure drawn ({error}); draw it with scripts/bench/throughput.py --figure {path}", flush=True)
    return path


def figure(*paths: Path) -> list[Path]:
    """``throughput_vs_batch_<model>.png`` (and .pdf) beside the first of the throughput files ``paths``, one panel
    per context; a context that several files measured is drawn from the last of them that did."""
    by_context: dict[int, dict[str, Any]] = {}
    model = None
    for path in paths:
        payload = json.loads(Path(path).read_text())
        model = model or payload["settings"].get("model_name") or payload["settings"]["model"]
        for context in {r["context"] for r in payload["rows"]}:
            by_context[context] = payload
    rows = [r for context, payload in by_context.items() for r in payload["rows"] if r["context"] == context]
    limits = [lim for context, payload in by_context.items() for lim in payload["limits"]
              if lim["context"] == context]
    from eval.report import plots

    stem = Path(paths[0]).parent / f"throughput_vs_batch_{str(model).lower().replace('/', '_')}"
    return plots.throughput_vs_batch(rows, limits, stem, title=f"Decode throughput vs batch size, {model}")
