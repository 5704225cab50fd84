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
