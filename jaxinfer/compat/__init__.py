"""Drop-in entry points with other JAX engines' signatures, implemented on jaxinfer.

- jaxinfer.compat.tpu_inference: tpu-inference's ragged paged attention v3 (RPA v3), the
  call that tpu-inference and sglang-jax models make each layer, over RPA v3's fused KV cache.
"""
from jaxinfer.compat import tpu_inference

__all__ = ["tpu_inference"]
