"""Training of the shipped default model pair: a byte-level BPE tokenizer, a hybrid
target and a small draft model, trained on the Python standard library's own source.

`python -m training run --out models --time-budget-s 480 --device cuda` does everything in one
command that ends within its budget; `python -m training evaluate --models models` recomputes
the model card's figures with the verifier's own engine.

It is not a benchmark and not part of the installed
package: it needs transformers (a test extra) and runs from the repository root, like bench/.
"""

PROG = "python -m training"  # the command line every message, recorded run and card names
