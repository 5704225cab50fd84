"""Drafter side: the client of the verifier service, the generation loop and the drafter CLI. The
proposers, the sampling parameters and the generation result it shares with the verifier live
there (verifier.proposers, verifier.params, verifier.generation): drafter imports verifier, never
the other way.

    python -m drafter generate --server HOST:PORT --prompt-ids 1,2,3 --max-new-tokens 32

Nothing here imports torch: drafting n-grams or random ids needs only grpcio, protobuf and numpy.
"""
