"""The diagnostic scripts that have no test beside their subject's (scripts/diagnostics/)."""

import json

import pytest
import torch

from tests.conftest import load_script


def test_the_prefill_profile_times_each_methods_first_token_and_lists_its_host_work(tmp_path):
    """step_profile.py --prefill on the CPU (tiny Llama): one result per method, its wall time and its host
    operations, the ones with the most time of their own first, in a result file; no device, so no kernels."""
    profile = load_script("diagnostics/step_profile")
    profile.main(["--prefill", "--model", "tiny_llama", "--methods", "full", "pqcache", "--length", "600",
                  "--budget", "64", "--top", "5", "--out", str(tmp_path)])
    (written,) = tmp_path.glob("prefill_profile_*.json")
    payload = json.loads(written.read_text())
    assert payload["kind"] == "prefill_profile" and payload["provenance"]["git_commit"]
    results = payload["results"]
    assert [r["method"] for r in results] == ["full", "pqcache"]
    for result in results:
        assert result["wall_ms"] > 0 and result["kernels"] == [] and result["device_ms"] == 0
        assert result["gpu_busy_ms"] is None
        times = [op["us"] for op in result["host_ops"]]
        assert 0 < len(times) <= 5 and times == sorted(times, reverse=True)
        assert any(op["op"].startswith("aten::") for op in result["host_ops"])



@pytest.mark.parametrize("script,bad,message", [
    ("diagnostics/attention_sweep", ["--lengths", "100"], "multiple of the page size"),
    ("diagnostics/shadowkv_score_sweep", ["--length", "100"], "multiple of 8"),
    ("diagnostics/shadowkv_score_sweep", ["--rows", "0"], "--rows must be positive"),
])
def test_the_kernel_sweeps_refuse_bad_settings_in_one_line_before_any_work(script, bad, message, capsys):
    with pytest.raises(SystemExit) as stopped:
        load_script(script).main(bad)
    assert stopped.value.code == 2 and message in capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message where there is no CUDA device")
@pytest.mark.parametrize("script", ["diagnostics/attention_sweep", "diagnostics/shadowkv_score_sweep"])
def test_the_kernel_sweeps_say_they_need_a_cuda_device(script):
    with pytest.raises(SystemExit, match="needs a CUDA device"):
        load_script(script).main([])
