"""Offline studies of routing: the simulator, router statistics, quality against T, policies."""
