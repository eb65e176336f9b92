// Host-side memos that keep set-up work out of the handlers' per-call path
// (docs/kernels/host-work.md):
//
//   PerDevice<T>          a value computed once per CUDA device and process (a kernel attribute
//                         raised, an occupancy answer), read without a lock once computed;
//   RecentValues<K, V, N> the last N (key -> value) pairs of a pure function, for one thread (the
//                         ragged logits' TMA descriptor, a function of the keys' address and
//                         count).
//
// Plain C++ (no CUDA header), so that a CPU test compiles this very code
// (tests/kernels/test_host_work_cpu.py).
#pragma once

#include <array>
#include <atomic>
#include <cstddef>
#include <mutex>
#include <utility>

namespace jax_sparse_mla {

// A T per device index in [0, kMaxDevices), computed by the first caller that succeeds and then
// read by every thread without a lock (an acquire load of the slot's flag). A failed computation
// is not remembered: the next call tries again. A device index outside the range computes every
// time.
template <typename T, int kMaxDevices = 64>
class PerDevice {
 public:
  // Sets *value to the device's T, computing it with `compute(device, &value)` when no call has yet
  // succeeded. `compute` returns a status; `ok` is its success value. Returns the status.
  template <typename Status, typename Compute>
  Status Get(int device, Status ok, Compute&& compute, T* value) {
    if (device < 0 || device >= kMaxDevices) {
      return std::forward<Compute>(compute)(device, value);
    }
    Slot& slot = slots_[device];
    if (slot.ready.load(std::memory_order_acquire)) {
      *value = slot.value;
      return ok;
    }
    std::lock_guard<std::mutex> lock(mutex_);
    if (!slot.ready.load(std::memory_order_relaxed)) {
      T computed{};
      const Status status = std::forward<Compute>(compute)(device, &computed);
      if (!(status == ok)) return status;
      slot.value = computed;
      slot.ready.store(true, std::memory_order_release);
    }
    *value = slot.value;
    return ok;
  }

  // Runs `run(device)` (which returns a status) until it has succeeded once for `device`; later
  // calls return `ok` without running it.
  template <typename Status, typename Run>
  Status Once(int device, Status ok, Run&& run) {
    if (device < 0 || device >= kMaxDevices) return std::forward<Run>(run)(device);
    Slot& slot = slots_[device];
    if (slot.ready.load(std::memory_order_acquire)) return ok;
    std::lock_guard<std::mutex> lock(mutex_);
    if (!slot.ready.load(std::memory_order_relaxed)) {
      const Status status = std::forward<Run>(run)(device);
      if (!(status == ok)) return status;
      slot.ready.store(true, std::memory_order_release);
    }
    return ok;
  }

 private:
  struct Slot {
    std::atomic<bool> ready{false};
    T value{};
  };
  std::mutex mutex_;  // serialises the computations (first calls only)
  std::array<Slot, kMaxDevices> slots_{};
};

// For Once() alone: a flag per device.
using PerDeviceOnce = PerDevice<bool>;

// The last kSize distinct keys looked up and their values, replaced oldest first. Not synchronised:
// keep one per thread (thread_local). For memoising a pure function of the key, so that a hit is
// always the value the function would return.
template <typename Key, typename Value, int kSize>
class RecentValues {
 public:
  // The value for `key`, from `compute(key, &value)` (a status; `ok` on success) on a miss. A
  // failed computation is not remembered.
  template <typename Status, typename Compute>
  Status Get(const Key& key, Status ok, Compute&& compute, Value* value) {
    for (int i = 0; i < count_; ++i) {
      if (entries_[i].first == key) {
        *value = entries_[i].second;
        return ok;
      }
    }
    Value computed{};
    const Status status = std::forward<Compute>(compute)(key, &computed);
    if (!(status == ok)) return status;
    entries_[next_] = {key, computed};
    next_ = (next_ + 1) % kSize;
    if (count_ < kSize) ++count_;
    *value = computed;
    return ok;
  }

  int size() const { return count_; }

 private:
  std::array<std::pair<Key, Value>, kSize> entries_{};
  int count_ = 0;
  int next_ = 0;
};

}  // namespace jax_sparse_mla
