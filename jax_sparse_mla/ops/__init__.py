"""The public pure-JAX semantics of the package: every op here runs on any JAX backend and is the
reference that the native kernels are tested against. Ops with native kernels dispatch through
`jax_sparse_mla.kernels.registry`."""
