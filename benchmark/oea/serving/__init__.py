"""Serving benchmarks: OEA against plain routing through real SGLang servers (speed and output quality)."""
