"""The load benchmark: many drafter processes against one verifier on loopback.

    python -m bench.load --out bench/results [--model DIR] [--sessions 64] [--processes 4] [--steps 300]

One `python -m verifier serve` subprocess (or --server HOST:PORT); several drafter processes
(drafters.py), each running many concurrent sessions with the one generation loop
(drafter.loop.DraftLoop): by default through drafter/fleet.py, one request per round for all of
a process's sessions on a VerifyRounds stream (--transport fleet-verify: a Verify call per round;
stream|unary: a VerifyStream or a Verify call per session); every session's
token stream is then compared with plain decoding of the same prompt on a separate engine
(reference.py). Writes load_<date>[_<name>].json (--name: what differs, e.g. the model). bench.serve reuses these parts.

Modules: workload (what each session does), server (the verifier subprocess), drafters (a drafter
process), processes (starting and collecting them), reference (plain decoding, timed or not, and
the comparison), report (figures and the JSON), progress (lines on stderr), cli.
"""
