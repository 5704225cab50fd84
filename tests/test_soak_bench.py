"""bench.soak on the CPU, short: drafters killed and restarted, the idle check, SIGTERM under load,
every reported generation against plain decoding; and its memory rule."""

import json

from bench import report, soak


def test_a_short_soak_passes_and_reports_what_it_checked(tmp_path):
    status = soak.main(["--out", str(tmp_path), "--model", "tiny", "--device", "cpu", "--minutes", "0.25", "--sessions", "4",
                        "--processes", "2", "--kill-every-s", "3", "--settle-s", "3", "--stop-after-s", "2",
                        "--max-new-tokens", "24"])
    (path,) = tmp_path.glob("soak_*.json")
    result = json.loads(path.read_text())
    assert status == 0, result["checks"]
    assert result["ok"] and all(result["checks"].values())
    assert result["soak"]["kills"] >= 1 and result["compared_generations"] > 0 and result["mismatches"] == 0
    assert result["idle"]["open_sessions"] == 0 and result["idle"]["free_slots"] == result["idle"]["n_slots"] == 4 + 2
    assert result["stop"]["server_exit_status"] == 0 and result["cancelled"] == 0
    row = report.Tables(tmp_path).soak()
    assert "| 0 | 0 | 0 |" in row and "| 6/6 |" in row and "PASS" in row


def test_memory_counts_as_flat_within_its_tolerances_only():
    steady = {"rss_mib": 1000.0, "gpu_mib": 20_000.0}
    assert soak.flat(steady, {"rss_mib": 1015.0, "gpu_mib": 20_050.0})
    assert not soak.flat(steady, {"rss_mib": 1100.0, "gpu_mib": 20_000.0})  # +10% RSS, past 16 MiB of noise
    assert not soak.flat(steady, {"rss_mib": 1000.0, "gpu_mib": 21_000.0})  # +1 GiB on the GPU
