"""The latency engine: TTFT, TT2T, TPOT (with its phase breakdown) and KV memory of several methods, side by side.

One process builds the model once (by default the real architecture with random weights: exact for time and
memory), then for each context length runs every method on the same random prompt, interleaved (A B A B ...),
``warmup`` unmeasured rounds first, then ``repeats`` measured rounds; each run generates N >= 64 tokens with the
phase timers on. Plain transformers decode is bound by launches and host overhead, so a latency is only meaningful
next to the full cache measured in the same process: every summary row carries its ratio to both full caches.

Every config comes from ``configs/`` composed by Hydra: the model (``model=<name>``), each method
(``method=<name> budget=<b>``, with ``--set`` and a variant's own settings as ``method.<key>=<value>``), and an
experiment's ``bench`` block (``experiment=latency``), which holds the settings of the paper's figures.

Writes ``<out>/latency_<host>_<date>.json`` (settings, provenance, every measurement, the summary), rewritten after
each measurement (``complete: false`` until the end), so that a process killed part-way leaves what it measured;
``resume`` completes such a file. A method out of GPU or host memory at a context is recorded there
(``out_of_memory``) and the others go on; a full cache whose KV cannot fit is recorded before its prefill.
``scripts/bench/latency.py`` is the command line.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eval.report.names import LATENCY_REFERENCES
from icecache.errors import ConfigError

MIN_DECODE_STEPS = 64
REFERENCES = LATENCY_REFERENCES
SEARCH_STATS = ("rows_read", "bytes_read", "scores", "lists")  # DCIIndex.last_query_stats, per decode step
# Where the step's searches spent their time (QueryPhases in icecache/dci/src/dci.hpp), nanoseconds per decode step
SEARCH_PHASES = ("fork", "descend", "group", "scan", "merge", "scan_busy")
LOOKAHEAD_COUNTERS = ("lookahead_searches", "lookahead_misses")  # IceCache's look-ahead, per decode step


# ---------------------------------------------------------------------------------------------------------------
# Configs composed by Hydra


def compose(overrides: list[str]):
    """The repository's config composed with ``overrides``; a composition error becomes one ``ConfigError``."""
    from eval.cli import compose_one, first_line, hydra_context

    try:
        with hydra_context():
            return compose_one(overrides)
    except Exception as error:  # noqa: BLE001  Hydra raises several types; the line says what is wrong
        raise ConfigError(f"{' '.join(overrides)}: {first_line(error)}") from None


def _container(node) -> Any:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(node, resolve=True)


def model_overrides(name: str) -> list[str]:
    """``model=<name>`` for a config of configs/model; a YAML path ``<dir>/model/<name>.yaml`` is composed with
    ``<dir>`` on Hydra's search path, so that its defaults list resolves as a repository config's does."""
    if not name.endswith(".yaml"):
        return [f"model={name}"]
    path = Path(name).resolve()
    if not path.exists() or path.parent.name != "model":
        raise ConfigError(f"model config {name}: give a config name of configs/model or a file "
                          f"<folder>/model/<name>.yaml")
    return [f"hydra.searchpath=[file://{path.parent.parent}]", f"model={path.stem}"]


def model_values(name: str) -> dict[str, Any]:
    """The model config ``name`` (a configs/model name or a YAML path) as composed."""
    return _container(compose(model_overrides(name)).model)


def model_spec(name: str, source: str | None, device: str, dtype: str):
    """The ModelSpec of model config ``name``, with its source replaced by ``source`` when given (``random``: the
    architecture with random weights) and the device and dtype given."""
    from icecache.core.models import ModelSpec

    values = model_values(name)
    if source:
        values["source"] = source
    values["device"], values["dtype"] = device, dtype
    return ModelSpec.from_dict(values)


def method_values(variant: str, budget: int | None, overrides: list[str]) -> dict[str, Any]:
    """The method config of ``variant`` at ``budget``, as composed: ``method=<name> budget=<budget>``, then the
    ``--set`` overrides ``<name>.<key>=<value>`` of that config as ``method.<key>=<value>``, then a variant's own:
    ``variant`` may be ``icecache:cuda_graph=true,cpu_threads=8``, so that two settings of one method can be
    measured side by side in one run (the variant's own come last: they win)."""
    name, _, inline = variant.partition(":")
    assignments = [override.partition(".")[2] for override in overrides if override.partition(".")[0] == name]
    own = [assignment for assignment in inline.split(",") if assignment]
    budget_override = "budget=null" if budget is None else f"budget={budget}"
    cfg = compose([f"method={name}", budget_override, *(f"method.{a}" for a in [*assignments, *own])])
    return _container(cfg.method)


def experiment_defaults(name: str | None) -> dict[str, Any]:
    """The ``bench`` block of experiment ``name`` (configs/experiment/<name>.yaml: the figures' settings), without
    its ``driver``; {} for no experiment."""
    if not name:
        return {}
    try:
        cfg = compose([f"experiment={name}"])
    except ConfigError:
        raise ConfigError(f"no experiment {name!r} that composes (configs/experiment/{name}.yaml)") from None
    bench = _container(cfg.bench) if "bench" in cfg else None
    if not bench:
        raise ConfigError(f"experiment {name!r} has no bench block; latency experiments are latency and scaling")
    bench.pop("driver", None)
    return bench


# ---------------------------------------------------------------------------------------------------------------
# Settings


@dataclass
class LatencySettings:
    """What a latency file measures, in the order its ``settings`` record them. The defaults apply where neither
    the command line nor the experiment's ``bench`` block sets a value."""

    experiment: str | None = None
    model: str = "llama31_8b"  # a configs/model name (or a YAML path)
    source: str = "random"  # the model's source: random is the real architecture with random weights
    lengths: list[int] = field(default_factory=lambda: [16384])
    methods: list[str] = field(default_factory=lambda: ["full", "icecache"])  # names or variants; REFERENCES added
    budget: int = 256
    threads: int | None = None  # torch CPU threads (None: torch's default)
    repeats: int = 3  # measured rounds
    warmup: int = 1  # unmeasured rounds first
    warmup_length: int | None = None  # the warm-up rounds once, at this context, instead of at every length
    decode_steps: int = MIN_DECODE_STEPS  # N decode steps per run: TPOT is the median of steps 2..N
    prefill_chunk_size: int | None = None
    layer_by_layer: bool = False  # prefill one decoder layer at a time (same result; bounds prefill memory)
    residual_on_host: bool = False  # with layer_by_layer: the prefill's residual stream in host memory
    set: list[str] = field(default_factory=list)  # METHOD.KEY=VALUE overrides of a method config
    device: str = "auto"
    dtype: str = "auto"
    seed: int = 0  # the random prompt's (seed + context)
    bandwidth_probe_gib: float = 2.0  # GiB read by the host-memory probe run first (0: none)
    # On CUDA, the hand-off probe first (core.handoff_probe: what one hand-off of host work costs in a captured
    # step here, per channel), recorded in the settings as handoff_costs
    handoff_probe: bool = True

    @classmethod
    def compose(cls, given: dict[str, Any]) -> "LatencySettings":
        """Settings from the values ``given`` (None: not given), over the experiment's ``bench`` block, over the
        defaults; checked, with both references first among the methods."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(given) - known)
        if unknown:
            raise ConfigError(f"unknown latency settings: {', '.join(unknown)}")
        values = {key: value for key, value in experiment_defaults(given.get("experiment")).items() if key in known}
        values.update({key: value for key, value in given.items() if value is not None})
        settings = cls(**values)
        settings.methods = [*REFERENCES, *(m for m in settings.methods if m not in REFERENCES)]
        settings.check()
        return settings

    def check(self) -> None:
        if self.decode_steps < MIN_DECODE_STEPS:
            raise ConfigError(f"--decode-steps must be at least {MIN_DECODE_STEPS} (TPOT is the median of steps "
                              f"2..N)")
        if self.residual_on_host and not self.layer_by_layer:
            raise ConfigError("--residual-on-host needs --layer-by-layer")
        if self.repeats < 1 or self.warmup < 0:
            raise ConfigError("--repeats must be >= 1 and --warmup >= 0")


# The settings a resumed command must share with the file it completes: everything that changes a measurement.
RESUME_SETTINGS = ("model", "source", "lengths", "methods", "budget", "threads", "repeats", "warmup", "warmup_length",
                   "decode_steps", "prefill_chunk_size", "layer_by_layer", "residual_on_host", "set", "device",
                   "dtype", "seed")


def read_unfinished(path: Path, settings: LatencySettings) -> dict[str, Any]:
    """The payload of the unfinished latency file ``path``, refused in one line (before anything is built) when it
    is finished, unreadable or measured with other settings than ``settings``."""
    try:
        prior = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise ConfigError(f"--resume {path}: cannot read it as a latency file ({error})") from None
    if prior.get("kind") != "latency" or prior.get("complete") is not False:
        raise ConfigError(f"--resume {path}: not an unfinished latency file (it needs complete: false)")
    for key in RESUME_SETTINGS:
        theirs, ours = prior["settings"].get(key), getattr(settings, key)
        if theirs != ours:
            raise ConfigError(f"--resume {path}: it was measured with {key}={theirs!r}, this command has {ours!r}; "
                              f"give the command the file's settings")
    return prior


# ---------------------------------------------------------------------------------------------------------------
# The summary and its table


def spread(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"median": None, "min": None, "max": None}
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarise(measurements: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (method, context): median and min-max over repeats, the median phase breakdown, memory, ratios."""
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for m in measurements:
        groups.setdefault((m["method"], m["context"]), []).append(m)
    rows = []
    for (method, context), group in groups.items():
        row: dict[str, Any] = {"method": method, "method_label": group[0].get("method_label", method),
                               "budget": group[0]["budget"], "context": context, "model": group[0]["model"],
                               "repeats": len(group)}
        if "method_config" in group[0]:
            row["method_config"] = group[0]["method_config"]
        for key in ("ttft_s", "tt2t_s", "tpot_s"):
            stats = spread([g[key] for g in group if g[key] is not None])
            row.update({f"{key}_median": stats["median"], f"{key}_min": stats["min"], f"{key}_max": stats["max"]})
        phases = sorted({p for g in group for p in g["phases_s"]})
        row["phases_s"] = {p: statistics.median(g["phases_s"].get(p, 0.0) for g in group) for p in phases}
        prefill = sorted({p for g in group for p in g.get("prefill_phases_s", {})})
        row["prefill_phases_s"] = {p: statistics.median(g.get("prefill_phases_s", {}).get(p, 0.0) for g in group)
                                   for p in prefill}
        for key in ("gpu_kv_bytes", "cpu_kv_bytes", "offloaded_kv_bytes", "peak_gpu_bytes", "host_rss_bytes",
                    "host_rss_added_bytes", "host_buffers_allocated_bytes"):  # the most any repeat held
            values = [g[key] for g in group if g.get(key) is not None]
            row[key] = max(values) if values else None
        for key in ("mean_attended_tokens", "pages_loaded_per_step", "bytes_to_gpu_per_step",
                    *(f"search_{name}_per_step" for name in SEARCH_STATS),
                    *(f"search_{name}_ns_per_step" for name in SEARCH_PHASES),
                    *(f"{name}_per_step" for name in LOOKAHEAD_COUNTERS)):  # mean over repeats
            values = [g[key] for g in group if g.get(key) is not None]
            row[key] = statistics.fmean(values) if values else None
        # The index search's rate: the bytes it read per step over its median time per step (``query``).
        # With the look-ahead, ``query`` is what the step still waits for of a search running beside it: no rate.
        query_s, search_bytes = row["phases_s"].get("query"), row.get("search_bytes_read_per_step")
        looked_ahead = row.get("lookahead_searches_per_step")
        row["search_gbps"] = search_bytes / query_s / 1e9 if query_s and search_bytes and not looked_ahead else None
        row["lookahead_miss_rate"] = (row["lookahead_misses_per_step"] or 0.0) / looked_ahead if looked_ahead \
            else None
        offloaded = row["offloaded_kv_bytes"]
        # Host memory per byte of offloaded KV (at the model's dtype): 1.0 is one copy and nothing else.
        row["host_kv_ratio"] = row["cpu_kv_bytes"] / offloaded if offloaded and row["cpu_kv_bytes"] else None
        rows.append(row)
    for row in rows:
        for reference in REFERENCES:
            base_row = next((r for r in rows if r["method"] == reference and r["context"] == row["context"]), None)
            for key in ("ttft_s", "tt2t_s", "tpot_s"):
                ours, base = row[f"{key}_median"], base_row and base_row[f"{key}_median"]
                ratio = ours / base if ours is not None and base else None
                row[f"{key.removesuffix('_s')}_ratio_to_{reference}"] = ratio
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    header = f"{'context':>8} {'method':<16} {'TTFT s':>8} {'TT2T s':>8} {'TPOT ms':>9} {'(min-max)':>15} " \
             f"{'x full':>7} {'x static':>8} {'GPU KV MiB':>10} {'CPU KV MiB':>10} {'x KV':>5} {'+RSS GiB':>8} " \
             f"{'peak GiB':>8}  phases ms"
    print(header)
    print("-" * len(header))

    def fmt(value, scale=1.0, digits=3):
        return "-" if value is None else f"{value * scale:.{digits}f}"

    for r in sorted(rows, key=lambda r: (r["context"], r["method"] not in REFERENCES, r["method"])):
        phases = " ".join(f"{k}={v * 1000:.1f}" for k, v in r["phases_s"].items())
        phases += "".join(f" prefill:{k}={v * 1000:.0f}" for k, v in r.get("prefill_phases_s", {}).items())
        if r.get("search_gbps"):
            phases += f" search={r['search_bytes_read_per_step'] / 1e6:.0f}MB@{r['search_gbps']:.1f}GB/s"
        if r.get("search_scan_ns_per_step"):
            phases += " [" + " ".join(f"{name}={r[f'search_{name}_ns_per_step'] / 1e6:.1f}"
                                      for name in SEARCH_PHASES if name != "scan_busy") + "]"
        print(f"{r['context']:>8} {r['method']:<16} {fmt(r['ttft_s_median']):>8} {fmt(r['tt2t_s_median']):>8} "
              f"{fmt(r['tpot_s_median'], 1000, 2):>9} "
              f"{fmt(r['tpot_s_min'], 1000, 1) + '-' + fmt(r['tpot_s_max'], 1000, 1):>15} "
              f"{fmt(r['tpot_ratio_to_full'], 1, 2):>7} {fmt(r['tpot_ratio_to_full_static'], 1, 2):>8} "
              f"{fmt(r['gpu_kv_bytes'], 2 ** -20, 0):>10} "
              f"{fmt(r['cpu_kv_bytes'], 2 ** -20, 0):>10} {fmt(r.get('host_kv_ratio'), 1, 2):>5} "
              f"{fmt(r.get('host_rss_added_bytes'), 2 ** -30, 1):>8} "
              f"{fmt(r['peak_gpu_bytes'], 2 ** -30, 1):>8}  {phases}")


# ---------------------------------------------------------------------------------------------------------------
# The host's memory


def host_memory_rates(gib: float) -> tuple[float | None, float | None]:
    """The host's first-touch and read rates in GB/s on this process's torch threads: the time to fill a fresh
    ``gib`` GiB float32 array (a virtual machine may map its memory in only as it is first touched, which is what
    a cache's host store and a pinned staging buffer pay), then the best of five sums over it, a STREAM-like read
    that no cache holds. (None, None) for 0."""
    import time

    import torch

    if gib <= 0:
        return None, None
    start = time.perf_counter()
    data = torch.ones(int(gib * 2**30) // 4, dtype=torch.float32)
    touch = data.nbytes / (time.perf_counter() - start) / 1e9
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - start)
    return touch, data.nbytes / best / 1e9


def dci_read_gbps(gib: float) -> float | None:
    """The host's read rate in GB/s as the index search's OpenMP threads see it: ``icecache.dci.measure_read_rate``
    (each thread sums its share of a fresh ``gib`` GiB buffer, best of five) on every core this process may run on,
    the index's default thread count. None for 0."""
    import os

    from icecache.dci import measure_read_rate

    if gib <= 0:
        return None
    threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return measure_read_rate(int(gib * 2**30), threads) / 1e9


def resident_bytes() -> int | None:
    """The process's resident memory now (Linux ``/proc/self/statm``; None elsewhere)."""
    import os

    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


# ---------------------------------------------------------------------------------------------------------------
# The measurement


def measure(settings: LatencySettings, out: str | Path, resume: Path | None = None) -> Path:
    """Measure ``settings`` into a new latency file in ``out`` (or, with ``resume``, complete that unfinished file
    into ``out/<its name>``, measuring only what it lacks); print the table; return the file's path. Bad settings
    raise ``ConfigError`` before the model is built."""
    prior = read_unfinished(resume, settings) if resume else None
    if prior is not None:
        from eval.provenance import check_resume_machine

        check_resume_machine(resume, prior)
    import torch

    import icecache.core.generation as generation
    from eval import provenance
    from icecache.core.cache import HarnessCache
    from icecache.core.host_memory import HostPool
    from icecache.core.method import method_label
    from icecache.core.timing import PhaseTimer

    spec, methods = bench_methods(settings)
    # One pool of host buffers for every method: their sequences run one at a time, so a buffer pinned for one
    # method's store serves the next method's (a run pins its host memory once, in its first rounds). Each
    # measurement records the bytes its sequence had to allocate (0: all reused).
    host_pool = HostPool(max_cached_bytes=host_pool_limit())
    model, device = load_bench_model(spec)
    touch_gbps, read_gbps = host_memory_rates(settings.bandwidth_probe_gib)
    index_read_gbps = dci_read_gbps(settings.bandwidth_probe_gib)
    if read_gbps is not None:
        print(f"host memory: first touch {touch_gbps:.1f} GB/s, read {read_gbps:.1f} GB/s on "
              f"{torch.get_num_threads()} threads, {index_read_gbps:.1f} GB/s on the index's threads", flush=True)
    vocab = model.config.vocab_size
    handoff_costs = None
    if settings.handoff_probe and device.type == "cuda" and prior is None:
        from icecache.core import handoff_probe

        try:
            handoff_costs = handoff_probe.measure(device)
            print(handoff_probe.format_table(handoff_costs), flush=True)
        except RuntimeError as error:  # the probe's failure is recorded; the latencies are measured regardless
            handoff_costs = {"error": str(error)}
            print(f"hand-off probe failed: {error}", flush=True)

    recorded = dataclasses.asdict(settings)
    recorded.update({"model_name": spec.name, "device_resolved": str(device),
                     "dtype_resolved": str(spec.resolved_dtype()), "host_read_gbps": read_gbps,
                     "host_first_touch_gbps": touch_gbps, "host_index_read_gbps": index_read_gbps,
                     **({"handoff_costs": handoff_costs} if handoff_costs is not None else {})})
    run_provenance = provenance.collect()
    if prior is None:
        measurements: list[dict[str, Any]] = []
        out_path, first_provenance, processes = provenance.result_path(out, "latency"), run_provenance, []
    else:  # the file's measurements stand; this process adds the rest and is listed after the first
        measurements = prior["measurements"]
        out_path, first_provenance = Path(out) / Path(resume).name, prior["provenance"]
        processes = [*prior.get("resumed_by", []), {"provenance": run_provenance, "host_read_gbps": read_gbps,
                                                    "host_first_touch_gbps": touch_gbps,
                                                    "host_index_read_gbps": index_read_gbps}]
        recorded = {**prior["settings"], "resumed": True}
    process = len(processes)  # 0: the first process; n: the n-th resumption
    done = {(m["context"], m["method"], m["round"]) for m in measurements}
    # (context, method) pairs that ran out of memory: recorded once, never run again (a resumption included)
    out_of_memory: list[dict[str, Any]] = list(prior.get("out_of_memory", [])) if prior is not None else []

    # Each process probes its host's read rate; a row is set against the rate of the process that measured it.
    read_rates = [recorded.get("host_read_gbps"), *(p.get("host_read_gbps") for p in processes)]
    index_read_rates = [recorded.get("host_index_read_gbps"), *(p.get("host_index_read_gbps") for p in processes)]

    def payload(complete: bool) -> dict[str, Any]:
        summary = summarise(measurements)
        for row in summary:  # the search's rate as a share of what the host's memory delivers
            by = next(m.get("process", 0) for m in measurements
                      if (m["context"], m["method"]) == (row["context"], row["method"]))
            rate = read_rates[by]
            row["search_share_of_host_read"] = row["search_gbps"] / rate if row.get("search_gbps") and rate else None
            rate = index_read_rates[by]  # the same share of the rate the index's own threads reach
            row["search_share_of_index_read"] = row["search_gbps"] / rate if row.get("search_gbps") and rate else None
        return {"kind": "latency", "settings": recorded, "provenance": first_provenance, "complete": complete,
                **({"resumed_by": processes} if processes else {}),
                "measurements": measurements, "summary": summary,
                **({"out_of_memory": out_of_memory} if out_of_memory else {})}

    def make_request(context: int) -> generation.GenerationRequest:
        generator = torch.Generator().manual_seed(settings.seed + context)
        prompt = torch.randint(0, vocab, (context,), generator=generator).tolist()
        return generation.GenerationRequest(input_ids=prompt, max_new_tokens=settings.decode_steps + 1,
                                            eos_token_ids=())

    warmup_request = make_request(settings.warmup_length) if settings.warmup_length is not None else None
    for context_index, context in enumerate(settings.lengths):
        # With warmup_length the warm-up rounds run once, at that (short) context, before the first length.
        warmups = settings.warmup if warmup_request is None or context_index == 0 else 0
        measured_request = make_request(context)
        for round_index in range(warmups + settings.repeats):
            measured = round_index >= warmups
            request = measured_request if measured or warmup_request is None else warmup_request
            for name, method in methods.items():  # interleaved: A B A B ...
                # A resumed run skips what its file holds, and the warm-ups of a method whose rounds are all there.
                if (context, name, round_index - warmups) in done or (not measured and all(
                        (context, name, r) in done for r in range(settings.repeats))):
                    continue
                if any((o["context"], o["method"]) == (context, name) for o in out_of_memory):
                    continue
                short = gpu_shortfall(model, method, len(request.input_ids) + settings.decode_steps + 1, device)
                if short is not None:
                    give_out(out_of_memory, context, name, process, "before the prefill", short)
                    provenance.write_result(out, "latency", payload(complete=False), path=out_path, quiet=True)
                    continue
                cache = HarnessCache(method, PhaseTimer(device, enabled=True), host_pool=host_pool)
                pool_bytes_before = host_pool.allocated_total_bytes
                rss_before = resident_bytes()
                ran_out = None
                try:
                    result = generation.greedy_generate(model, cache, request,
                                                        prefill_chunk_size=settings.prefill_chunk_size,
                                                        layer_by_layer=settings.layer_by_layer,
                                                        residual_on_host=settings.residual_on_host)
                except (RuntimeError, MemoryError) as error:  # torch.OutOfMemoryError is a RuntimeError
                    kind = allocation_failure(error)
                    if kind is None:
                        raise
                    where = "GPU" if kind == "gpu" else "host"
                    ran_out = f"{where} memory: {(str(error).splitlines() or [type(error).__name__])[0][:300]}"
                if ran_out is not None:
                    # Out of the handler, whose traceback holds the failed run's frames and their tensors: the
                    # cache goes, the allocator gives its blocks back, and the next method runs on a clean GPU.
                    cache.close()
                    del cache
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
                    give_out(out_of_memory, context, name, process, "during the run", ran_out)
                    provenance.write_result(out, "latency", payload(complete=False), path=out_path, quiet=True)
                    continue
                rss_after = resident_bytes()  # the cache still holds everything it kept
                if measured:
                    measurements.append(measurement(spec.name, name, method, context, process,
                                                    round_index - warmups, result, rss_before, rss_after,
                                                    method_label(dataclasses.asdict(method.config)),
                                                    host_pool.allocated_total_bytes - pool_bytes_before))
                    # Each finished measurement is on disk at once: a run killed at its time limit keeps the rest.
                    provenance.write_result(out, "latency", payload(complete=False), path=out_path, quiet=True)
                cache.close()
                del cache, result
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            print(f"context {context}: round {round_index + 1}/{warmups + settings.repeats}"
                  f"{'' if measured else ' (warm-up)'} done", flush=True)

    final = payload(complete=True)
    print_table(final["summary"])
    for o in out_of_memory:
        print(f"{o['context']:>8} {o['method']:<16} out of memory {o['stage']}: {o['error']}")
    return provenance.write_result(out, "latency", final, path=out_path)


def bench_methods(settings) -> tuple[Any, dict[str, Any]]:
    """What a benchmark's settings (``model``, ``source``, ``device``, ``dtype``, ``threads``, ``methods``,
    ``budget``, ``set``) name: the model's spec and every method, built and checked, no weights read yet (bad
    settings stop here with a ``ConfigError``). Sets torch's CPU threads first."""
    import torch

    from eval.plugins import build_method
    from icecache.core.models import model_info

    if settings.threads:
        torch.set_num_threads(settings.threads)
    spec = model_spec(settings.model, settings.source, settings.device, settings.dtype)
    info = model_info(spec)
    return spec, {name: build_method(method_values(name, settings.budget, settings.set), info)
                  for name in settings.methods}


def load_bench_model(spec) -> tuple[Any, Any]:
    """The model of ``spec`` with the harness's attention, and its device, saying what it builds."""
    from icecache.core.cache import ATTENTION_NAME
    from icecache.core.models import load_model

    print(f"building {spec.name} ({spec.source}) on {spec.resolved_device()} / {spec.resolved_dtype()} ...",
          flush=True)
    model, _ = load_model(spec, ATTENTION_NAME)
    return model, spec.resolved_device()


def host_total_bytes() -> int | None:
    """The host's physical memory (None where the size is unknown)."""
    import os

    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def host_pool_limit() -> int | None:
    """The free host buffers the latency engine's pool keeps: two fifths of the host's memory (None where the
    size is unknown), so that methods of different layouts cannot pin the host full between them."""
    total = host_total_bytes()
    return None if total is None else int(0.4 * total)


def allocation_failure(error: BaseException) -> str | None:
    """``"gpu"`` or ``"host"`` when ``error`` is an allocation failure, else None (a real error, raised)."""
    import torch

    if isinstance(error, torch.cuda.OutOfMemoryError):
        return "gpu"
    if isinstance(error, MemoryError):
        return "host"
    text = str(error)
    if isinstance(error, RuntimeError):
        if text.startswith("cuMemHostAlloc failed"):  # pinning host memory (core.cuda_driver)
            return "host"
        if "out of memory" in text.lower():
            return "gpu"
    return None


def full_kv_bytes(model_config, tokens: int, element_bytes: int) -> int:
    """The keys and values of ``tokens`` tokens in every layer of a model with ``model_config``'s geometry."""
    from icecache.core.layer import ModelInfo

    info = ModelInfo.from_config(model_config)
    return 2 * info.n_layers * info.n_kv_heads * info.head_dim * tokens * element_bytes


def gpu_shortfall(model, method, tokens: int, device) -> str | None:
    """Why a method that keeps every token's KV on the GPU (no ``budget``: the full caches) cannot hold ``tokens``
    on this GPU beside what is allocated now (the model), or None where it can or keeps less. Checked before the
    prefill, which would otherwise run for minutes at long contexts before running out."""
    import torch

    if device.type != "cuda" or getattr(method.config, "budget", 0) is not None:
        return None
    need = full_kv_bytes(model.config, tokens, torch.finfo(model.dtype).bits // 8)
    free, total = torch.cuda.mem_get_info(device)
    if need <= free:
        return None
    return (f"GPU memory: its KV of {tokens} tokens needs {need / 2**30:.1f} GiB, and {free / 2**30:.1f} of the "
            f"GPU's {total / 2**30:.1f} GiB are free beside the model")


def give_out(out_of_memory: list[dict[str, Any]], context: int, name: str, process: int, stage: str,
             error: str) -> None:
    """Record that ``name`` ran out of memory at ``context`` (its other rounds there are not run)."""
    out_of_memory.append({"context": context, "method": name, "process": process, "stage": stage, "error": error})
    print(f"context {context}: {name} out of memory {stage}: {error}", flush=True)


def measurement(model: str, name: str, method, context: int, process: int, round_index: int, result,
                rss_before: int | None, rss_after: int | None, label: str,
                host_buffers_allocated: int = 0) -> dict[str, Any]:
    """One measured run of method ``name`` as the latency file records it; ``host_buffers_allocated``: the bytes of
    host buffers its sequence allocated (``core.host_memory``; the rest it reused)."""
    n_steps = max(1, len(result.step_times_s))
    counters = result.counters
    return {
        "model": model, "method": name, "budget": method.config.budget, "context": context, "process": process,
        "method_label": label, "round": round_index,
        # every setting as it ran, defaults included: a default changed later does not rename this row (its label
        # is its settings against the defaults of the day the tables are drawn, eval/report/variants.py)
        "method_config": dataclasses.asdict(method.config),
        "ttft_s": result.ttft_s, "tt2t_s": result.tt2t_s,
        "tpot_s": result.tpot_s, "phases_s": result.phase_breakdown(), "prefill_phases_s": result.prefill_phases,
        "decode_steps": len(result.step_times_s), "gpu_kv_bytes": result.gpu_kv_bytes,
        "cpu_kv_bytes": result.cpu_kv_bytes, "peak_gpu_bytes": result.peak_gpu_bytes,
        "offloaded_kv_bytes": result.offloaded_kv_bytes, "host_rss_bytes": rss_after,
        "host_rss_added_bytes": None if rss_after is None else rss_after - rss_before,
        "host_buffers_allocated_bytes": host_buffers_allocated,
        "mean_attended_tokens": counters.get("mean_attended_tokens"),
        **({"host_channel": counters["host_channel"]} if "host_channel" in counters else {}),
        "pages_loaded_per_step": counters.get("pages_loaded", 0) / n_steps,
        "bytes_to_gpu_per_step": counters.get("bytes_to_gpu", 0) / n_steps,
        **{f"search_{stat}_per_step": counters[f"search_{stat}"] / n_steps
           for stat in SEARCH_STATS if f"search_{stat}" in counters},
        **{f"search_{phase}_ns_per_step": counters[f"search_{phase}_ns"] / n_steps
           for phase in SEARCH_PHASES if f"search_{phase}_ns" in counters},
        **({f"{counter}_per_step": counters.get(counter, 0) / n_steps for counter in LOOKAHEAD_COUNTERS}
           if "lookahead_searches" in counters else {}),
    }


# ---------------------------------------------------------------------------------------------------------------
# One layer of the latency model, for the benchmarks of a layer's host work (scripts/bench/prompt_index.py and
# scripts/bench/host_step.py)


def llama8b_layer_method(threads: int, search_team_spin_us: int | None = None):
    """IceCache at budget 256 for one sparsified layer of the Llama-3.1-8B geometry (32 query / 8 KV heads of 128
    dimensions, bf16), its index on ``threads`` threads (its search team spinning ``search_team_spin_us``)."""
    import torch

    from eval.plugins import build_method
    from icecache.core.method import ModelInfo

    info = ModelInfo(n_layers=1, n_heads=32, n_kv_heads=8, head_dim=128, dtype=torch.bfloat16)
    return build_method({"name": "icecache", "budget": 256, "n_dense_layers": 0, "cpu_threads": threads,
                         "search_team_spin_us": search_team_spin_us}, info)
