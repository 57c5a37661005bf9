"""The cluster simulator and its calibration (fitted to an engine run or measured on a
running cluster), and the benches that hold it against the engine and the cluster."""
