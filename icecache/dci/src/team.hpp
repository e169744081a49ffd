// A team of threads kept by whoever searches an index (an IceCache sequence's decode steps, or a Forest for the
// queries Python makes), for the search's parallel phases.
//
// Why not an OpenMP team: a decode step searches once per layer with the GPU's work in between (a few hundred
// microseconds), and libgomp's threads have gone to sleep by the next search whenever the process holds more
// OpenMP threads than cores (then it spins ~100 probes before sleeping; the prompt builds' teams and the main
// thread's team count too). Waking the team then cost ~0.3 ms per search on the H200 host, a fifth of the step's
// searches. This team's workers spin on a generation word for `spin_ns` after their last job, which the caller
// sets to cover the gap between its searches (on a GPU host) or not at all (the CPU path, where the gap is the
// model's own work on the same cores), then sleep on a condition variable.
//
// Inside `run`, the n threads meet at `barrier()`; loops share their indices through an atomic counter
// (`next_index`). An exception in any thread is kept (the first one) and rethrown by `run` once every thread has
// returned; a thread that fails still reaches the barriers, because `guarded` catches inside the phase.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include <unistd.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace dci {

inline void spin_pause() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#endif
}

class Team {
 public:
  // `size` threads in all, the caller of `run` included; workers spin `spin_ns` for the next job after each.
  Team(int size, int64_t spin_ns) : size_(size < 1 ? 1 : size), spin_ns_(spin_ns < 0 ? 0 : spin_ns) {
    workers_.reserve(size_ - 1);
    for (int tid = 1; tid < size_; ++tid) workers_.emplace_back([this, tid] { work(tid); });
  }
  Team(const Team&) = delete;
  Team& operator=(const Team&) = delete;
  ~Team() {
    {
      std::lock_guard<std::mutex> lock(sleep_mutex_);
      stopping_.store(true, std::memory_order_seq_cst);
      generation_.fetch_add(1, std::memory_order_seq_cst);
    }
    wake_.notify_all();
    for (auto& w : workers_) w.join();
  }

  int size() const { return size_; }
  int64_t spin_ns() const { return spin_ns_; }
  void set_spin_ns(int64_t ns) { spin_ns_.store(ns < 0 ? 0 : ns, std::memory_order_relaxed); }

  // fn(tid) on min(n, size) threads, tid 0 on the caller; returns when all have returned. One run at a time.
  void run(int n, const std::function<void(int)>& fn) {
    std::lock_guard<std::mutex> one_at_a_time(run_mutex_);
    run_locked(n, fn);
  }

  // run, unless another run holds the team: then nothing runs and it returns false (the caller does the work
  // alone, e.g. a page gather while the look-ahead's search has the team).
  bool try_run(int n, const std::function<void(int)>& fn) {
    std::unique_lock<std::mutex> held(run_mutex_, std::try_to_lock);
    if (!held.owns_lock()) return false;
    run_locked(n, fn);
    return true;
  }

  // Inside run: returns once every one of the run's threads has called it (the same number of times).
  void barrier() {
    const uint32_t phase = barrier_phase_.load(std::memory_order_acquire);
    if (arrived_.fetch_add(1, std::memory_order_acq_rel) == active_ - 1) {
      arrived_.store(0, std::memory_order_relaxed);
      barrier_phase_.fetch_add(1, std::memory_order_release);
      return;
    }
    uint32_t spins = 0;
    while (barrier_phase_.load(std::memory_order_acquire) == phase) {
      spin_pause();
      if ((++spins & 0x3fffu) == 0) std::this_thread::yield();  // a descheduled teammate gets the core
    }
  }

  // Runs f(), keeping the first exception any thread of the run threw (rethrown by run).
  template <class F>
  void guarded(F&& f) {
    if (failed_.load(std::memory_order_relaxed)) return;  // a teammate failed: skip the work, keep the barriers
    try {
      f();
    } catch (...) {
      std::lock_guard<std::mutex> lock(error_mutex_);
      if (!error_) error_ = std::current_exception();
      failed_.store(true, std::memory_order_relaxed);
    }
  }

  // Inside run: whether a thread of the run has failed (a thread waiting on a teammate's work stops waiting).
  bool failed() const { return failed_.load(std::memory_order_relaxed); }

  // The run's threads share a loop's indices: each calls this until it returns >= the loop's length. `counter` is
  // reset (to 0) by the caller before the run, one counter per loop.
  static int64_t next_index(std::atomic<int64_t>& counter) { return counter.fetch_add(1, std::memory_order_relaxed); }

 private:
  using Clock = std::chrono::steady_clock;

  // run's work, with run_mutex_ held
  void run_locked(int n, const std::function<void(int)>& fn) {
    n = n < 1 ? 1 : (n > size_ ? size_ : n);
    error_ = nullptr;
    failed_.store(false, std::memory_order_relaxed);
    active_ = n;
    job_ = &fn;
    arrived_.store(0, std::memory_order_relaxed);
    done_.store(0, std::memory_order_relaxed);
    generation_.fetch_add(1, std::memory_order_seq_cst);  // publishes the job: workers read it after this
    if (sleepers_.load(std::memory_order_seq_cst) > 0) {
      std::lock_guard<std::mutex> lock(sleep_mutex_);
      wake_.notify_all();
    }
    guarded([&] { fn(0); });
    // every worker of the run passes the generation it saw, whether it had a share or not
    const int workers = size_ - 1;
    uint32_t spins = 0;
    while (done_.load(std::memory_order_acquire) < workers) {
      spin_pause();
      if ((++spins & 0xffffu) == 0) std::this_thread::yield();
    }
    job_ = nullptr;
    if (error_) std::rethrow_exception(error_);
  }

  void work(int tid) {
    uint64_t seen = 0;
    for (;;) {
      uint64_t now_gen = generation_.load(std::memory_order_acquire);
      if (now_gen == seen) {
        const auto start = Clock::now();
        uint32_t spins = 0;
        while ((now_gen = generation_.load(std::memory_order_acquire)) == seen) {
          spin_pause();
          if ((++spins & 255u) != 0) continue;
          if (Clock::now() - start < std::chrono::nanoseconds(spin_ns_.load(std::memory_order_relaxed))) continue;
          std::unique_lock<std::mutex> lock(sleep_mutex_);
          sleepers_.fetch_add(1, std::memory_order_seq_cst);
          wake_.wait(lock, [&] { return generation_.load(std::memory_order_seq_cst) != seen; });
          sleepers_.fetch_sub(1, std::memory_order_seq_cst);
        }
      }
      seen = now_gen;
      if (stopping_.load(std::memory_order_acquire)) return;
      if (tid < active_) guarded([&] { (*job_)(tid); });
      done_.fetch_add(1, std::memory_order_acq_rel);
    }
  }

  const int size_;
  std::atomic<int64_t> spin_ns_;
  std::vector<std::thread> workers_;
  std::mutex run_mutex_, sleep_mutex_, error_mutex_;
  std::condition_variable wake_;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> sleepers_{0}, done_{0}, arrived_{0};
  std::atomic<uint32_t> barrier_phase_{0};
  std::atomic<bool> stopping_{false}, failed_{false};
  int active_ = 1;
  const std::function<void(int)>* job_ = nullptr;
  std::exception_ptr error_;
};

// The process's team of `size` threads, made at the first call (spinning `spin_ns`) and shared by every caller
// until the last lets it go. Sharing is what keeps a batch fast: its rows' host steps run one after another, and
// with a team each, every row's workers would spin through the next rows' searches on the cores those need. Runs
// take turns (`run`), so a team shared is a team borrowed; no result depends on which team runs a search. A child
// process gets teams of its own: a forked copy of a team has no threads behind it.
inline std::shared_ptr<Team> shared_team(int size, int64_t spin_ns) {
  struct Entry {
    pid_t pid;
    std::weak_ptr<Team> team;
  };
  static std::mutex mutex;
  static std::map<int, Entry> teams;
  std::lock_guard<std::mutex> lock(mutex);
  Entry& entry = teams[size < 1 ? 1 : size];
  std::shared_ptr<Team> team = entry.pid == getpid() ? entry.team.lock() : nullptr;
  if (!team) {
    team = std::make_shared<Team>(size, spin_ns);
    entry = Entry{getpid(), team};
  }
  return team;
}

}  // namespace dci
