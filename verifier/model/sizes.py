"""The sizes the engine's defaults are made for, stated once; the graph buckets
(verifier/model/graphs.py) and the padding (verifier/model/padding.py) derive theirs from these."""

DEFAULT_MAX_K = 8  # most drafts per step: the engine's, the server's (--max-k), generate's and check's default
FULL_BATCH_SESSIONS = 64  # sessions whose verifies at DEFAULT_MAX_K the largest default graph bucket holds
FULL_BATCH_ROWS = FULL_BATCH_SESSIONS * (DEFAULT_MAX_K + 1)  # that bucket's rows: 576
