// The Python extension jax_sparse_mla._jax_sparse_mla_native: FFI handler capsules and the host
// planner. Kept free of CUDA code (the kernels live in the .cu files).
#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "common/cubin_loader.h"
#include "common/index_conversion.h"
#include "nanobind/nanobind.h"
#include "nanobind/stl/string.h"
#include "nanobind/stl/vector.h"
#include "common/sha256.h"
#include "sm120/sm120_plan.h"
#include "sm90/indexer_logits.h"
#include "sm90/indexer_topk.h"
#include "sm90/sm90_handlers.h"
#include "sm90/sm90_schedule.h"
#include "sm100/trtllm_gen.h"
#include "xla/ffi/api/c_api.h"

namespace nb = nanobind;

namespace {

template <typename T>
nb::capsule EncapsulateFfiHandler(T* fn) {
  static_assert(std::is_invocable_r_v<XLA_FFI_Error*, T, XLA_FFI_CallFrame*>,
                "Encapsulated function must be an XLA FFI handler");
  return nb::capsule(reinterpret_cast<void*>(fn));
}

// The FFI targets of this build: name and handler symbol.
struct Target {
  const char* name;
  XLA_FFI_Handler* handler;
};

const std::vector<Target>& Targets() {
  static const std::vector<Target> targets = {
#ifdef JAX_SPARSE_MLA_HAS_COMMON
      {"jax_sparse_mla_index_conversion", JaxSparseMlaIndexConversion},
      {"jax_sparse_mla_index_conversion_counts", JaxSparseMlaIndexConversionCounts},
#endif
#ifdef JAX_SPARSE_MLA_HAS_SM90
      {"jax_sparse_mla_sm90_decode_bf16", JaxSparseMlaSm90DecodeBf16},
      {"jax_sparse_mla_sm90_decode_fp8", JaxSparseMlaSm90DecodeFp8},
      {"jax_sparse_mla_sm90_fp8_decode", JaxSparseMlaSm90Fp8Decode},
      {"jax_sparse_mla_sm90_paged_mqa_logits", JaxSparseMlaSm90PagedMqaLogits},
      {"jax_sparse_mla_sm90_mqa_logits", JaxSparseMlaSm90MqaLogits},
      {"jax_sparse_mla_sm90_top_k_per_row", JaxSparseMlaSm90TopKPerRow},
      {"jax_sparse_mla_sm90_top_k_per_row_decode", JaxSparseMlaSm90TopKPerRowDecode},
      {"jax_sparse_mla_sm90_top_k_per_row_cluster", JaxSparseMlaSm90TopKPerRowCluster},
      {"jax_sparse_mla_sm90_top_k_per_row_decode_cluster",
       JaxSparseMlaSm90TopKPerRowDecodeCluster},
      {"jax_sparse_mla_sm90_top_k_per_row_stream", JaxSparseMlaSm90TopKPerRowStream},
      {"jax_sparse_mla_sm90_top_k_per_row_decode_stream", JaxSparseMlaSm90TopKPerRowDecodeStream},
#endif
#ifdef JAX_SPARSE_MLA_HAS_SM100
      {"jax_sparse_mla_trtllm_gen_decode", JaxSparseMlaTrtllmGenDecode},
#endif
#ifdef JAX_SPARSE_MLA_HAS_SM120
      {"jax_sparse_mla_sm120_decode", JaxSparseMlaSm120Decode},
#endif
  };
  return targets;
}

nb::dict Registrations() {
  nb::dict targets;
  for (const Target& target : Targets()) {
    targets[target.name] = EncapsulateFfiHandler(target.handler);
  }
  return targets;
}

// What a handler symbol declares (XLA_FFI_DEFINE_HANDLER_SYMBOL's traits, the FFI API version of
// its headers), asked the way XLA asks: a call frame that carries the metadata extension, which the
// handler answers without running. The frame has no API table: a handler reads it only to report a
// struct-size mismatch, which cannot occur here (the handlers and this file include the same FFI
// headers).
XLA_FFI_Metadata HandlerMetadata(XLA_FFI_Handler* handler) {
  XLA_FFI_Metadata metadata = {};
  metadata.struct_size = XLA_FFI_Metadata_STRUCT_SIZE;
  XLA_FFI_Metadata_Extension extension = {};
  extension.extension_base.struct_size = XLA_FFI_Metadata_Extension_STRUCT_SIZE;
  extension.extension_base.type = XLA_FFI_Extension_Metadata;
  extension.extension_base.next = nullptr;
  extension.metadata = &metadata;
  XLA_FFI_CallFrame frame = {};
  frame.struct_size = XLA_FFI_CallFrame_STRUCT_SIZE;
  frame.extension_start = &extension.extension_base;
  frame.api = nullptr;
  frame.stage = XLA_FFI_ExecutionStage_EXECUTE;
  if (handler(&frame) != nullptr) {
    throw std::runtime_error("an FFI handler did not answer the metadata query");
  }
  return metadata;
}

bool CommandBufferCompatible(XLA_FFI_Handler* handler) {
  return (HandlerMetadata(handler).traits & XLA_FFI_HANDLER_TRAITS_COMMAND_BUFFER_COMPATIBLE) != 0;
}

// Targets whose handlers declare xla::ffi::Traits::kCmdBufferCompatible, read from the handlers
// themselves. JAX takes a handler's traits at registration, not from its symbol, so
// kernels/native.py passes them for these names.
std::vector<std::string> CommandBufferTargets() {
  std::vector<std::string> names;
  for (const Target& target : Targets()) {
    if (CommandBufferCompatible(target.handler)) names.push_back(target.name);
  }
  return names;
}

nb::dict HandlerTraits() {
  nb::dict result;
  for (const Target& target : Targets()) {
    const XLA_FFI_Metadata metadata = HandlerMetadata(target.handler);
    nb::dict entry;
    entry["traits"] = metadata.traits;
    entry["command_buffer_compatible"] =
        (metadata.traits & XLA_FFI_HANDLER_TRAITS_COMMAND_BUFFER_COMPATIBLE) != 0;
    entry["api_version"] =
        nb::make_tuple(metadata.api_version.major_version, metadata.api_version.minor_version);
    result[target.name] = entry;
  }
  return result;
}

// Which handler families this build holds and the machine code each was compiled for.
nb::dict BuildInfo() {
  nb::dict info;
#ifdef JAX_SPARSE_MLA_HAS_COMMON
  info["common"] = JAX_SPARSE_MLA_COMMON_GENCODE;
#endif
#ifdef JAX_SPARSE_MLA_HAS_SM90
  info["sm90"] = JAX_SPARSE_MLA_SM90_GENCODE;
#endif
#ifdef JAX_SPARSE_MLA_HAS_SM100
  const jax_sparse_mla::TrtllmGenBuildInfo trtllm = jax_sparse_mla::GetTrtllmGenBuildInfo();
  info["sm100"] = JAX_SPARSE_MLA_SM100_GENCODE;
  info["trtllm_gen_num_kernels"] = trtllm.num_kernels;
  info["trtllm_gen_cubin_path"] = trtllm.cubin_path;
  info["trtllm_gen_metainfo_hash"] = trtllm.metainfo_hash;
  info["trtllm_gen_flashinfer_version"] = trtllm.flashinfer_version;
#endif
#ifdef JAX_SPARSE_MLA_HAS_SM120
  info["sm120"] = JAX_SPARSE_MLA_SM120_GENCODE;
#endif
  return info;
}

nb::bytes ResolveCubin(const std::string& path, const std::string& sha256) {
  std::string data, error;
  bool found;
  {
    nb::gil_scoped_release release;
    found = jax_sparse_mla::ResolveCubin(path, sha256, &data, &error);
  }
  if (!found) throw std::runtime_error(error);
  return nb::bytes(data.data(), data.size());
}

std::string Sha256Hex(nb::bytes data) {
  return jax_sparse_mla::Sha256Hex(data.c_str(), data.size());
}

nb::dict Sm120Plan(int64_t num_tokens, int64_t num_heads, int64_t top_k, int64_t sm_count) {
  jax_sparse_mla::Sm120Plan plan;
  const std::string error =
      jax_sparse_mla::PlanSm120Decode(num_tokens, num_heads, top_k, sm_count, &plan);
  if (!error.empty()) throw nb::value_error(error.c_str());
  nb::dict result;
  result["chunks"] = plan.chunks;
  result["chunks_per_block"] = plan.chunks_per_block;
  result["num_splits"] = plan.num_splits;
  result["scratch_heads"] = plan.scratch_heads;
  return result;
}

#ifdef JAX_SPARSE_MLA_HAS_SM100
nb::dict TrtllmGenSelectKernel(const std::string& q_dtype, const std::string& kv_dtype,
                               int64_t page_size, int64_t num_heads, int64_t q_len,
                               int64_t top_k, int64_t batch, int sm, int sm_count,
                               int64_t num_pages, bool read_cubins) {
  jax_sparse_mla::TrtllmGenQuery query;
  query.q_dtype = q_dtype;
  query.kv_dtype = kv_dtype;
  query.page_size = page_size;
  query.num_heads = num_heads;
  query.q_len = q_len;
  query.top_k = top_k;
  query.batch = batch;
  query.sm = sm;
  query.sm_count = sm_count;
  query.num_pages = num_pages;
  query.read_cubins = read_cubins;
  jax_sparse_mla::TrtllmGenSelection selection;
  {
    nb::gil_scoped_release release;
    selection = jax_sparse_mla::SelectTrtllmGenKernel(query);
  }
  auto triple = [](const int64_t* v) { return nb::make_tuple(v[0], v[1], v[2]); };
  nb::dict result;
  result["error"] = selection.error;
  result["info"] = selection.info;
  result["candidate_kernels"] = selection.candidate_kernels;
  result["function_name"] = selection.function_name;
  result["cubin_path"] = selection.cubin_path;
  result["cubin_sha256"] = selection.cubin_sha256;
  result["cubin_bytes"] = selection.cubin_bytes;
  result["requested_cubins"] = selection.requested_cubins;
  result["launched"] = selection.launched;
  result["modules_loaded"] = selection.modules_loaded;
  result["tensor_maps"] = selection.tensor_maps;
  result["grid"] = triple(selection.grid);
  result["block"] = triple(selection.block);
  result["cluster"] = triple(selection.cluster);
  result["shared_mem_bytes"] = selection.shared_mem_bytes;
  result["table_index"] = selection.table_index;
  result["table_sha256"] = selection.table_sha256;
  result["table_sm"] = selection.table_sm;
  result["table_shared_mem_bytes"] = selection.table_shared_mem_bytes;
  result["table_threads"] = selection.table_threads;
  result["multi_ctas_kv_mode"] = selection.multi_ctas_kv_mode;
  return result;
}
#endif

#ifdef JAX_SPARSE_MLA_HAS_SM90
nb::dict Sm90Schedule(int64_t num_tokens, int64_t num_heads, int64_t padded_keys,
                      int device_ordinal) {
  jax_sparse_mla::Sm90Schedule schedule;
  std::string error;
  {
    nb::gil_scoped_release release;
    error = jax_sparse_mla::PlanSm90Schedule(num_tokens, num_heads, padded_keys, device_ordinal,
                                             &schedule);
  }
  if (!error.empty()) throw nb::value_error(error.c_str());
  nb::dict result;
  result["schedule"] = nb::bytes(reinterpret_cast<const char*>(schedule.data.data()),
                                 schedule.data.size() * sizeof(int32_t));
  result["num_works"] = schedule.num_works;
  result["cluster_size"] = schedule.cluster_size;
  result["num_clusters"] = schedule.num_clusters;
  result["num_sms"] = schedule.num_sms;
  result["partial_o_offset"] = schedule.partial_o_offset;
  result["partial_lse_offset"] = schedule.partial_lse_offset;
  result["float_workspace_bytes"] = schedule.float_workspace_bytes;
  return result;
}

#endif

}  // namespace

NB_MODULE(_jax_sparse_mla_native, m) {
  m.doc() = "Native kernels of jax_sparse_mla (XLA FFI handlers for CUDA).";
  m.def("registrations", &Registrations,
        "Maps each FFI target name to a capsule of its XLA FFI handler (platform CUDA).");
#ifdef JAX_SPARSE_MLA_HAS_SM90
  m.def("sm90_plan_token_limit", &jax_sparse_mla::Sm90PlanTokenLimit, nb::arg("num_heads"),
        nb::arg("padded_keys"), nb::arg("num_sms"),
        "The most tokens sm90_schedule plans in one launch for num_heads heads over padded_keys "
        "slots on a GPU of num_sms SMs (0 when not one token fits). Arithmetic only: no GPU needed.");
  m.def("sm90_schedule", &Sm90Schedule, nb::arg("num_tokens"), nb::arg("num_heads"),
        nb::arg("padded_keys"), nb::arg("device_ordinal"),
        "Plans FlashInfer's SM90 MLA kernel for a static decode shape on the host. Returns a dict "
        "with 'schedule' (bytes of an int32 array, the kernel's work lists) and the integers "
        "num_works, cluster_size, num_clusters, num_sms, partial_o_offset, partial_lse_offset, "
        "float_workspace_bytes.");
#endif
#ifdef JAX_SPARSE_MLA_HAS_SM100
  m.def("trtllm_gen_select_kernel", &TrtllmGenSelectKernel, nb::arg("q_dtype"),
        nb::arg("kv_dtype"), nb::arg("page_size"), nb::arg("num_heads"), nb::arg("q_len"),
        nb::arg("top_k"), nb::arg("batch") = 1, nb::arg("sm") = 100, nb::arg("sm_count") = 148,
        nb::arg("num_pages") = 1024, nb::arg("read_cubins") = true,
        "Runs the TRTLLM-gen handler's set-up and FlashInfer's kernel selection, cubin load "
        "(through the cubin loader, sha256-checked) and launch set-up for one configuration on "
        "the host, without a GPU, up to cuLaunchKernelEx. Returns a dict: error ('' when the "
        "launch was reached; else the handler's message, e.g. 'Missing TRTLLM-GEN kernel "
        "(decode): ...'), info, function_name, cubin_path, cubin_sha256, cubin_bytes, launched, "
        "grid, block, cluster, shared_mem_bytes and the table entry (table_index, table_sha256, "
        "table_sm, table_shared_mem_bytes, table_threads, multi_ctas_kv_mode).");
#endif
  m.def("command_buffer_targets", &CommandBufferTargets,
        "Names of the targets whose handlers are safe to record in CUDA graphs (XLA command "
        "buffers): those whose handler symbols declare the trait; register them with the "
        "COMMAND_BUFFER_COMPATIBLE trait.");
  m.def("handler_traits", &HandlerTraits,
        "What each target's handler symbol declares, read from the handler's metadata as XLA reads "
        "it: {name: {'traits': int (XLA_FFI_Handler_Traits bits), 'command_buffer_compatible': "
        "bool, 'api_version': (major, minor) of the XLA FFI headers it was built with}}.");
  m.def("build_info", &BuildInfo,
        "Handler families in this build ('sm90', 'sm100', 'sm120': comma-separated machine-code "
        "targets) and, with sm100, the TRTLLM-gen kernel table compiled in "
        "(trtllm_gen_num_kernels, trtllm_gen_metainfo_hash, trtllm_gen_cubin_path, "
        "trtllm_gen_flashinfer_version).");
  m.def("sha256_hex", &Sha256Hex, nb::arg("data"),
        "SHA-256 of bytes as lower-case hex (the digest the cubin loader checks).");
  m.def("resolve_cubin", &ResolveCubin, nb::arg("path"), nb::arg("sha256"),
        "Reads a FlashInfer cubin as the TRTLLM-gen loader does: the first file "
        "<folder>/<path> whose sha256 matches, over cubin_search_dirs(). Raises RuntimeError "
        "naming the file and every place tried; never downloads.");
  m.def("cubin_search_dirs", &jax_sparse_mla::CubinSearchDirs,
        "Folders the cubin loader searches, in order: $FLASHINFER_CUBIN_DIR, the flashinfer-cubin "
        "package (see set_cubin_package_dir), ${FLASHINFER_WORKSPACE_BASE:-$HOME}/.cache/flashinfer/"
        "cubins.");
  m.def("set_cubin_package_dir", &jax_sparse_mla::SetCubinPackageDir, nb::arg("path"),
        "Registers the flashinfer-cubin package's cubin folder ('' to clear).");
  m.def("sm120_plan", &Sm120Plan, nb::arg("num_tokens"), nb::arg("num_heads"), nb::arg("top_k"),
        nb::arg("sm_count"),
        "FlashInfer's split-K plan for the SM120 DSv3.2 decode: dict with chunks, "
        "chunks_per_block, num_splits and scratch_heads.");
}
