"""The Python side of the compiled CPU kernels (sources in the repository's kernels/csrc)."""
