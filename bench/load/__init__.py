"""The load benchmark: many drafter processes against one verifier on loopback.
How it measures, what it checks and writes: bench/README.md, Methods, `bench.load`.
"""
