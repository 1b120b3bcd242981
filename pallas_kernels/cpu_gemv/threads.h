// Work split for the kernels of gemv.cc: persistent worker threads and the chunk counter they share with the caller.
#ifndef JAXINFER_CPU_GEMV_THREADS_H_
#define JAXINFER_CPU_GEMV_THREADS_H_

#include <immintrin.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace jaxinfer_gemv {

// ---------------------------------------------------------------------------------------------------------------
// Work split: a call's chunks are taken from an atomic counter by the calling thread and by persistent worker
// threads. A decode step calls these kernels a few hundred times, tens of microseconds apart, so the workers spin
// for a while after each job (`kSpin`) instead of sleeping: waking a sleeping thread costs about as long as a small
// matmul takes; they spin by yielding, so XLA's own threads still get the core whenever they have work. After the
// spin they sleep until the next job. One job runs at a time; a call made while another
// runs (XLA may run independent thunks concurrently) does its chunks alone.
//
// A worker and the calling thread must not share a CPU. In a VM, Linux sees a halted vCPU as busy (preempted),
// so a woken thread lands on its waker's CPU, and an idle vCPU does not pull work until its next tick: a woken
// worker then waited up to 4 ms (a scheduler tick) behind the caller while the other CPU idled, and a cold decode
// step ran on one core (measured: the worker took 1-66 of 120 jobs a step). So each worker publishes the CPU it
// spins on, and the caller, before it hands out a job, keeps off its own CPU every worker that is asleep or
// spinning there (`sched_setaffinity` on the worker: a syscall only when they meet).
constexpr auto kSpin = std::chrono::microseconds(300);

struct Job {
  std::atomic<int64_t> next{0}, done{0};
  int64_t count = 0;
  void (*call)(const void*, int64_t) = nullptr;
  const void* ctx = nullptr;

  void drain() {
    for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < count;) {
      call(ctx, i);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

// Threads per call: the CPUs this process may run on, capped by JAXINFER_NATIVE_THREADS when set (read once).
inline int64_t max_threads() {
  static const int64_t threads = [] {
    cpu_set_t set;
    int64_t cpus = sched_getaffinity(0, sizeof(set), &set) == 0 ? CPU_COUNT(&set) : 1;
    const char* env = std::getenv("JAXINFER_NATIVE_THREADS");
    int64_t cap = env && *env ? std::max<int64_t>(1, std::atoll(env)) : cpus;
    return std::max<int64_t>(1, std::min(cpus, cap));
  }();
  return threads;
}

class Workers {
 public:
  static Workers& get() {
    static Workers* workers = new Workers(max_threads() - 1);  // never destroyed: threads outlive exit safely
    return *workers;
  }

  template <typename F>
  void run(int64_t count, const F& f) {
    std::unique_lock<std::mutex> lock(submit_, std::try_to_lock);
    if (threads_.empty() || count <= 1 || !lock.owns_lock()) {
      for (int64_t i = 0; i < count; ++i) f(i);
      return;
    }
    keep_workers_off(sched_getcpu());
    Job job;
    job.count = count;
    job.call = [](const void* ctx, int64_t i) { (*static_cast<const F*>(ctx))(i); };
    job.ctx = &f;
    job_.store(&job);
    generation_.fetch_add(1);
    if (sleepers_.load() > 0) {
      std::lock_guard<std::mutex> guard(sleep_);
      wake_.notify_all();
    }
    job.drain();
    for (int spins = 0; job.done.load(std::memory_order_acquire) < count; ++spins) {
      if (spins < 4000) _mm_pause();
      else sched_yield();  // the worker holding the last chunk may need this core
    }
    job_.store(nullptr);
    while (inside_.load() > 0) _mm_pause();  // no worker still holds &job
  }

 private:
  // Where a worker runs: its thread id, the CPU it last spun on, whether it sleeps, and the CPU its affinity
  // leaves out (-1: none; read and written by the caller only, under submit_).
  struct Seat {
    std::atomic<pid_t> tid{0};
    std::atomic<int> cpu{-1};
    std::atomic<bool> asleep{false};
    int excluded = -1;
  };

  explicit Workers(int64_t n) : seats_(new Seat[n]) {
    if (sched_getaffinity(0, sizeof(allowed_), &allowed_) != 0) CPU_ZERO(&allowed_);
    for (int64_t t = 0; t < n; ++t) threads_.emplace_back([this, t] { loop(seats_[t]); });
    for (auto& t : threads_) t.detach();
  }

  // Keeps every worker that sleeps, or spins on `cpu`, off `cpu` (the caller's): its affinity becomes the
  // process's CPUs less `cpu`. Failures (a CPU set changed since) leave the worker where it is.
  void keep_workers_off(int cpu) {
    if (cpu < 0 || cpu >= CPU_SETSIZE || !CPU_ISSET(cpu, &allowed_) || CPU_COUNT(&allowed_) < 2) return;
    for (size_t t = 0; t < threads_.size(); ++t) {
      Seat& seat = seats_[t];
      pid_t tid = seat.tid.load();
      if (tid == 0 || seat.excluded == cpu || (!seat.asleep.load() && seat.cpu.load(std::memory_order_relaxed) != cpu))
        continue;
      cpu_set_t set = allowed_;
      CPU_CLR(cpu, &set);
      if (sched_setaffinity(tid, sizeof(set), &set) == 0) seat.excluded = cpu;
    }
  }

  void loop(Seat& seat) {
    seat.tid.store(pid_t(syscall(SYS_gettid)));
    uint64_t seen = generation_.load();
    for (;;) {
      auto start = std::chrono::steady_clock::now();
      for (int spins = 0; generation_.load(std::memory_order_acquire) == seen; ++spins) {
        seat.cpu.store(sched_getcpu(), std::memory_order_relaxed);
        sched_yield();  // polite: XLA's own threads (its parallel fusions) get this core when they need it
        if ((spins & 15) == 15 && std::chrono::steady_clock::now() - start > kSpin) {
          std::unique_lock<std::mutex> lock(sleep_);
          sleepers_.fetch_add(1);
          seat.asleep.store(true);
          wake_.wait(lock, [&] { return generation_.load() != seen; });
          seat.asleep.store(false);
          sleepers_.fetch_sub(1);
          break;
        }
      }
      seen = generation_.load();
      inside_.fetch_add(1);
      if (Job* job = job_.load()) job->drain();
      inside_.fetch_sub(1);
    }
  }

  std::vector<std::thread> threads_;
  std::unique_ptr<Seat[]> seats_;
  cpu_set_t allowed_;
  std::mutex submit_, sleep_;
  std::condition_variable wake_;
  std::atomic<Job*> job_{nullptr};
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> inside_{0}, sleepers_{0};
};

template <typename F>
void parallel_chunks(int64_t count, const F& f) {
  Workers::get().run(count, f);
}

// Rows of N per chunk: one chunk per thread, a multiple of `align`, at least `min_rows`. Each chunk costs a cold
// start of its weight stream and a hand-over of the shared counters between the cores; one per thread over four
// (the earlier split): SmolLM2's int4 / int8 layer calls 1.04-1.16x faster at one row from DRAM, 1.01-1.16x at
// eight rows, the engine's int4 batch-1 step 1.06x (BENCHMARKS.md, session 29). A late thread's chunk is still
// taken by whichever thread is free first (`Job::drain`).
inline int64_t rows_per_chunk(int64_t n, int64_t align, int64_t min_rows) {
  int64_t threads = max_threads();
  int64_t rows = (n + threads - 1) / threads;
  rows = std::max(rows, min_rows);
  return (rows + align - 1) / align * align;
}

}  // namespace jaxinfer_gemv

#endif  // JAXINFER_CPU_GEMV_THREADS_H_
