"""`python -m jax_sparse_mla`: the self-description runs and covers every op that dispatches."""

from __future__ import annotations

import jax

from jax_sparse_mla import __main__ as self_description
from jax_sparse_mla.kernels import native, registry


def test_self_description_names_versions_device_and_every_dispatching_op(capsys):
    self_description.main()
    printed = capsys.readouterr().out
    assert f"jax {jax.__version__}" in printed
    assert f"default device: {jax.devices()[0].platform}" in printed
    assert ("native extension: built" in printed) == (native.module is not None)
    for cache in ("bf16", "fp8 (e4m3)", "fp8_ds_mla"):
        assert f"sparse_mla_decode, {cache} cache: " in printed
    assert "convert_req_index_to_global_index, filter_and_convert_dcp_index:" in printed
    for case in ("in place or counts only: ", "compact, T < 128, no DCP: ",
                 "compact, T >= 128 or DCP: "):
        assert case in printed
    ops = {k.op for k in registry.registered_op_kernels()}
    assert len(ops) == 6
    for op in ops:
        assert f"  {op}: " in printed
    if registry.current_device_capability() is None:
        assert "sparse_mla_decode, bf16 cache: xla (pure JAX: the default device is not a CUDA GPU)" \
            in printed


def test_extension_line_carries_the_kernel_table_when_sm100_is_built(capsys):
    info = native.build_info()
    self_description.main()
    printed = capsys.readouterr().out
    if "sm100" in info:
        assert (f"TRTLLM-gen kernel table {info['trtllm_gen_metainfo_hash']} "
                f"({info['trtllm_gen_num_kernels']} kernels)") in printed
    else:
        assert "TRTLLM-gen" not in printed
