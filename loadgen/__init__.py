"""The HTTP load generator: open- and closed-loop load against an OpenAI-compatible endpoint,
its records, statistics, reports and plots, and the benches that load a running cluster
(`bench overload`, `bench soak`). It imports neither torch nor the engine."""
