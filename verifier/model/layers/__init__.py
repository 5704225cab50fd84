"""One module per layer kind; each pulls its own tensors from the checkpoint and computes over a RowBatch."""
