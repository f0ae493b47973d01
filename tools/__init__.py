"""Developer tools the installed package never imports: benchmarks (`bench_*`, `compare_bench`,
`profile_decode`, `load_test`), quality measurements (`sparse_quality`, `factual_eval`), synthetic models
(`make_synthetic_model`), the fuzzer (`fuzz/`), the import-order check (`import_graph`) and the GPU machine's
scripts. Run from the repository's root: `python -m tools.NAME`."""
