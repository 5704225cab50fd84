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
    for key in ("step_floors", "kernel_breakdowns", "mtp_draft", "kernel_figures", "per_token"):  # as a file from before own floors
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
    with_models = [p for p in report.RESULTS.glob("serve_*.json") if json.loads(p.read_text())["models"]]
    old_path = max(with_models, key=lambda p: report.parse_name(p.name)[1])
    old = json.loads(old_path.read_text())
    for m in old["models"].values():  # as a file from before round timings
        for key in ("round_breakdown_ms", "added_ms_per_round", "added_ms_per_round_p50"):
            m.pop(key, None)
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


def test_fp8_real_size_adds_the_mtp_table_only_for_files_that_time_mtp_drafts(tmp_path):
    """The committed files (no `mtp_draft`) give the table as before; a file with it adds a row of
    each K's draft against its own floor and a decode step, and the LM head's share of the floor."""
    old_path = max(report.RESULTS.glob("fp8_real_size_*.json"), key=lambda p: report.parse_name(p.name)[1])
    old = json.loads(old_path.read_text())
    for key in ("mtp_draft", "kernel_figures", "per_token"):  # as a file from before the MTP timing and the kernel figures
        old.pop(key, None)
    (tmp_path / "fp8_real_size_2026-01-01_a.json").write_text(json.dumps(old))
    before = report.Tables(tmp_path).fp8_real_size()
    assert "MTP draft" not in before
    drafts = {str(k): {"ms": 0.5 * k, "floor_ms": 0.25 * k, "ratio": 2.0, "ratio_to_decode": 0.5 * k / 8.0,
                       "total_bytes": 1.1e9 * k, "bytes": {"lm_head": 1.0e9 * k}} for k in (1, 2, 3, 4)}
    mtp = {"layers": 1, "mlp": "moe", "weight_bytes": 0.85e9, "drafts": drafts}
    (tmp_path / "fp8_real_size_2026-01-01_a.json").write_text(json.dumps({**old, "mtp_draft": mtp}))
    (tmp_path / "fp8_real_size_2026-01-01_b.json").write_text(json.dumps({**old, "mtp_draft": {"error": "RuntimeError: x"}}))
    text = report.Tables(tmp_path).fp8_real_size()
    assert text.startswith(before.split("\n\nSource:")[0])  # the main table unchanged, the second file's row added below it
    assert f"| {old['config']} ({old.get('device', '-')}; 1 moe layer, 0.85 GB) | 0.50 (2.0x of 0.25; 0.06x) | 1.00 (2.0x of 0.50; 0.12x) | " \
           "1.50 (2.0x of 0.75; 0.19x) | 2.00 (2.0x of 1.00; 0.25x) | 91% |" in text
    assert text.count("1 moe layer") == 1 and text.rstrip().endswith("_2026-01-01_b.json`.")


def test_fp8_real_size_rows_name_what_their_run_changed(tmp_path):
    """A run's --name beyond the device ("_h200-masked-tiles") labels its rows, so a comparison run on
    the same device reads as one; the device name alone adds nothing."""
    old_path = max(report.RESULTS.glob("fp8_real_size_*.json"), key=lambda p: report.parse_name(p.name)[1])
    d = json.loads(old_path.read_text())
    config = d["config"]
    (tmp_path / f"fp8_real_size_2026-01-01_{config}_h200.json").write_text(json.dumps(d))
    (tmp_path / f"fp8_real_size_2026-01-01_{config}_h200-masked-tiles.json").write_text(json.dumps({**d, "decode_ms_b1": 9.87}))
    tables = report.Tables(tmp_path)
    text = tables.fp8_real_size()
    assert f"| {config} (full, " in text and f"| {config}, masked-tiles (full, " in text
    assert f"| {config}, h200" not in text
    labels = {p.name: tables.labelled(p)["label"] for p in tmp_path.iterdir()}
    assert sorted(labels.values()) == [config, f"{config}, masked-tiles"]


def committed_serve() -> tuple[dict, dict]:
    """(a committed serve file's models, a committed remote_drafter part): templates of synthetic files."""
    models = json.loads((report.RESULTS / "serve_2026-11-30.json").read_text())["models"]
    remote = json.loads((report.RESULTS / "serve_2026-12-01_remote_drafter.json").read_text())["remote_drafter"]
    return models, remote


def serve_file(models: dict, remote: dict | None, date: str) -> str:
    return json.dumps({"device": "NVIDIA H200", "date": date, "models": models, "remote_drafter": remote})


def test_serve_remote_table_adds_the_mtp_columns_only_for_files_with_the_mtp_modes(tmp_path):
    """A remote part from before the MTP modes renders as the committed ones do; one with them adds
    MTP through the service and in process (tok/s, x the plain of its side, mean acceptance length),
    a skipped one says so, and a mode whose streams differ is named."""
    _, old = committed_serve()
    (tmp_path / "serve_2026-01-01_a.json").write_text(serve_file({}, old, "2026-01-01"))
    before = report.Tables(tmp_path).serve_remote()
    assert "MTP" not in before and "| yes | `serve_2026-01-01_a.json` |" in before
    mtp = {"mtp_skipped": None, "remote_mtp_tokens_per_s": 812.34, "remote_mtp_speedup": 1.456, "remote_mtp_mean_acceptance_length": 2.718,
           "inprocess_mtp_tokens_per_s": 1700.5, "inprocess_mtp_speedup": 1.166, "inprocess_mtp_mean_acceptance_length": 2.7,
           "streams_equal_by_mode": dict.fromkeys(("remote_plain", "remote_model", "remote_mtp", "inprocess_plain", "inprocess_model",
                                                   "inprocess_mtp"), True)}
    (tmp_path / "serve_2026-01-02_b.json").write_text(serve_file({}, {**old, **mtp}, "2026-01-02"))
    skipped = {**{key: None for key in mtp}, "mtp_skipped": "no MTP head",
               "streams_equal_by_mode": {"remote_plain": True, "inprocess_model": False},
               "streams_equal": False}
    (tmp_path / "serve_2026-01-03_c.json").write_text(serve_file({}, {**old, **skipped}, "2026-01-03"))
    text = report.Tables(tmp_path).serve_remote()
    assert "| MTP through the service: tok/s (x remote plain), mean acceptance length | MTP in process: tok/s (x in-process plain), " \
           "mean acceptance length | streams equal | file |" in text
    rows = {line.rsplit("`", 2)[1]: line for line in text.splitlines() if line.endswith(".json` |")}
    # the old file's row: its cells as before, "-" under the MTP columns
    assert rows["serve_2026-01-01_a.json"] == before.splitlines()[2].replace(" | yes |", " | - | - | yes |")
    assert rows["serve_2026-01-02_b.json"].endswith("| 812.3 (1.46x), 2.72 | 1700.5 (1.17x), 2.70 | yes (6 modes) | "
                                                    "`serve_2026-01-02_b.json` |")
    assert rows["serve_2026-01-03_c.json"].endswith("| skipped | skipped | NO: inprocess_model | `serve_2026-01-03_c.json` |")


def test_serve_tables_read_the_newest_file_that_has_their_part(tmp_path):
    """A newer serve file of the remote part alone (`--model ''`: no models) does not hide the older
    file's models from the serve table and the summary, nor a newer run without the remote part
    (null remote_drafter) the remote table; each model keeps its newest file."""
    for path in report.RESULTS.iterdir():  # every other bench as committed: the summary reads them
        if not path.name.startswith("serve_") and path.is_file():
            (tmp_path / path.name).write_bytes(path.read_bytes())
    models, remote = committed_serve()
    (tmp_path / "serve_2026-12-10.json").write_text(serve_file(models, remote, "2026-12-10"))
    (tmp_path / "serve_2026-12-11.json").write_text(serve_file({}, {**remote, "plain_tokens_per_s": 123.4}, "2026-12-11"))
    newer_2b = {**models["2b"], "service_over_engine": 0.5, "service_tokens_per_s": 5000.0, "engine_tokens_per_s": 10000.0}
    (tmp_path / "serve_2026-12-12.json").write_text(serve_file({"2b": newer_2b}, None, "2026-12-12"))
    tables = report.Tables(tmp_path)
    serve = tables.serve()
    assert "| shipped |" in serve and "NVIDIA H200, 2026-12-10 |" in serve and "| 2b | 10,000 | 5,000 | 0.500 |" in serve
    assert "Source: `serve_2026-12-12.json`, `serve_2026-12-10.json`." in serve
    remote_rows = [line for line in tables.serve_remote().splitlines() if line.endswith(".json` |")]
    assert len(remote_rows) == 1 and "| 123.4 |" in remote_rows[0] and remote_rows[0].endswith("| `serve_2026-12-11.json` |")
    summary = tables.summary()
    assert "| Through the gRPC service, 64 sessions, 2B: tokens/s over the engine's alone | 0.50 (5,000 / 10,000), 0 streams differ | " \
           "H200 | `serve_2026-12-12.json` |" in summary
    # the file of the remote part alone gives no model row; without the newer 2B run the 2B row reads the older full file
    (tmp_path / "serve_2026-12-12.json").unlink()
    summary = report.Tables(tmp_path).summary()
    assert "0 streams differ | H200 | `serve_2026-12-10.json` |" in summary and "serve_2026-12-11" not in summary


def test_fp8_real_size_adds_the_step_figures_for_files_that_have_them(tmp_path):
    """A file with kernel figures adds a row: the batch-1 verifies of K + 1 rows, the per-token figure
    with its assumed acceptance, launches, the kernels' bytes or FLOPs and torch's sort/top-k launches."""
    path = max(report.RESULTS.glob("fp8_real_size_*.json"), key=lambda p: report.parse_name(p.name)[1])
    d = json.loads(path.read_text())
    for key in ("kernel_figures", "per_token"):
        d.pop(key, None)
    (tmp_path / "fp8_real_size_2026-01-01_a.json").write_text(json.dumps(d))
    assert "launches a step" not in report.Tables(tmp_path).fp8_real_size()
    d.update({f"verify_k{k}_ms_b1": float(k) for k in (1, 2, 3, 4)},
             per_token={"assumed_mean_acceptance_length": {"1": 1.9, "2": 2.4, "3": 2.8}, "k1_ms": 3.0, "k2_ms": 2.5, "k3_ms": 2.0},
             kernel_figures={"launches": {"decode_ms_b1": 500, "verify_k8_ms_b64": 510}, "fp8_gemm_one_row_tb_s": 2.5,
                             "fp8_gemm_576_rows_tflop_s": 401.2, "routed_experts_b1_tb_s": 2.4, "routed_experts_b64_tb_s": 2.6,
                             "sort_topk_launches": {"decode_ms_b1": 0, "verify_k8_ms_b64": 0}})
    (tmp_path / "fp8_real_size_2026-01-01_a.json").write_text(json.dumps(d))
    text = report.Tables(tmp_path).fp8_real_size()
    assert (f"| {d['config']} ({d.get('device', '-')}) | 1.00 / 2.00 / 3.00 / 4.00 | 3.00 / 2.50 / 2.00 (acceptance 1.9 / 2.4 / 2.8) | 500 / 510 | 2.50 | 401 | "
            "2.40 / 2.60 | 0 |") in text
