"""One (model, method, task, budget) run: resumable, append-only, with an atomic done marker.

Output directory = ``<output_root>/<task>/<model>/<method>/budget-<b>/<hash>``: a pure function of the settings
that can change a number, so a resubmitted sweep lands in the same place. Per sample one JSON line is appended
and flushed; a restarted run skips the ids already written (a torn last line is dropped); ``metrics.json`` is
written last, atomically, and marks the run done.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from icecache.core.errors import ConfigError
from icecache.core.method import method_class
from icecache.core.models import ModelSpec, check_model, model_info

PREDICTIONS = "predictions.jsonl"
METRICS = "metrics.json"


@dataclass
class RunConfig:
    model: ModelSpec
    method: dict[str, Any]
    task: dict[str, Any]
    output_root: str = "results/runs"
    prefill_chunk_size: int | None = None
    layer_by_layer_prefill: bool = False  # same result; bounds prefill memory (generation._prefill_layer_by_layer)
    prefill_residual_on_host: bool = False  # with layer_by_layer_prefill: the residual stream in host memory
    threads: int | None = None
    measure_phases: bool = False
    resume: bool = True
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "RunConfig":
        values = dict(values)
        known = {f.name for f in dataclasses.fields(cls)}
        extra = {k: values.pop(k) for k in list(values) if k not in known}
        method = dict(values.pop("method"))
        if not method_class(method.get("name")).uses_budget:
            method["budget"] = None  # the full cache ignores it: one run directory whatever budget was asked
        return cls(model=ModelSpec.from_dict(dict(values.pop("model"))), method=method, extra=extra, **values)

    def identity(self) -> dict[str, Any]:
        """The settings that can change a result (device and dtype included, threads and paths not)."""
        model = dataclasses.asdict(self.model)
        model["device"] = str(self.model.resolved_device())
        model["dtype"] = str(self.model.resolved_dtype())
        model.pop("install_hint", None)
        return {"model": model, "method": self.method, "task": self.task, "prefill_chunk_size": self.prefill_chunk_size}

    def config_hash(self) -> str:
        canonical = json.dumps(self.identity(), sort_keys=True, default=str)
        return hashlib.sha256(canonical.encode()).hexdigest()[:10]

    def output_dir(self) -> Path:
        budget = self.method.get("budget")
        budget_part = "budget-none" if budget is None else f"budget-{budget}"
        return (
            Path(self.output_root) / self.task["name"] / self.model.name / self.method["name"] / budget_part
            / self.config_hash()
        )


def read_records(path: Path) -> list[dict[str, Any]]:
    """Complete JSON lines of a predictions file; a torn last line (killed mid-write) is dropped."""
    if not path.exists():
        return []
    records, seen = [], set()
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if record["sample_id"] not in seen:
                seen.add(record["sample_id"])
                records.append(record)
    return records


def write_json_atomic(path: Path, payload: Any) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "w", encoding="utf-8") as handle:
        json.dump(payload, handle, indent=2, sort_keys=True, default=str)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def _truncate_torn_tail(path: Path) -> None:
    """Drop a partial last line so the next append starts on a fresh line."""
    if not path.exists():
        return
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        cut = data.rfind(b"\n") + 1
        with open(path, "r+b") as handle:
            handle.truncate(cut)


class RunLock:
    """Exclusive lock next to the predictions, so two jobs never write one run (duplicate sweep points)."""

    def __init__(self, directory: Path):
        self.path = directory / ".lock"

    def __enter__(self):
        import fcntl

        self.handle = open(self.path, "w")
        try:
            fcntl.flock(self.handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ConfigError(f"another process is writing {self.path.parent}; wait for it or kill it") from None
        return self

    def __exit__(self, *exc):
        self.handle.close()


def prepare(config: RunConfig):
    """Every cheap check, before any weights load: -> (task, method, ModelInfo)."""
    from eval.base import build_task
    from icecache.core.method import build_method

    task = build_task(config.task)
    check_model(config.model)
    info = model_info(config.model)
    method = build_method(config.method, info)
    if config.prefill_chunk_size is not None and config.prefill_chunk_size <= 0:
        raise ConfigError("prefill_chunk_size must be positive or null")
    if config.prefill_residual_on_host and not config.layer_by_layer_prefill:
        raise ConfigError("prefill_residual_on_host=true needs layer_by_layer_prefill=true")
    return task, method


def summarise_latency(records: list[dict[str, Any]]) -> dict[str, Any]:
    def med(key: str):
        values = [r["gen"][key] for r in records if r.get("gen", {}).get(key) is not None]
        return statistics.median(values) if values else None

    attended = [r["gen"]["mean_attended_tokens"] for r in records if r["gen"].get("mean_attended_tokens") is not None]
    return {
        "median_ttft_s": med("ttft_s"),
        "median_tt2t_s": med("tt2t_s"),
        "median_tpot_s": med("tpot_s"),
        "mean_attended_tokens": statistics.fmean(attended) if attended else None,
        "max_peak_gpu_bytes": max((r["gen"].get("peak_gpu_bytes") or 0 for r in records), default=0) or None,
    }


def run(config: RunConfig) -> dict[str, Any]:
    import torch
    from omegaconf import OmegaConf
    from tqdm.auto import tqdm

    from eval.base import PromptContext
    from icecache import provenance
    from icecache.core.cache import ATTENTION_NAME, HarnessCache
    from icecache.core.generation import GenerationRequest, greedy_generate
    from icecache.core.models import load_model
    from icecache.core.timing import PhaseTimer

    task, method = prepare(config)
    out_dir = config.output_dir()
    metrics_path = out_dir / METRICS
    if config.resume and metrics_path.exists():
        print(f"already done: {metrics_path}")
        return json.loads(metrics_path.read_text())
    out_dir.mkdir(parents=True, exist_ok=True)
    if config.threads:
        torch.set_num_threads(config.threads)

    with RunLock(out_dir):
        predictions_path = out_dir / PREDICTIONS
        if not config.resume and predictions_path.exists():
            predictions_path.unlink()
        _truncate_torn_tail(predictions_path)
        (out_dir / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(config.identity())))
        write_json_atomic(out_dir / "env.json", provenance.collect())

        model, tokenizer = load_model(config.model, ATTENTION_NAME)
        context = PromptContext(
            tokenizer=tokenizer,
            model_name=config.model.name,
            chat_template=config.model.chat_template,
            max_length=config.model.max_length,
        )
        done = {r["sample_id"] for r in read_records(predictions_path)}
        samples = list(task.samples(context))
        todo = [s for s in samples if s.sample_id not in done]
        default_eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        with open(predictions_path, "a", encoding="utf-8") as sink:
            for sample in tqdm(todo, desc=f"{config.task['name']} / {config.method['name']}", initial=len(done),
                               total=len(samples)):
                cache = HarnessCache(method, PhaseTimer(config.model.resolved_device(), config.measure_phases))
                request = GenerationRequest(
                    input_ids=sample.input_ids,
                    max_new_tokens=sample.max_new_tokens,
                    eos_token_ids=sample.eos_token_ids if sample.eos_token_ids is not None else default_eos,
                    min_new_tokens=sample.min_new_tokens,
                    stop_strings=sample.stop_strings,
                    suffix_ids=sample.suffix_ids,
                )
                result = greedy_generate(
                    model, cache, request, prefill_chunk_size=config.prefill_chunk_size, tokenizer=tokenizer,
                    layer_by_layer=config.layer_by_layer_prefill, residual_on_host=config.prefill_residual_on_host,
                )
                prediction = tokenizer.decode(result.token_ids, skip_special_tokens=True)
                record = {
                    "sample_id": sample.sample_id,
                    "prediction": prediction,
                    "output_ids": result.token_ids,
                    "answers": sample.answers,
                    **task.score(sample, prediction, result.token_ids),
                    "meta": sample.meta,
                    "gen": result.summary(),
                }
                sink.write(json.dumps(record, default=str) + "\n")
                sink.flush()
                os.fsync(sink.fileno())
                del cache

        records = read_records(predictions_path)
        order = {s.sample_id: i for i, s in enumerate(samples)}
        records = sorted((r for r in records if r["sample_id"] in order), key=lambda r: order[r["sample_id"]])
        metrics = {
            "task": config.task["name"],
            "model": config.model.name,
            "method": config.method["name"],
            "budget": config.method.get("budget"),
            "config_hash": config.config_hash(),
            "n_samples": len(records),
            "metrics": task.aggregate(records),
            "latency": summarise_latency(records),
            "settings": config.identity(),
            "provenance": provenance.collect(),
        }
        write_json_atomic(metrics_path, metrics)
    return metrics


def main_from_dict(values: dict[str, Any]) -> dict[str, Any] | None:
    """CLI wrapper: a ``ConfigError`` becomes one line on stderr and exit code 2."""
    try:
        return run(RunConfig.from_dict(values))
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
