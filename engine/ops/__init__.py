"""The op library: the engine's kernels, written in the jitkern DSL, with host wrappers.

One module per op family; each module holds the kernels and thin numpy-facing wrappers that pick tile
sizes and launch. Numpy references live next to the tests (tests/ops/).
"""
