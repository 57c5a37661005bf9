"""What a replica tells the cluster: per-step statistics, the periodic reports to the metrics
actor and the router, the monitor of its requests, and the log that calibrates the simulator."""
