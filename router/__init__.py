"""Router: live view of workers, pairing policy, the two-leg prefill -> decode transaction."""
