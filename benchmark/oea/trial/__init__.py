"""The operator's trial of OEA on a warm server they run (trial.py and the steps it calls)."""
