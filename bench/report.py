"""The tables of bench/README.md and README.md, generated from the newest results files.

    python -m bench.report            # rewrite the tables in place
    python -m bench.report --check    # exit 1 when a table differs from what the results give

A results file is named `<bench>_<date>[_<variant>].json` (bench.machine.results_path; the variant
says what differs: a model, a config, a host); `python -m drafter bench` writes a folder
`acceptance_<date>[_<variant>]/results.json`. For each bench and variant the newest date is read.
Each table sits between `<!-- report:NAME -->` and `<!-- /report:NAME -->` in its markdown file and
names the files it was made from. Figures are the files' own, rounded; ratios are of two figures
of one file.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
BENCH_README = REPO / "bench" / "README.md"
README = REPO / "README.md"
NAME = re.compile(r"^(?P<bench>[a-z0-9_]+?)_(?P<date>\d{4}-\d{2}-\d{2})(?:_(?P<variant>[A-Za-z0-9._-]+?))?(?:\.json)?$")
MARKER = re.compile(r"(<!-- report:(?P<name>[a-z0-9_]+) -->\n)(?P<body>.*?)(<!-- /report:(?P=name) -->)", re.S)


def parse_name(name: str) -> tuple[str, str, str] | None:
    """'gpu_2026-12-03_x.json' -> ('gpu', '2026-12-03', 'x'); None for a name outside the rule."""
    m = NAME.match(name)
    return (m["bench"], m["date"], m["variant"] or "") if m else None


def by_variant(results: Path, bench: str) -> dict[str, list[Path]]:
    """{variant: the files of bench and that variant, newest date first}, variants sorted ('' first)."""
    dated: dict[str, list[tuple[str, Path]]] = {}
    for path in results.iterdir():
        parsed = parse_name(path.name)
        if parsed is None or parsed[0] != bench:
            continue
        if path.is_dir():
            path = path / "results.json"
            if not path.exists():
                continue
        elif path.suffix != ".json":
            continue
        _, date, variant = parsed
        dated.setdefault(variant, []).append((date, path))
    return {v: [path for _, path in sorted(dated[v], key=lambda d: d[0], reverse=True)] for v in sorted(dated)}


def newest(results: Path, bench: str) -> dict[str, Path]:
    """{variant: the newest file of bench and that variant}, variants sorted ('' first)."""
    return {v: paths[0] for v, paths in by_variant(results, bench).items()}


class Tables:
    """Reads results files once; each method returns one table's markdown, sources named."""

    def __init__(self, results: Path = RESULTS):
        self.results = results
        self._cache: dict[Path, dict] = {}

    def load(self, path: Path) -> dict:
        if path not in self._cache:
            self._cache[path] = json.loads(path.read_text())
        return self._cache[path]

    def labelled(self, path: Path) -> dict:
        """A results file of one config with "label": its config, and what its file name says differs
        beyond the device (`--name`: "qwen3.6-35b-a3b_h200-masked-tiles" -> "qwen3.6-35b-a3b, masked-tiles")."""
        d = self.load(path)
        variant = parse_name(path.name)[2]
        extra = re.sub(r"^(h100|h200)(-|$)", "", variant[len(d["config"]):].lstrip("_")) if variant.startswith(d["config"]) else ""
        return {**d, "label": f"{d['config']}, {extra}" if extra else d["config"]}

    def files(self, bench: str) -> dict[str, Path]:
        found = newest(self.results, bench)
        if not found:
            raise FileNotFoundError(f"no {bench}_<date>*.json under {self.results}")
        return found

    def files_with(self, bench: str, has: Callable[[dict], bool]) -> dict[str, Path]:
        """{variant: its newest file that has what a table reads}: a newer run of one part only (a
        serve run of the remote part alone, `--model ''`) does not hide an older run's other part."""
        found = {}
        for variant, paths in by_variant(self.results, bench).items():
            path = next((p for p in paths if has(self.load(p))), None)
            if path is not None:
                found[variant] = path
        return found

    def serve_models(self) -> list[tuple[str, Path, str, dict]]:
        """(variant, file, model name, its figures) of the serve results: per variant and model, the
        newest file that served that model (files of the remote part alone serve none)."""
        picked: dict[tuple[str, str], tuple[Path, dict]] = {}
        for variant, paths in by_variant(self.results, "serve").items():
            for path in paths:  # newest first: a model keeps its newest file
                for name, m in self.load(path)["models"].items():
                    if "error" not in m:  # a model whose run failed has no figures: an older file's stand
                        picked.setdefault((variant, name), (path, m))
        return [(variant, path, name, m) for (variant, name), (path, m) in picked.items()]

    def one(self, bench: str, variant: str = "") -> tuple[Path, dict]:
        files = self.files(bench)
        if variant not in files:
            raise FileNotFoundError(f"no {bench}_<date>{'_' + variant if variant else ''}.json under {self.results}")
        return files[variant], self.load(files[variant])

    def rel(self, path: Path) -> str:
        return str(path.relative_to(self.results)) if path.is_relative_to(self.results) else str(path)

    def source(self, *paths: Path) -> str:
        return "Source: " + ", ".join(f"`{self.rel(p)}`" for p in paths) + "."

    # --- bench/README.md -------------------------------------------------------------------------

    def rollback(self) -> str:
        path, d = self.one("rollback")
        rows = [f"{r['heads']} x {r['d_k']} x {r['d_v']} ({r['state_mib']:.2f} MiB) | {r['k']} | {r['accepted']} | {r['mode']} | "
                f"{r['total_bytes'] / 2**20:.2f} MiB | {r['verify_ms']:.2f} | {r['rollback_ms']:.3f} | "
                f"{'yes' if r['state_equal_serial'] else 'NO'}" for r in d["rows"] if r["k"] == max(x["k"] for x in d["rows"])]
        return table(["state (heads x d_k x d_v)", "K", "a", "mode", "state traffic / seq / layer", "verify ms",
                      "rollback ms", "state = serial"], rows,
                     f"{d['device']}, {d['backend']}, torch {d['torch']}, median of {d['repeats']}. " + self.source(path))

    def gpu(self) -> str:
        path, d = self.one("gpu")
        rows = []
        for name, m in d["models"].items():
            b8, b64 = m["batch"]["8"], m["batch"]["64"]
            v = m["verify_ms"]
            woa = m["rollback"]["woa"]
            rows.append(f"{name} | {m['model_params'] / 1e9:.2f} B | {m['hbm_floor_ms']:.2f} | {m['decode_ms']:.2f} "
                        f"({m['decode_ms'] / m['hbm_floor_ms']:.2f}x) | {v['1']:.2f} | {v['4']:.2f} | {v['8']:.2f} "
                        f"({v['8'] / m['decode_ms']:.2f}x) | {v['16']:.2f} | {b8['verify8_ms']:.2f} | {b64['hbm_floor_ms']:.2f} | "
                        f"{b64['decode_ms']:.2f} ({b64['decode_ms'] / b64['hbm_floor_ms']:.2f}x) | {b64['verify8_ms']:.2f} "
                        f"({b64['verify8_ms'] / b64['decode_ms']:.2f}x) | {woa['rollback_ms']:.3f} "
                        f"({woa['rollback_ms'] / woa['verify_ms']:.1%}) | {m['bitexact_rows_equal']}/{m['bitexact_rows_total']}")
        return table(["model", "params", "HBM floor ms", "decode ms (x floor)", "K=1", "K=4", "K=8 (x decode)", "K=16",
                      "b=8 K=8", "b=64 floor ms", "b=64 decode (x its floor)", "b=64 K=8 (x b=64 decode)", "WOA rollback ms (of its K=8 verify)",
                      "rows = serial"], rows,
                     f"{d['device']}, torch {d['torch']}, triton {d['triton']}, {d['date']}; ms per engine step. " + self.source(path))

    def gpu_time(self) -> str:
        path, d = self.one("gpu")
        rows = []
        for name, m in d["models"].items():
            t = m.get("step_timeline")
            if not t:
                continue
            top0 = m["kernel_breakdown_k0"]["top"][0]
            top8 = m["kernel_breakdown_k8"]["top"][0]
            rows.append(f"{name} | {t['k0']['wall_ms']:.2f} / {t['k0']['device_busy_ms']:.2f} / {t['k0']['device_span_ms']:.2f} | "
                        f"{t['k8']['wall_ms']:.2f} / {t['k8']['device_busy_ms']:.2f} / {t['k8']['device_span_ms']:.2f} | "
                        f"{m['kernel_breakdown_k0']['launches']} | {top0['kernel']} {top0['device_ms']:.2f} | "
                        f"{top8['kernel']} {top8['device_ms']:.2f}")
        return table(["model", "decode: wall / GPU busy / first-to-last kernel, ms", "K=8: wall / busy / span, ms",
                      "kernels a step", "largest kernel, decode (ms)", "largest kernel, K=8 (ms)"], rows,
                     "Profiled graphed steps of batch 1 (the profiler widens the walls). " + self.source(path))

    def gemm(self) -> str:
        path, d = self.one("gemm")
        rows = []
        for shape, s in d["shapes"].items():
            cells = " | ".join(f"{s['rows'][str(r)]['ours_tflops']:g} / {s['rows'][str(r)]['cublas_tflops']:g}" for r in d["rows"])
            last = s["rows"][str(d["rows"][-1])]["ours_over_cublas"]
            rows.append(f"{shape} [{s['N']}, {s['K']}] | {s['split_k']} | {cells} | {last:.2f} | "
                        f"{'yes' if s['row_invariant'] else 'NO'} | {s['tiles_equal']}")
        return table(["weight [N, K]", "split-K", *(f"M = {r}: ours / cuBLAS TFLOP/s" for r in d["rows"]),
                      f"M = {d['rows'][-1]}: ours / cuBLAS", "row-invariant", "tiles equal"], rows,
                     f"{d['device']}, torch {d['torch']}, triton {d['triton']}, {d['date']}. " + self.source(path))

    def fp8_real_size(self) -> str:
        """One row per config. Files that record each figure's own floor (`step_floors`: the weights
        its rows route to, the dense weights, states, KV) show every figure against it and the
        experts a layer its rows route to; older files show the decode against the weights' floor.
        Files that time the MTP head's drafts (`mtp_draft`) add a second table (fp8_mtp_draft)."""
        figures = ("decode_ms_b1", "verify_k8_ms_b1", "decode_ms_b64", "verify_k8_ms_b64")
        files = list(self.files("fp8_real_size").values())
        own = any("step_floors" in self.load(path) for path in files)
        rows = []
        for path in files:
            d = self.labelled(path)
            floors = d.get("step_floors") or {}
            if own:
                cells = [f"{d[k]:.2f} ({floors[k]['ratio']:.1f}x of {floors[k]['floor_ms']:.2f})" if k in floors else f"{d[k]:.2f} (-)"
                         for k in figures]
                experts = " / ".join(f"{floors[k]['distinct_experts']['mean']:.0f}" for k in figures) + \
                    f" of {floors[figures[0]]['distinct_experts']['of']}" if floors else "-"
                cells.append(experts)
            else:
                cells = [f"{d['decode_ms_b1']:.2f} ({d['decode_ms_b1'] / d['hbm_floor_ms']:.1f}x)", *(f"{d[k]:.2f}" for k in figures[1:])]
            rows.append(f"{d['label']} ({d['scale']}, {d['experts']} experts) | {d.get('device', '-')} | {d['params_total'] / 1e9:.2f} B "
                        f"({d['params_active'] / 1e9:.2f} B) | {d['checkpoint_gb']:.1f} GB | {d['load_s']:.1f} s | "
                        f"{d['hbm_floor_ms']:.2f} | " + " | ".join(cells) + " | "
                        f"{d['bitexact_rows']}; full batch {d.get('full_batch_rows', '-')} rows, "
                        f"{d.get('full_batch_states', '-')} states | {d['gate']} | {d['gpu_memory_gib']:.1f} GiB")
        if own:
            head = ["decode b=1 ms (x its own floor ms)", "K=8 b=1", "decode b=64", "K=8 b=64", "experts a layer (mean, each figure)"]
        else:
            head = ["decode b=1 ms (x floor)", "K=8 b=1", "decode b=64", "K=8 b=64"]
        text = table(["config", "device", "params (active)", "checkpoint", "load", "HBM floor ms", *head, "rows = serial", "gate",
                      "peak GPU memory"], rows, "")
        mtp = self.fp8_mtp_draft([self.labelled(path) for path in files])
        steps = self.fp8_step_figures([self.labelled(path) for path in files])
        return text + ("\n" + mtp if mtp else "") + ("\n" + steps if steps else "") + "\n" + self.source(*files) + "\n"

    def fp8_step_figures(self, results: list[dict]) -> str:
        """One row per fp8_real_size file with kernel figures: the batch-1 verifies of K + 1 rows an
        MTP drafter pairs with, the time per output token at one request with the MTP head at the
        published acceptance (an assumption the file states), launches a step, and the kernels
        against their own bytes or FLOPs; "" when none has them."""
        rows = []
        for d in results:
            kf = d.get("kernel_figures")
            if not kf:
                continue
            verifies = " / ".join(f"{d[f'verify_k{k}_ms_b1']:.2f}" for k in (1, 2, 3, 4) if d.get(f"verify_k{k}_ms_b1") is not None)
            pt = d.get("per_token") or {}
            accept = pt.get("assumed_mean_acceptance_length", {})
            per_token = " / ".join(f"{pt[f'k{k}_ms']:.2f}" for k in (1, 2, 3) if pt.get(f"k{k}_ms") is not None)
            accepted = " / ".join(str(accept[str(k)]) for k in (1, 2, 3) if str(k) in accept)
            launches = kf["launches"]
            many = next((key for key in kf if key.startswith("fp8_gemm_") and key.endswith("_rows_tflop_s")), None)

            def num(value, digits=2):
                return "-" if value is None else f"{value:.{digits}f}"
            rows.append(f"{d['label']} ({d.get('device', '-')}) | {verifies or '-'} | {per_token or '-'} (acceptance {accepted or '-'}) | "
                        f"{launches.get('decode_ms_b1', '-')} / {max(launches.values()) if launches else '-'} | "
                        f"{num(kf['fp8_gemm_one_row_tb_s'])} | {num(kf.get(many), 0) if many else '-'} | "
                        f"{num(kf['routed_experts_b1_tb_s'])} / {num(kf.get('routed_experts_b64_tb_s'))} | "
                        f"{sum(v or 0 for v in kf['sort_topk_launches'].values())}")
        if not rows:
            return ""
        return table(["config", "verify K+1 rows at b=1, K = 1 / 2 / 3 / 4, ms", "ms per output token, MTP K = 1 / 2 / 3 at b=1 (assumed acceptance)",
                      "launches a step (decode b=1 / most)", "FP8 GEMM, one row, TB/s", "FP8 GEMM, 576 rows, TFLOP/s",
                      "routed experts b=1 / b=64, TB/s of distinct experts", "torch sort / top-k launches"], rows, "")

    def fp8_mtp_draft(self, results: list[dict]) -> str:
        """One row per fp8_real_size file that timed MTP drafts: per K its ms (x its own floor; x a
        batch-1 decode step), and the LM head's share of the K = 1 floor; "" when none did."""
        rows = []
        for d in results:
            mtp = d.get("mtp_draft") or {}
            if "drafts" not in mtp:
                continue
            cells = []
            for figure in mtp["drafts"].values():
                cells.append("-" if figure["ms"] is None else
                             f"{figure['ms']:.2f} ({figure['ratio']:.1f}x of {figure['floor_ms']:.2f}; {figure['ratio_to_decode']:.2f}x)")
            one = mtp["drafts"]["1"]
            rows.append(f"{d['label']} ({d.get('device', '-')}; {mtp['layers']} {mtp['mlp']} layer, {mtp['weight_bytes'] / 1e9:.2f} GB) | "
                        + " | ".join(cells)
                        + f" | {one['bytes']['lm_head'] / one['total_bytes']:.0%}")
        if not rows:
            return ""
        ks = list(next(d["mtp_draft"]["drafts"] for d in results if "drafts" in (d.get("mtp_draft") or {})))
        return table(["MTP draft, b=1, after 1 accepted (catch-up of 2 rows)", f"K={ks[0]} ms (x its own floor ms; x a decode b=1)",
                      *(f"K={k}" for k in ks[1:]), "LM head of the K=1 floor"], rows, "")

    def contract(self) -> str:
        rows, paths = [], []
        for variant, path in self.files("row_invariance").items():
            d = self.load(path)
            paths.append(path)
            seconds = sum(s.get("seconds", 0) for s in d["shapes"])
            rows.append(f"`bench.row_invariance`: {len(d['shapes'])} shapes of {len(d['configs'])} configs, "
                        f"M = 1..{d['max_rows']} | {'every row equal alone' if d['invariant'] else 'ROWS DIFFER'} "
                        f"({seconds:.0f} s) | {d['device']}, {d['date']} | `{self.rel(path)}`")
        for variant, path in self.files("check").items():
            d = self.load(path)
            paths.append(path)
            env, s = d["environment"], d["settings"]
            what = f"{variant or 'default'}: {d['model']['model_type']}, {d['model']['layers']} layers, {env['dtype']}, {s['sequences']} sequences, K up to {s['max_k']}"
            if d["passed"]:
                result = f"PASS: {d['rows_equal']}/{d['rows_checked']} rows, {d['states_equal']}/{d['states_checked']} layer states, {d['seconds']:.0f} s"
            else:
                first = d["first_difference"] or {}
                result = (f"FAIL: {d['rows_equal']}/{d['rows_checked']} rows equal; first difference in "
                          f"{first.get('check', '?')}")
            rows.append(f"`verifier check` {what} | {result} | {env.get('gpu') or env['device']}, {path.stem.split('_')[1]} | `{self.rel(path)}`")
        for variant, path in self.files("gpu_tests").items():
            d = self.load(path)
            paths.append(path)
            summary = next((line for line in reversed(d["tail"]) if re.search(r"\d+ (passed|failed)", line)), "no summary")
            failed = [line.split(" ", 1)[1] for line in d["tail"] if line.startswith("FAILED ")]
            result = f"exit {d['exit_status']}: {summary.strip('= ')}" + (f" ({', '.join(failed)})" if failed else "")
            rows.append(f"`bench.gpu_tests` {' '.join(a for a in d['pytest_args'] if a.startswith('tests'))} | {result} | "
                        f"{d['device']}, {d['date']} | `{self.rel(path)}`")
        return table(["run", "result", "device, date", "file"], rows, "")

    def acceptance(self) -> str:
        path, d = self.one("acceptance")
        rows = [f"{r['drafter']} | {r['k']} | {r['mean_acceptance_length']:.2f} | {r['acceptance_rate']:.3f} | "
                f"{', '.join(f'{p:.2f}' for p in r['per_position_acceptance'])} | {r['tokens_per_s']:.1f} | "
                f"{r['speedup_vs_plain']:.2f}x | {'yes' if r['streams_match_plain'] else 'NO'}" for r in d["rows"]]
        return table(["drafter", "K", "mean acceptance length", "acceptance rate", "per-position acceptance", "tokens/s",
                      "vs plain", "streams = plain"], rows,
                     f"Plain decoding through the same server: {d['plain']['tokens_per_s']:.1f} tokens/s. " + self.source(path))

    def load_table(self) -> str:
        rows, paths = [], []
        for variant, path in self.files("load").items():
            d = self.load(path)
            paths.append(path)
            rows.append(f"{d['model']} ({d['device']}, {d['dtype']}) | {d['sessions']} | {d['processes']} | {d['steps']:,} | "
                        f"{d['steps_per_s']:.1f} | {d['tokens_per_s']:.1f} | {d['p50_ms']:.1f} | {d['p99_ms']:.1f} | "
                        f"{d['rows_per_batch_mean']:.1f} | {d['errors']} | {d.get('mismatches', '-')} | "
                        f"{d.get('free_slots_before', '-')} -> {d.get('free_slots_after', '-')}")
        return table(["model", "sessions", "processes", "steps", "steps/s", "tokens/s", "p50 ms", "p99 ms", "rows/batch",
                      "errors", "mismatches", "free slots"], rows, self.source(*paths))

    def soak(self) -> str:
        found = newest(self.results, "soak")
        if not found:
            return "No soak results yet.\n"
        rows = []
        for path in found.values():
            d = self.load(path)
            c, mem = d["config"], d["memory"]
            gpu = "-" if mem["steady"]["gpu_mib"] is None else f"{mem['steady']['gpu_mib']:,.0f} -> {mem['end']['gpu_mib']:,.0f}"
            rows.append(f"{Path(d['model_dir']).name} ({c['device']}, {d['device']}) | {c['minutes']:g} | {c['sessions']} x {c['processes']} | "
                        f"{d['soak']['kills']} | {d['soak']['steps'] + d['stop']['steps']:,} | {d['compared_generations']:,} | "
                        f"{d['mismatches']} | {d['tokens_lost']} | {d['cancelled']} | "
                        f"{', '.join(f'{k} {v}' for k, v in d['stop']['errors_by_code'].items()) or 'none'} | "
                        f"{d['idle']['free_slots']}/{d['idle']['n_slots']} | {mem['steady']['rss_mib']:,.0f} -> {mem['end']['rss_mib']:,.0f} | "
                        f"{gpu} | {'PASS' if d['ok'] else 'FAIL: ' + ', '.join(k for k, v in d['checks'].items() if not v)}")
        return table(["model (device)", "minutes", "sessions x processes", "kills", "steps", "generations compared", "mismatches",
                      "tokens lost", "CANCELLED", "errors at the stop", "slots free after", "server RSS MiB", "GPU MiB", "result"],
                     rows, self.source(*found.values()))

    def abuse(self) -> str:
        found = newest(self.results, "abuse")
        if not found:
            return "No abuse results yet.\n"
        rows = []
        for path in found.values():
            d = self.load(path)
            idle = d["idle"]["rss_mib"]
            for a in d["attempts"]:
                rows.append(f"{a['attempt']} | {a['status']} | {a['longest_health_ms']:.1f} | {a['peak_rss_mib'] - idle:+.0f} | "
                            f"{a['peak_threads']} | {a['witness_longest_step_ms']:.1f}")
            rows.append(f"**{d['model']} ({d['device']}): witnesses {d['witness_equal']}/{d['witness_streams']} equal to plain, "
                        f"idle RSS {idle:,.0f} MiB, requests up to {d['request_limit_bytes'] / (1 << 20):.2f} MiB** | "
                        f"**{'PASS' if d['pass'] else 'FAIL'}** | | | |")
        return table(["attempt", "status", "longest health ms", "RSS over idle MiB", "server threads", "witness's longest step ms"],
                     rows, self.source(*found.values()))

    def fp8_walk(self) -> str:
        found = newest(self.results, "fp8_walk")
        if not found:
            return "No fp8_walk results yet.\n"
        rows = []
        for variant, path in sorted(found.items()):
            d = self.load(path)
            counts, dense = d["weights_per_step"], d["dense"]

            def pinned_us(shape: str, rows_: int) -> float:  # the pinned config, timed before and after the candidates
                runs = [dense[shape][c][str(rows_)] for c in ("pinned", "pinned_again") if c in dense[shape]]
                return sum(runs) / len(runs)

            sizes = {shape: [int(v) for v in shape.split("x")] for shape in counts}
            one_row = sum(counts[s] * n * k for s, (n, k) in sizes.items()) / sum(counts[s] * pinned_us(s, 1) for s in counts) / 1e6
            many = max(d["timed_rows"])
            tflops = (sum(counts[s] * 2 * many * n * k for s, (n, k) in sizes.items())
                      / sum(counts[s] * pinned_us(s, many) for s in counts) / 1e6)
            shapes = ", ".join(f"{s} x{counts[s]}: {pinned_us(s, 1):.1f} / {pinned_us(s, many):.1f}" for s in counts)
            kept = "-"  # files from before the model kept the real weights
            if all("kept_real" in dense[s] for s in counts):
                flops = sum(counts[s] * 2 * many * n * k for s, (n, k) in sizes.items())
                kept = f"{flops / sum(counts[s] * dense[s]['kept_real'][str(many)] for s in counts) / 1e6:.0f}"
            label = f", {variant}" if variant else ""
            rows.append(f"{d['config']}{label} | {d['device']}, {d['date']} | {one_row:.2f} | {tflops:.0f} | {kept} | {shapes}")
        return table(["config", "device, date", "one row, TB/s of FP8 weight", f"{many} rows, TFLOP/s (dequantized per call)",
                      f"{many} rows, TFLOP/s (the kept real weight)", f"per weight: us at 1 / {many} rows"], rows,
                     self.source(*found.values()))

    def delta_rule_prefill(self) -> str:
        found = newest(self.results, "delta_rule_prefill")
        if not found:
            return "No results yet.\n"
        rows = []
        for path in found.values():
            d = self.load(path)
            precision = d.get("chunked_precision", "ieee")  # absent: a file from before the option
            for f in d["shapes"]:
                tiles = ", ".join(f"{tile} {t['ms']:.3f}{'' if t['same_bits'] else ' (OTHER BITS)'}"
                                  for tile, t in f.get("serial_tiles", {}).items()) or "-"
                rows.append(f"{d['heads']} heads, {d['d_k']} x {d['d_v']}, sub-chunks of {d['chunk']}, {precision} products | "
                            f"{d['device']}, {d['date']} | "
                            f"{f['sequences']} x {f['rows'] // f['sequences']:,} | {f['serial_ms']:.3f} | {tiles} | {f['chunked_ms']:.3f} "
                            f"({f['chunked_x_serial']:.2f}x) | {f['max_state_difference']:.1e} of {f['state_scale']:.2f}")
        return table(["shape", "device, date", "prompts x rows", "serial walk, ms a layer",
                      "serial walk in other tiles (BLOCK_V x warps), ms", "chunked, ms a layer (x serial)",
                      "largest state difference (of the state's scale)"], rows, self.source(*found.values()))

    def prefill(self) -> str:
        def together(d: dict) -> str:
            if "together_ms" not in d:  # a file from before prompts shared turns
                return "- | "
            return (f"{d['arriving']} x {d['prompt_tokens']:,}: {d['together_ms']:.1f} ({d['together_x_floor']:.2f}x, "
                    f"{d['together_x_one_by_one']:.2f}x), turns of {d['prefill_rows']:,} rows, "
                    f"{'= each alone' if d['together_equals_alone'] else 'DIFFERS FROM ALONE'} | ")

        def open_gpu(d: dict) -> str:
            b = d.get("ttft_kernel_breakdown")
            if not b:  # a file from before the bench profiled an open
                return "-"
            top = ", ".join(f"{t['kernel'].lstrip('_').removesuffix('_kernel')} {t['device_ms']:.0f}" for t in b["top"][:4])
            return f"{b['device_ms']:.0f} ({b['launches']:,}): {top}"

        def forms(d: dict) -> str:
            """Prefill's optional kernels the run took (absent: a file from before the switch)."""
            labels = (("chunked_delta_rule", "chunked delta rule"), ("tiled_attention", "tiled attention"),
                      ("expert_tiles", "expert tiles"))
            taken = [label for key, label in labels if d.get(key)]
            if d.get("chunked_delta_rule") and d.get("chunked_precision") not in (None, "ieee"):  # absent: before the option
                taken.append(f"{d['chunked_precision']} products")
            if d.get("expert_walk") not in (None, "scale-after"):  # absent: a file from before the option
                taken.append(f"experts' {d['expert_walk']} walk")
            if d.get("conv_run_rows"):  # absent or 0: a step's few runs
                taken.append(f"conv runs of {d['conv_run_rows']} rows")
            if d.get("heads_rows", 1) > 1:  # absent or 1: a program a row
                taken.append(f"head split {d['heads_rows']} rows a program")
            return f", {', '.join(taken)}" if taken else ""

        def inside(d: dict) -> str:
            """Where the arriving prompts ran: inside the steps (absent or 0: turns of their own)."""
            if not d.get("step_prompt_rows"):
                return ""
            same = "" if d.get("arriving_equal_alone", True) else ", DIFFER FROM ALONE"
            return f", inside steps of {d['step_prompt_rows']:,} prompt rows{same}"

        found = newest(self.results, "prefill")
        if not found:
            return "No prefill results yet.\n"
        rows = []
        for path in found.values():
            d = self.load(path)
            rows.append(f"{d['config']} ({d['scale']}{forms(d)}) | {d['device']}, {d['date']} | {d['prompt_tokens']:,} in chunks of "
                        f"{d['prefill_chunk']:,} | "
                        f"{d['ttft_cold_ms']:.1f} ({d['ttft_x_floor']:.2f}x of {d['ttft_floor_ms']:.1f}) | "
                        f"{d['ttft_cached_ms']:.1f} ({d['cached_tokens']:,} restored), "
                        f"{'= cold' if d['cached_equals_cold'] else 'DIFFERS FROM COLD'} | "
                        f"{together(d)}"
                        f"{d['step_p99_alone_ms']:.1f} / {d['step_p99_arriving_ms']:.1f} ({d['step_p99_ratio']:.2f}x), "
                        f"{d['running']} running, {d['arriving']} arriving{inside(d)} | {open_gpu(d)}")
        return table(["config", "device, date", "prompt tokens", "first token, cold ms (x its compute floor)",
                      "first token from a cached prefix, ms", "prompts arriving together: all in, ms (x their floors, x one by one)",
                      "p99 between decode steps, ms: alone / while prompts arrive",
                      "a cold open on the GPU: kernels' ms (launches), the top four"],
                     rows, self.source(*found.values()))

    def serve(self) -> str:
        rows, paths = [], []
        for variant, path, name, m in self.serve_models():
            d = self.load(path)
            if path not in paths:
                paths.append(path)
            label = name if not variant else f"{variant}"
            rows.append(f"{label} | {m['engine_tokens_per_s']:,.0f} | {m['service_tokens_per_s']:,.0f} | "
                        f"{m['service_over_engine']:.3f} | {m['service_tokens_per_s_more_processes']:,.0f} | "
                        f"{m['p50_ms']:.2f} | {m['p99_ms']:.2f} | {m['graph_captures_during_load']} | "
                        f"{m['random_drafts_vs_plain_b64']:.3f} | {m['oracle_trimmed_vs_untrimmed']:.3f} | {m['mismatches']} | "
                        f"{d['device']}, {d['date']}")
        return table(["model", "engine tok/s", "service tok/s", "service / engine", "2x processes tok/s", "p50 ms",
                      "p99 ms", "captures during load", "random K=4 / plain", "oracle trimmed / untrimmed", "mismatches",
                      "device, date"], rows, self.source(*paths)) + self.serve_breakdown()

    def serve_breakdown(self) -> str:
        """Where a plain round goes (bench/serve_breakdown.py), for the models of the serve table
        whose file times it (the same file as their row above); nothing for files from before the
        round timings."""
        rows, paths = [], []
        for variant, path, name, m in self.serve_models():
            b = m.get("round_breakdown_ms")
            if not b:
                continue
            if path not in paths:
                paths.append(path)
            rows.append(f"{name if not variant else variant} | {b['round']:.2f} | {b['engine']:.2f} | "
                        f"{m['added_ms_per_round']:.2f} ({_or_dash(m['added_ms_per_round_p50'])}) | {b['server_in']:.2f} | "
                        f"{b['server_out']:.2f} | {b['wire']:.2f} | {b['drafter']:.2f} | {b['unexplained']:.2f}")
        if not rows:
            return ""
        return "\n" + table(["model", "round ms (plain)", "engine step", "added: mean (p50)", "server in", "server out",
                             "wire", "drafter", "unexplained"], rows, self.source(*paths))

    def serve_remote(self) -> str:
        """One row per variant: its newest serve file with a remote drafter part. Files whose part
        ran the MTP modes (the `mtp_skipped` key, null or why not) add two columns: MTP drafting
        through the service and in process; older files give the table as before, "-" there."""
        found = self.files_with("serve", lambda d: bool(d.get("remote_drafter")))
        remotes = [(path, self.load(path)["remote_drafter"]) for path in found.values()]
        mtp = any("mtp_skipped" in r for _, r in remotes)
        rows = []
        for path, r in remotes:
            engine = r.get("server_engine_ms_per_round", {}).get("remote_plain")
            cells = [str(r["k"]), f"{r['plain_tokens_per_s']:.1f}", f"{r['remote_model_tokens_per_s']:.1f}",
                     f"{r['remote_model_speedup']:.2f}x", f"{r['inprocess_model_speedup']:.2f}x",
                     f"{r['ms_per_round']['remote_plain']:.2f} / {r['ms_per_round']['inprocess_plain']:.2f}",
                     "-" if engine is None else f"{engine:.2f}"]
            if mtp:
                cells += [_mtp_cell(r, "remote"), _mtp_cell(r, "inprocess")]
            rows.append(" | ".join(cells + [_streams_equal(r), f"`{self.rel(path)}`"]))
        head = ["MTP through the service: tok/s (x remote plain), mean acceptance length",
                "MTP in process: tok/s (x in-process plain), mean acceptance length"] if mtp else []
        return table(["K", "plain tok/s (remote)", "model drafter tok/s (remote)", "remote speedup", "in-process speedup",
                      "ms a plain round: remote / in process", "of it the server's engine", *head, "streams equal", "file"], rows, "")

    def service_floor(self) -> str:
        rows, paths = [], []
        for variant, path in self.files("rpc_floor").items():
            d = self.load(path)
            paths.append(path)
            f = d["figures"]
            rows.append(f"`bench.rpc_floor` | {d['device']} | empty unary call {f['grpc_empty_unary_us']:g} us; event loop "
                        f"to engine thread and back {f['thread_handoff_us']:g} us; one-step Verify, no model {f['verify_one_step_us']:g} us")
        for variant, path in self.files("server_overhead").items():
            d = self.load(path)
            paths.append(path)
            for label, shapes in d["microseconds_per_step"].items():
                figures = "; ".join(f"{shape} {s['server_cpu_us_per_step']:g} us CPU, {s['wall_us_per_step']:g} us wall"
                                    for shape, s in shapes.items())
                rows.append(f"`bench.server_overhead` ({d['sessions']} sessions) | {d['device']} | {figures}")
        return table(["bench", "host", "per step"], rows, self.source(*paths))

    def goodput_policy(self) -> str:
        path, d = self.one("goodput_policy")
        rows = []
        for key, v in d["microseconds_per_call"].items():
            sessions, k = re.match(r"(\d+)_sessions_k(\d+)", key).groups()
            v = v.get("vectorised", v)  # files that timed a second path for small batches: the path served now
            rows.append(f"{sessions} | {k} | {v['trim_us']:g} | {v['observe_us']:g}")
        return table(["sessions", "K", "trim (us)", "observe (us)"],
                     rows, f"{d['device']}, best of five runs of {d['calls']:,} calls. " + self.source(path))

    def parity_unseen(self) -> str:
        path, d = self.one("parity_unseen")
        rows = []
        for family, r in d["results"].items():
            spec = r["speculative_equals_plain"]
            rows.append(f"{family} | {'yes' if r['greedy_equals_hf'] else 'NO'} ({r['tokens']} tokens) | "
                        f"{r['max_relative_logit_error']:.1e} | {sum(spec.values())}/{len(spec)}")
        return table(["family", "greedy tokens = HF", "max relative logit error", "speculative runs = plain"], rows,
                     f"{d['device']}, transformers {d['transformers']}. " + self.source(path))

    # --- README.md -------------------------------------------------------------------------------

    def device_of(self, path: Path) -> str:
        """The GPU a results file was measured on, short ("H100", "H200"): figures compare only within one."""
        d = self.load(path)
        name = d.get("device") if "environment" not in d else d["environment"].get("gpu") or d["environment"].get("device", "?")
        return next((part for part in name.split() if part[:1] in "HABL" and part[1:].isdigit()), name)

    def summary(self) -> str:
        gpu_path, g = self.one("gpu")
        m = g["models"]["qwen35_2b"]
        b64 = m["batch"]["64"]
        woa = m["rollback"]["woa"]
        fp8 = {v: p for v, p in self.files("fp8_real_size").items()}
        # the newest; among one date's, one of the kernels as they are (no label beyond the device: a
        # comparison run names what it changes) and with each step's own floor (the fuller measurement)
        fp8_path = fp8[max(fp8, key=lambda v: (self.load(fp8[v])["date"], self.labelled(fp8[v])["label"] == self.load(fp8[v])["config"],
                                               "step_floors" in self.load(fp8[v]), v))]
        f = self.load(fp8_path)
        checks = [(p, self.load(p)) for v, p in self.files("check").items() if "fp8" in v and self.load(p)["passed"]]
        rows = [
            f"2B hybrid (Qwen3.5-style, bf16), decode at batch 1 | {m['decode_ms']:.2f} ms, {m['decode_ms'] / m['hbm_floor_ms']:.2f}x "
            f"its HBM floor ({m['hbm_floor_ms']:.2f} ms) | {self.device_of(gpu_path)} | `{self.rel(gpu_path)}`",
            f"2B, verify K = 8 drafts at batch 1 | {m['verify_ms']['8']:.2f} ms, {m['verify_ms']['8'] / m['decode_ms']:.2f}x "
            f"a decode step | {self.device_of(gpu_path)} | `{self.rel(gpu_path)}`",
            f"2B, 64 sequences: decode / verify K = 8 | {b64['decode_ms']:.2f} / {b64['verify8_ms']:.2f} ms "
            f"({b64['verify8_ms'] / b64['decode_ms']:.2f}x); the decode {b64['decode_ms'] / b64['hbm_floor_ms']:.2f}x its floor "
            f"(weights and fp32 states, {b64['hbm_floor_ms']:.2f} ms) | {self.device_of(gpu_path)} | `{self.rel(gpu_path)}`",
            f"2B, write-on-accept rollback (a = 4 of K = 8) | {woa['rollback_ms']:.3f} ms, {woa['rollback_ms'] / woa['verify_ms']:.1%} "
            f"of its verify | {self.device_of(gpu_path)} | `{self.rel(gpu_path)}`",
        ]
        if checks:
            names = ", ".join(p.stem.split("_", 2)[2] for p, _ in checks)
            rows.append(f"`verifier check` at full size in block FP8 ({names}): a batch of "
                        f"{checks[0][1]['settings']['sequences']} against each sequence alone | PASS: "
                        + "; ".join(f"{c['rows_equal']}/{c['rows_checked']} rows, {c['states_equal']}/{c['states_checked']} layer states"
                                    for _, c in checks) + f" | {self.device_of(checks[0][0])} | " + ", ".join(f"`{self.rel(p)}`" for p, _ in checks))
        figures = ("decode_ms_b1", "verify_k8_ms_b1", "decode_ms_b64", "verify_k8_ms_b64")
        if "step_floors" in f:  # each figure against its own floor
            times = " / ".join(f"{f[k]:.2f} ({f['step_floors'][k]['ratio']:.1f}x)" for k in figures)
            rows.append(f"{f['config']} block FP8 at full size: decode b=1 / K = 8 b=1 / decode b=64 / K = 8 b=64 | {times} ms "
                        f"(x each step's own memory floor), {f['gpu_memory_gib']:.1f} GiB | {self.device_of(fp8_path)} | `{self.rel(fp8_path)}`")
        else:
            rows.append(f"{f['config']} block FP8 at full size: decode b=1 / K = 8 b=1 / decode b=64 | {f['decode_ms_b1']:.2f} / "
                        f"{f['verify_k8_ms_b1']:.2f} / {f['decode_ms_b64']:.2f} ms ({f['decode_ms_b1'] / f['hbm_floor_ms']:.1f}x "
                        f"its floor at batch 1), {f['gpu_memory_gib']:.1f} GiB | {self.device_of(fp8_path)} | `{self.rel(fp8_path)}`")
        mtp = f.get("mtp_draft") or {}
        if mtp.get("drafts") and all(d.get("ms") is not None for d in mtp["drafts"].values()):
            cells = " / ".join(f"{d['ms']:.2f} ({d['ratio']:.1f}x)" for _, d in sorted(mtp["drafts"].items()))
            rows.append(f"{f['config']} block FP8: its MTP head drafting K = {' / '.join(sorted(mtp['drafts']))} tokens at b=1 "
                        f"(one CUDA graph replay) | {cells} ms (x its own memory floor) | {self.device_of(fp8_path)} | `{self.rel(fp8_path)}`")
        served = self.files_with("serve", lambda d: (d.get("remote_drafter") or {}).get("remote_mtp_tokens_per_s") is not None)
        if served:
            path = max(served.values(), key=lambda p: self.load(p)["date"])
            r = self.load(path)["remote_drafter"]
            rows.append(f"Shipped target and its own MTP head, K = {r['k']}, one session: tokens/s through the service / in process | "
                        f"{r['remote_mtp_tokens_per_s']:,.0f} ({r['remote_mtp_speedup']:.2f}x plain; the remote draft model "
                        f"{r['remote_model_speedup']:.2f}x) / {r['inprocess_mtp_tokens_per_s']:,.0f} ({r['inprocess_mtp_speedup']:.2f}x; "
                        f"the draft model {r['inprocess_model_speedup']:.2f}x), "
                        + ("streams = plain" if all(r.get("streams_equal_by_mode", {"": r["streams_equal"]}).values()) else "STREAMS DIFFER")
                        + f" | {self.device_of(path)} | `{self.rel(path)}`")
        for _, p, name, mm in self.serve_models():  # each model's newest file that served it
            if name == "shipped":  # the 24M target's step is small beside the round trip, so its ratio would measure the RPC: bench/README.md
                continue
            label = "2B" if name == "2b" else (p.stem.split("_", 2)[2] if p.stem.count("_") > 1 else name)
            rows.append(f"Through the gRPC service, 64 sessions, {label}: tokens/s over the engine's alone | "
                        f"{mm['service_over_engine']:.2f} ({mm['service_tokens_per_s']:,.0f} / {mm['engine_tokens_per_s']:,.0f}), "
                        f"{mm['mismatches']} streams differ | {self.device_of(p)} | `{self.rel(p)}`")
        return table(["what", "today", "device", "results file (bench/results/)"], rows, "")

    def bench_readme_tables(self) -> dict[str, Callable[[], str]]:
        return {"rollback": self.rollback, "gpu": self.gpu, "gpu_time": self.gpu_time,
                "gemm": self.gemm, "fp8_real_size": self.fp8_real_size, "fp8_walk": self.fp8_walk, "contract": self.contract,
                "acceptance": self.acceptance, "load": self.load_table, "soak": self.soak, "abuse": self.abuse, "prefill": self.prefill,
                "delta_rule_prefill": self.delta_rule_prefill, "serve": self.serve,
                "serve_remote": self.serve_remote, "service_floor": self.service_floor,
                "goodput_policy": self.goodput_policy, "parity_unseen": self.parity_unseen}


def _or_dash(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _mtp_cell(remote: dict, side: str) -> str:
    """MTP drafting on one side ("remote": through the service, "inprocess"): tok/s (x that side's
    plain), mean acceptance length; "-" for a file from before the MTP modes, "skipped" when they
    did not run (the served target has no MTP head)."""
    if "mtp_skipped" not in remote:
        return "-"
    tokens_per_s = remote.get(f"{side}_mtp_tokens_per_s")
    if remote["mtp_skipped"] or tokens_per_s is None:
        return "skipped"
    return (f"{tokens_per_s:.1f} ({remote[f'{side}_mtp_speedup']:.2f}x), "
            f"{remote[f'{side}_mtp_mean_acceptance_length']:.2f}")


def _streams_equal(remote: dict) -> str:
    """Whether every mode's streams were equal: yes or NO; with each mode's comparison recorded,
    how many modes were compared, or the modes whose streams differ from remote plain's."""
    by_mode = remote.get("streams_equal_by_mode")
    if not by_mode:
        return "yes" if remote["streams_equal"] else "NO"
    differ = [mode for mode, equal in by_mode.items() if not equal]
    return f"NO: {', '.join(differ)}" if differ else f"yes ({len(by_mode)} modes)"


def table(head: list[str], rows: list[str], note: str) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head), *(f"| {row} |" for row in rows)]
    return "\n".join(lines) + ("\n\n" + note if note else "") + "\n"


def fill(text: str, tables: dict[str, Callable[[], str]], where: str) -> str:
    """text with every marked table regenerated; ValueError for a marker with no table or a table with no marker."""
    seen = set()

    def one(m: re.Match) -> str:
        name = m["name"]
        if name not in tables:
            raise ValueError(f"{where}: <!-- report:{name} --> names no table (known: {', '.join(sorted(tables))})")
        seen.add(name)
        return m.group(1) + tables[name]() + m.group(4)

    out = MARKER.sub(one, text)
    missing = sorted(set(tables) - seen)
    if missing:
        raise ValueError(f"{where}: no <!-- report:NAME --> ... <!-- /report:NAME --> markers for {', '.join(missing)}")
    return out


def generate(results: Path = RESULTS, bench_readme: Path = BENCH_README, readme: Path = README) -> dict[Path, str]:
    """{markdown file: its text with the tables regenerated}."""
    tables = Tables(results)
    return {bench_readme: fill(bench_readme.read_text(), tables.bench_readme_tables(), str(bench_readme)),
            readme: fill(readme.read_text(), {"summary": tables.summary}, str(readme))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.report", description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 when a file differs from what it would be")
    args = parser.parse_args(argv)
    try:
        wanted = generate()
    except (ValueError, FileNotFoundError, KeyError) as exc:
        print(f"bench.report: {exc}", file=sys.stderr)
        return 1
    stale = [path for path, text in wanted.items() if path.read_text() != text]
    if args.check:
        for path in stale:
            print(f"bench.report: the tables in {path.relative_to(REPO)} differ from what bench/results gives; "
                  f"run `python -m bench.report` and commit the result", file=sys.stderr)
        return 1 if stale else 0
    for path in stale:
        path.write_text(wanted[path])
        print(f"wrote {path.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
