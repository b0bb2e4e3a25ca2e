"""Pallas kernels (GPU via the Triton lowering; CPU via Pallas interpret mode).

This package never imports jaxinfer or planner. Each kernel family lives in
one module whose entry point takes `impl` (the lowering: "triton" today, a
Mosaic GPU one can be registered beside it) and `interpret`.
"""
