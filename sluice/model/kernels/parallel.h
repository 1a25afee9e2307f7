// sluice::parallel_for: the kernels' fork-join, tolerant of preempted threads.
//
// at::parallel_for (an OpenMP team) ends a region only when every thread has run its static
// share: on a machine whose cores are shared, one preempted thread stalls the region for the
// rest of its timeslice. Here the range is cut into chunks that the calling thread and a pool
// of workers claim from one atomic ticket. Guarantees:
// - the call returns once every chunk has run; a worker that has not woken by then finds
//   nothing left to claim, so the caller alone can finish any job (it never waits for a worker
//   that holds no chunk);
// - each index of [begin, end) is passed to f exactly once, and a chunk is a contiguous range,
//   so a kernel whose outputs are each computed within one index gives the same bits for any
//   number of threads or chunks;
// - workers spin briefly after a job, then sleep on a futex: an idle process burns no CPU;
// - the pool has at::get_num_threads() - 1 workers, resized when that changes, created on the
//   first parallel call (after any fork); a forked child makes a fresh pool;
// - one job at a time: a call made while another runs (another Python thread, or a nested call
//   from inside a chunk) runs inline on its own thread;
// - an exception thrown by f in any thread is rethrown by the caller after the job has ended.
// Both kernel modules include this header; `adopt` makes one module use the other's pool, so the
// process has one set of workers (two sets would spin against each other on a few cores).
#pragma once

#include <ATen/Parallel.h>
#include <pybind11/pybind11.h>
#include <pthread.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <cstdint>
#include <exception>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#if defined(__linux__)
#include <linux/futex.h>
#include <sys/syscall.h>
#endif
#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace sluice {

constexpr int64_t CHUNKS_PER_THREAD = 4;  // a preempted worker holds back at most one of these
constexpr int64_t WORKER_SPIN_US = 50;    // a decode step's gaps between kernels are shorter

inline void cpu_relax() {
#if defined(__x86_64__)
  _mm_pause();
#else
  std::this_thread::yield();
#endif
}

inline void futex_wait(std::atomic<uint32_t>* word, uint32_t expected) {
#if defined(__linux__)
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT_PRIVATE, expected, nullptr,
          nullptr, 0);
#else
  if (word->load() == expected) std::this_thread::sleep_for(std::chrono::microseconds(200));
#endif
}

inline void futex_wake_all(std::atomic<uint32_t>* word) {
#if defined(__linux__)
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE_PRIVATE, INT_MAX, nullptr,
          nullptr, 0);
#else
  (void)word;
#endif
}

// One parallel_for call: f(ctx, b, e) for each chunk [b, e) of [begin, end) cut in `chunks`.
struct Job {
  void (*run)(const void* ctx, int64_t begin, int64_t end) = nullptr;
  const void* ctx = nullptr;
  int64_t begin = 0, end = 0, chunks = 0;
};

// The ticket: generation (24 bits) | chunks (20) | next unclaimed chunk (20). A claim is a CAS
// on the whole word, so it takes a chunk of the job that is current at that instant only.
constexpr int TICKET_BITS = 20;
constexpr uint64_t TICKET_MASK = (uint64_t{1} << TICKET_BITS) - 1;
constexpr int64_t MAX_CHUNKS = int64_t{1} << (TICKET_BITS - 1);

struct PoolStats {
  int64_t jobs, inline_calls, caller_chunks, worker_chunks, workers;
};

class Pool {
 public:
  static constexpr uint32_t VERSION = 1;  // of this layout: checked before adopting a pool
  const uint32_t version = VERSION;
  const uint32_t layout_size = sizeof(Pool);

  // Whether this thread may start a job now (false: one is running; run inline instead).
  bool try_acquire() { return !busy_.exchange(true, std::memory_order_acquire); }
  void release() { busy_.store(false, std::memory_order_release); }
  void count_inline() { inline_calls_.fetch_add(1, std::memory_order_relaxed); }

  // The holder of try_acquire only: runs the job to its end with `workers` workers.
  void run(const Job& job, int workers) {
    resize(workers);
    job_ = job;
    done_.store(0, std::memory_order_relaxed);
    error_ = nullptr;
    generation_ = (generation_ + 1) & 0xffffff;
    const uint64_t ticket = (generation_ << (2 * TICKET_BITS)) |
                            (static_cast<uint64_t>(job.chunks) << TICKET_BITS);
    ticket_.store(ticket, std::memory_order_release);  // publishes job_
    wake_.fetch_add(1, std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) > 0) futex_wake_all(&wake_);
    int64_t mine = 0;
    while (claim_and_run()) ++mine;
    for (int64_t spins = 0; done_.load(std::memory_order_acquire) < job.chunks; ++spins) {
      if (spins < 4096) cpu_relax();
      else sched_yield();  // a worker holding a chunk was preempted: let it run
    }
    jobs_.fetch_add(1, std::memory_order_relaxed);
    caller_chunks_.fetch_add(mine, std::memory_order_relaxed);
    worker_chunks_.fetch_add(job.chunks - mine, std::memory_order_relaxed);
    if (error_) std::rethrow_exception(error_);
  }

  // Test hook: while held, the workers claim nothing (as if never scheduled).
  void hold_workers(bool hold) { hold_.store(hold, std::memory_order_seq_cst); }
  // Benchmark switch: off, parallel_for is at::parallel_for (the kernels' split before the pool).
  void enable(bool on) { enabled_.store(on, std::memory_order_relaxed); }
  bool enabled() const { return enabled_.load(std::memory_order_relaxed); }

  PoolStats stats() const {
    return {jobs_.load(), inline_calls_.load(), caller_chunks_.load(), worker_chunks_.load(),
            static_cast<int64_t>(threads_.size())};
  }

 private:
  // Claims the next chunk of the current job and runs it; false when none is left.
  bool claim_and_run() {
    uint64_t t = ticket_.load(std::memory_order_acquire);
    for (;;) {
      const int64_t chunks = static_cast<int64_t>((t >> TICKET_BITS) & TICKET_MASK);
      const int64_t next = static_cast<int64_t>(t & TICKET_MASK);
      if (next >= chunks) return false;
      if (ticket_.compare_exchange_weak(t, t + 1, std::memory_order_acq_rel,
                                        std::memory_order_acquire)) {
        run_chunk(next, chunks);  // job_ is the claimed chunk's: it stays until done_ counts it
        return true;
      }
    }
  }

  void run_chunk(int64_t c, int64_t chunks) {
    const Job& j = job_;
    const int64_t range = j.end - j.begin;
    try {
      j.run(j.ctx, j.begin + range * c / chunks, j.begin + range * (c + 1) / chunks);
    } catch (...) {
      std::lock_guard<std::mutex> lock(error_mutex_);
      if (!error_) error_ = std::current_exception();
    }
    done_.fetch_add(1, std::memory_order_acq_rel);
  }

  void worker_loop() {
    uint32_t seen = wake_.load(std::memory_order_acquire);
    while (!stop_.load(std::memory_order_acquire)) {
      if (!hold_.load(std::memory_order_acquire)) {
        while (claim_and_run()) {
        }
      }
      if (!spin_for_wake(seen)) {
        sleepers_.fetch_add(1, std::memory_order_seq_cst);
        if (wake_.load(std::memory_order_seq_cst) == seen) futex_wait(&wake_, seen);
        sleepers_.fetch_sub(1, std::memory_order_seq_cst);
      }
      seen = wake_.load(std::memory_order_acquire);
    }
  }

  // Whether the wake word moved from `seen` within WORKER_SPIN_US.
  bool spin_for_wake(uint32_t seen) const {
    const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(WORKER_SPIN_US);
    for (;;) {
      for (int i = 0; i < 64; ++i) {
        if (wake_.load(std::memory_order_acquire) != seen) return true;
        cpu_relax();
      }
      if (std::chrono::steady_clock::now() >= until) return false;
    }
  }

  void resize(int workers) {
    if (static_cast<int>(threads_.size()) == workers) return;
    stop_.store(true, std::memory_order_seq_cst);
    wake_.fetch_add(1, std::memory_order_seq_cst);
    futex_wake_all(&wake_);
    for (auto& t : threads_) t.join();
    threads_.clear();
    stop_.store(false, std::memory_order_seq_cst);
    for (int i = 0; i < workers; ++i) threads_.emplace_back([this] { worker_loop(); });
  }

  alignas(64) std::atomic<uint64_t> ticket_{0};
  alignas(64) std::atomic<int64_t> done_{0};
  alignas(64) std::atomic<uint32_t> wake_{0};  // the futex word: bumped for each job and stop
  std::atomic<int> sleepers_{0};
  alignas(64) std::atomic<bool> busy_{false};
  std::atomic<bool> stop_{false};
  std::atomic<bool> hold_{false};
  std::atomic<bool> enabled_{false};  // off: at::parallel_for (SLUICE_KERNEL_POOL turns it on)
  Job job_;
  uint64_t generation_ = 0;
  std::exception_ptr error_;
  std::mutex error_mutex_;
  std::vector<std::thread> threads_;  // owned by the holder of try_acquire
  std::atomic<int64_t> jobs_{0}, inline_calls_{0}, caller_chunks_{0}, worker_chunks_{0};
};

// This module's own pool, created on first use and made afresh in a forked child (whose copy has
// no threads; the parent's copy is leaked there, never joined).
inline Pool* own_pool_ptr = nullptr;
inline pid_t own_pool_pid = 0;

inline Pool* own_pool() {
  static std::once_flag at_fork;
  std::call_once(at_fork, [] {
    pthread_atfork(nullptr, nullptr, [] { own_pool_ptr = nullptr; });
  });
  if (own_pool_ptr == nullptr) own_pool_ptr = new Pool();
  return own_pool_ptr;
}

// Where this module gets its pool: its own, or another module's getter after `adopt`.
inline Pool* (*pool_source)() = &own_pool;

template <typename F>
void invoke_chunk(const void* ctx, int64_t begin, int64_t end) {
  (*static_cast<const F*>(ctx))(begin, end);
}

// at::parallel_for's contract: f(b, e) over disjoint ranges covering [begin, end), each of at
// least about `grain` indices, inline when the range is not above the grain or one thread.
template <typename F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  if (begin >= end) return;
  Pool* pool = pool_source();
  if (!pool->enabled()) {
    at::parallel_for(begin, end, grain, f);
    return;
  }
  const int64_t range = end - begin, threads = at::get_num_threads();
  if (range <= grain || range == 1 || threads <= 1 || at::in_parallel_region()) {
    f(begin, end);
    return;
  }
  const int64_t g = std::max<int64_t>(grain, 1);
  const int64_t chunks = std::min({(range + g - 1) / g, threads * CHUNKS_PER_THREAD, MAX_CHUNKS});
  if (!pool->try_acquire()) {
    pool->count_inline();
    f(begin, end);
    return;
  }
  struct Release {
    Pool* p;
    ~Release() { p->release(); }
  } release{pool};
  pool->run(Job{&invoke_chunk<F>, &f, begin, end, chunks}, static_cast<int>(threads - 1));
}

// The module functions of the pool: `_pool_stats()`, `_pool_hold_workers(hold)` (tests),
// `_pool_enable(on)` (benchmarks: off is at::parallel_for),
// `_pool_capsule()` and `_pool_adopt(capsule)` (the other module's pool, if its layout matches).
inline void bind_pool(pybind11::module_& m) {
  static const char* const CAPSULE = "sluice.kernels.pool";
  static Pool* (*const getter)() = &own_pool;
  m.def("_pool_stats", [] {
    const PoolStats s = pool_source()->stats();
    pybind11::dict d;
    d["jobs"] = s.jobs, d["inline_calls"] = s.inline_calls, d["workers"] = s.workers;
    d["caller_chunks"] = s.caller_chunks, d["worker_chunks"] = s.worker_chunks;
    return d;
  });
  m.def("_pool_hold_workers", [](bool hold) { pool_source()->hold_workers(hold); });
  m.def("_pool_enable", [](bool on) { pool_source()->enable(on); });
  m.def("_pool_capsule", [] {
    return pybind11::capsule(const_cast<void*>(static_cast<const void*>(&getter)), CAPSULE);
  });
  m.def("_pool_adopt", [](const pybind11::capsule& c) {
    if (std::string(c.name() ? c.name() : "") != CAPSULE) return false;
    auto source = *static_cast<Pool* (*const*)()>(c.get_pointer());
    const Pool* other = source();
    if (other->version != Pool::VERSION || other->layout_size != sizeof(Pool)) return false;
    pool_source = source;
    return true;
  });
}

}  // namespace sluice
