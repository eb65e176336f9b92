"""CPU tests of what the native handlers do on the host per call (docs/kernels/host-work.md):

* the memos that keep set-up out of the per-call path (ffi/common/host_cache.h, compiled from that
  header as host C++): PerDevice computes once per device however many threads ask, retries a failed
  computation and computes every time for a device index it has no slot for; RecentValues returns
  what the function returned, computes each key once while it is held, and evicts oldest first;
* the handler sources: every handler symbol declares command-buffer compatibility except the one the
  docs name, every symbol is registered by ffi/module.cc, and no handler source makes a call that
  synchronises, allocates or queries the device per call outside the helpers made for it;
* the built extension (skipped without it): the traits the handler symbols declare, read from their
  metadata as XLA reads them, and the targets kernels/native.py registers as command-buffer
  compatible are the same.
"""

from __future__ import annotations

import pathlib
import re
import subprocess

import pytest

from requirements import compile_host_program, require_native

FFI = pathlib.Path(__file__).resolve().parents[2] / "ffi"

# Handlers that do not declare kCmdBufferCompatible, and why (docs/kernels/host-work.md):
# FlashInfer's TRTLLM-gen runner loads cubins (cuModuleLoadData) at a configuration's first call
# and selects its kernel on the host per call; it has not run on SM100 hardware, let alone inside
# a CUDA graph.
NOT_COMMAND_BUFFER = {"JaxSparseMlaTrtllmGenDecode": "jax_sparse_mla_trtllm_gen_decode"}

DRIVER = r"""
#include <atomic>
#include <cstdio>
#include <cstring>
#include <thread>
#include <vector>
#include "common/host_cache.h"

using jax_sparse_mla::PerDevice;
using jax_sparse_mla::PerDeviceOnce;
using jax_sparse_mla::RecentValues;

// 16 threads ask 8 devices 1000 times each: prints the computations per device and whether every
// answer was the device's value.
int Threads() {
  PerDevice<int> cache;
  std::atomic<int> computed[8] = {};
  std::atomic<bool> right{true};
  std::vector<std::thread> threads;
  for (int t = 0; t < 16; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 1000; ++i) {
        const int device = (t + i) % 8;
        int value = -1;
        const int status = cache.Get(device, 0, [&](int d, int* out) {
          computed[d].fetch_add(1);
          *out = 100 + d;
          return 0;
        }, &value);
        if (status != 0 || value != 100 + device) right = false;
      }
    });
  }
  for (auto& thread : threads) thread.join();
  for (int d = 0; d < 8; ++d) std::printf("%d ", computed[d].load());
  std::printf("%d\n", right.load() ? 1 : 0);
  return 0;
}

// A failing computation is tried again; the first success is kept; Once runs until it succeeds.
int Failures() {
  PerDevice<int> cache;
  int calls = 0, value = -1;
  auto failing = [&](int, int* out) { ++calls; *out = 7; return 3; };
  auto working = [&](int, int* out) { ++calls; *out = 5; return 0; };
  const int first = cache.Get(2, 0, failing, &value);
  const int second = cache.Get(2, 0, working, &value);
  const int third = cache.Get(2, 0, failing, &value);
  PerDeviceOnce once;
  int runs = 0;
  const int a = once.Once(1, 0, [&](int) { ++runs; return runs < 2 ? 9 : 0; });
  const int b = once.Once(1, 0, [&](int) { ++runs; return 0; });
  const int c = once.Once(1, 0, [&](int) { ++runs; return 0; });
  std::printf("%d %d %d %d %d %d %d %d %d\n", first, second, third, value, calls, a, b, c, runs);
  return 0;
}

// Device indices without a slot (negative, >= 64) compute on every call.
int OutOfRange() {
  PerDevice<int> cache;
  int calls = 0, value = 0;
  for (int device : {-1, 64, 64, 1000}) {
    cache.Get(device, 0, [&](int d, int* out) { ++calls; *out = d; return 0; }, &value);
  }
  std::printf("%d %d\n", calls, value);
  return 0;
}

// RecentValues<int, long, 4> over a key sequence from stdin: prints, per lookup, the value and
// whether it was computed (1) or held (0).
int Recent() {
  RecentValues<int, long, 4> recent;
  int key;
  while (std::scanf("%d", &key) == 1) {
    bool computed = false;
    long value = 0;
    const int status = recent.Get(key, 0, [&](int k, long* out) {
      computed = true;
      if (k < 0) return 1;  // a failed computation: not remembered
      *out = 1000L * k + 1;
      return 0;
    }, &value);
    std::printf("%d %ld %d %d\n", status, value, computed ? 1 : 0, recent.size());
  }
  return 0;
}

int main(int argc, char** argv) {
  if (argc < 2) return 2;
  if (!std::strcmp(argv[1], "threads")) return Threads();
  if (!std::strcmp(argv[1], "failures")) return Failures();
  if (!std::strcmp(argv[1], "out_of_range")) return OutOfRange();
  if (!std::strcmp(argv[1], "recent")) return Recent();
  return 2;
}
"""


@pytest.fixture(scope="module")
def driver(tmp_path_factory) -> pathlib.Path:
    return compile_host_program(DRIVER, tmp_path_factory.mktemp("host_cache"))


def run(driver: pathlib.Path, command: str, stdin: str = "") -> list[str]:
    result = subprocess.run([str(driver), command], input=stdin, capture_output=True, text=True,
                            check=True)
    return result.stdout.split("\n")


# --- ffi/common/host_cache.h ----------------------------------------------------------------------

def test_per_device_computes_once_per_device_under_threads(driver):
    *computed, right = map(int, run(driver, "threads")[0].split())
    assert computed == [1] * 8
    assert right == 1


def test_per_device_retries_failures_and_keeps_the_first_success(driver):
    first, second, third, value, calls, a, b, c, runs = map(int, run(driver, "failures")[0].split())
    assert (first, second, third) == (3, 0, 0)
    assert value == 5 and calls == 2  # the third call read the kept value
    assert (a, b, c, runs) == (9, 0, 0, 2)


def test_per_device_computes_every_time_without_a_slot(driver):
    calls, value = map(int, run(driver, "out_of_range")[0].split())
    assert calls == 4 and value == 1000


def test_recent_values_hold_the_last_keys(driver):
    keys = [1, 2, 1, 3, 4, 2, 5, 1, -1, 5, 6, 2]
    lines = [line.split() for line in run(driver, "recent", " ".join(map(str, keys)))[:-1]]
    got = [(int(s), int(v), int(c)) for s, v, c, _ in lines]
    sizes = [int(n) for *_, n in lines]
    expected = [
        (0, 1001, 1), (0, 2001, 1), (0, 1001, 0), (0, 3001, 1), (0, 4001, 1), (0, 2001, 0),
        (0, 5001, 1),  # evicts 1 (the oldest)
        (0, 1001, 1),  # evicts 2
        (1, 0, 1),     # a failure: computed, not held
        (0, 5001, 0), (0, 6001, 1),  # 6 evicts 3
        (0, 2001, 1),  # 2 was evicted by 1: computed again
    ]
    assert got == expected
    assert sizes == [1, 2, 2, 3, 4, 4, 4, 4, 4, 4, 4, 4]


# --- the handler sources --------------------------------------------------------------------------

def handler_definitions() -> dict[str, str]:
    """Handler symbol -> the text of its XLA_FFI_DEFINE_HANDLER_SYMBOL(...) in ffi/."""
    definitions = {}
    for path in sorted(FFI.rglob("*")):
        if path.suffix not in (".cu", ".cc", ".cuh", ".h") or "cublas_stub" in path.parts:
            continue
        text = path.read_text()
        for match in re.finditer(r"XLA_FFI_DEFINE_HANDLER_SYMBOL\(\s*(\w+)", text):
            if match.group(1) == "fn":  # a macro's own definition
                continue
            depth, end = 0, match.start()
            for end in range(text.index("(", match.start()), len(text)):
                depth += {"(": 1, ")": -1}.get(text[end], 0)
                if depth == 0:
                    break
            definitions[match.group(1)] = text[match.start():end + 1]
    return definitions


def expand_macros(definition: str) -> str:
    """The definition with the binding macros of ffi/ it names spelled out (traits sit there)."""
    sources = "\n".join(p.read_text() for p in FFI.rglob("*.cu"))
    for name in set(re.findall(r"\b(JAX_SPARSE_MLA_[A-Z_]+)\b", definition)):
        match = re.search(rf"#define {name}\b((?:.*\\\n)*.*)", sources)
        if match:
            definition += match.group(1)
    return definition


def test_every_handler_declares_command_buffer_compatibility_but_the_documented_one():
    definitions = handler_definitions()
    assert len(definitions) >= 15, sorted(definitions)
    compatible = {name for name, text in definitions.items()
                  if "kCmdBufferCompatible" in expand_macros(text)}
    assert set(definitions) - compatible == set(NOT_COMMAND_BUFFER)


def test_module_registers_every_handler_symbol():
    module = (FFI / "module.cc").read_text()
    registered = set(re.findall(r"\{\"jax_sparse_mla_\w+\",\s*(\w+)\}", module))
    assert registered == set(handler_definitions())


# Calls a handler must not make per call (docs/kernels/host-work.md), and the files where they may
# appear: host planners called at trace time, the per-device helpers and what they run once, the
# SM100 runner's own set-up (FlashInfer's host code, documented there).
PER_CALL_FORBIDDEN = {
    r"cudaGetDeviceProperties": set(),
    r"cudaMalloc\w*\(": set(),
    r"cudaFree\(": set(),
    r"cudaMemcpy(?!Async)\w*\(": set(),
    r"cudaMemset(?!Async)\w*\(": set(),
    r"cudaStreamSynchronize|cudaDeviceSynchronize|cudaEventSynchronize": set(),
    r"cudaFuncSetAttribute": {"common/launch.h"},
    r"cudaOccupancy\w+": {"sm90/indexer_topk.cu"},  # inside MaxActiveClusters' PerDevice
    r"cudaDeviceGetAttribute": {"sm90/sm90_schedule.cu", "sm100/trtllm_gen_decode.cu"},
    r"cudaSetDevice": {"sm90/sm90_schedule.cu", "sm100/trtllm_gen_decode.cu"},
    r"cuTensorMapEncode\w*\(": set(),  # indexer_logits.cu calls it through a RecentValues memo
    # FlashInfer's launcher sets the kernel attribute on every call; sm90_decode.cuh launches the
    # same kernel through LaunchHopperMla instead.
    r"BatchMLAPageAttentionHopper\s*<": set(),
}


def test_handler_sources_make_no_per_call_setup_calls():
    found = []
    for path in sorted(FFI.rglob("*")):
        if path.suffix not in (".cu", ".cc", ".cuh", ".h") or "cublas_stub" in path.parts:
            continue
        relative = path.relative_to(FFI).as_posix()
        code = re.sub(r"//.*", "", path.read_text())  # comments may name them
        for pattern, allowed in PER_CALL_FORBIDDEN.items():
            if relative not in allowed and re.search(pattern, code):
                found.append(f"{relative}: {pattern}")
    assert not found, found


def test_occupancy_query_and_tensor_map_stay_behind_their_memos():
    topk = re.sub(r"//.*", "", (FFI / "sm90/indexer_topk.cu").read_text())
    body = topk[topk.index("cudaError_t MaxActiveClusters"):topk.index("ffi::Error LaunchCluster")]
    assert "PerDevice<" in body and "cudaOccupancyMaxActiveClusters" in body
    assert topk.count("cudaOccupancyMaxActiveClusters") == 1
    logits = (FFI / "sm90/indexer_logits.cu").read_text()
    assert "thread_local RecentValues<" in logits
    assert len(re.findall(r"\bencode\(", logits)) == 1  # only inside the memo's computation


# --- the built extension --------------------------------------------------------------------------

def test_extension_command_buffer_targets_are_what_the_handlers_declare():
    module = require_native()
    traits = module.handler_traits()
    assert set(traits) == set(module.registrations())
    declared = {name for name, entry in traits.items() if entry["command_buffer_compatible"]}
    assert all(bool(entry["traits"] & 1) == entry["command_buffer_compatible"]
               for entry in traits.values())
    assert set(module.command_buffer_targets()) == declared
    assert set(traits) - declared == set(NOT_COMMAND_BUFFER.values()) & set(traits)
    assert {entry["api_version"][0] for entry in traits.values()} == {0}
