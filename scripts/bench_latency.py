#!/usr/bin/env python
"""Latency benchmark: TTFT, TT2T, TPOT (with its phase breakdown) and KV memory of several methods, side by side.

    python scripts/bench_latency.py --experiment latency                     # the paper's latency figures
    python scripts/bench_latency.py --experiment scaling                     # decode latency vs context
    python scripts/bench_latency.py --model llama31_8b --lengths 36000 --methods full icecache --budget 256

One process builds the model once (by default the real architecture with random weights: exact for time and
memory), then for each context length runs every method on the same random prompt, interleaved (A B A B ...),
``warmup`` unmeasured rounds first, then ``repeats`` measured rounds; each run generates N >= 64 tokens with the
phase timers on. Plain transformers decode is bound by launches and host overhead, so a latency is only meaningful
next to the full cache measured in the same process: every summary row carries its ratio to full.

Writes results/bench/latency_<host>_<date>.json (settings, provenance, every measurement, the summary) and
prints a table. Needs only argparse and PyYAML (a transformers dependency): no Hydra on the GPU host.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import statistics
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

MIN_DECODE_STEPS = 64
# Every row's ratios: to plain transformers decode (full) and to the fast full cache (full_static: static buffers
# and a CUDA-graphed step), which is the fair reference; both run in every measurement.
REFERENCES = ("full", "full_static")


def read_yaml(path: Path) -> dict[str, Any]:
    import yaml

    return yaml.safe_load(path.read_text(encoding="utf-8")) or {}


def _merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in top.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def read_config(path: Path) -> dict[str, Any]:
    """A config group file with its plain defaults list resolved (``/group/name@_here_`` entries and ``_self_``),
    the subset of Hydra composition the model and method files use; anything else is refused, not guessed."""
    values = read_yaml(path)
    defaults = values.pop("defaults", None) or ["_self_"]
    if "_self_" not in defaults:
        defaults = [*defaults, "_self_"]
    merged: dict[str, Any] = {}
    for entry in defaults:
        if entry == "_self_":
            merged = _merge(merged, values)
            continue
        if not isinstance(entry, str) or not entry.startswith("/") or entry.split("@")[-1] not in ("_here_", entry):
            raise SystemExit(f"error: {path}: defaults entry {entry!r} is beyond this driver; compose it with Hydra")
        merged = _merge(merged, read_config(REPO / "configs" / (entry.split("@")[0].lstrip("/") + ".yaml")))
    return merged


def experiment_defaults(name: str | None) -> dict[str, Any]:
    """The ``bench`` block of configs/experiment/<name>.yaml (the single place the figures' settings live)."""
    if not name:
        return {}
    path = REPO / "configs" / "experiment" / f"{name}.yaml"
    if not path.exists():
        raise SystemExit(f"error: no experiment {name!r} (looked for {path})")
    bench = read_yaml(path).get("bench")
    if not bench:
        raise SystemExit(f"error: {path} has no bench block; latency experiments are latency and scaling")
    return bench


def model_spec(name: str, source: str | None, device: str, dtype: str):
    from icecache.core.models import ModelSpec

    path = Path(name) if name.endswith(".yaml") else REPO / "configs" / "model" / f"{name}.yaml"
    if not path.exists():
        raise SystemExit(f"error: no model config {path}")
    values = read_config(path)
    if source:
        values["source"] = source
    if values.get("source") == "random":
        values.setdefault("tokenizer", "bytes")  # prompts are random ids; no tokenizer download
    values["device"], values["dtype"] = device, dtype
    return ModelSpec.from_dict(values)


_INTERPOLATION = re.compile(r"\$\{([^}]*)\}")


def method_values(name: str, budget: int | None, overrides: list[str]) -> dict[str, Any]:
    """configs/method/<name>.yaml with ``${budget}`` filled in, then the ``method.key=value`` overrides of
    ``--set`` for that config, then a variant's own: ``name`` may be ``icecache:cuda_graph=true,cpu_threads=8``,
    so that two settings of one method can be measured side by side in one run."""
    import yaml

    name, _, inline = name.partition(":")
    path = REPO / "configs" / "method" / f"{name}.yaml"
    if not path.exists():
        raise SystemExit(f"error: no method config {path}")
    values = read_config(path)
    for key, value in list(values.items()):
        if isinstance(value, str) and _INTERPOLATION.search(value):
            if value.strip() != "${budget}":
                raise SystemExit(f"error: {path}: {key}: {value} is an interpolation this driver cannot resolve")
            values[key] = budget
    assignments = [override.partition(".")[2] for override in overrides if override.partition(".")[0] == name]
    for assignment in [*assignments, *filter(None, inline.split(","))]:  # the variant's own last: they win
        key, _, raw = assignment.partition("=")
        values[key] = yaml.safe_load(raw)
    return values


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
        for key in ("ttft_s", "tt2t_s", "tpot_s"):
            stats = spread([g[key] for g in group if g[key] is not None])
            row.update({f"{key}_median": stats["median"], f"{key}_min": stats["min"], f"{key}_max": stats["max"]})
        phases = sorted({p for g in group for p in g["phases_s"]})
        row["phases_s"] = {p: statistics.median(g["phases_s"].get(p, 0.0) for g in group) for p in phases}
        prefill = sorted({p for g in group for p in g.get("prefill_phases_s", {})})
        row["prefill_phases_s"] = {p: statistics.median(g.get("prefill_phases_s", {}).get(p, 0.0) for g in group)
                                   for p in prefill}
        for key in ("gpu_kv_bytes", "cpu_kv_bytes", "offloaded_kv_bytes", "peak_gpu_bytes", "host_rss_bytes",
                    "host_rss_added_bytes"):  # the most any repeat held
            values = [g[key] for g in group if g.get(key) is not None]
            row[key] = max(values) if values else None
        for key in ("mean_attended_tokens", "pages_loaded_per_step", "bytes_to_gpu_per_step",
                    *(f"search_{name}_per_step" for name in SEARCH_STATS),
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


SEARCH_STATS = ("rows_read", "bytes_read", "scores", "lists")  # DCIIndex.last_query_stats, per decode step
LOOKAHEAD_COUNTERS = ("lookahead_searches", "lookahead_misses")  # IceCache's look-ahead, per decode step


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


def resident_bytes() -> int | None:
    """The process's resident memory now (Linux ``/proc/self/statm``; None elsewhere)."""
    import os

    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def print_table(rows: list[dict[str, Any]]) -> None:
    header = f"{'context':>8} {'method':<16} {'TTFT s':>8} {'TT2T s':>8} {'TPOT ms':>9} {'(min-max)':>15} " \
             f"{'x full':>7} {'x static':>8} {'GPU KV MiB':>10} {'CPU KV MiB':>10} {'x KV':>5} {'+RSS GiB':>8} " \
             f"{'peak GiB':>8}  phases ms"
    print(header)
    print("-" * len(header))
    for r in sorted(rows, key=lambda r: (r["context"], r["method"] not in REFERENCES, r["method"])):
        def fmt(value, scale=1.0, digits=3):
            return "-" if value is None else f"{value * scale:.{digits}f}"

        phases = " ".join(f"{k}={v * 1000:.1f}" for k, v in r["phases_s"].items())
        phases += "".join(f" prefill:{k}={v * 1000:.0f}" for k, v in r.get("prefill_phases_s", {}).items())
        if r.get("search_gbps"):
            phases += f" search={r['search_bytes_read_per_step'] / 1e6:.0f}MB@{r['search_gbps']:.1f}GB/s"
        print(f"{r['context']:>8} {r['method']:<16} {fmt(r['ttft_s_median']):>8} {fmt(r['tt2t_s_median']):>8} "
              f"{fmt(r['tpot_s_median'], 1000, 2):>9} "
              f"{fmt(r['tpot_s_min'], 1000, 1) + '-' + fmt(r['tpot_s_max'], 1000, 1):>15} "
              f"{fmt(r['tpot_ratio_to_full'], 1, 2):>7} {fmt(r['tpot_ratio_to_full_static'], 1, 2):>8} "
              f"{fmt(r['gpu_kv_bytes'], 2 ** -20, 0):>10} "
              f"{fmt(r['cpu_kv_bytes'], 2 ** -20, 0):>10} {fmt(r.get('host_kv_ratio'), 1, 2):>5} "
              f"{fmt(r.get('host_rss_added_bytes'), 2 ** -30, 1):>8} "
              f"{fmt(r['peak_gpu_bytes'], 2 ** -30, 1):>8}  {phases}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--experiment", help="read defaults from configs/experiment/<name>.yaml (latency, scaling)")
    parser.add_argument("--model", help="model config name in configs/model (or a YAML path); default llama31_8b")
    parser.add_argument("--source", help="model source; default random (real architecture, random weights)")
    parser.add_argument("--lengths", type=int, nargs="+", help="context lengths in tokens")
    parser.add_argument("--methods", nargs="+",
                        help="method config names, or variants such as icecache:cuda_graph=true (full and full_static "
                             "are added)")
    parser.add_argument("--budget", type=int, help="KV token budget per query head")
    parser.add_argument("--threads", type=int, help="torch CPU threads")
    parser.add_argument("--repeats", type=int, help="measured rounds")
    parser.add_argument("--warmup", type=int, help="unmeasured rounds first")
    parser.add_argument("--warmup-length", type=int,
                        help="run the warm-up rounds once, at this context, instead of at every length (long contexts)")
    parser.add_argument("--decode-steps", type=int, help=f"N decode steps per run (>= {MIN_DECODE_STEPS})")
    parser.add_argument("--prefill-chunk-size", type=int, help="prefill in chunks of this many tokens")
    parser.add_argument("--layer-by-layer", action="store_true", default=None,
                        help="prefill one decoder layer at a time (same result; bounds prefill memory)")
    parser.add_argument("--residual-on-host", action="store_true", default=None,
                        help="with --layer-by-layer: keep the prefill's residual stream in host memory")
    parser.add_argument("--set", nargs="*", action="extend", default=[], metavar="METHOD.KEY=VALUE",
                        help="method setting overrides, e.g. icecache.n_reuse_layers=4")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random prompt")
    parser.add_argument("--bandwidth-probe-gib", type=float, default=2.0,
                        help="GiB read by the host-memory bandwidth probe run first (0: none)")
    parser.add_argument("--out", default=str(REPO / "results" / "bench"), help="output folder")
    parser.add_argument("--resume", type=Path, metavar="FILE",
                        help="a latency file this command left unfinished (complete: false): measure only what it "
                             "lacks, with its settings, and write the whole to <out>/<its name>")
    args = parser.parse_args(argv)
    defaults = {"model": "llama31_8b", "source": "random", "lengths": [16384], "methods": ["full", "icecache"],
                "budget": 256, "threads": None, "repeats": 3, "warmup": 1, "decode_steps": MIN_DECODE_STEPS,
                "prefill_chunk_size": None, "layer_by_layer": False, "residual_on_host": False}
    defaults.update({k: v for k, v in experiment_defaults(args.experiment).items() if k != "driver"})
    for key, value in defaults.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    if args.decode_steps < MIN_DECODE_STEPS:
        parser.error(f"--decode-steps must be at least {MIN_DECODE_STEPS} (TPOT is the median of steps 2..N)")
    if args.residual_on_host and not args.layer_by_layer:
        parser.error("--residual-on-host needs --layer-by-layer")
    if args.repeats < 1 or args.warmup < 0:
        parser.error("--repeats must be >= 1 and --warmup >= 0")
    args.methods = [*REFERENCES, *(m for m in args.methods if m not in REFERENCES)]
    args.resumed = read_unfinished(args.resume, args) if args.resume else None
    return args


# The settings a resumed command must share with the file it completes: everything that changes a measurement.
RESUME_SETTINGS = ("model", "source", "lengths", "methods", "budget", "threads", "repeats", "warmup", "warmup_length",
                   "decode_steps", "prefill_chunk_size", "layer_by_layer", "residual_on_host", "set", "device",
                   "dtype", "seed")


def read_unfinished(path: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The payload of the unfinished latency file ``path``, refused in one line (before anything is built) when it
    is finished, unreadable or measured with other settings than ``args``."""
    import json

    try:
        prior = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise SystemExit(f"error: --resume {path}: cannot read it as a latency file ({error})") from None
    if prior.get("kind") != "latency" or prior.get("complete") is not False:
        raise SystemExit(f"error: --resume {path}: not an unfinished latency file (it needs complete: false)")
    for key in RESUME_SETTINGS:
        theirs, ours = prior["settings"].get(key), getattr(args, key)
        if theirs != ours:
            raise SystemExit(f"error: --resume {path}: it was measured with {key}={theirs!r}, this command has "
                             f"{ours!r}; give the command the file's settings")
    return prior


def main(argv: list[str] | None = None) -> Path:
    args = parse_args(argv)
    import torch

    from eval import provenance
    from eval.plugins import build_method
    from icecache.core.cache import ATTENTION_NAME, HarnessCache
    from icecache.core.generation import GenerationRequest, greedy_generate
    from icecache.core.method import method_label
    from icecache.core.models import load_model, model_info
    from icecache.core.timing import PhaseTimer
    from icecache.errors import ConfigError

    if args.threads:
        torch.set_num_threads(args.threads)
    spec = model_spec(args.model, args.source, args.device, args.dtype)
    info = model_info(spec)
    try:
        methods = {name: build_method(method_values(name, args.budget, args.set), info) for name in args.methods}
    except ConfigError as error:
        raise SystemExit(f"error: {error}") from None
    print(f"building {spec.name} ({spec.source}) on {spec.resolved_device()} / {spec.resolved_dtype()} ...",
          flush=True)
    model, _ = load_model(spec, ATTENTION_NAME)
    device = spec.resolved_device()
    touch_gbps, read_gbps = host_memory_rates(args.bandwidth_probe_gib)
    if read_gbps is not None:
        print(f"host memory: first touch {touch_gbps:.1f} GB/s, read {read_gbps:.1f} GB/s on "
              f"{torch.get_num_threads()} threads", flush=True)
    vocab = model.config.vocab_size

    prior = args.resumed
    settings = {k: v for k, v in vars(args).items() if k not in ("out", "resume", "resumed")}
    settings.update({"model_name": spec.name, "device_resolved": str(device),
                     "dtype_resolved": str(spec.resolved_dtype()), "host_read_gbps": read_gbps,
                     "host_first_touch_gbps": touch_gbps})
    run_provenance = provenance.collect()
    if prior is None:
        measurements: list[dict[str, Any]] = []
        out_path, first_provenance, processes = provenance.result_path(args.out, "latency"), run_provenance, []
    else:  # the file's measurements stand; this process adds the rest and is listed after the first
        measurements = prior["measurements"]
        out_path, first_provenance = Path(args.out) / args.resume.name, prior["provenance"]
        processes = [*prior.get("resumed_by", []), {"provenance": run_provenance, "host_read_gbps": read_gbps,
                                                    "host_first_touch_gbps": touch_gbps}]
        settings = {**prior["settings"], "resumed": True}
    process = len(processes)  # 0: the first process; n: the n-th resumption
    done = {(m["context"], m["method"], m["round"]) for m in measurements}

    # Each process probes its host's read rate; a row is set against the rate of the process that measured it.
    read_rates = [settings.get("host_read_gbps"), *(p.get("host_read_gbps") for p in processes)]

    def payload(complete: bool) -> dict[str, Any]:
        summary = summarise(measurements)
        for row in summary:  # the search's rate as a share of what the host's memory delivers
            by = next(m.get("process", 0) for m in measurements
                      if (m["context"], m["method"]) == (row["context"], row["method"]))
            rate = read_rates[by]
            row["search_share_of_host_read"] = row["search_gbps"] / rate if row.get("search_gbps") and rate else None
        return {"kind": "latency", "settings": settings, "provenance": first_provenance, "complete": complete,
                **({"resumed_by": processes} if processes else {}),
                "measurements": measurements, "summary": summary}

    def make_request(context: int) -> GenerationRequest:
        generator = torch.Generator().manual_seed(args.seed + context)
        prompt = torch.randint(0, vocab, (context,), generator=generator).tolist()
        return GenerationRequest(input_ids=prompt, max_new_tokens=args.decode_steps + 1, eos_token_ids=())

    warmup_request = make_request(args.warmup_length) if args.warmup_length is not None else None
    for context_index, context in enumerate(args.lengths):
        # With --warmup-length the warm-up rounds run once, at that (short) context, before the first length.
        warmups = args.warmup if warmup_request is None else (args.warmup if context_index == 0 else 0)
        measured_request = make_request(context)
        for round_index in range(warmups + args.repeats):
            measured = round_index >= warmups
            request = measured_request if measured or warmup_request is None else warmup_request
            for name, method in methods.items():  # interleaved: A B A B ...
                # A resumed run skips what its file holds, and the warm-ups of a method whose rounds are all there.
                if (context, name, round_index - warmups) in done or (not measured and all(
                        (context, name, r) in done for r in range(args.repeats))):
                    continue
                cache = HarnessCache(method, PhaseTimer(device, enabled=True))
                rss_before = resident_bytes()
                result = greedy_generate(model, cache, request, prefill_chunk_size=args.prefill_chunk_size,
                                         layer_by_layer=args.layer_by_layer,
                                         residual_on_host=args.residual_on_host)
                rss_after = resident_bytes()  # the cache still holds everything it kept
                n_steps = max(1, len(result.step_times_s))
                if measured:
                    measurements.append({
                        "model": spec.name, "method": name, "budget": method.config.budget, "context": context,
                        "process": process,
                        "method_label": method_label(dataclasses.asdict(method.config)),
                        "round": round_index - warmups, "ttft_s": result.ttft_s, "tt2t_s": result.tt2t_s,
                        "tpot_s": result.tpot_s, "phases_s": result.phase_breakdown(),
                        "prefill_phases_s": result.prefill_phases,
                        "decode_steps": len(result.step_times_s), "gpu_kv_bytes": result.gpu_kv_bytes,
                        "cpu_kv_bytes": result.cpu_kv_bytes, "peak_gpu_bytes": result.peak_gpu_bytes,
                        "offloaded_kv_bytes": result.offloaded_kv_bytes, "host_rss_bytes": rss_after,
                        "host_rss_added_bytes": None if rss_after is None else rss_after - rss_before,
                        "mean_attended_tokens": result.counters.get("mean_attended_tokens"),
                        "pages_loaded_per_step": result.counters.get("pages_loaded", 0) / n_steps,
                        "bytes_to_gpu_per_step": result.counters.get("bytes_to_gpu", 0) / n_steps,
                        **{f"search_{name}_per_step": result.counters[f"search_{name}"] / n_steps
                           for name in SEARCH_STATS if f"search_{name}" in result.counters},
                        **({f"{name}_per_step": result.counters.get(name, 0) / n_steps for name in LOOKAHEAD_COUNTERS}
                           if "lookahead_searches" in result.counters else {}),
                    })
                    # Each finished measurement is on disk at once: a run killed at its time limit keeps the rest.
                    provenance.write_result(args.out, "latency", payload(complete=False), path=out_path, quiet=True)
                cache.close()
                del cache, result
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            print(f"context {context}: round {round_index + 1}/{warmups + args.repeats}"
                  f"{'' if measured else ' (warm-up)'} done", flush=True)

    final = payload(complete=True)
    print_table(final["summary"])
    return provenance.write_result(args.out, "latency", final, path=out_path)


if __name__ == "__main__":
    main()
