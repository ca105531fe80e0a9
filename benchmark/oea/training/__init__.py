"""Training of the small MoE checkpoints shipped in benchmark/oea/models/."""
