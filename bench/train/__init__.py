"""Training of the shipped default model pair (issue 7): a byte-level BPE tokenizer, a hybrid
target and a small draft model, trained on the Python standard library's own source.

`python -m bench.train run --out models --time-budget-s 480 --device cuda` does everything in one
command that ends within its budget; `python -m bench.train evaluate --models models` recomputes
the model card's figures with the verifier's own engine.
"""
