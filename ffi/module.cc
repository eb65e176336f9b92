// The Python extension jax_sparse_mla._jax_sparse_mla_native: FFI handler capsules and the host
// planner. Kept free of CUDA code (the kernels live in the .cu files).
#include <cstdint>
#include <string>
#include <type_traits>

#include "nanobind/nanobind.h"
#include "sm90_handlers.h"
#include "sm90_schedule.h"

namespace nb = nanobind;

namespace {

template <typename T>
nb::capsule EncapsulateFfiHandler(T* fn) {
  static_assert(std::is_invocable_r_v<XLA_FFI_Error*, T, XLA_FFI_CallFrame*>,
                "Encapsulated function must be an XLA FFI handler");
  return nb::capsule(reinterpret_cast<void*>(fn));
}

nb::dict Registrations() {
  nb::dict targets;
  targets["jax_sparse_mla_sm90_decode_bf16"] = EncapsulateFfiHandler(JaxSparseMlaSm90DecodeBf16);
  targets["jax_sparse_mla_sm90_decode_fp8"] = EncapsulateFfiHandler(JaxSparseMlaSm90DecodeFp8);
  return targets;
}

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

}  // namespace

NB_MODULE(_jax_sparse_mla_native, m) {
  m.doc() = "Native kernels of jax_sparse_mla (XLA FFI handlers for CUDA).";
  m.def("registrations", &Registrations,
        "Maps each FFI target name to a capsule of its XLA FFI handler (platform CUDA).");
  m.def("sm90_schedule", &Sm90Schedule, nb::arg("num_tokens"), nb::arg("num_heads"),
        nb::arg("padded_keys"), nb::arg("device_ordinal"),
        "Plans FlashInfer's SM90 MLA kernel for a static decode shape on the host. Returns a dict "
        "with 'schedule' (bytes of an int32 array, the kernel's work lists) and the integers "
        "num_works, cluster_size, num_clusters, num_sms, partial_o_offset, partial_lse_offset, "
        "float_workspace_bytes.");
}
