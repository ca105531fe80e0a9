"""CPU costs of the OEA routing path and of the --oea-check-ranks guard."""
