// Shares a CPU kernel's work items between the calling thread and XLA's
// intra-op thread pool.
//
// Items are handed out by an atomic counter and `done` counts finished ones,
// so the caller waits for the work, never for a pool task that may start late
// (a late task finds no item left and touches only the shared state it owns a
// reference to). `fn` is copied into every task: it must capture by value.

#ifndef LEGORL_CPU_POOL_H_
#define LEGORL_CPU_POOL_H_

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>

#include "xla/ffi/api/ffi.h"

namespace legorl {

struct Work {
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  std::mutex mutex;
  std::condition_variable finished;
};

// Calls fn(i) once for each i in [0, count), on up to pool.num_threads() threads: the caller and
// helpers from the pool (one thread per core; more only took turns on the cores).
template <typename Fn>
void parallel_for(xla::ffi::ThreadPool& pool, int64_t count, Fn fn) {
  if (count <= 0) return;
  auto work = std::make_shared<Work>();
  auto drain = [work, fn, count]() {
    int64_t finished = 0;
    for (int64_t i; (i = work->next.fetch_add(1)) < count; ++finished) fn(i);
    if (finished && work->done.fetch_add(finished) + finished == count) {
      std::lock_guard<std::mutex> lock(work->mutex);
      work->finished.notify_all();
    }
  };
  const int64_t helpers = std::min<int64_t>(pool.num_threads() - 1, count - 1);
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule(decltype(drain)(drain));  // each task owns a copy
  drain();
  std::unique_lock<std::mutex> lock(work->mutex);
  work->finished.wait(lock, [&] { return work->done.load() == count; });
}

}  // namespace legorl

#endif  // LEGORL_CPU_POOL_H_
