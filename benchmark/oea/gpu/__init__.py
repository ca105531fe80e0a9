"""GPU checks of the fused OEA kernel and the runtime path (torch and Triton; no SGLang needed)."""
