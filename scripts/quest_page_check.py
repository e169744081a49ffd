#!/usr/bin/env python
"""Is Quest's low passkey score on SmolLM2 (budget 256) a bug or page granularity? Two failing samples, re-run
with a larger budget, smaller pages, and more dense layers (BENCHMARKS.md, CPU accuracy)."""
from pathlib import Path

import yaml

from eval.plugins import build_method
from eval.tasks.base import PromptContext, build_task
from icecache.core.cache import ATTENTION_NAME, HarnessCache
from icecache.core.generation import GenerationRequest, greedy_generate
from icecache.core.models import ModelSpec, load_model, model_info

VARIANTS = [
    {"name": "quest", "budget": 256},
    {"name": "quest", "budget": 1024},
    {"name": "quest", "budget": 256, "page_size": 8},
    {"name": "quest", "budget": 256, "n_dense_layers": 4},
]

values = yaml.safe_load(Path("configs/model/smollm2_135m.yaml").read_text())
values.pop("defaults")
spec = ModelSpec.from_dict({**values, "device": "cpu", "dtype": "float32"})
model, tok = load_model(spec, ATTENTION_NAME)
info = model_info(spec)
task = build_task({"name": "passkey", "lengths": [4096], "num_depths": 20})
samples = list(task.samples(PromptContext(tokenizer=tok)))
for s in [samples[0], samples[3]]:
    for m in VARIANTS:
        request = GenerationRequest(s.input_ids, s.max_new_tokens, eos_token_ids=[tok.eos_token_id])
        r = greedy_generate(model, HarnessCache(build_method(m, info)), request)
        print(s.sample_id, m, repr(tok.decode(r.token_ids)), s.answers, flush=True)
