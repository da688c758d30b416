"""Served-model tooling for the tests, the benchmarks, the demo and the GPU check (not needed by
the server itself): `launcher` (start and stop `python -m sglang.launch_server`), `ports`, `models`
(real small models fetched with pip), `tiny_model`, `answers` (answer extraction),
`hf_reference` (the transformers decode loop with the same eviction) and `gpu_check`.

Nothing here imports SGLang: the GPU check runs on an image without it."""
