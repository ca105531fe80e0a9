"""Modules shared by the benchmark folders: held-out windows, the A/B report, confidence intervals."""
