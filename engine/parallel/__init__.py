"""Tensor parallelism (vLLM's `--tensor-parallel-size`): weight sharding (tp.py), communicators (comm.py),
the rank processes (runtime.py) and the one decision of whether a size can run here (config.py)."""
