"""Host-side scheduler (NumPy only, never jax): page-table checks, Algorithm 1, plan buffers."""
