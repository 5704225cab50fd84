"""Model shape presets, one place that bench/, tests/ and training/ import; and transformers building
them (hf_reference.py: random-weight checkpoints, and the parity oracle reading one back).

    tiny.py          SPECS: the test suite's tiny checkpoints (bench.rpc_floor and bench.server_overhead
                     serve one too)
    bench_models.py  MODELS: the GPU benches' ~2B dense model and its two MoE siblings; TINY_CONFIG:
                     the service benches' tiny model (bench.load, bench.serve)
    published.py     PUBLISHED, PUBLISHED_SIZES: published config.json files at real size
    training.py      PRESETS: the default pair's target and draft shapes, and the tiny pair

Why a folder of its own at the repository root, beside bench/ and training/: the installed product
(verifier/, drafter/, hybrid_kernels) builds no preset and never imports this folder, so it is not
one of the packages pyproject.toml installs and no shape or reference model ships with the product.
It is not under tests/ either, because bench/ and training/ use the same presets and the oracle
(bench.parity_unseen, bench.rpc_floor, bench.server_overhead, training's evaluation), and tests/ is
no importable package (tests/conftest.py puts tests/ itself on sys.path). Run from the repository
root, as the tests, the benches and `python -m training` are, all three import it by one name.
Nothing keeps a copy of a preset: the GEMM benches (bench/gemm.py, bench/linear_configs.py) derive
their weight shapes from DENSE_2B (bench_models.weight_shapes).
"""
