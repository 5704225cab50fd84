"""The done-when check of issues 2 and 3, as a new user would run it, on checkpoints the tests never see.

For one new checkpoint per family (shapes unlike the tests' SPECS in presets/tiny.py),
saved by transformers:
  - `python -m verifier generate` greedy tokens vs HF `generate`, and the --logits-out rows vs HF's
    logits (max |ours - hf| / max |hf|; the issue's bound is 1e-3);
  - plain vs speculative CLI runs (random, oracle, ngram drafts x woa, snapshot rollback x greedy
    and --temperature 0.9 --seed 42): identical tokens and bitwise identical --logits-out arrays.
Needs the test extras (transformers). Writes parity_unseen_<date>.json under --out.

    python -m bench.parity_unseen [--out bench/results]
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

from bench.machine import device_name
from verifier.arguments import DefaultsHelpFormatter
from presets.hf_reference import build_hf_model, load_hf

REPO = Path(__file__).resolve().parent.parent



def _schedule(kinds: str) -> dict:
    """The layer schedule `kinds` (one letter a layer, in order: L linear attention, F full attention) as
    config fields: layer_types and the num_hidden_layers it implies."""
    layer_types = [{"L": "linear_attention", "F": "full_attention"}[kind] for kind in kinds]
    return dict(num_hidden_layers=len(layer_types), layer_types=layer_types)


# name (also the transformers family it is built as) -> config fields
SPECS = {
    "qwen3_next": dict(
        vocab_size=120, hidden_size=56, intermediate_size=90, num_hidden_layers=6, full_attention_interval=3,
        num_attention_heads=8, num_key_value_heads=2, head_dim=14, linear_num_key_heads=3, linear_num_value_heads=6,
        linear_key_head_dim=10, linear_value_head_dim=14, linear_conv_kernel_dim=4, num_experts=5, num_experts_per_tok=2,
        moe_intermediate_size=20, shared_expert_intermediate_size=28, tie_word_embeddings=False),
    "qwen3_5": dict(
        vocab_size=110, hidden_size=48, intermediate_size=100, **_schedule("LFLLF"),
        num_attention_heads=6, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=8,
        linear_key_head_dim=12, linear_value_head_dim=8, linear_conv_kernel_dim=2, tie_word_embeddings=False),
    "qwen3_5_moe": dict(
        vocab_size=104, hidden_size=40, **_schedule("LLFLF"),
        num_attention_heads=5, num_key_value_heads=1, head_dim=12, linear_num_key_heads=2, linear_num_value_heads=6,
        linear_key_head_dim=10, linear_value_head_dim=6, linear_conv_kernel_dim=4, num_experts=7, num_experts_per_tok=3,
        moe_intermediate_size=14, shared_expert_intermediate_size=18, tie_word_embeddings=False),
    "kimi_linear": dict(
        vocab_size=100, hidden_size=44, intermediate_size=70, **_schedule("LLFLF"),
        num_attention_heads=3, num_key_value_heads=3, kv_lora_rank=10, qk_nope_head_dim=12, qk_rope_head_dim=4, v_head_dim=12,
        linear_num_heads=4, linear_head_dim=8, linear_conv_kernel_dim=3, num_experts=6, num_experts_per_tok=3,
        moe_intermediate_size=12, num_shared_experts=1, routed_scaling_factor=1.7, num_expert_group=3, topk_group=2,
        first_k_dense_replace=2, pad_token_id=0, bos_token_id=1, eos_token_id=99),
}
PROMPT = [7, 8, 9, 10, 7, 8, 9, 11, 12]
NEW = 30


def cli(*args) -> dict:
    proc = subprocess.run([sys.executable, "-m", "verifier", "generate", *map(str, args)], capture_output=True, text=True, cwd=REPO)
    if proc.returncode:
        raise RuntimeError(proc.stderr)
    return json.loads(proc.stdout)


def check(name: str, family: str, fields: dict, tmp: Path) -> dict:
    path = tmp / name
    build_hf_model(family, fields, seed=123).save_pretrained(path)
    hf = load_hf(path)
    ids = torch.tensor([PROMPT])
    out = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                      output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    hf_tokens = out.sequences[0, len(PROMPT):].tolist()
    hf_logits = torch.stack([row[0] for row in out.logits]).numpy()
    prompt = ",".join(map(str, PROMPT))
    plain = cli("--model", path, "--prompt-ids", prompt, "--max-new-tokens", NEW, "--json", "--logits-out", tmp / "plain.npy")
    ours = np.load(tmp / "plain.npy")
    n = len(plain["tokens"])
    result = {
        "greedy_equals_hf": plain["tokens"] == hf_tokens[:n],
        "tokens": n,
        "max_relative_logit_error": float(np.abs(ours - hf_logits[:n]).max() / np.abs(hf_logits[:n]).max()),
        "speculative_equals_plain": {},
    }
    for label, sampling in (("greedy", []), ("t0.9-seed42", ["--temperature", "0.9", "--seed", "42"])):
        base = cli("--model", path, "--prompt-ids", prompt, "--max-new-tokens", NEW, "--json", "--logits-out", tmp / "base.npy", *sampling)
        for draft in ("random", "oracle", "ngram"):
            for mode in ("woa", "snapshot"):
                spec = cli("--model", path, "--prompt-ids", prompt, "--max-new-tokens", NEW, "--json", "--logits-out", tmp / "spec.npy",
                           "--draft", draft, "--k", 5, "--rollback", mode, *sampling)
                same = spec["tokens"] == base["tokens"] and np.array_equal(np.load(tmp / "spec.npy"), np.load(tmp / "base.npy"))
                result["speculative_equals_plain"][f"{label}/{draft}/{mode}"] = same
    print(name, json.dumps(result), flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.parity_unseen", description=__doc__.split("\n")[0],
                                     formatter_class=DefaultsHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results", help="directory for parity_unseen_<date>.json (default: the repository's bench/results)")
    args = parser.parse_args()
    today = datetime.date.today().isoformat()
    with tempfile.TemporaryDirectory() as tmp:
        results = {name: check(name, name, fields, Path(tmp)) for name, fields in SPECS.items()}
    out = {"benchmark": "parity_unseen", "device": device_name(), "date": today, "torch": torch.__version__,
           "transformers": __import__("transformers").__version__, "results": results}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"parity_unseen_{today}.json"
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
