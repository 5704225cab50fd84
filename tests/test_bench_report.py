"""bench.report: the tables of bench/README.md and README.md are what the committed results give."""

from __future__ import annotations

import json

from bench import report


def test_committed_tables_match_the_results():
    stale = [str(path) for path, text in report.generate().items() if path.read_text() != text]
    assert not stale, f"run `python -m bench.report`: tables differ from bench/results in {stale}"
    assert report.main(["--check"]) == 0


def test_every_results_file_follows_the_naming_rule():
    for path in report.RESULTS.iterdir():
        assert report.parse_name(path.name) is not None, f"{path.name}: not <bench>_<date>[_<variant>].json"


def test_the_newest_file_by_date_is_read_per_variant(tmp_path):
    for name, decode in [("gpu_2026-01-02.json", 2.0), ("gpu_2026-01-10.json", 1.0), ("gpu_2025-12-31.json", 3.0),
                         ("gpu_2026-01-05_other-host.json", 4.0), ("gpu_tests_2026-02-01.json", 5.0)]:
        (tmp_path / name).write_text(json.dumps({"decode_ms": decode}))
    found = report.newest(tmp_path, "gpu")
    assert {v: p.name for v, p in found.items()} == {"": "gpu_2026-01-10.json", "other-host": "gpu_2026-01-05_other-host.json"}
    assert report.Tables(tmp_path).one("gpu")[1]["decode_ms"] == 1.0
    assert set(report.newest(tmp_path, "gpu_tests")) == {""}


def test_check_fails_with_a_message_when_a_table_drifts(tmp_path, monkeypatch, capsys):
    bench_readme, readme = tmp_path / "bench.md", tmp_path / "README.md"
    bench_readme.write_text(report.BENCH_README.read_text().replace("| qwen35_2b |", "| qwen35_2b (edited) |", 1))
    readme.write_text(report.README.read_text())
    monkeypatch.setattr(report, "BENCH_README", bench_readme)
    monkeypatch.setattr(report, "README", readme)
    monkeypatch.setattr(report, "REPO", tmp_path)
    real = report.generate
    monkeypatch.setattr(report, "generate", lambda: real(report.RESULTS, bench_readme, readme))
    assert report.main(["--check"]) == 1
    assert "bench.md" in capsys.readouterr().err
    assert report.main([]) == 0
    assert report.main(["--check"]) == 0


def test_fp8_real_size_table_shows_each_figure_against_its_own_floor(tmp_path):
    """Files without own floors (the committed ones) keep the decode against the weights' floor; a
    file with `step_floors` shows every figure over its own floor, and the experts its rows route to."""
    old = json.loads(next(report.RESULTS.glob("fp8_real_size_*.json")).read_text())
    for key in ("step_floors", "kernel_breakdowns"):  # as a file from before own floors
        old.pop(key, None)
    (tmp_path / "fp8_real_size_2026-01-01_old.json").write_text(json.dumps(old))
    assert "x its own floor" not in report.Tables(tmp_path).fp8_real_size()
    figures = ("decode_ms_b1", "verify_k8_ms_b1", "decode_ms_b64", "verify_k8_ms_b64")
    floors = {key: {"floor_ms": 2.0 * (i + 1), "ratio": old[key] / (2.0 * (i + 1)), "distinct_experts": {"mean": 8.0 * (i + 1), "of": 256}}
              for i, key in enumerate(figures)}
    (tmp_path / "fp8_real_size_2026-01-02_new.json").write_text(json.dumps({**old, "step_floors": floors}))
    text = report.Tables(tmp_path).fp8_real_size()
    assert "decode b=1 ms (x its own floor ms)" in text
    new_row, old_row = sorted((line for line in text.splitlines() if line.startswith("| qwen")), key=lambda line: "(-)" in line)
    assert f"{old['verify_k8_ms_b64']:.2f} ({old['verify_k8_ms_b64'] / 8.0:.1f}x of 8.00)" in new_row
    assert "| 8 / 16 / 24 / 32 of 256 |" in new_row
    assert old_row.count("(-)") == 4 and "| - |" in old_row


def test_serve_table_shows_the_round_breakdown_only_for_files_that_have_it(tmp_path):
    """The committed serve files (no round timings) give the serve table as before; a file with
    `round_breakdown_ms` adds the table of where a plain round goes."""
    old_path = max(report.RESULTS.glob("serve_*.json"), key=lambda p: report.parse_name(p.name)[1])
    old = json.loads(old_path.read_text())
    (tmp_path / "serve_2026-01-01.json").write_text(json.dumps(old))
    before = report.Tables(tmp_path).serve()
    assert "server in" not in before
    name = next(iter(old["models"]))
    parts = {"round": 7.28, "engine": 4.15, "server_in": 1.0, "server_out": 0.5, "wire": 1.2, "drafter": 0.4, "unexplained": 0.03}
    old["models"][name].update(round_breakdown_ms=parts, added_ms_per_round=3.13, added_ms_per_round_p50=3.0)
    (tmp_path / "serve_2026-01-02.json").write_text(json.dumps(old))
    text = report.Tables(tmp_path).serve()
    assert text.startswith(before.replace("2026-01-01", "2026-01-02").rstrip("\n"))
    assert f"| {name} | 7.28 | 4.15 | 3.13 (3.00) | 1.00 | 0.50 | 1.20 | 0.40 | 0.03 |" in text
