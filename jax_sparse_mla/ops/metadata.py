"""Attention metadata as JAX pytrees, and the FlashInfer sparse-MLA metadata builder.

Arrays are pytree children (they trace under jit); the ints that shape the computation are static aux
data, so a change in them is a new compilation, as a change of batch layout is a new CUDA graph in vLLM.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from .. import _validation as v

# FlashInfer sparse MLA's reorder threshold by query heads per rank: longer "decodes" pay off with more heads.
_REORDER_THRESHOLD_BY_HEADS = {8: 128, 16: 128, 32: 128, 64: 256, 128: 1024}
_DEFAULT_REORDER_THRESHOLD = 1024


def _register(cls, data_fields: list[str]):
    meta_fields = [f.name for f in dataclasses.fields(cls) if f.name not in data_fields]
    return jax.tree_util.register_dataclass(cls, data_fields=data_fields, meta_fields=meta_fields)


@dataclasses.dataclass(frozen=True)
class CommonAttentionMetadata:
    """Per-step batch description, the builder's input (vLLM's CommonAttentionMetadata, trimmed).

    query_start_loc: [R + 1] int32 cumulative query lengths; seq_lens: [R] int32 context + query lengths;
    block_table_tensor: [R, W] int32 block ids; slot_mapping: [T] int32/int64 write slots (< 0 skipped).
    num_reqs, num_actual_tokens, max_query_len, max_seq_len: static ints.
    query_start_loc_cpu, seq_lens_cpu: optional host copies (tuples of ints) of the two arrays. The
    decode/prefill split needs them for a batch with max_query_len above the reorder threshold; when
    they are absent the builder reads the arrays, which works outside jit only.
    """

    query_start_loc: jax.Array
    seq_lens: jax.Array
    block_table_tensor: jax.Array
    slot_mapping: jax.Array
    num_reqs: int
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    query_start_loc_cpu: tuple[int, ...] | None = None
    seq_lens_cpu: tuple[int, ...] | None = None


_register(CommonAttentionMetadata,
          ["query_start_loc", "seq_lens", "block_table_tensor", "slot_mapping"])


@dataclasses.dataclass(frozen=True)
class FlashInferMLASparseMetadata:
    """What FlashInferMLASparseImpl.forward_mqa reads (vLLM's target-era FlashInferMLASparseMetadata).

    Arrays: query_start_loc [R + 1], slot_mapping [T], block_table [R, W], req_id_per_token [T] (padded
    tokens map to request 0), seq_lens [R] (global, not DCP-local), all int32 (slot_mapping may be int64).
    Static: the batch sizes, the decode/prefill split, block_size, topk_tokens and
    cp_kv_cache_interleave_size. prefill_max_seq_len is the longest prefill request's seq_len, or
    max_seq_len when seq_lens was traced and given without a host copy. vLLM's `prefill` (dense MHA prefill) metadata has no counterpart: this
    port runs every token through sparse MQA, which equals dense MHA while prefill lengths <= top-k.
    leading_reqs and leading_query_len (not in vLLM's class): the first leading_reqs requests all
    bring leading_query_len tokens (0 included) and the next one (if any) a different number, read
    from the host copy of query_start_loc (leading_reqs = 0 where there is none). The Flax indexer
    scores such leading requests as decodes through the paged logits when leading_query_len is small
    and gathers the keys of the other requests only (a decode-first mixed step).
    """

    query_start_loc: jax.Array
    slot_mapping: jax.Array
    block_table: jax.Array
    req_id_per_token: jax.Array
    seq_lens: jax.Array
    num_reqs: int
    max_query_len: int
    max_seq_len: int
    num_actual_tokens: int
    num_decodes: int
    num_prefills: int
    num_decode_tokens: int
    prefill_max_seq_len: int = 0
    block_size: int = 64
    topk_tokens: int = 2048
    cp_kv_cache_interleave_size: int = 1
    leading_reqs: int = 0
    leading_query_len: int = 0


_register(FlashInferMLASparseMetadata,
          ["query_start_loc", "slot_mapping", "block_table", "req_id_per_token", "seq_lens"])


def req_id_per_token(query_start_loc: jax.Array, num_tokens: int) -> jax.Array:
    """[T] int32 request of each token: the r with qsl[r] <= t < qsl[r + 1]; tokens past qsl[-1] -> 0.

    A binary search on device, so it traces under jit; zero-length requests are skipped. Unrolled
    (log2 R steps of straight-line code): the default search is a while loop, which XLA on a GPU
    runs step by step from the host outside the step's CUDA graph, one small kernel and copy per
    iteration (6 of each in a decode step of 32 requests, about 20 µs of idle GPU a step on an H100).
    """
    tokens = jnp.arange(num_tokens, dtype=query_start_loc.dtype)
    num_reqs = query_start_loc.shape[0] - 1
    req = jnp.searchsorted(query_start_loc[1:], tokens, side="right",
                           method="scan_unrolled").astype(jnp.int32)
    req = jnp.minimum(req, max(num_reqs - 1, 0))
    return jnp.where(tokens < query_start_loc[-1], req, 0)


def _host_ints(name: str, host_copy: tuple[int, ...] | None, array: jax.Array) -> np.ndarray:
    if host_copy is not None:
        return np.asarray(host_copy, dtype=np.int64)
    try:
        return np.asarray(array, dtype=np.int64)
    except (jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError):
        raise ValueError(
            f"this batch mixes decodes and prefills, so the split needs {name}_cpu in "
            "CommonAttentionMetadata when the builder runs under jit."
        ) from None


def leading_uniform_requests(query_start_loc_cpu: np.ndarray | None) -> tuple[int, int]:
    """(n, q): the first n >= 1 requests all have query length q >= 0 and request n (if any) another
    one; (0, 0) without a host copy, without requests, or when the tokens do not start at 0."""
    if query_start_loc_cpu is None or len(query_start_loc_cpu) < 2 or query_start_loc_cpu[0] != 0:
        return 0, 0
    query_lens = np.diff(np.asarray(query_start_loc_cpu, dtype=np.int64))
    first = int(query_lens[0])
    differs = query_lens != first
    return (int(np.argmax(differs)) if differs.any() else len(query_lens)), first


def split_decodes_and_prefills(
    query_start_loc_cpu: np.ndarray, max_query_len: int, num_tokens: int, decode_threshold: int
) -> tuple[int, int, int, int]:
    """(num_decodes, num_prefills, num_decode_tokens, num_prefill_tokens) of a decode-first batch.

    A request is a decode when its query length is <= decode_threshold (short extends count as decodes).
    """
    num_reqs = len(query_start_loc_cpu) - 1
    if max_query_len <= decode_threshold:
        return num_reqs, 0, num_tokens, 0
    query_lens = np.diff(query_start_loc_cpu)
    is_prefill = query_lens > decode_threshold
    if not is_prefill.any():
        return num_reqs, 0, num_tokens, 0
    first_prefill = int(np.argmax(is_prefill))
    decode_tokens = int(query_start_loc_cpu[first_prefill])
    return first_prefill, num_reqs - first_prefill, decode_tokens, num_tokens - decode_tokens


class FlashInferMLASparseMetadataBuilder:
    """Builds FlashInferMLASparseMetadata from CommonAttentionMetadata.

    num_heads: query heads per tensor-parallel rank (picks the reorder threshold);
    block_size: KV-cache block size; topk_tokens: the model's index_topk;
    cp_kv_cache_interleave_size: DCP interleave I (block_size % I == 0);
    max_decode_query_len: 1 + speculative tokens when speculative decoding is on (spec steps are decodes).
    """

    def __init__(
        self,
        *,
        num_heads: int,
        block_size: int = 64,
        topk_tokens: int = 2048,
        cp_kv_cache_interleave_size: int = 1,
        max_decode_query_len: int | None = None,
    ) -> None:
        num_heads = v.check_positive_int("num_heads", num_heads)
        self.block_size = v.check_positive_int("block_size", block_size)
        self.topk_tokens = v.check_positive_int("topk_tokens", topk_tokens)
        self.cp_kv_cache_interleave_size = v.check_positive_int(
            "cp_kv_cache_interleave_size", cp_kv_cache_interleave_size)
        if self.block_size % self.cp_kv_cache_interleave_size:
            raise ValueError(
                f"block_size ({block_size}) must be a multiple of cp_kv_cache_interleave_size "
                f"({cp_kv_cache_interleave_size})."
            )
        threshold = _REORDER_THRESHOLD_BY_HEADS.get(num_heads, _DEFAULT_REORDER_THRESHOLD)
        if max_decode_query_len is not None:
            threshold = max(threshold, v.check_positive_int("max_decode_query_len", max_decode_query_len))
        self.reorder_batch_threshold = threshold

    def build(self, common: CommonAttentionMetadata) -> FlashInferMLASparseMetadata:
        """Checks `common` (every argument before any use: TypeError for a wrong type or dtype,
        ValueError for a wrong rank, size or value) and builds the metadata.

        Checked at trace time: the static sizes (ints >= 0), query_start_loc [num_reqs + 1] int32,
        seq_lens [R] int32 and block_table_tensor [R, W] int32 (the same R >= num_reqs: a padded
        batch may have R > num_reqs rows, never fewer), slot_mapping [>= num_actual_tokens]
        int32/int64, and the host copies. Checked on values when they are concrete (eager calls, host
        copies): query_start_loc starts at >= 0, never decreases and ends at <= num_actual_tokens;
        0 <= seq_lens <= max_seq_len. Under jax.jit traced values are not checked (nothing here
        indexes with them; the Flax layers' prefill path gathers at most max_seq_len keys of a
        request).
        """
        if not isinstance(common, CommonAttentionMetadata):
            raise TypeError(f"common must be a CommonAttentionMetadata, got {type(common).__name__}.")
        num_reqs = v.check_int("num_reqs", common.num_reqs, minimum=0)
        num_tokens = v.check_int("num_actual_tokens", common.num_actual_tokens, minimum=0)
        max_query_len = v.check_int("max_query_len", common.max_query_len, minimum=0)
        max_seq_len = v.check_int("max_seq_len", common.max_seq_len, minimum=0)
        qsl_arr = v.int32_array("query_start_loc", common.query_start_loc, 1)
        seq_lens_arr = v.as_array("seq_lens", common.seq_lens)
        v.check_int32("seq_lens", seq_lens_arr)
        v.check_rank("seq_lens", seq_lens_arr, 1)
        table = v.as_array("block_table_tensor", common.block_table_tensor)
        v.check_int32("block_table_tensor", table)
        v.check_rank("block_table_tensor", table, 2)
        slot_mapping = v.as_array("slot_mapping", common.slot_mapping)
        v.check_int_dtype("slot_mapping", slot_mapping)
        v.check_rank("slot_mapping", slot_mapping, 1)
        if qsl_arr.shape != (num_reqs + 1,):
            raise ValueError(
                f"query_start_loc must have shape ({num_reqs + 1},) for num_reqs="
                f"{num_reqs}, got {tuple(qsl_arr.shape)}."
            )
        if table.shape[0] != seq_lens_arr.shape[0]:
            raise ValueError(
                f"seq_lens and block_table_tensor must have one entry per request (the same R): got "
                f"seq_lens {tuple(seq_lens_arr.shape)} and block_table_tensor {tuple(table.shape)}."
            )
        v.check_rows_cover("block_table_tensor", table, num_reqs, "requests (num_reqs)")
        if slot_mapping.shape[0] < num_tokens:
            raise ValueError(
                f"slot_mapping has {slot_mapping.shape[0]} entries for "
                f"{num_tokens} tokens (num_actual_tokens)."
            )
        qsl_host = _checked_host_copy("query_start_loc_cpu", common.query_start_loc_cpu,
                                      num_reqs + 1)
        seq_lens_host = _checked_host_copy("seq_lens_cpu", common.seq_lens_cpu,
                                           int(seq_lens_arr.shape[0]))
        for name, values in (("query_start_loc", v.host_values(qsl_arr)),
                             ("query_start_loc_cpu", qsl_host)):
            if values is not None and values.size:
                if values[0] < 0 or np.any(np.diff(values) < 0):
                    raise ValueError(f"{name} must start at >= 0 and never decrease, got "
                                     f"{values.tolist()}.")
                if values[-1] > num_tokens:
                    raise ValueError(f"{name} ends at {int(values[-1])}, past num_actual_tokens="
                                     f"{num_tokens}.")
        for name, values in (("seq_lens", v.host_values(seq_lens_arr)),
                             ("seq_lens_cpu", seq_lens_host)):
            if values is not None and np.any(values < 0):
                raise ValueError(f"{name} must be >= 0, got {values.tolist()}.")
            if values is not None:
                v.check_values_at_most(name, values, max_seq_len, "max_seq_len")
        if max_query_len <= self.reorder_batch_threshold:
            split = (num_reqs, 0, num_tokens, 0)
        else:
            qsl = _host_ints("query_start_loc", qsl_host, qsl_arr)
            split = split_decodes_and_prefills(qsl, max_query_len, num_tokens,
                                               self.reorder_batch_threshold)
        num_decodes, num_prefills, num_decode_tokens, _ = split
        prefill_max_seq_len = 0
        if num_prefills:
            seq_lens = seq_lens_host if seq_lens_host is not None else v.host_values(seq_lens_arr)
            # Traced seq_lens without a host copy (a chunked prefill's step under jit): the caller's
            # static bound max_seq_len stands in for the longest prefill.
            prefill_max_seq_len = (max_seq_len if seq_lens is None
                                   else int(np.asarray(seq_lens)[num_decodes:].max(initial=0)))
        leading_reqs, leading_query_len = leading_uniform_requests(
            qsl_host if qsl_host is not None else v.host_values(qsl_arr))
        return FlashInferMLASparseMetadata(
            query_start_loc=qsl_arr,
            slot_mapping=slot_mapping[:num_tokens],
            block_table=table,
            req_id_per_token=req_id_per_token(qsl_arr, num_tokens),
            seq_lens=seq_lens_arr,
            num_reqs=num_reqs,
            max_query_len=max_query_len,
            max_seq_len=max_seq_len,
            num_actual_tokens=num_tokens,
            num_decodes=num_decodes,
            num_prefills=num_prefills,
            num_decode_tokens=num_decode_tokens,
            prefill_max_seq_len=prefill_max_seq_len,
            block_size=self.block_size,
            topk_tokens=self.topk_tokens,
            cp_kv_cache_interleave_size=self.cp_kv_cache_interleave_size,
            leading_reqs=leading_reqs,
            leading_query_len=leading_query_len,
        )


def _checked_host_copy(name: str, values, length: int) -> np.ndarray | None:
    """A host copy (tuple or list of ints, or None) as an int64 array of `length` entries."""
    if values is None:
        return None
    if not isinstance(values, (tuple, list)) or not all(
            isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_)) for x in values):
        raise TypeError(f"{name} must be None or a tuple of ints, got {type(values).__name__}: "
                        f"{v._short(values)}.")
    if len(values) != length:
        raise ValueError(f"{name} must have {length} entries, got {len(values)}.")
    return np.asarray(values, dtype=np.int64)
