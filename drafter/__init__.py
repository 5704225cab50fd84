"""Drafter side: proposers, the client of the verifier service and the generation loop.

    python -m drafter generate --server HOST:PORT --prompt-ids 1,2,3 --max-new-tokens 32

Nothing here imports torch: drafting n-grams or random ids needs only grpcio, protobuf and numpy.
"""
