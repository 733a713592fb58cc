// Why this file exists: the executorch 1.5.1 wheel ships libexecutorch_threadpool.so (which exports
// executorch::extension::threadpool::get_threadpool() and ThreadPool::_unsafe_reset_threadpool(unsigned))
// but not the header declaring them (only threadpool_guard.h is in include/). The trainer needs to set the
// number of threads (1 by default, as the Python backend's `_unsafe_reset_threadpool(1)`), so these are
// the declarations of the two functions it calls, written from the library's exported symbols
// (`nm -DC libexecutorch_threadpool.so`). Only non-virtual member functions are declared and the class is
// never instantiated, dereferenced or sized here, so its data layout does not matter.
#pragma once

#include <cstddef>
#include <cstdint>

namespace executorch::extension::threadpool {

class ThreadPool {
 public:
  bool _unsafe_reset_threadpool(uint32_t num_threads);
  size_t get_thread_count() const;

 private:
  ThreadPool() = delete;
};

ThreadPool* get_threadpool();

}  // namespace executorch::extension::threadpool
