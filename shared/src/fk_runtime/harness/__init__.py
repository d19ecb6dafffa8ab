"""fk-runtime's harness: the float64 reference checks the tests use (`testing`, `pytest_plugin`),
the benchmark sweeps (`bench`) and the main job (`cli`, `python -m fk_runtime`). No op call imports
anything from here; an op's users need none of it (fk-runtime's `test` and `bench` extras)."""
