"""The diagnostic scripts that have no test beside their subject's (scripts/diagnostics/)."""

import json

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

