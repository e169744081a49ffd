"""The stop set: generation stops on the tokenizer's EOS and on every EOS id of the model's generation config, as
``generate`` does in the reference scripts (Llama-3.1-Instruct's generation config lists three)."""

import json
from types import SimpleNamespace

from eval import runner
from eval.config import RunConfig
from icecache.core.generation import default_eos_token_ids


def test_union_of_the_tokenizer_eos_and_the_generation_config_eos_list():
    tokenizer = SimpleNamespace(eos_token_id=128009)
    llama31 = SimpleNamespace(eos_token_id=[128001, 128008, 128009])
    assert default_eos_token_ids(tokenizer, llama31) == [128009, 128001, 128008]
    assert default_eos_token_ids(tokenizer, SimpleNamespace(eos_token_id=2)) == [128009, 2]
    assert default_eos_token_ids(tokenizer, None) == [128009]
    assert default_eos_token_ids(SimpleNamespace(eos_token_id=None), llama31) == [128001, 128008, 128009]
    assert default_eos_token_ids(SimpleNamespace(eos_token_id=None), SimpleNamespace(eos_token_id=None)) == []


def test_the_runner_stops_on_the_models_eos_list(tmp_path, monkeypatch):
    from icecache.core import generation

    seen = []
    real = generation.greedy_generate

    def recording(model, cache, request, **kwargs):
        seen.append(list(request.eos_token_ids))
        return real(model, cache, request, **kwargs)

    monkeypatch.setattr(generation, "greedy_generate", recording)
    values = {
        "model": {"name": "tiny-llama", "source": "random", "architecture": "llama", "tokenizer": "bytes",
                  "device": "cpu", "dtype": "float32",
                  "config": {"vocab_size": 512, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                             "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 4096,
                             "eos_token_id": [300, 301]}},
        "method": {"name": "full", "budget": None},
        "task": {"name": "passkey", "lengths": [300], "num_depths": 1, "calibration": "tokens"},
        "output_root": str(tmp_path),
    }
    runner.run(RunConfig.from_dict(json.loads(json.dumps(values))))
    assert seen == [[257, 300, 301]]  # the byte tokenizer's </s>, then the model's two
