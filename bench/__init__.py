"""Benchmarks: `python -m bench quick` (`make bench`) compares radixserve with baselines in the same run."""
