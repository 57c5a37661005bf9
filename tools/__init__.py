"""Tools and benches around the product: the engine's in-process benchmarks and the tiny
model's evaluation (``tools.bench``), the cluster simulator and its calibration
(``tools.capacity``), the tiny model's training (``tools.tiny_training``), and the
`dllm-serve` command line that gathers every package's commands (``tools.cli``)."""
