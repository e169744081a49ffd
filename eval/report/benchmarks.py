"""The tables of BENCHMARKS.md, rendered from the result files in results/bench/ and the paper's figures.

    python scripts/bench/tables.py            # rewrite every table region of BENCHMARKS.md
    python scripts/bench/tables.py --check    # exit 1 if a region differs from what the files render

A region is the text between ``<!-- table:NAME -->`` and ``<!-- /table:NAME -->``; NAME is one of ``RENDERERS``.
Each table shows the newest numbers, row by row, and names the file and commit each row comes from:

* headline: per method, its accuracy as a share of the full cache's (the ``accuracy_*.json`` of runs on a GPU that
  reaches the longest context, the newest of those, at the latency files' budget) beside its decode time over
  ``full_static``'s (the latency table's rows).

* latency (``latency_*.json``): for every (context, method) the newest file that measured it. A method variant
  (``icecache:key=value``) is shown only from the file that gives its base method's row at that context, since it
  was measured to be compared with it. Ratios are to ``full`` and ``full_static`` of the same file.
  Files of the scaling experiment (``settings.experiment == "scaling"``) are left to the scaling table.
* scaling: the same choice over the scaling experiment's files, beside the paper's scaling figure;
  other-gpus-scaling: the scaling files in results/bench's folders (other GPUs), per GPU and context.
* capacity: per (model, method), the largest context the GPU host's memory allows, projected by a line through
  the method's measured peak GPU and host memory (``render_capacity``).
* breakdown: the IceCache and IceCache-reuse rows of the latency table, with their phases and memory.
* host-step (``host_step_*.json``), prompt-index (``prompt_index_*.json``), dci (``dci_*.json``): the newest file per
  (host, threads, context) (and, for the index, per first-pass precision).
* kernels (``kernels_*.json``): the newest file per host.
* cpu-accuracy (``cpu_accuracy*.json``, lists of run metrics): the newest run per (task, model, method, budget,
  command-line settings).
* accuracy (``accuracy_*.json``, the curated runs of the accuracy experiments): the newest file per model and
  device (the GPU its runs ran on, or CPU), one table per file with every task and length side by side, every cell
  from its runs' metrics.json (eval.report.accuracy).
* page-quality (``page_quality_*.json``): the newest file per (host, model, task, length, budget).

"Newest" is the latest ``provenance.date`` (then the file name); the host is the file name's label
(``latency_<host>_<date>.json``). A method with settings is written as ``eval.report.names.method_text`` writes it
(``icecache (lookahead)``), whichever spelling its file recorded; methods are in the report's order
(``eval.report.methods``), a method's variants right after it.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import sys
from pathlib import Path
from typing import Any, Callable

from .names import method_text, split_method
from .variants import rename_rows

REPO = Path(__file__).resolve().parents[2]
# The pages with table regions: the numbers, and what bounds them.
PAGES = (REPO / "BENCHMARKS.md", REPO / "docs" / "performance.md")
RESULTS = REPO / "results" / "bench"
PAPER = REPO / "results" / "paper" / "paper_figures.json"

REFERENCES = ("full", "full_static")
ICECACHE_METHODS = ("icecache", "icecache_reuse")
# Command-line settings of a run that do not change its results (paths, thread counts) or that are columns already.
NOT_PROTOCOL = ("output_root", "threads", "method.cpu_threads", "task.data_dir", "budget", "method", "task", "model")
REGION = re.compile(r"(<!-- table:(?P<name>[a-z0-9-]+) -->\n)(?P<body>.*?)(<!-- /table:(?P=name) -->)", re.DOTALL)


# --------------------------------------------------------------------------------------------------------------
# Reading result files


class Result:
    """One result file: its data, name, host label and provenance."""

    def __init__(self, path: Path):
        self.path = path
        self.data = json.loads(path.read_text(encoding="utf-8"))
        rename_rows(self.data)  # a latency row named by the settings it ran with (report/variants.py)
        self.provenance: dict[str, Any] = self.data.get("provenance") or {}

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def host(self) -> str:
        """The label between the kind and the date in ``<kind>_<host>_<date>.json``."""
        kinds = "latency|throughput|dci|kernels|prompt_index|host_step|page_quality|handoff"
        match = re.fullmatch(rf"(?:{kinds})_(.+?)_\d{{8}}(?:-\d+)?\.json", self.name)
        return match.group(1) if match else "?"

    @property
    def order(self) -> tuple[str, str]:
        return (str(self.provenance.get("date") or ""), self.name)

    @property
    def commit(self) -> str:
        return short_commit(self.provenance)

    def commit_of_process(self, process: int) -> str:
        """The commit of the file's process ``process`` (0: the file's own, n: the n-th that resumed it)."""
        resumed = self.data.get("resumed_by", [])
        if not 0 < process <= len(resumed):
            return self.commit
        return short_commit(resumed[process - 1].get("provenance") or {})

    def commit_of(self, row: dict[str, Any]) -> str:
        """The commit that measured a summary row: a file completed by ``--resume`` holds rows of several
        processes, and its measurements say which process (0: the file's own, n: the n-th that resumed it)."""
        processes = {m.get("process", 0) for m in self.data.get("measurements", [])
                     if m.get("context") == row.get("context") and m.get("method_label", m.get("method"))
                     == row.get("method_label", row.get("method"))}
        return self.commit_of_process(processes.pop()) if len(processes) == 1 else self.commit


def short_commit(provenance: dict[str, Any]) -> str:
    commit = str(provenance.get("git_commit") or "?")[:7]
    return f"{commit} (dirty)" if provenance.get("git_dirty") else commit


def load(results: Path, pattern: str) -> list[Result]:
    """The files matching ``pattern``, oldest first."""
    return sorted((Result(path) for path in results.glob(pattern)), key=lambda r: r.order)


def newest_by(items: list[tuple[tuple, tuple, Any]]) -> dict[tuple, Any]:
    """``(key, order, value)`` triples -> the value with the largest order for each key."""
    best: dict[tuple, tuple[tuple, Any]] = {}
    for key, order, value in items:
        if key not in best or order > best[key][0]:
            best[key] = (order, value)
    return {key: value for key, (_, value) in best.items()}


def method_sort_key(method: str) -> tuple:
    """The methods' display order (``eval.report.methods``), a method's variants right after it."""
    from eval.report.methods import sort_key

    base, _ = split_method(method)
    return (*sort_key(base), method_text(method))


def method_cell(method: str) -> str:
    return f"`{method_text(method)}`"


# --------------------------------------------------------------------------------------------------------------
# Formatting


def fmt(value: float | None, scale: float = 1.0, digits: int = 1) -> str:
    return "-" if value is None else f"{value * scale:.{digits}f}"


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def spread(values: list[float], scale: float = 1.0, digits: int = 2) -> str:
    """median (min-max) of a few rounds."""
    ordered = sorted(values)
    middle = len(ordered) // 2
    median = ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2
    if len(ordered) == 1:
        return fmt(median, scale, digits)
    return f"{fmt(median, scale, digits)} ({fmt(ordered[0], scale, digits)}-{fmt(ordered[-1], scale, digits)})"


# --------------------------------------------------------------------------------------------------------------
# Latency


def is_scaling(f: Result) -> bool:
    return (f.data.get("settings") or {}).get("experiment") == "scaling"


def latency_rows(results: Path, scaling: bool = False) -> list[tuple[dict[str, Any], Result]]:
    """The newest summary row per (context, method), variants only beside their base method's row, from the
    scaling experiment's files (``scaling``) or from the others."""
    files = [f for f in load(results, "latency_*.json") if is_scaling(f) == scaling]
    candidates = [((row["context"], row["method"]), f.order, (row, f)) for f in files for row in f.data["summary"]]
    newest = newest_by(candidates)
    chosen = []
    for (context, method), (row, f) in newest.items():
        if ":" in method:
            base = newest.get((context, split_method(method)[0]))
            if base is None or base[1] is not f:
                continue
        chosen.append((row, f))
    return sorted(chosen, key=lambda item: (item[0]["context"], method_sort_key(item[0]["method"])))


def reference_row(f: Result, context: int, method: str) -> dict[str, Any] | None:
    return next((r for r in f.data["summary"] if r["context"] == context and r["method"] == method), None)


def ratio_value(row: dict[str, Any], f: Result, reference: str, key: str = "tpot_s_median") -> float | None:
    """A summary row's ``key`` over the ``reference`` method's in the same file (TTFT and TT2T: the last round's,
    ``last_round``); None where the file lacks either."""
    base = reference_row(f, row["context"], reference)
    if base is None:
        return None
    if key in ("ttft_s", "tt2t_s"):
        mine, theirs = last_round(f, row, key), last_round(f, base, key)
    else:
        mine, theirs = row.get(key), base.get(key)
    return mine / theirs if mine and theirs else None


def ratio_to(row: dict[str, Any], f: Result, reference: str) -> str:
    """The row's TPOT over the reference method's in the same file, formatted ("-" where there is none)."""
    value = ratio_value(row, f, reference)
    return "-" if value is None else f"{value:.2f}"


def nearest_context(contexts: list[int], target: int | None) -> int | None:
    if not contexts or target is None:
        return None
    return min(contexts, key=lambda c: (abs(c - target), c))


def file_settings(f: Result) -> list[str]:
    """What a latency file measured with, part by part (the parts several files share are said once)."""
    s = f.data.get("settings", {})
    prefill = "one-chunk prefill" if not s.get("prefill_chunk_size") else f"{s['prefill_chunk_size']}-token chunks"
    if s.get("layer_by_layer"):
        prefill += ", layer by layer"
    if s.get("residual_on_host"):
        prefill += ", residual stream on the host"
    rounds = f"{s.get('repeats')} round{'' if s.get('repeats') == 1 else 's'}"
    warmup = f"{s.get('warmup')} warm-up" + (f" at {s['warmup_length']}" if s.get("warmup_length") else "")
    p = f.provenance
    return [f"{p.get('gpu') or 'CPU'}, torch {p.get('torch')}",
            f"{s.get('model_name') or s.get('model')} ({s.get('source')} weights, {s.get('dtype_resolved')})",
            f"budget {s.get('budget')}", f"{s.get('threads')} threads", f"{rounds} + {warmup}",
            f"{s.get('decode_steps')} decode steps", prefill]


def file_notes(f: Result) -> list[str]:
    """How a file was written when not by one process that ran to its end."""
    notes = []
    if f.data.get("complete") is False:
        notes.append("unfinished (its process ended after the methods shown; --resume completes it)")
    notes += [f"continued by another process at commit {str(r['provenance'].get('git_commit'))[:7]}, "
              f"{r['provenance'].get('date')} (--resume)" for r in f.data.get("resumed_by", [])]
    return notes


def sources(files: list[Result]) -> str:
    """The settings of the files a table shows: what they all share on one line, then each group of files that
    share the rest, then how each file that was not written by one whole process came to be."""
    parts = {f.name: file_settings(f) for f in files}
    shared = [part for part in parts[files[0].name] if all(part in mine for mine in parts.values())] if files else []
    groups: dict[str, list[str]] = {}
    for f in files:
        rest = ", ".join(part for part in parts[f.name] if part not in shared)
        if rest:
            groups.setdefault(rest, []).append(f"`{f.name}`")
    lines = [f"* {'Every file' if len(files) > 1 else f'`{files[0].name}`'}: {', '.join(shared)}."] if shared else []
    lines += [f"* {', '.join(names)}: {rest}." for rest, names in groups.items()]
    lines += [f"* `{f.name}`: {'; '.join(file_notes(f))}." for f in files if file_notes(f)]
    return "\n".join(lines)


def render_latency(results: Path, paper: dict[str, Any]) -> str:
    chosen = latency_rows(results)
    figures = paper.get("latency", {})
    paper_context = nearest_context(sorted({row["context"] for row, _ in chosen}), figures.get("context_tokens"))
    rows = []
    for row, f in chosen:
        method = row["method"]
        paper_cell = "-"
        if row["context"] == paper_context and ":" not in method:
            tpot, tt2t = figures.get("tpot_ms", {}).get(method), figures.get("tt2t_s", {}).get(method)
            if tpot is not None or tt2t is not None:
                paper_cell = f"{fmt(tpot, digits=0)} ms / {fmt(tt2t, digits=2)} s"
        rows.append([
            str(row["context"]), method_cell(method), fmt(row.get("tpot_s_median"), 1000),
            f"{fmt(row.get('tpot_s_min'), 1000)}-{fmt(row.get('tpot_s_max'), 1000)}",
            ratio_to(row, f, "full"), ratio_to(row, f, "full_static"),
            fmt(row.get("ttft_s_median"), digits=2), fmt(row.get("tt2t_s_median"), digits=2),
            fmt(row.get("peak_gpu_bytes"), 2**-30), paper_cell, f"`{f.name}`", f.commit_of(row),
        ])
    header = ["context", "method", "TPOT ms", "min-max", "x full", "x full_static", "TTFT s", "TT2T s", "peak GiB",
              "paper TPOT / TT2T", "file", "commit"]
    used = sorted({f.name: f for _, f in chosen}.values(), key=lambda f: f.order)
    note = (f"Ratios are to `full` and `full_static` measured in the same file. The paper's column "
            f"({figures.get('model')}, {figures.get('task')}, {figures.get('hardware')}) is filled at the context "
            f"nearest its {figures.get('context_tokens')} tokens.")
    return "\n\n".join([table(header, rows), note, sources(used), render_paper_scaling(paper)])


def render_latency_summary(results: Path, paper: dict[str, Any]) -> str:
    """The latency table's numbers one line per method: TPOT and TT2T at each context, beside the paper's."""
    chosen = latency_rows(results)
    contexts = sorted({row["context"] for row, _ in chosen})
    cells = {(method_text(row["method"]), row["context"]): row for row, _ in chosen}
    methods = sorted({method_text(row["method"]) for row, _ in chosen}, key=method_sort_key)
    figures = paper.get("latency", {})
    rows = []
    for method in methods:
        at = [cells.get((method, context)) or {} for context in contexts]
        rows.append([f"`{method}`", *(fmt(row.get("tpot_s_median"), 1000) for row in at),
                     *(fmt(row.get("tt2t_s_median"), digits=2) for row in at),
                     fmt(figures.get("tpot_ms", {}).get(method), digits=0),
                     fmt(figures.get("tt2t_s", {}).get(method), digits=2)])
    paper_at = context_label(figures.get("context_tokens"))
    header = ["method", *(f"{context_label(c)} TPOT ms" for c in contexts),
              *(f"{context_label(c)} TT2T s" for c in contexts), f"paper TPOT ms ({paper_at})",
              f"paper TT2T s ({paper_at})"]
    note = (f"The newest measurement of each method at each context; every cell's file, commit, spread, TTFT and "
            f"peak memory: docs/performance.md, \"Latency in detail\". The paper's columns: "
            f"{figures.get('model')}, {figures.get('task')}, {figures.get('hardware')}.")
    return "\n\n".join([table(header, rows), note])


def last_round(f: Result, row: dict[str, Any], key: str) -> float | None:
    """``key`` (``ttft_s`` or ``tt2t_s``) of a summary row's last round: the round with the host buffers pooled and
    the kernels compiled, where the first may pay for both; the median when the file keeps no measurements."""
    # ``method`` names a variant with its settings (``method_label`` is its base method's name, the same for all).
    rounds = [m for m in f.data.get("measurements", []) if m.get("context") == row["context"]
              and m.get("method") == row["method"]]
    if not rounds:
        return row.get(f"{key}_median")
    return max(rounds, key=lambda m: m.get("round", 0)).get(key)


def render_other_gpus(results: Path, paper: dict[str, Any]) -> str:
    """Latency measured on GPUs other than the main tables' (a folder of files under results/bench/ per GPU kind and
    day): per GPU, the newest row of each context and method, each ratio to the full caches of its own file."""
    files = [f for f in load(results, "*/latency_*.json") if not is_scaling(f)]
    if not files:
        return "None: no `results/bench/<folder>/latency_*.json`."
    newest = newest_by([((str(f.provenance.get("gpu") or f.host), row["context"], row["method"]), f.order, (row, f))
                        for f in files for row in f.data["summary"]])
    rows = []
    for (gpu, context, method), (row, f) in sorted(
            newest.items(), key=lambda item: (item[0][0], item[0][1], method_sort_key(item[0][2]))):
        ttft, tt2t = last_round(f, row, "ttft_s"), last_round(f, row, "tt2t_s")
        over_full = ratio_value(row, f, "full", "ttft_s")
        rows.append([gpu, context_label(context), f"`{method_text(method)}`", fmt(row.get("tpot_s_median"), 1000),
                     ratio_to(row, f, "full_static"), fmt(ttft, digits=2),
                     "-" if over_full is None else f"{over_full:.2f}", fmt(tt2t, digits=2),
                     f"`{f.path.parent.name}/{f.name}`", f.commit_of(row)])
    header = ["GPU", "context", "method", "TPOT ms", "x full_static", "TTFT s", "x full's TTFT", "TT2T s", "file",
              "commit"]
    note = ("The newest row of each method per GPU and context from the files in results/bench's folders (the main "
            "tables read results/bench/ itself). Ratios are to the full caches of the same file; TTFT and TT2T are "
            "the last round's (host buffers pooled, kernels compiled). Hosts of one GPU kind differ (host CPUs, "
            "PCIe): a ratio is of one file, and rows of different files are not one measurement.")
    return "\n\n".join([table(header, rows), note])


def goal_value(f: Result, row: dict[str, Any], measure: str) -> float | None:
    """A ``SpeedGoal`` measure of a file's summary row, over its reference method's in the same file."""
    from icecache.core.method import SPEED_MEASURES

    key, reference, _ = SPEED_MEASURES[measure]
    return ratio_value(row, f, reference, key)


def render_speed_goals(results: Path, paper: dict[str, Any]) -> str:
    """Each method's ``speed_goals`` (declared on the method) against the newest file of each GPU that measured it
    beside the goal's reference (latency files; throughput files for ``throughput``): the ratio, met or missed,
    and the file."""
    from eval.plugins import method_class
    from icecache.core.method import METHODS, SPEED_MEASURES

    def files(kind: str) -> list[Result]:  # a file resumed on another GPU is no one GPU's measurement
        return [f for f in [*load(results, f"{kind}_*.json"), *load(results, f"*/{kind}_*.json")]
                if not is_scaling(f) and len(file_gpus(f)) == 1]

    sources = [(measure, f) for measure in SPEED_MEASURES
               for f in files("throughput" if measure == "throughput" else "latency")]
    found_all: dict[tuple, list] = {}
    for measure, f in sources:
        for row in f.data.get("summary") or []:
            if (value := goal_value(f, row, measure)) is not None:
                key = (str(f.provenance.get("gpu") or f.host), row["context"], row["method"], measure)
                found_all.setdefault(key, []).append((f.order, (value, f, row)))
    measured = newest_by([(key, order, found) for key, items in found_all.items() for order, found in items])
    gpus = sorted({gpu for gpu, *_ in measured})

    def verdict_of(value: float, goal: Any) -> str:
        short = value / goal.bound - 1 if goal.lower_is_better else 1 - value / goal.bound
        return "met" if goal.met_by(value) else f"missed by {short:.0%}"

    def where(f: Result, row: dict[str, Any]) -> str:
        folder = f"{f.path.parent.name}/" if f.path.parent != results else ""
        return f"`{folder}{f.name}`, {f.commit_of(row)}"

    def cell(gpu: str, method: str, goal: Any) -> str:
        key = (gpu, goal.context, method, goal.measure)
        if key not in measured:
            return "not measured"
        value, f, row = measured[key]
        verdict = verdict_of(value, goal)
        if goal.measure == "throughput":
            reference = reference_row(f, goal.context, "full_static") or {}
            if fitted_unmeasured(f, goal.context, "full_static", int(reference.get("largest_batch") or 0)):
                verdict += ", overstated: `full_static`'s fitted rows went unmeasured"
        text = f"{value:.2f}, {verdict} ({where(f, row)})"
        # Lent hosts of one GPU differ in their CPUs, which bound the host-bound rows: an earlier file's better
        # ratio (same method row, same settings) says what the same kind of GPU has reached, beside the newest.
        sign = 1 if goal.lower_is_better else -1
        best_value, best_f, best_row = min((found for _, found in found_all[key]), key=lambda found: sign * found[0])
        if best_f is not f and f"{best_value:.2f}" != f"{value:.2f}" and sign * best_value < sign * value:
            text += f"; best {best_value:.2f}, {verdict_of(best_value, goal)} ({where(best_f, best_row)})"
        return text

    rows = []
    for name in sorted(METHODS, key=method_sort_key):
        for goal in sorted(method_class(name).speed_goals,
                           key=lambda g: (g.settings, list(SPEED_MEASURES).index(g.measure), g.context)):
            method = f"{name}:{goal.settings}" if goal.settings else name
            rows.append([f"`{method_text(method)}`", context_label(goal.context), goal.measure,
                         f"{'≤' if goal.lower_is_better else '≥'} {goal.bound:g}",
                         *(cell(gpu, method, goal) for gpu in gpus), goal.source])
    if not rows:
        return "No method declares a speed goal."
    header = ["method", "context", "measure", "goal", *gpus, "where the goal comes from"]
    note = ("Each method declares the speeds its design reaches (`speed_goals` on the method: "
            "`icecache.core.method.SpeedGoal`); a cell is the newest file of that GPU holding the method and the "
            "goal's reference at that context, and, where an earlier file of that GPU did better, its best, with "
            "its commit (the lent hosts' CPUs differ, and they bound the host-bound rows). tpot: TPOT over "
            "`full_static`'s; ttft: TTFT over `full`'s; tt2t: time to the second token over `full_static`'s "
            "(TTFT and TT2T of the last round), from the latency files; "
            "throughput: the best decode tokens per second over batch sizes over `full_static`'s best, from the "
            "throughput files; each ratio within one file. A ratio on one GPU is not the other's: their "
            "`full_static` and host CPUs differ.")
    return "\n\n".join([table(header, rows), note])


# The least relative change the regression gate calls a slowdown: two rounds of 64 steps rarely agree better.
MIN_NOISE = 0.05


def relative_spread(row: dict[str, Any]) -> float:
    """(max - min) / median of a summary row's rounds' TPOT; 0 when the row has one round."""
    median, low, high = row.get("tpot_s_median"), row.get("tpot_s_min"), row.get("tpot_s_max")
    if not median or low is None or high is None:
        return 0.0
    return (high - low) / median


def gate_key(row: dict[str, Any], f: Result) -> tuple:
    """What must match for two latency rows to be compared: model, budget, threads, context and method."""
    s = f.data.get("settings") or {}
    return (model_of(f), s.get("budget"), s.get("threads"), row["context"], method_text(row["method"]))


def regression_checks(results: Path) -> list[dict[str, Any]]:
    """For every newest latency row with a ``full_static`` beside it: its TPOT over ``full_static``'s against the
    best (lowest) such ratio of any earlier file with the same model, budget, threads and context. Ratios, not
    milliseconds, so that a host running slower on the day moves both sides. ``slower`` when the newest is above the
    best by more than the larger round spread of the two rows (at least ``MIN_NOISE``)."""
    ratios: dict[tuple, list[tuple[float, dict[str, Any], Result]]] = {}
    for f in load(results, "latency_*.json"):
        if is_scaling(f):
            continue
        for row in f.data["summary"]:
            base = reference_row(f, row["context"], "full_static")
            if base is None or not base.get("tpot_s_median") or row.get("tpot_s_median") is None:
                continue
            ratios.setdefault(gate_key(row, f), []).append((row["tpot_s_median"] / base["tpot_s_median"], row, f))
    checks = []
    for row, f in latency_rows(results):
        if row["method"] == "full_static":  # the reference every ratio is to
            continue
        measured = ratios.get(gate_key(row, f), [])
        newest = next((item for item in measured if item[2].name == f.name), None)
        if newest is None:
            continue
        earlier = [item for item in measured if item[2].order < f.order]
        best = min(earlier, key=lambda item: item[0]) if earlier else None
        noise = max(MIN_NOISE, relative_spread(row), relative_spread(best[1]) if best else 0.0)
        change = newest[0] / best[0] - 1 if best else None
        verdict = "first file" if best is None else ("slower" if change > noise else
                                                     ("faster" if change < -noise else "within noise"))
        checks.append({"row": row, "file": f, "ratio": newest[0], "best": best, "change": change, "noise": noise,
                       "verdict": verdict})
    return checks


def render_regression(results: Path, paper: dict[str, Any]) -> str:
    checks = regression_checks(results)
    rows = []
    for c in checks:
        best = c["best"]
        rows.append([
            str(c["row"]["context"]), method_cell(c["row"]["method"]), f"{c['ratio']:.2f}",
            "-" if best is None else f"{best[0]:.2f} (`{best[2].name}`, {best[2].commit_of(best[1])})",
            "-" if c["change"] is None else f"{c['change'] * 100:+.0f}%", f"{c['noise'] * 100:.0f}%",
            f"**{c['verdict']}**" if c["verdict"] == "slower" else c["verdict"],
        ])
    header = ["context", "method", "newest x full_static", "best earlier x full_static (file, commit)", "change",
              "noise", "verdict"]
    slower = [c for c in checks if c["verdict"] == "slower"]
    note = (f"{len(checks)} rows checked, {len(slower)} slower than their best earlier file beyond noise"
            + (": " + ", ".join(f"`{method_text(c['row']['method'])}` at {context_label(c['row']['context'])}"
                                for c in slower) if slower else "")
            + ". Noise is the larger relative spread (max-min over median) of the two rows' rounds, at least "
              f"{MIN_NOISE * 100:.0f}%.")
    return "\n\n".join([table(header, rows), note])


def render_regression_summary(results: Path, paper: dict[str, Any]) -> str:
    """One line: how many rows the regression gate checked, and which ones are slower than their best."""
    checks = regression_checks(results)
    slower = [c for c in checks if c["verdict"] == "slower"]
    listed = ", ".join(f"`{method_text(c['row']['method'])}` at {context_label(c['row']['context'])} "
                       f"({c['change'] * 100:+.0f}%, noise {c['noise'] * 100:.0f}%)" for c in slower)
    return (f"Regression gate: {len(checks)} newest latency rows checked against the best earlier file of the same "
            f"settings (TPOT over `full_static`'s); {len(slower)} slower beyond noise" + (f": {listed}." if listed
                                                                                         else ".")
            + " The table: docs/performance.md, \"Regression gate\".")


def context_label(tokens: Any) -> str:
    """4096 -> 4k, 7500 -> 7.5k (eval.report.accuracy.length_label)."""
    from eval.report.accuracy import length_label

    return length_label(tokens)


def render_scaling(results: Path, paper: dict[str, Any]) -> str:
    figure = paper.get("scaling") or {}
    paper_ms = figure.get("tpot_ms", {})
    rows = []
    chosen = latency_rows(results, scaling=True)
    for row, f in chosen:
        method = row["method"]
        ours = row.get("tpot_s_median")
        theirs = paper_ms.get(str(row["context"]), {}).get(method)
        rows.append([
            str(row["context"]), method_cell(method), fmt(ours, 1000), ratio_to(row, f, "full"),
            ratio_to(row, f, "full_static"), fmt(row.get("tt2t_s_median"), digits=1),
            fmt(row.get("peak_gpu_bytes"), 2**-30), fmt(row.get("cpu_kv_bytes"), 2**-30),
            fmt(row.get("host_kv_ratio"), digits=2), fmt(theirs, digits=0),
            fmt(None if ours is None or theirs is None else ours * 1000 / theirs, digits=2), f"`{f.name}`",
            f.commit_of(row),
        ])
    header = ["context", "method", "TPOT ms", "x full", "x full_static", "TT2T s", "peak GiB", "host KV GiB",
              "host / KV", "paper TPOT ms", "ours / paper", "file", "commit"]
    used = sorted({f.name: f for _, f in chosen}.values(), key=lambda f: f.order)
    note = (f"The paper's column is its scaling figure ({figure.get('model')}, {figure.get('task')}, "
            f"{figure.get('hardware')}); its full cache is not said to be a static one. Ratios are to `full` and "
            f"`full_static` measured in the same file (one process per context).")
    return "\n\n".join([table(header, rows), note, sources(used)])


def paper_scaling_tpots(paper: dict[str, Any]) -> tuple[dict[tuple[str, int], float], list[str]]:
    """The paper's scaling figure as {(method, context): TPOT ms}, and its methods in display order."""
    figure = paper.get("scaling") or {}
    theirs = {(method, int(context)): ms for context, values in (figure.get("tpot_ms") or {}).items()
              for method, ms in values.items()}
    return theirs, sorted({method for method, _ in theirs}, key=method_sort_key)


def render_scaling_summary(results: Path, paper: dict[str, Any]) -> str:
    """The scaling table one line per context: each method's TPOT beside the paper's."""
    chosen = latency_rows(results, scaling=True)
    contexts = sorted({row["context"] for row, _ in chosen})
    methods = sorted({method_text(row["method"]) for row, _ in chosen}, key=method_sort_key)
    ours = {(method_text(row["method"]), row["context"]): row.get("tpot_s_median") for row, _ in chosen}
    figure = paper.get("scaling") or {}
    theirs, paper_methods = paper_scaling_tpots(paper)
    rows = [[context_label(c), *(fmt(ours.get((m, c)), 1000) for m in methods),
             *(fmt(theirs.get((m, c)), digits=0) for m in paper_methods)] for c in contexts]
    header = ["context", *(f"`{m}` TPOT ms" for m in methods), *(f"paper `{m}`" for m in paper_methods)]
    note = (f"The paper's columns are its scaling figure ({figure.get('model')}, {figure.get('task')}, "
            f"{figure.get('hardware')}). Every cell's file and commit, ratios, TT2T and memory: docs/performance.md, "
            f"\"Scaling in detail\".")
    return "\n\n".join([table(header, rows), note])


def render_other_gpus_scaling(results: Path, paper: dict[str, Any]) -> str:
    """The scaling experiment on GPUs other than the main table's (its files in a folder of results/bench/): per GPU
    and context the newest row of each method, its TPOT with the ratio to `full_static` of its own file, beside
    the paper's scaling figure."""
    files = [f for f in load(results, "*/latency_*.json") if is_scaling(f)]
    if not files:
        return "None: no scaling file in a `results/bench/<folder>/`."
    def gpu(f: Result) -> str:
        return str(f.provenance.get("gpu") or f.host)

    newest = newest_by([((gpu(f), row["context"], method_text(row["method"])), f.order, (row, f))
                        for f in files for row in f.data["summary"]])
    # A method that did not fit its GPU or host at a context (the latency file's out_of_memory), where no newer file
    # measured it there
    gave_out = newest_by([((gpu(f), o["context"], method_text(o["method"])), f.order, (o, f))
                          for f in files for o in f.data.get("out_of_memory", [])])
    methods = sorted({method for _, _, method in [*newest, *gave_out]}, key=method_sort_key)
    figure = paper.get("scaling") or {}
    theirs, paper_methods = paper_scaling_tpots(paper)
    rows = []
    for name, context in sorted({(name, context) for name, context, _ in [*newest, *gave_out]}):
        cells, used, commits = [], {}, set()
        for method in methods:
            row, f = newest.get((name, context, method), (None, None))
            oom, oom_file = gave_out.get((name, context, method), (None, None))
            if oom is not None and (row is None or oom_file.order > f.order):
                used[oom_file.name] = oom_file
                commits.add(oom_file.commit_of_process(oom.get("process", 0)))
                cells.append("out of " + ("host" if oom.get("error", "").startswith("host") else "GPU") + " memory")
                continue
            if row is None:
                cells.append("-")
                continue
            used[f.name] = f
            commits.add(f.commit_of(row))
            ratio = ratio_to(row, f, "full_static")
            cells.append(fmt(row.get("tpot_s_median"), 1000) + ("" if ratio == "-" else f" ({ratio}x)"))
        rows.append([name, context_label(context), *cells,
                     *(fmt(theirs.get((m, context)), digits=0) for m in paper_methods),
                     ", ".join(f"`{f.path.parent.name}/{f.name}`" for f in used.values()),
                     ", ".join(sorted(commits))])
    header = ["GPU", "context", *(f"`{m}` TPOT ms (x full_static)" for m in methods),
              *(f"paper `{m}`" for m in paper_methods), "file", "commit"]
    note = (f"The newest row of each method per GPU and context from the scaling files in results/bench's folders "
            f"(the table above reads results/bench/ itself); each ratio is to the `full_static` of the row's own file "
            f"(one process per context). The paper's columns: its scaling figure ({figure.get('model')}, "
            f"{figure.get('task')}, {figure.get('hardware')}).")
    return "\n\n".join([table(header, rows), note])


def render_paper_scaling(paper: dict[str, Any]) -> str:
    scaling = paper.get("scaling")
    if not scaling:
        return ""
    cells = "; ".join(
        f"{int(context) // 1000}k: {values.get('full')} / {values.get('icecache')} / {values.get('icecache_reuse')} ms"
        for context, values in sorted(scaling["tpot_ms"].items(), key=lambda item: int(item[0]))
    )
    return (f"The paper's scaling figure ({scaling['model']}, {scaling['task']}, {scaling['hardware']}), decode "
            f"latency per token of full / `icecache` / `icecache_reuse`: {cells}.")


# --------------------------------------------------------------------------------------------------------------
# The largest context each method reaches: projected from the measured memory


# What one host offers (GiB): the GPU's memory, and the host memory left to one process (3 GiB kept for the OS).
CAPACITY_GIB = {"h200": {"gpu": 139.0, "host": 125.0}}


def prefill_settings(f: Result) -> tuple:
    """What shapes a run's peak GPU memory besides the context: the prefill's chunking and the budget."""
    s = f.data.get("settings") or {}
    return (s.get("prefill_chunk_size"), bool(s.get("layer_by_layer")), bool(s.get("residual_on_host")),
            s.get("budget"))


def model_of(f: Result) -> str:
    s = f.data.get("settings") or {}
    return str(s.get("model_name") or s.get("model") or "?")


def host_bytes(row: dict[str, Any], f: Result) -> float:
    """The host memory a run needs: its cache's host bytes over the process's resident memory with the full cache
    (``full_static``) in the same file, where the file has it (the process-wide resident memory of a later run
    also holds what earlier runs of the process left)."""
    base = reference_row(f, row["context"], "full_static") or {}
    return float(row.get("cpu_kv_bytes") or 0) + float(base.get("host_rss_bytes") or 0)


def capacity_points(files: list[Result]) -> dict[tuple[str, str], tuple[list[tuple[dict[str, Any], Result]], int]]:
    """Per (model, method) the rows a memory fit uses, and how many commits they span: among the files with the
    prefill settings of its newest measurement, the newest commit that measured it at two or more contexts, else
    the newest row of each context; a method measured at one context only is left out."""
    by_method: dict[tuple[str, str], list[tuple[dict[str, Any], Result]]] = {}
    for f in files:
        model = model_of(f)
        for row in f.data["summary"]:
            if ":" not in row["method"] and row.get("peak_gpu_bytes"):
                by_method.setdefault((model, row["method"]), []).append((row, f))
    chosen = {}
    for key, rows in by_method.items():
        newest_settings = prefill_settings(max(rows, key=lambda item: item[1].order)[1])
        rows = [(r, f) for r, f in rows if prefill_settings(f) == newest_settings]
        by_commit = {commit: newest_by([(r["context"], f.order, (r, f)) for r, f in rows if f.commit == commit])
                     for commit in {f.commit for _, f in rows}}
        fits = [points for points in by_commit.values() if len(points) >= 2]
        if fits:
            points = max(fits, key=lambda p: max(f.order for _, f in p.values()))
            chosen[key] = (sorted(points.values(), key=lambda item: item[0]["context"]), 1)
            continue
        newest = newest_by([(r["context"], f.order, (r, f)) for r, f in rows])
        if len(newest) >= 2:
            points = sorted(newest.values(), key=lambda item: item[0]["context"])
            chosen[key] = (points, len({f.commit for _, f in points}))
    return chosen


def longer_measurement(files: list[Result], model: str, method: str,
                       points: list[tuple[dict[str, Any], Result]]) -> tuple[dict[str, Any], Result] | None:
    """The newest row of ``method`` at the longest context past the fitted ``points``, measured with their prefill
    settings; None if there is none."""
    settings, longest = prefill_settings(points[-1][1]), max(r["context"] for r, _ in points)
    rows = [(r, f) for f in files if model_of(f) == model and prefill_settings(f) == settings
            for r in f.data["summary"] if r["method"] == method and r["context"] > longest and r.get("peak_gpu_bytes")]
    return max(rows, key=lambda item: (item[0]["context"], item[1].order)) if rows else None


def line_fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares intercept and slope."""
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / sum((x - mean_x) ** 2 for x in xs)
    return mean_y - slope * mean_x, slope


def file_gpus(f: Result) -> list[str]:
    """The GPUs a file was measured on: its own, then those of the runs that resumed it, each once."""
    names = [f.provenance.get("gpu") or (f.data.get("settings") or {}).get("device_resolved") or "?"]
    names += [(run.get("provenance") or {}).get("gpu") for run in f.data.get("resumed_by", [])]
    return list(dict.fromkeys(str(name) for name in names if name))


def render_throughput(results: Path, paper: dict[str, Any]) -> str:
    """Per model, context and way of running a batch's rows (side by side on streams of their own, the default, or
    in turn: ``--rows-in-turn``), from the newest throughput file that measured it (``full_static`` in the same
    file): decode tokens per second at each batch size, the limit, and the best over ``full_static``'s best."""
    tables = throughput_tables(load(results, "throughput_*.json"))
    return "\n\n".join(tables) or ("No throughput file yet: `python scripts/bench/throughput.py` on a GPU host "
                                    "writes one.")


def render_other_gpus_throughput(results: Path, paper: dict[str, Any]) -> str:
    """``render_throughput``'s tables for the throughput files in results/bench's folders (GPUs other than the main
    tables'), per GPU as well."""
    tables = throughput_tables(load(results, "*/throughput_*.json"), per_gpu=True)
    return "\n\n".join(tables) or "None: no `results/bench/<folder>/throughput_*.json`."


def fitted_unmeasured(f: Result, context: int, method: str, largest: int) -> int:
    """How many rows a method's failed prefill left fitted without a measured batch of them (0 if none)."""
    fitted = [lim.get("rows_prefilled") or 0 for lim in f.data.get("limits", [])
              if lim["context"] == context and lim["method"] == method and lim.get("stage") == "prefill"]
    return max(fitted, default=0) if max(fitted, default=0) > largest else 0


def host_reads(row: dict[str, Any] | None) -> str:
    """What a batch's step copied into GPU memory and the rate that is over its median step ("-" where the file
    predates the count or the method copies nothing)."""
    moved = (row or {}).get("bytes_to_gpu_per_step")
    if not moved or not row.get("tpot_s"):
        return "-"
    return f"{moved / 1e6:,.0f}, {moved / row['tpot_s'] / 1e9:.1f}"


def link_note(settings: dict[str, Any]) -> str:
    """The file's link probe (core.link_probe) in one sentence, or nothing where it has none."""
    link = settings.get("link") or {}
    if "dma_gbps" not in link:
        return ""
    blocks = ", ".join(f"{int(size) // 1024} KB {by_order['random']:.0f}" for size, by_order in
                       sorted(link.get("zero_copy_gbps", {}).items(), key=lambda item: int(item[0])))
    return (f" This host's GPU reads pinned host memory at {link['dma_gbps']:.0f} GB/s with its copy engines and, "
            f"with the methods' zero-copy block copy from scattered blocks, at {blocks} GB/s (`link`, "
            f"scripts/bench/link.py).")


def throughput_tables(files: list[Result], per_gpu: bool = False) -> list[str]:
    """One table per model, context, way of running the rows (and GPU, ``per_gpu``): the newest file's."""
    def gpu(f: Result) -> str:
        return " + ".join(file_gpus(f)) if per_gpu else ""

    def groups(f: Result) -> int:
        return int((f.data.get("settings") or {}).get("row_groups") or 1)

    newest = newest_by([((gpu(f), model_of(f), row["context"],
                          bool((f.data.get("settings") or {}).get("row_streams")), groups(f)), f.order, f)
                        for f in files for row in f.data.get("rows", [])])
    parts = []
    for (_, model, context, side_by_side, n_groups), f in sorted(newest.items(), key=lambda item: item[0]):
        rows = [r for r in f.data["rows"] if r["context"] == context]
        batches = sorted({r["batch_size"] for r in rows})
        summary = [e for e in f.data.get("summary", []) if e["context"] == context]
        lines = []
        reference_short = 0
        # A variant (``shadowkv:batch_kernels=false``) has its base method's label: rows go by the recorded method.
        for entry in sorted(summary, key=lambda e: method_sort_key(e.get("method", e["method_label"]))):
            method = entry.get("method", entry["method_label"])
            by_batch = {r["batch_size"]: r for r in rows if r.get("method", r["method_label"]) == method}
            limit = (f"{entry['failure']} memory at {entry['first_failed_batch']}" if entry.get("failure")
                     else f"none up to {entry['largest_batch']}")
            unmeasured = fitted_unmeasured(f, context, method, entry["largest_batch"])
            if unmeasured:
                limit += f" ({unmeasured} fitted, not measured)"
                if method == "full_static":
                    reference_short = unmeasured
            best = (f"{entry['best_tokens_per_s']:.0f} ({entry['best_batch']})" if entry.get("best_tokens_per_s")
                    else "-")
            ratio = entry.get("best_over_reference")
            largest = by_batch.get(entry["largest_batch"], {})
            peak, host = largest.get("peak_gpu_bytes"), largest.get("host_rss_bytes")
            lines.append([method_cell(method),
                          *(fmt(by_batch[b]["tokens_per_s"], digits=0) if b in by_batch else "-" for b in batches),
                          best, "-" if ratio is None else f"{ratio:.2f}x", limit,
                          f"{'-' if peak is None else f'{peak / 2**30:.0f}'} / "
                          f"{'-' if host is None else f'{host / 2**30:.0f}'}",
                          str(entry.get("flattens_after_batch") or "-"),
                          host_reads(by_batch.get(entry.get("best_batch")))])
        header = ["method", *(f"B={b}" for b in batches), "best tok/s (batch)", "x full_static's best", "out of memory",
                  "at the largest: peak GPU / host GiB", "+<10% after", "from host at best: MB/step, GB/s"]
        settings = f.data.get("settings") or {}
        rows_run = (", the rows side by side on streams of their own" if side_by_side
                    else ", the rows in turn on the model's stream (`--rows-in-turn`; a file that records no "
                         "`row_streams` ran them so)")
        if n_groups > 1:
            rows_run += (f", the methods with one launch for all rows (`decode_rows`) in {n_groups} groups of rows, "
                         f"a launch each (`--row-groups {n_groups}`)")
        name = f"{f.path.parent.name}/{f.name}" if per_gpu else f.name
        gpus = file_gpus(f)
        machine = gpus[0] if len(gpus) == 1 else (f"resumed across GPUs ({' + '.join(gpus)}): its ratios are not "
                                                  f"one machine's")
        unfinished = ("" if f.data.get("complete", True) else
                      " The run ended before its last batch (its time ran out): a method's sizes past its last "
                      "column were not measured, so its limit is where it stopped.")
        note = (f"{model} at {context_label(context)} tokens, budget {settings.get('budget')}, "
                f"{settings.get('decode_steps')} steps per batch{rows_run}; `{name}`, commit {f.commit}, "
                f"{machine}. Decode tokens per second (batch / median step).{unfinished}{link_note(settings)}")
        if reference_short:
            note += (f" `full_static`'s {reference_short} rows that fit were not measured (their decode ran out of "
                     f"memory after the failed prefill), so its best here is below what it holds and the ratios "
                     f"overstate.")
        parts.append(note + "\n\n" + table(header, lines))
    return parts


def render_capacity(results: Path, paper: dict[str, Any]) -> str:
    files = [f for f in load(results, "latency_*.json") if f.host in CAPACITY_GIB]
    fitted = capacity_points(files)
    rows = []
    for (model, method), (points, n_commits) in sorted(fitted.items(),
                                                       key=lambda item: (item[0][0], method_sort_key(item[0][1]))):
        capacity = CAPACITY_GIB[points[-1][1].host]
        contexts = [float(r["context"]) for r, _ in points]
        bounds, slopes, lines = {}, {}, {}
        for part, needed in (("gpu", lambda r, f: float(r["peak_gpu_bytes"])), ("host", host_bytes)):
            intercept, slope = lines[part] = line_fit(contexts, [needed(r, f) for r, f in points])
            # A part that does not grow with the context (the full caches' host memory) bounds nothing.
            slopes[part] = slope if slope >= 1024 else 0.0  # bytes per token
            bounds[part] = (capacity[part] * 2**30 - intercept) / slope if slopes[part] else None
        reached = [(value, part) for part, value in bounds.items() if value is not None]
        largest, bound = min(reached) if reached else (None, "-")
        check = longer_measurement(files, model, method, points)
        if check is None:
            checked = "-"
        else:
            row, f = check
            predicted = [lines[part][0] + lines[part][1] * row["context"] for part in ("gpu", "host")]
            measured = [float(row["peak_gpu_bytes"]), host_bytes(row, f)]
            checked = (f"{row['context'] // 1000}k: GPU {fmt(predicted[0], 2**-30)} / {fmt(measured[0], 2**-30)}, "
                       f"host {fmt(predicted[1], 2**-30)} / {fmt(measured[1], 2**-30)} (`{f.name}`)")

        def tokens(value: float | None) -> str:
            return "-" if value is None else f"{value / 1000:,.0f}k"

        rows.append([
            model, method_cell(method), ", ".join(f"{int(c) // 1000}k" for c in contexts),
            fmt(slopes["gpu"] * 1e5, 2**-30, 2), fmt(slopes["host"] * 1e5, 2**-30, 2),
            tokens(bounds["gpu"]), tokens(bounds["host"]), tokens(largest), bound,
            ", ".join(sorted({f"`{f.name}`" for _, f in points}))
            + (f" ({n_commits} commits)" if n_commits > 1 else ""), checked,
        ])
    header = ["model", "method", "contexts fitted", "GPU GiB / 100k tokens", "host GiB / 100k tokens",
              "GPU-bound context", "host-bound context", "largest context", "bound", "files",
              "line / measured past the fit (GiB)"]
    caps = "; ".join(f"{host}: GPU {c['gpu']:.0f} GiB, host {c['host']:.0f} GiB" for host, c in CAPACITY_GIB.items())
    measured = {(model_of(f), r["method"]) for f in files for r in f.data["summary"] if ":" not in r["method"]}
    single = sorted(f"{method_cell(method)} ({model})" for model, method in measured - set(fitted))
    note = (f"Projected, not measured: a straight line through each method's peak GPU memory and host memory at the "
            f"contexts it was measured at with one prefill setting (the newest commit with two or more contexts; "
            f"else the newest row per context), solved for the capacity ({caps}). Host memory is the cache's host "
            f"bytes plus the process's resident memory with `full_static` in the same file. Past the fitted "
            f"range the line ignores what a longer prompt adds besides KV (larger pinned staging, allocator "
            f"rounding). The last column checks the line where the method was measured past the fitted contexts "
            f"(the longest such context, same prefill settings): the line's value beside the measured one.")
    if single:
        note += " Measured at one context only, so not projected: " + ", ".join(single) + "."
    return "\n\n".join([table(header, rows), note])


# --------------------------------------------------------------------------------------------------------------
# IceCache's decode breakdown and memory


def model_spec(settings: dict[str, Any]) -> dict[str, Any] | None:
    """The model config a latency file names (configs/model/<model>.yaml), None where there is none."""
    path = REPO / "configs" / "model" / f"{settings.get('model')}.yaml"
    if not path.is_file():
        return None
    import yaml

    return yaml.safe_load(path.read_text(encoding="utf-8")) or {}


def model_weight_bytes(settings: dict[str, Any]) -> int | None:
    """Bytes of a Llama- or Mistral-architecture model's weights from its config (configs/model/<model>.yaml)."""
    spec = model_spec(settings)
    if spec is None:
        return None
    c = spec.get("config") or {}
    if spec.get("architecture") not in ("llama", "mistral") or "hidden_size" not in c:
        return None
    hidden, layers, vocab = c["hidden_size"], c["num_hidden_layers"], c["vocab_size"]
    head_dim = c.get("head_dim") or hidden // c["num_attention_heads"]
    attention = hidden * head_dim * (2 * c["num_attention_heads"] + 2 * c["num_key_value_heads"])
    per_layer = attention + 3 * hidden * c["intermediate_size"] + 2 * hidden
    embeddings = vocab * hidden * (1 if c.get("tie_word_embeddings") else 2)
    n_bytes = {"torch.bfloat16": 2, "torch.float16": 2, "torch.float32": 4}.get(settings.get("dtype_resolved"))
    return None if n_bytes is None else n_bytes * (layers * per_layer + embeddings + hidden)


def model_layers(settings: dict[str, Any]) -> int | None:
    """The model's layer count from its config (configs/model/<model>.yaml)."""
    spec = model_spec(settings)
    return None if spec is None else (spec.get("config") or {}).get("num_hidden_layers")


def handoff_costs(f: Result, results: Path) -> tuple[dict[str, Any] | None, str]:
    """The hand-off probe's costs a latency file recorded in its settings, else the newest probe file of its host;
    with where they come from."""
    costs = (f.data.get("settings") or {}).get("handoff_costs")
    if costs and "us_per_layer_over_floor" in costs:
        return costs, "same file"
    probes = [g for g in load(results, "handoff_*.json") if g.host == f.host]
    return (probes[-1].data, f"`{probes[-1].name}`") if probes else (None, "-")


def render_floor(results: Path, paper: dict[str, Any]) -> str:
    """IceCache's measured step beside what its design needs on the same host: the transformer (``full_static``'s
    step in the same file), the searches reading their bytes at the host's read rate (same file), and one hand-off
    through the channel with a 1 MB exchange each way per indexed layer (the hand-off probe)."""
    from icecache.method.config import IceCacheConfig

    rows = []
    for row, f in latency_rows(results):
        if split_method(row["method"])[0] not in ICECACHE_METHODS or not row.get("tpot_s_median"):
            continue
        base = reference_row(f, row["context"], "full_static")
        settings = f.data.get("settings") or {}
        layers = model_layers(settings)
        read_gbps = settings.get("host_read_gbps")
        search_bytes = row.get("search_bytes_read_per_step")
        costs, source = handoff_costs(f, results)
        if base is None or layers is None or not read_gbps or not search_bytes or costs is None:
            continue
        indexed = layers - IceCacheConfig.n_dense_layers
        over = costs["us_per_layer_over_floor"]
        handoff_s = indexed * over.get("stream_memory_native", float("nan")) * 1e-6
        exchange_s = indexed * over.get("copies_1048576", float("nan")) * 1e-6
        search_s = search_bytes / (read_gbps * 1e9)
        floor = base["tpot_s_median"] + search_s + handoff_s + exchange_s
        phases = row.get("phases_s") or {}
        rows.append([
            str(row["context"]), method_cell(row["method"]), fmt(row["tpot_s_median"], 1000),
            f"{row['tpot_s_median'] / base['tpot_s_median']:.2f}",
            " / ".join(fmt(phases.get(name), 1000) for name in ("query", "load", "model")),
            fmt(base["tpot_s_median"], 1000), fmt(search_s, 1000), fmt(handoff_s, 1000, 2), fmt(exchange_s, 1000),
            fmt(floor, 1000), f"{floor / base['tpot_s_median']:.2f}",
            f"{row['tpot_s_median'] / floor:.2f}", f"`{f.name}`", source,
        ])
    header = ["context", "method", "TPOT ms", "x full_static", "query / load / model ms", "transformer ms",
              "search at host read rate ms", "hand-offs ms", "1 MB exchanges ms", "floor ms", "floor x full_static",
              "TPOT / floor", "file", "hand-off probe"]
    note = ("The floor adds, to `full_static`'s step in the same file, the step's searches reading the bytes they "
            "read (`search MB / step` in the breakdown) at the host's read rate measured in the same run (a 2 GiB "
            "sum on the same threads), and per indexed layer (the model's layers less the dense ones) one hand-off "
            "through the stream-memory channel and a 1 MB copy each way (the hand-off probe: IceCache's exchange "
            "sends about 20 KB to the host and 0.8 MB back, so this is an upper bound). It leaves out the page "
            "gather on the host and the window's inserts, which are part of the design too.")
    return "\n\n".join([table(header, rows), note])


def render_breakdown(results: Path, paper: dict[str, Any]) -> str:
    rows = []
    for row, f in latency_rows(results):
        if split_method(row["method"])[0] not in ICECACHE_METHODS:
            continue
        phases = row.get("phases_s") or {}
        # Phases with a median of zero (insert: one step in 16) are left out.
        named = {k: v for k, v in phases.items() if k not in ("query", "load", "model") and v >= 5e-5}
        parts = sum(phases.values())
        weights = model_weight_bytes(f.data.get("settings", {}))
        peak = row.get("peak_gpu_bytes")
        rows.append([
            str(row["context"]), method_cell(row["method"]), fmt(row.get("tpot_s_median"), 1000),
            fmt(phases.get("query"), 1000), fmt(phases.get("load"), 1000), fmt(phases.get("model"), 1000),
            " ".join(f"{k} {fmt(v, 1000)}" for k, v in sorted(named.items())) or "-",
            fmt(parts / row["tpot_s_median"] if row.get("tpot_s_median") else None, digits=2),
            fmt(row.get("pages_loaded_per_step"), digits=0), fmt(row.get("bytes_to_gpu_per_step"), 1e-6),
            fmt(row.get("gpu_kv_bytes"), 2**-20, 0), fmt(row.get("cpu_kv_bytes"), 2**-30),
            fmt(row.get("host_kv_ratio"), digits=2), fmt(row.get("host_rss_added_bytes"), 2**-30),
            fmt(row.get("search_bytes_read_per_step"), 1e-6, 0), fmt(row.get("search_gbps"), digits=1),
            fmt(row.get("search_share_of_host_read"), digits=2),
            fmt(peak, 2**-30), fmt(None if peak is None or weights is None else peak - weights, 1e-9, 2),
            f"`{f.name}`", f.commit,
        ])
    figure = paper.get("breakdown")
    if figure:
        ms = figure["ms"]
        rows.append([
            f"paper, ~{figure['context_tokens'] // 1000}k", f"`{figure['method']}`", fmt(ms.get("total"), digits=0),
            fmt(ms.get("query"), digits=0), fmt(ms.get("load"), digits=0),
            f"{fmt(ms.get('decoding'), digits=0)} (decoding)",
            f"other {fmt(ms.get('other'), digits=0)}", "-", "-", "-", "-", "-", "-", "-", "-", "-", "-", "-", "-",
            figure["hardware"], "-",
        ])
    header = ["context", "method", "TPOT ms", "query ms", "load ms", "model ms", "other phases ms", "parts / TPOT",
              "blocks loaded / step", "MB to GPU / step", "GPU KV MiB", "host KV GiB", "host / KV", "RSS added GiB",
              "search MB / step", "search GB/s", "search / host read", "peak GiB",
              "peak - weights GB", "file", "commit"]
    return table(header, rows)


# --------------------------------------------------------------------------------------------------------------
# Host work per layer: decode step, prompt job


def render_host_step(results: Path, paper: dict[str, Any]) -> str:
    files = load(results, "host_step_*.json")
    # Files before --variants timed the one setting of their process, not recorded ("-").
    newest = newest_by([((f.host, f.data["threads"], f.data["length"], v.get("kernel_settings", "-")), f.order, (v, f))
                        for f in files for v in f.data.get("variants", [f.data])])
    rows = []
    for (host, threads, length, kernels), (v, f) in sorted(newest.items()):
        ms = v["median_ms"]
        rows.append([host, str(threads), str(length), kernels if kernels == "-" else f"`{kernels}`",
                     fmt(ms.get("search"), digits=2), fmt(ms.get("stage"), digits=2), fmt(ms.get("rest"), digits=2),
                     fmt(ms.get("host_step"), digits=2), str(f.data["steps"]), f"`{f.name}`", f.commit])
    header = ["host", "threads", "context", "kernels (ISA:prefetch:chunk:level)", "search ms", "diff + gather ms",
              "rest ms", "host step ms", "steps", "file", "commit"]
    return table(header, rows)


def render_prompt_index(results: Path, paper: dict[str, Any]) -> str:
    files = load(results, "prompt_index_*.json")
    newest = newest_by([((f.host, f.data["threads"], entry["length"]), f.order, (entry, f))
                        for f in files for entry in f.data["results"]])
    rows = []
    for (host, threads, length), (entry, f) in sorted(newest.items()):
        seconds = entry["seconds"]

        def part(name: str, seconds: dict = seconds) -> str:  # files from before the single host copy time a page
            return spread(seconds[name]) if seconds.get(name) else "-"  # rewrite and a float32 copy

        rows.append([host, str(threads), str(length), spread(seconds["job_total"]), spread(seconds["build"]),
                     part("token_store"), part("rewrite"), part("to_float32"), str(len(seconds["job_total"])),
                     f"`{f.name}`", f.commit])
    latency = paper.get("latency", {})
    tt2t = latency.get("tt2t_s", {}).get("icecache")
    if tt2t is not None:
        rows.append([f"paper ({latency.get('hardware')})", "64", f"~{latency.get('context_tokens')}",
                     f"< {tt2t / 30:.2f} (TT2T {tt2t} s over 30 layers)", "-", "-", "-", "-", "-", "-", "-"])
    header = ["host", "threads", "context", "job s", "build s", "token store s", "page rewrite s", "float32 copy s",
              "rounds", "file", "commit"]
    return table(header, rows)


# --------------------------------------------------------------------------------------------------------------
# DCI index, kernels


def binding(f: Result) -> str:
    """How a file's OpenMP threads were bound (``OMP_PROC_BIND``, with ``OMP_PLACES``); files from before the
    provenance recorded it ran with the documented ``OMP_PROC_BIND=false``."""
    bind = f.provenance.get("omp_proc_bind", "false") or "unset"
    places = f.provenance.get("omp_places")
    return f"{bind} ({places})" if places else bind


def render_dci(results: Path, paper: dict[str, Any]) -> str:
    files = load(results, "dci_*.json")
    # Files before the kernel variants searched float32 keys with the build's one kernel set.
    # Files before --query-dtype scored float32 queries.
    newest = newest_by([((f.host, row["n"], row["threads"], row.get("score_precision") or "float32", binding(f),
                          row.get("key_dtype", "float32"), row.get("query_dtype", "float32"), row.get("variant", "-")),
                         f.order, (row, f))
                        for f in files for row in f.data["rows"]])
    rows = []
    for (host, n, threads, precision, bound, key_dtype, query_dtype, variant), (row, f) in sorted(newest.items()):
        kernels = f"`{variant}`" if variant != "-" else "-"
        dtypes = key_dtype if query_dtype == "float32" else f"{key_dtype} (queries {query_dtype})"
        rows.append([host, str(n), dtypes, str(threads), bound, precision, kernels, fmt(row["build_s"], digits=3),
                     fmt(row["query_ms"], digits=3), fmt(row.get("read_share"), digits=2),
                     fmt(row["exact_ms"], digits=2), fmt(row["page_recall"], digits=3),
                     fmt(row["token_recall"], digits=3), fmt(row["mass_recall"], digits=3), f"`{f.name}`", f.commit])
    figure = paper.get("breakdown")
    if figure:
        per_layer = figure["ms"]["query"] / 30
        rows.append([f"paper ({figure['hardware']})", f"~{figure['context_tokens']}", "-", "64", "-", "-", "-", "-",
                     f"~{per_layer:.1f} ({figure['ms']['query']} ms per token over 30 layers)", "-", "-", "-", "-",
                     "-", "-", "-"])
    header = ["host", "keys", "key dtype", "threads", "threads bound", "first pass",
              "kernels (ISA:prefetch:chunk[:level])",
              "build s / layer", "query ms / layer", "search / host read", "exact top-k ms (torch)",
              "page recall", "token recall", "mass recall", "file", "commit"]
    return table(header, rows)


def render_kernels(results: Path, paper: dict[str, Any]) -> str:
    newest = newest_by([((f.host,), f.order, f) for f in load(results, "kernels_*.json")])
    rows = []
    for (host,), f in sorted(newest.items()):
        for a in f.data.get("attention", []):
            comparison = (f"dense SDPA {fmt(a.get('sdpa_dense_us'))}, "
                          f"PyTorch reference {fmt(a.get('reference_us'), digits=0)}")
            rows.append([host, "paged decode attention", f"{a['n_pages']} pages, {a['n_tokens']} tokens / KV head",
                         fmt(a.get("triton_host_us")), fmt(a.get("triton_graph_us")), comparison, f"`{f.name}`",
                         f.commit])
        for b in f.data.get("bulk_loader", []):
            host_us = b.get("load_host_us", b.get("total_us"))
            rows.append([host, "bulk load", f"{b['load']}, {b['bytes'] / 2**10:.0f} KiB", fmt(host_us),
                         f"{fmt(b.get('h2d_copy_us'))} (copy)",
                         f"gather {fmt(b.get('gather_us'))}, scatter {fmt(b.get('scatter_us'))}",
                         f"`{f.name}`", f.commit])
        for c in f.data.get("page_copies", []):
            rows.append([host, "page scatter", f"{c['load']}, {c['bytes'] / 2**10:.0f} KiB",
                         fmt(c.get("scatter_host_us")), fmt(c.get("scatter_us")),
                         f"block copy from mapped host memory {fmt(c.get('copy_blocks_mapped_us'))}, from device "
                         f"{fmt(c.get('copy_blocks_device_us'))}; raw H2D copy {fmt(c.get('h2d_copy_us'))}",
                         f"`{f.name}`", f.commit])
    header = ["host", "kernel", "size", "host µs / call", "GPU µs", "for comparison, µs", "file", "commit"]
    return table(header, rows)


# --------------------------------------------------------------------------------------------------------------
# CPU accuracy


def run_overrides(run: dict[str, Any]) -> dict[str, str]:
    """The ``key=value`` arguments of the run's command line."""
    words = shlex.split(str(run.get("provenance", {}).get("command") or ""))
    return dict(word.split("=", 1) for word in words if "=" in word and not word.startswith("-"))


def config_defaults() -> dict[str, str]:
    """The run config's default model (its name) and budget, for run records that do not carry them."""
    import yaml

    config = yaml.safe_load((REPO / "configs" / "config.yaml").read_text(encoding="utf-8"))
    choices = {k: v for entry in config["defaults"] if isinstance(entry, dict) for k, v in entry.items()}
    model = yaml.safe_load((REPO / "configs" / "model" / f"{choices['model']}.yaml").read_text(encoding="utf-8"))
    return {"model": model["name"], "budget": str(config["budget"]), "task": choices["task"]}


def run_key(run: dict[str, Any]) -> tuple[str, str, str, str, str]:
    """(task, model, method, budget, the command line's other result-changing settings) of one run record; what a
    record lacks is taken from its command line, else from the run config's defaults (budget marked so)."""
    overrides, settings, defaults = run_overrides(run), run.get("settings", {}), config_defaults()
    task = run.get("task") or settings.get("task", {}).get("name") or overrides.get("task", defaults["task"])
    model = run.get("model") or settings.get("model", {}).get("name") or overrides.get("model", defaults["model"])
    method = run.get("method") or settings.get("method", {}).get("name") or overrides.get("method", "?")
    budget = run.get("budget") or settings.get("method", {}).get("budget") or overrides.get("budget")
    if method in REFERENCES:
        budget = "-"  # the full caches ignore it
    elif budget is None:
        budget = f"{defaults['budget']} (default)"
    protocol = " ".join(f"{k}={v}" for k, v in overrides.items() if k not in NOT_PROTOCOL)
    return task, model, method, str(budget), protocol


def per_task(metrics: dict[str, Any]) -> str:
    tasks = metrics.get("tasks")
    if isinstance(tasks, dict):
        return ", ".join(f"{task} {' / '.join(f'{v:g}' for v in by_length.values())}"
                         for task, by_length in tasks.items())
    by_length = metrics.get("by_length")
    if isinstance(by_length, dict) and len(by_length) > 1:
        return ", ".join(f"{length}: {v:g}" for length, v in by_length.items())
    return "-"


def published(task: str, method: str, paper: dict[str, Any]) -> str:
    if task != "passkey":
        return "-"
    cells = []
    for entry in paper.get("baseline_papers", {}).get("passkey", []):
        if method in entry.get("score_pct", {}):
            cells.append(f"{entry['score_pct'][method]:g} ({entry['paper']}, {entry['model']}, "
                         f"{entry['context_tokens'] // 1000}k, budget {entry['budget']})")
        elif method in entry.get("score_pct_range", {}):
            low, high = entry["score_pct_range"][method]
            cells.append(f"{low:g}-{high:g} ({entry['paper']}, {entry['model']}, {entry['context']}, "
                         f"budgets {entry['budget']})")
    return "; ".join(cells) or "-"


def render_cpu_accuracy(results: Path, paper: dict[str, Any]) -> str:
    files = load(results, "cpu_accuracy*.json")
    items = []
    for f in files:
        for run in f.data.get("runs", []):
            order = (str(run.get("provenance", {}).get("date") or ""), f.name)
            items.append((run_key(run), order, (run, f)))
    newest = newest_by(items)
    rows = []
    for key in sorted(newest, key=lambda k: (k[0], method_sort_key(k[2]), k[3], k[4])):
        task, model, method, budget, protocol = key
        run, f = newest[key]
        metrics = run.get("metrics", {})
        attended = (run.get("latency") or {}).get("mean_attended_tokens")
        rows.append([task, model, method_cell(method), budget, f"`{protocol}`" if protocol else "-",
                     str(run.get("n_samples", metrics.get("n"))), fmt(metrics.get("score")), per_task(metrics),
                     fmt(attended, digits=0), published(task, method, paper), short_commit(run.get("provenance", {})),
                     f"`{f.name}`"])
    header = ["task", "model", "method", "budget", "settings", "samples", "score", "per task (by length)",
              "mean attended tokens", "published (the baseline's paper)", "commit", "file"]
    return table(header, rows)


# --------------------------------------------------------------------------------------------------------------
# Accuracy with the selection diagnostic, and the page layouts' own quality


def runs_device(f: Result) -> str:
    """Where a curated accuracy file's runs ran: their GPUs, or ``CPU``."""
    gpus = {str((r.get("provenance") or {}).get("gpu") or "CPU") for r in f.data.get("runs") or []}
    return ", ".join(sorted(gpus)) or "CPU"


def render_accuracy(results: Path, paper: dict[str, Any]) -> str:
    from eval.report import accuracy as A

    newest = newest_by([((str(f.data.get("model")), runs_device(f)), f.order, f)
                        for f in load(results, "accuracy_*.json")])
    if not newest:
        return ("Not measured yet: no `results/bench/accuracy_*.json`. `make reproduce-accuracy` (or the commands "
                "in docs/reproduce.md, \"Accuracy\") runs the experiments and writes one; every cell of this table "
                "will come from the metrics.json of those runs.")
    blocks = []
    # per model, the GPU's files before the CPU host's (the grid before a smaller check), then the newest first
    for (model, _), f in sorted(sorted(newest.items(), key=lambda item: item[1].order, reverse=True),
                                key=lambda item: (item[0][0], item[0][1] == "CPU")):
        runs = f.data.get("runs") or []
        rows = A.accuracy_rows(runs)
        commits = sorted({short_commit(r.get("provenance") or {}) for r in runs})
        gpus = sorted({str((r.get("provenance") or {}).get("gpu") or "CPU") for r in runs})
        dates = sorted(str((r.get("provenance") or {}).get("date") or "")[:10] for r in runs)
        missing = len(f.data.get("missing") or [])
        source = (f"`{f.name}`: {len(runs)} finished runs"
                  + (f", {missing} not finished" if missing else "")
                  + f" of `{'`, `'.join(f.data.get('sweeps') or [])}`; {', '.join(gpus)}; commits "
                  f"{', '.join(commits)}; run {dates[0] if dates else '?'} to {dates[-1] if dates else '?'}.")
        figures = [name for name in (f.data.get("figures") or (f"accuracy_vs_budget_{model}.png",
                                                                f"accuracy_vs_tpot_{model}.png",
                                                                f"mass_by_layer_{model}.png"))
                   if (results / name).exists()]
        if figures:
            source += " Figures: " + ", ".join(f"`results/bench/{name}`" for name in figures) + "."
        blocks += [f"#### {model}, {runs_device(f)}", accuracy_table(rows) if rows else "(no finished runs)", source]
    return "\n\n".join(blocks + [ACCURACY_DEFINITIONS])


ACCURACY_DEFINITIONS = (
    "A cell is the task's score in percent (passkey: keys retrieved; RULER: the mean of its tasks' string-match "
    "scores) with the 2.5th-97.5th percentile of a bootstrap that resamples the samples within each (length, task); "
    "after it, Δ is the score minus the full cache's on the same samples, with a paired bootstrap's interval "
    "(where both runs' samples were on disk or in the file when it was curated; files curated before runs carried "
    "their samples have it only where both runs' predictions were on the curating host's disk). The tokens attended "
    "and the attention mass they hold are in the curated file and in `scripts/collect.py`'s accuracy.md.")


def accuracy_table(rows: list) -> str:
    """A model's accuracy rows (eval.report.accuracy.AccuracyRow) as one table per task and length: a line per
    method, a column per budget, each cell the score [95% interval] and, where the run was paired with the full
    cache, its difference [paired interval] beside it. A budget-free method (the full caches) gives its one score
    under every budget; the samples per cell are said in the table's caption, or in the cell where they differ."""
    from eval.report import accuracy as A

    def cell(row: Any, with_n: bool) -> str:
        if row is None:
            return "-"
        text = A.score_cell(row) + (f" (n {row.n})" if with_n else "")
        return text + (f" · Δ {A.difference_cell(row)}" if row.difference is not None else "")

    groups = sorted({(r.task, r.length) for r in rows}, key=lambda c: (c[0], c[1] is None, c[1] or 0))
    methods = sorted({r.method for r in rows}, key=method_sort_key)
    blocks = []
    for task, length in groups:
        members = [r for r in rows if (r.task, r.length) == (task, length)]
        budgets = sorted({r.budget for r in members if r.budget is not None}) or [None]
        cells = {}
        for r in members:
            for budget in [r.budget] if r.budget is not None else budgets:
                cells[(r.method, budget)] = r
        counts = sorted({r.n for r in members}, key=lambda n: n or 0)
        caption = f"**{task}, {A.length_label(length)}**" + (f" ({counts[0]} samples a cell)" if len(counts) == 1
                                                             else "")
        header = ["method", *("score" if b is None else f"budget {b}" for b in budgets)]
        lines = [[method_cell(m), *(cell(cells.get((m, b)), len(counts) > 1) for b in budgets)]
                 for m in methods if any((m, b) in cells for b in budgets)]
        blocks.append(caption + "\n\n" + table(header, lines))
    return "\n\n".join(blocks)


def render_page_quality(results: Path, paper: dict[str, Any]) -> str:
    files = load(results, "page_quality_*.json")
    if not files:
        return ("Not measured yet: no `results/bench/page_quality_*.json`; `python scripts/diagnostics/page_quality.py "
                "--model smollm2_135m --length 4096` writes one.")
    def key(f: Result) -> tuple:
        s = f.data.get("settings") or {}
        return (f.host, str(s.get("model")), str(s.get("task")) + (f":{s.get('subtask')}" if s.get("task") == "ruler"
                                                                     else ""), int(s.get("length") or 0),
                int(s.get("budget") or 0))
    newest = newest_by([(key(f), f.order, f) for f in files])
    names = ("token_topk", "positional", "dci", "kmeans", "dci_fixed", "dci_search")
    rows = []
    for (host, model, task, length, budget), f in sorted(newest.items()):
        result = f.data.get("result") or {}
        mean = result.get("mean") or {}
        tokens = result.get("prompt_tokens") or []
        rows.append([host, model, task, str(length), str(budget), str(len(tokens)),
                     str(budget // int(result.get("page_size") or 16)), str(result.get("n_selected_pages")),
                     *[fmt(mean.get(name), digits=3) for name in names], f"`{f.name}`", f.commit])
    header = ["host", "model", "task", "length", "budget", "prompts", "pages", "K", *names, "file", "commit"]
    return table(header, rows)


# --------------------------------------------------------------------------------------------------------------
# The headline: accuracy kept and decode time, side by side


def render_headline(results: Path, paper: dict[str, Any]) -> str:
    from eval.report import accuracy as A

    latency = latency_rows(results)
    budgets = {(f.data.get("settings") or {}).get("budget") for _, f in latency}
    budget = budgets.pop() if len(budgets) == 1 else None
    accuracy_files = load(results, "accuracy_*.json")
    # the grid run on a GPU (as the speeds beside it were) that reaches the longest context, the newest of those: a
    # later, smaller check on the CPU host, or a newer grid of a short-context model, does not replace it
    on_gpu = [f for f in accuracy_files if runs_device(f) != "CPU"] or accuracy_files
    graded = [(f, A.accuracy_rows(f.data.get("runs") or [])) for f in reversed(on_gpu)]  # newest first
    newest, scores = max(graded, key=lambda fr: max((r.length or 0 for r in fr[1]), default=0),
                         default=(None, []))
    scores = [r for r in scores if r.budget is None or r.budget == budget]
    accuracy_columns = sorted({(r.task, r.length) for r in scores}, key=lambda c: (c[0], c[1] or 0))
    shares = {(method_text(r.method), r.task, r.length): r.share_of_full for r in scores}
    contexts = sorted({row["context"] for row, f in latency if reference_row(f, row["context"], "full_static")})
    ratios = {(method_text(row["method"]), row["context"]): ratio_to(row, f, "full_static") for row, f in latency}
    methods = {m for m, *_ in shares} | {m for m, _ in ratios}
    rows = []
    for method in sorted(methods, key=method_sort_key):
        share_cells = [shares.get((method, task, length)) for task, length in accuracy_columns]
        rows.append([f"`{method}`", *("-" if s is None else f"{s:.0f}%" for s in share_cells),
                     *(ratios.get((method, c), "-") for c in contexts)])
    header = ["method", *(f"{task} {A.length_label(length)}, % of full" for task, length in accuracy_columns),
              *(f"{A.length_label(c)}, x full_static" for c in contexts)]
    models = sorted({model_of(f) for _, f in latency})
    note = (f"Accuracy: the score over `full`'s at the same length, budget {budget}, from `{newest.name}` "
            f"({newest.data.get('model')}; the accuracy table below). " if newest else "Accuracy: not measured yet. ")
    note += (f"Speed: TPOT over `full_static`'s TPOT in the same file ({', '.join(models)}, budget {budget}; the "
             f"latency table below); under 1 is faster than `full_static`.")
    return "\n\n".join([table(header, rows), note])


RENDERERS: dict[str, Callable[[Path, dict[str, Any]], str]] = {
    "headline": render_headline,
    "latency": render_latency,
    "latency-summary": render_latency_summary,
    "other-gpus": render_other_gpus,
    "speed-goals": render_speed_goals,
    "other-gpus-throughput": render_other_gpus_throughput,
    "regression": render_regression,
    "regression-summary": render_regression_summary,
    "scaling": render_scaling,
    "scaling-summary": render_scaling_summary,
    "other-gpus-scaling": render_other_gpus_scaling,
    "capacity": render_capacity,
    "throughput": render_throughput,
    "breakdown": render_breakdown,
    "icecache-floor": render_floor,
    "host-step": render_host_step,
    "prompt-index": render_prompt_index,
    "dci": render_dci,
    "kernels": render_kernels,
    "cpu-accuracy": render_cpu_accuracy,
    "accuracy": render_accuracy,
    "page-quality": render_page_quality,
}


# --------------------------------------------------------------------------------------------------------------
# The page


def render_page(text: str, results: Path, paper: dict[str, Any]) -> str:
    """``text`` with every table region replaced by what the result files render."""
    names = [m.group("name") for m in REGION.finditer(text)]
    unknown = sorted(set(names) - set(RENDERERS))
    if unknown:
        raise SystemExit(f"error: unknown table region(s) {', '.join(unknown)}; known: {', '.join(RENDERERS)}")

    def replace(match: re.Match) -> str:
        body = RENDERERS[match.group("name")](results, paper).rstrip("\n")
        return f"{match.group(1)}{body}\n{match.group(4)}"

    return REGION.sub(replace, text)


def stale_regions(old: str, new: str) -> list[str]:
    before = {m.group("name"): m.group("body") for m in REGION.finditer(old)}
    after = {m.group("name"): m.group("body") for m in REGION.finditer(new)}
    return sorted(name for name in after if before.get(name) != after[name])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--page", type=Path, action="append", default=None,
                        help="a Markdown page with table regions (repeatable; default: " + ", ".join(
                            str(page.relative_to(REPO)) for page in PAGES) + ")")
    parser.add_argument("--results", type=Path, default=RESULTS, help="folder of result files")
    parser.add_argument("--paper", type=Path, default=PAPER, help="the paper's figures (JSON)")
    parser.add_argument("--check", action="store_true", help="only check that the pages are up to date")
    args = parser.parse_args(argv)
    paper = json.loads(args.paper.read_text(encoding="utf-8")) if args.paper.is_file() else {}
    failed = False
    for page in args.page or PAGES:
        text = page.read_text(encoding="utf-8")
        rendered = render_page(text, args.results, paper)
        stale = stale_regions(text, rendered)
        if args.check:
            if stale:
                print(f"{page} is stale in: {', '.join(stale)}; run python scripts/bench/tables.py", file=sys.stderr)
                failed = True
            else:
                print(f"{page}: every table matches {args.results}")
            continue
        if rendered != text:
            page.write_text(rendered, encoding="utf-8")
        print(f"{page}: {len(stale)} table(s) rewritten" + (f" ({', '.join(stale)})" if stale else ""))
    return 1 if failed else 0
