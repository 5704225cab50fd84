"""Benchmarks: short scripts that check correctness, then time, then write JSON under bench/results/.

Each runs as a module from the repository root (`python -m bench.rollback`, `python -m bench.load`,
...) and imports the project as packages: nothing here patches sys.path or imports from tests/.
"""
