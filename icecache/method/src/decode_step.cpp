// IceCache's host work of one decode step, per sparsified layer, as one C++ call on state C++ holds (the package's
// docstring, icecache/method/__init__.py, walks through the step; layer.py is its Python side).
//
// Why C++: a captured decode step runs every layer's host work as a CUDA host function, and the step's GPU work
// waits for it. In Python that work takes the GIL on the driver's thread once per layer and step, and a few hundred
// NumPy calls; here it is one call with the GIL never taken, so the step's host time is the search and the copies.
//
// Three objects, made from Python once:
//   NativeSequence  what a sequence's layers share: the thread that runs the look-ahead searches, one at a time, and
//                   the first error any step raised (after which every step of the sequence does nothing, as no
//                   state an error left half-updated is to be built on);
//   ReuseGroup      one reuse group's index (the owner's Forest) and selection, page counts and changed pages: the
//                   owner writes them, the group's other layers read them;
//   DecodeStep      one layer's step: raw pointers to its pinned decode buffers, the window ring's host copy and the
//                   token store's storage (all allocated by Python as tensors), and the state the step updates
//                   (window ring, positions, resident and stale pages, counters and timings).
// The step and the look-ahead start are exported as `extern "C" void f(void* state)`, whose addresses Python hands
// to HostExchange.run_native: called directly, or enqueued with cuLaunchHostFunc while a CUDA graph is captured.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "forest.hpp"

namespace py = pybind11;
using dci::Instance;
using dci_forest::Forest;

namespace icestep {

// The host dtype of the window copy, the token store and the page blocks.
enum HostDtype : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

constexpr int kBruteForceThreshold = 3000;  // index.py's BRUTE_FORCE_THRESHOLD
constexpr int kBlocksPerGatherThread = 8;  // a gather thread with fewer blocks does not repay waking it

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// float32 to bfloat16 as torch rounds it (to nearest, ties to even; a NaN becomes the quiet NaN 0x7fc0).
uint16_t to_bfloat16(float f) {
  if (std::isnan(f)) return 0x7fc0u;
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  const uint32_t bias = 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>((bits + bias) >> 16);
}

float from_bfloat16(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// Rows of `n` float32 values into the host dtype (dst holds n elements of it).
void store_row(const float* src, int n, int dtype, char* dst) {
  if (dtype == kFloat32) {
    std::memcpy(dst, src, static_cast<size_t>(n) * 4);
  } else if (dtype == kBFloat16) {
    uint16_t* out = reinterpret_cast<uint16_t*>(dst);
    for (int i = 0; i < n; ++i) out[i] = to_bfloat16(src[i]);
  } else {
    uint16_t* out = reinterpret_cast<uint16_t*>(dst);
    for (int i = 0; i < n; ++i) out[i] = dci::float_to_half(src[i]);  // IEEE round to nearest even, as torch
  }
}

// ---------------------------------------------------------------------------------------------- selection steps
// Per KV head, its query heads' ranked pages interleaved rank by rank, the first k distinct (-1 padded).
// pages [n_kv * group_size, ranks] -> out [n_kv, k].
void merge_group_pages(const int32_t* pages, int n_kv, int group_size, int ranks, int k, int64_t* out) {
  for (int g = 0; g < n_kv; ++g) {
    int64_t* row = out + static_cast<int64_t>(g) * k;
    std::fill(row, row + k, -1);
    int kept = 0;
    for (int r = 0; r < ranks && kept < k; ++r)
      for (int j = 0; j < group_size && kept < k; ++j) {
        const int64_t page = pages[(static_cast<int64_t>(g) * group_size + j) * ranks + r];
        if (page < 0 || std::find(row, row + kept, page) != row + kept) continue;
        row[kept++] = page;
      }
  }
}

// One head of diff_selection: resident [K] (page per slot) updated in place to hold selection [K]. A selected page
// in a slot, not stale, stays; the n-th other slot (slot order) takes the n-th page to load (selection order).
// Appends the (slot, page) pairs loaded.
template <class IsStale>
void diff_head(int64_t* resident, const int64_t* selection, int k, IsStale is_stale, std::vector<int32_t>& slots,
               std::vector<int64_t>& pages, std::vector<uint8_t>& kept, std::vector<int64_t>& to_load) {
  kept.assign(k, 0);
  for (int s = 0; s < k; ++s)
    kept[s] = resident[s] >= 0 && !is_stale(resident[s]) &&
              std::find(selection, selection + k, resident[s]) != selection + k;
  to_load.clear();
  for (int r = 0; r < k; ++r) {
    if (selection[r] < 0) continue;
    bool present = false;
    for (int s = 0; s < k && !present; ++s) present = kept[s] && resident[s] == selection[r];
    if (!present) to_load.push_back(selection[r]);
  }
  size_t paired = 0;
  for (int s = 0; s < k; ++s) {
    if (kept[s]) continue;
    if (paired < to_load.size()) {  // pairs up to the shorter of the free slots and the pages to load
      resident[s] = to_load[paired++];
      slots.push_back(s);
      pages.push_back(resident[s]);
    } else {
      resident[s] = -1;
    }
  }
}

// Cosine of every query head's speculative and exact query, in float64; a zero row against a zero row counts as 1,
// a zero row against another as 0.
double min_head_cosine(const float* speculative, const float* exact, int n_heads, int dim, double* cosines) {
  double low = INFINITY;
  for (int h = 0; h < n_heads; ++h) {
    const float* a = speculative + static_cast<int64_t>(h) * dim;
    const float* b = exact + static_cast<int64_t>(h) * dim;
    double aa = 0, bb = 0, ab = 0;
    for (int d = 0; d < dim; ++d) {
      aa += static_cast<double>(a[d]) * a[d];
      bb += static_cast<double>(b[d]) * b[d];
      ab += static_cast<double>(a[d]) * b[d];
    }
    const double na = std::sqrt(aa), nb = std::sqrt(bb), norms = na * nb;
    const double c = norms > 0 ? ab / norms : (na == 0 && nb == 0 ? 1.0 : 0.0);
    if (cosines) cosines[h] = c;
    low = std::min(low, c);
  }
  return low;
}

bool all_finite(const float* x, int64_t n) {
  double sum = 0;
  for (int64_t i = 0; i < n; ++i) sum += x[i];
  return std::isfinite(sum);
}

// ---------------------------------------------------------------------------------------------- the Forest, raw
// What Forest::query does, into caller buffers and with no Python object: the pages P [nq, K] (and tokens, scores,
// which the step does not use) of each query head, and what the search read.
dci::SearchCounters forest_query(Forest& f, dci::Team& team, const float* q, int64_t nq, int K,
                                 const dci::SearchConfig& sc, int ratio, int32_t* P, int32_t* T, float* PS, float* TS) {
  std::atomic<int64_t> rows{0}, bytes{0}, scores{0}, lists{0};
  f.last_phases_ = dci::QueryPhases{};
  if (f.cfg_.num_dirs() == 1) {
    f.query_grouped(q, nq, K, sc, ratio, P, T, PS, TS, rows, bytes, scores, lists, team);
  } else {
    const int dim = f.cfg_.dim;
    const int nthreads = std::max(1, static_cast<int>(std::min<int64_t>(nq, f.threads_)));
    if (static_cast<int>(f.scratch_.size()) < nthreads) f.scratch_.resize(nthreads);
#pragma omp parallel num_threads(nthreads)
    {
      dci::Scratch& s = f.scratch_[omp_get_thread_num()];
      dci::search_counters() = dci::SearchCounters{};
#pragma omp for schedule(dynamic, 1)
      for (int64_t h = 0; h < nq; ++h)
        f.inst_[h / ratio]->query(q + h * dim, K, sc, s, P + h * K, T + h * K, PS + h * K, TS + h * K);
      Forest::add_counters(rows, bytes, scores, lists);
    }
  }
  f.last_query_ = {rows.load(), bytes.load(), scores.load(), lists.load()};
  return f.last_query_;
}

// DCIIndex.insert of keys [instances, m, dim] (the index's key dtype) as one batch; into an empty index, the
// build with DCIIndex.build's defaults, as DCIIndex.insert does.
void forest_insert_batch(Forest& f, const char* keys, int64_t m, int fov, double pr) {
  const int I = f.num_instances();
  const size_t rb = f.row_bytes();
  if (f.inst_[0]->num_tokens() == 0) {
    dci::SearchConfig sc{30, 1.0, 1.0};
    dci::AnchorConfig ac{60, 60, 1.02};
    const int outer = std::max(1, std::min(I, f.threads_));
    const int inner = std::max(1, f.threads_ / outer);
    omp_set_max_active_levels(2);
#pragma omp parallel for schedule(dynamic, 1) num_threads(outer)
    for (int i = 0; i < I; ++i)
      f.inst_[i]->build(keys + static_cast<int64_t>(i) * m * rb, m, sc, ac, kBruteForceThreshold, inner);
    return;
  }
  dci::SearchConfig sc{fov, pr, 1.0};
#pragma omp parallel for schedule(dynamic, 1) num_threads(std::max(1, std::min(I, f.threads_)))
  for (int i = 0; i < I; ++i)
    f.inst_[i]->insert(keys + static_cast<int64_t>(i) * m * rb, m, sc, true, kBruteForceThreshold);
}

// Forest::pop_changed_pages into `out` [instances, width]; returns width (the most pages of an instance).
int64_t forest_pop_changed(Forest& f, std::vector<uint8_t>& out) {
  const int64_t I = f.num_instances(), P = f.max_pages();
  out.assign(I * P, 0);
  for (int64_t i = 0; i < I; ++i) {
    auto& changed = f.inst_[i]->changed();
    for (size_t p = 0; p < changed.size(); ++p) {
      out[i * P + p] = changed[p] != 0;
      changed[p] = 0;
    }
  }
  return P;
}

// Forest::page_valid_counts into `out` [instances, width]; returns width.
int64_t forest_page_counts(const Forest& f, std::vector<int32_t>& out) {
  const int64_t I = f.num_instances(), P = f.max_pages();
  out.assign(I * P, 0);
  for (int64_t i = 0; i < I; ++i)
    for (int64_t p = 0; p < f.inst_[i]->num_pages(); ++p) {
      const dci::Leaf& lf = f.inst_[i]->leaves()[p];
      out[i * P + p] = lf.owner == -2 ? 0 : lf.count;
    }
  return P;
}

// The token ids of page `page` of instance `head` in slot order, -1 padded (Forest::pages_items for one page).
void forest_page_items(const Forest& f, int head, int64_t page, int32_t* ids) {
  const Instance& x = *f.inst_[head];
  if (page < 0 || page >= x.num_pages()) throw std::out_of_range("page out of range");
  const dci::Leaf& lf = x.leaves()[page];
  const int count = lf.owner == -2 ? 0 : lf.count;
  for (int t = 0; t < dci::kPageSlots; ++t) ids[t] = t < count ? lf.item[t] : -1;
}

// ---------------------------------------------------------------------------------------------- shared objects
class DecodeStep;

class NativeSequence {
 public:
  ~NativeSequence() { stop(); }

  // The look-ahead job of `step` queued for the worker thread at once.
  void submit(DecodeStep* step) {
    std::lock_guard<std::mutex> lock(mutex_);
    start_worker();
    queue_.push_back(step);
    wake_.notify_one();
  }

  // The look-ahead job of `step`, held back until the host step in flight has finished with the team (`release`).
  // In stream order layer l+1's look-ahead starts before layer l's host step; queued at once, its search would take
  // the team, and layer l's page gather would then run on one thread and a missed speculation's exact search
  // would wait for the whole look-ahead search: the step's critical path would pay for the work meant to hide.
  void defer(DecodeStep* step) {
    std::lock_guard<std::mutex> lock(mutex_);
    deferred_.push_back(step);
  }

  // Queue held-back jobs for the worker thread (started at the first job): `only`'s, if held (its own step needs
  // it now), or with nullptr every one (a host step has finished with the team).
  void release(DecodeStep* only) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (deferred_.empty()) return;
    start_worker();
    if (only == nullptr) {
      queue_.insert(queue_.end(), deferred_.begin(), deferred_.end());
      deferred_.clear();
    } else {
      const auto held = std::find(deferred_.begin(), deferred_.end(), only);
      if (held == deferred_.end()) return;
      deferred_.erase(held);
      queue_.push_back(only);
    }
    wake_.notify_one();
  }

  // Ends the worker after the jobs it has, the held-back ones included (the sequence has ended).
  void stop() {
    release(nullptr);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!worker_.joinable()) return;
      stopping_ = true;
      wake_.notify_one();
    }
    worker_.join();
    worker_ = std::thread();
  }

  bool running() {
    std::lock_guard<std::mutex> lock(mutex_);
    return worker_.joinable();
  }
  // The team the sequence's searches and page gathers run on: the process's team of `threads` threads
  // (dci::shared_team, which the other sequences of a batch share), taken at the first call; a later caller asking
  // more gets that many at most. Its workers spin `team_spin_ns` after each job.
  dci::Team& team(int threads) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!team_) {
      team_ = dci::shared_team(threads, team_spin_ns_);
      team_->set_spin_ns(team_spin_ns_);
    }
    return *team_;
  }
  void set_team_spin(double seconds) {
    std::lock_guard<std::mutex> lock(mutex_);
    team_spin_ns_ = static_cast<int64_t>(seconds * 1e9);
    if (team_) team_->set_spin_ns(team_spin_ns_);
  }
  double team_spin() {
    std::lock_guard<std::mutex> lock(mutex_);
    return static_cast<double>(team_spin_ns_) * 1e-9;
  }
  // Which team the sequence runs on (an opaque number, equal for sequences sharing one; 0 before its first search).
  uintptr_t team_id() {
    std::lock_guard<std::mutex> lock(mutex_);
    return reinterpret_cast<uintptr_t>(team_.get());
  }

  bool failed() const { return failed_.load(std::memory_order_acquire); }
  void fail(const std::string& message) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!failed_.load()) error_ = message;
    failed_.store(true, std::memory_order_release);
  }
  std::string error() {
    std::lock_guard<std::mutex> lock(mutex_);
    return error_;
  }
  void clear_error() {
    std::lock_guard<std::mutex> lock(mutex_);
    error_.clear();
    failed_.store(false);
  }

 private:
  void work();
  void start_worker() {  // with mutex_ held
    if (worker_.joinable()) return;
    stopping_ = false;
    worker_ = std::thread([this] { work(); });
  }

  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<DecodeStep*> queue_;
  std::vector<DecodeStep*> deferred_;  // look-ahead jobs started in stream order, not yet released to the worker
  std::thread worker_;
  bool stopping_ = false;
  std::atomic<bool> failed_{false};
  std::string error_;
  int64_t team_spin_ns_ = 0;
  std::shared_ptr<dci::Team> team_;  // last member: let go before the rest goes
};

struct ReuseGroup {
  ReuseGroup(int n_kv_heads, int k) : n_kv(n_kv_heads), k(k) {}

  // The owner's index, once its prompt job built it; what the group knew of the former one is dropped.
  void set_forest(py::object forest) {
    forest_ref = forest;
    this->forest = forest.is_none() ? nullptr : &forest.cast<Forest&>();
    counts_valid = false;
    changed.clear();
    changed_width = 0;
  }
  int64_t n_tokens() const { return forest == nullptr ? 0 : forest->inst_[0]->num_tokens(); }
  Forest& index() const {
    if (forest == nullptr) throw std::runtime_error("the reuse group's index is not built");
    return *forest;
  }
  // Valid tokens of every page [n_kv, counts_width], read from the index again only after it changes.
  const int32_t* page_counts() {
    if (!counts_valid) {
      counts_width = forest_page_counts(index(), counts);
      counts_valid = true;
    }
    return counts.data();
  }

  int n_kv, k;
  py::object forest_ref;  // keeps the Forest alive as long as the group
  Forest* forest = nullptr;
  std::vector<int64_t> selection;  // [n_kv, k] this step's pages per KV head, -1 padded; empty before the first
  std::vector<int32_t> counts;
  int64_t counts_width = 0;
  bool counts_valid = false;
  std::vector<uint8_t> changed;  // [n_kv, changed_width]: the pages the owner's last insert changed
  int64_t changed_width = 0;
};

struct StepConfig {
  int layer = 0, n_heads = 0, n_kv_heads = 0, head_dim = 0, page_size = 16, n_sink_pages = 0, n_selected = 0;
  int n_window_pages = 1, first_window_slot = 0;
  bool owner = true, keys_in_index = false;
  int host_dtype = kFloat32;
  int query_field_of_view = -1;  // -1: max(int(1.5e-3 * tokens), 30)
  double query_prop_to_retrieve = 0.8;
  int insert_field_of_view = 20;
  double insert_prop_to_retrieve = 0.6;
  double lookahead_min_cosine = 0.9;
  // The layer before this one runs a host step of its own (it is sparse): the look-ahead's search waits for that
  // step to be done with the team (NativeSequence::defer). After a dense layer it starts at once.
  bool lookahead_after_host_step = true;
};

// What the step counted and timed since Python last took it (DecodeStep::take_records).
struct Records {
  std::vector<double> attended;  // each step's mean attended tokens per KV head (a float32 value)
  int64_t pages_loaded = 0, bytes_to_gpu = 0;
  int64_t searches = 0, rows_read = 0, bytes_read = 0, scores = 0, lists = 0;
  int64_t lookahead_searches = 0, lookahead_misses = 0;
  dci::QueryPhases search_phases;  // summed over the searches the step waited for (not the look-ahead's)
  double query_s = 0, load_s = 0, insert_s = 0;
  int query_n = 0, load_n = 0, insert_n = 0;  // how many times each phase ran (a phase that ran is reported)
  std::vector<double> host_step, lookahead_search;
};

class DecodeStep {
 public:
  DecodeStep(std::shared_ptr<NativeSequence> seq, std::shared_ptr<ReuseGroup> group, const StepConfig& cfg)
      : cfg_(cfg), seq_(std::move(seq)), group_(std::move(group)) {
    if (cfg_.n_kv_heads < 1 || cfg_.n_heads % cfg_.n_kv_heads != 0) throw std::invalid_argument("bad head counts");
    if (cfg_.page_size != dci::kPageSlots) throw std::invalid_argument("page_size must be the DCI leaf capacity");
    if (cfg_.host_dtype < kFloat32 || cfg_.host_dtype > kFloat16) throw std::invalid_argument("bad host dtype");
    item_ = cfg_.host_dtype == kFloat32 ? 4 : 2;
    group_size_ = cfg_.n_heads / cfg_.n_kv_heads;
    resident_.assign(static_cast<size_t>(cfg_.n_kv_heads) * cfg_.n_selected, -1);
    pages_.resize(static_cast<size_t>(cfg_.n_heads) * cfg_.n_selected);
    tokens_out_.resize(pages_.size());
    page_scores_.resize(pages_.size());
    token_scores_.resize(pages_.size());
    ahead_pages_.resize(pages_.size());
    ahead_query_.resize(static_cast<size_t>(cfg_.n_heads) * cfg_.head_dim);
  }

  ~DecodeStep() { wait_lookahead(); }

  // ------------------------------------------------------------------ what Python points the step at
  void set_window(uintptr_t keys, uintptr_t values, int64_t start, int count) {
    window_keys_ = reinterpret_cast<char*>(keys);
    window_values_ = reinterpret_cast<char*>(values);
    window_start_ = start;
    window_count_ = count;
    window_head_ = 0;
  }
  void set_positions(py::array_t<int64_t, py::array::c_style | py::array::forcecast> positions) {
    positions_.assign(positions.data(), positions.data() + positions.size());
  }
  void set_sink_len(int64_t n) { sink_len_ = n; }
  void set_tokens(uintptr_t keys, uintptr_t values, int64_t head_stride, int64_t n_tokens, int64_t capacity) {
    if (keys == 0 && !cfg_.keys_in_index) throw std::invalid_argument("this layer's token store must hold keys");
    store_keys_ = reinterpret_cast<char*>(keys);
    store_values_ = reinterpret_cast<char*>(values);
    store_stride_ = head_stride;
    n_tokens_ = n_tokens;
    capacity_ = capacity;
  }
  void set_buffers(uintptr_t query, uintptr_t key, uintptr_t value, uintptr_t window_rows, uintptr_t counts,
                   int n_slots, uintptr_t slots, uintptr_t heads, int max_blocks, uintptr_t keys, uintptr_t values,
                   uintptr_t attended, int64_t trace_width) {
    if (n_slots != cfg_.n_sink_pages + cfg_.n_selected + cfg_.n_window_pages)
      throw std::invalid_argument("n_slots must be sink + selected + window pages");
    if (max_blocks < cfg_.n_kv_heads * cfg_.n_selected) throw std::invalid_argument("too few blocks");
    query_ = reinterpret_cast<const float*>(query);
    key_ = reinterpret_cast<const float*>(key);
    value_ = reinterpret_cast<const float*>(value);
    window_rows_ = reinterpret_cast<int64_t*>(window_rows);
    counts_ = reinterpret_cast<int32_t*>(counts);
    n_slots_ = n_slots;
    slots_ = reinterpret_cast<int32_t*>(slots);
    heads_ = reinterpret_cast<int32_t*>(heads);
    max_blocks_ = max_blocks;
    block_keys_ = reinterpret_cast<char*>(keys);
    block_values_ = reinterpret_cast<char*>(values);
    attended_ = reinterpret_cast<uint8_t*>(attended);
    trace_width_ = trace_width;
  }
  void set_speculative(uintptr_t query) { speculative_ = reinterpret_cast<const float*>(query); }

  // ------------------------------------------------------------------ the entries
  // The host work of one decode step (the layer's decode buffers in, the blocks, counts and rows out). Never
  // throws: an error is kept by the sequence and every later step of it does nothing.
  void run_step() noexcept {
    if (seq_->failed()) return;
    try {
      step();
    } catch (const std::exception& error) {
      seq_->fail(where() + error.what());
    } catch (...) {
      seq_->fail(where() + "unknown error");
    }
  }

  // The look-ahead: the speculative query copied from its exchange, its job handed to the sequence's worker.
  void start_lookahead() noexcept {
    if (seq_->failed()) return;
    try {
      if (speculative_ == nullptr) throw std::runtime_error("look-ahead started without its speculative query");
      wait_lookahead();  // a job not taken by a step (none is expected) ends before its state is reused
      std::copy(speculative_, speculative_ + ahead_query_.size(), ahead_query_.begin());
      {
        std::lock_guard<std::mutex> lock(job_mutex_);
        job_pending_ = true;
        job_done_ = false;
      }
      if (cfg_.lookahead_after_host_step) seq_->defer(this);
      else seq_->submit(this);
    } catch (const std::exception& error) {
      seq_->fail(where() + error.what());
    }
  }

  // Whether a look-ahead job has started and its step has not yet taken it: meanwhile the job may write the window,
  // the token store and the index, so nothing else may touch them.
  bool lookahead_pending() {
    std::lock_guard<std::mutex> lock(job_mutex_);
    return job_pending_;
  }

  // On the sequence's worker thread: offload the window page that is due and search with the speculative query.
  void run_lookahead() noexcept {
    const auto start = std::chrono::steady_clock::now();
    try {
      if (!seq_->failed()) {
        if (window_full()) offload_window_page();
        ahead_has_pages_ = group_->n_tokens() > 0;
        if (ahead_has_pages_) ahead_stats_ = search(ahead_query_.data(), ahead_pages_.data());
      }
    } catch (const std::exception& error) {
      seq_->fail(where() + "look-ahead: " + error.what());
    }
    std::lock_guard<std::mutex> lock(job_mutex_);
    {
      std::lock_guard<std::mutex> records(records_mutex_);
      records_.lookahead_search.push_back(seconds_since(start));
    }
    job_done_ = true;
    job_wake_.notify_all();
  }

  // ------------------------------------------------------------------ what Python reads
  py::dict take_records() {
    Records r;
    {
      std::lock_guard<std::mutex> lock(records_mutex_);
      std::swap(r, records_);
    }
    py::dict d;
    d["attended"] = r.attended;
    d["pages_loaded"] = r.pages_loaded;
    d["bytes_to_gpu"] = r.bytes_to_gpu;
    d["searches"] = r.searches;
    d["rows_read"] = r.rows_read;
    d["bytes_read"] = r.bytes_read;
    d["scores"] = r.scores;
    d["lists"] = r.lists;
    d["lookahead_searches"] = r.lookahead_searches;
    d["lookahead_misses"] = r.lookahead_misses;
    d["search_phase_ns"] = Forest::phases_dict(r.search_phases);
    py::dict phases;
    if (r.query_n) phases["query"] = r.query_s;
    if (r.load_n) phases["load"] = r.load_s;
    if (r.insert_n) phases["insert"] = r.insert_s;
    d["phases"] = phases;
    d["host_step"] = r.host_step;
    d["lookahead_search"] = r.lookahead_search;
    return d;
  }
  py::array_t<int64_t> resident() const {
    py::array_t<int64_t> out({cfg_.n_kv_heads, cfg_.n_selected});
    std::copy(resident_.begin(), resident_.end(), out.mutable_data());
    return out;
  }
  py::array_t<int64_t> positions() const {
    py::array_t<int64_t> out(static_cast<py::ssize_t>(positions_.size()));
    std::copy(positions_.begin(), positions_.end(), out.mutable_data());
    return out;
  }
  py::array_t<bool> stale() const {
    py::array_t<bool> out({static_cast<int64_t>(cfg_.n_kv_heads), stale_width_});
    bool* o = out.mutable_data();
    for (size_t i = 0; i < stale_.size(); ++i) o[i] = stale_[i] != 0;
    return out;
  }
  py::array_t<int32_t> window_slot_counts() const {
    py::array_t<int32_t> out(cfg_.n_window_pages);
    for (int i = 0; i < cfg_.n_window_pages; ++i) out.mutable_data()[i] = window_slot_count(i);
    return out;
  }
  // This step's trace into attended [n_kv, width] (bytes, 1: attended), from the host's state.
  void trace_into(py::array_t<uint8_t, py::array::c_style> attended) {
    if (attended.ndim() != 2 || attended.shape(0) != cfg_.n_kv_heads) throw std::invalid_argument("attended [n_kv, width]");
    trace(attended.mutable_data(), attended.shape(1));
  }
  // Test entries for the window ring alone: the new token [n_kv, dim] (float32) appended, its pool rows returned;
  // and the oldest page offloaded (into the token store and, on an owner, the index).
  py::array_t<int64_t> window_append(py::array_t<float, py::array::c_style | py::array::forcecast> key,
                                     py::array_t<float, py::array::c_style | py::array::forcecast> value) {
    py::array_t<int64_t> rows(cfg_.n_kv_heads);
    append_token(key.data(), value.data(), rows.mutable_data());
    return rows;
  }
  void window_offload() {
    py::gil_scoped_release nogil;
    offload_window_page();
  }
  bool window_full() const { return window_count_ == window_capacity(); }
  std::pair<uintptr_t, uintptr_t> step_entry();
  std::pair<uintptr_t, uintptr_t> lookahead_entry();

  int64_t window_start_ = 0;
  int window_count_ = 0, window_head_ = 0;
  int64_t n_tokens_ = 0, capacity_ = 0, sink_len_ = 0;
  StepConfig cfg_;

 private:
  std::string where() const { return "layer " + std::to_string(cfg_.layer) + ": "; }
  int window_capacity() const { return cfg_.n_window_pages * cfg_.page_size; }
  size_t row_bytes() const { return static_cast<size_t>(cfg_.head_dim) * item_; }
  int window_slot_count(int slot) const {
    const int n = cfg_.n_window_pages;
    const int logical = ((slot - window_head_) % n + n) % n;
    return std::clamp(window_count_ - logical * cfg_.page_size, 0, cfg_.page_size);
  }

  void wait_lookahead() {
    seq_->release(this);
    std::unique_lock<std::mutex> lock(job_mutex_);
    job_wake_.wait(lock, [this] { return !job_pending_ || job_done_; });
  }

  void step() {
    const auto start = std::chrono::steady_clock::now();
    if (query_ == nullptr) throw std::runtime_error("the decode buffers are not set");
    if (store_values_ == nullptr) throw std::runtime_error("the token store is not set");
    bool ahead = false;
    seq_->release(this);  // this layer's look-ahead, if still held back (no host step ran since it started)
    {
      std::unique_lock<std::mutex> lock(job_mutex_);
      if (job_pending_) {  // before anything else: the job offloads the window page that was due
        const auto waited = std::chrono::steady_clock::now();
        job_wake_.wait(lock, [this] { return job_done_; });
        job_pending_ = false;
        ahead = true;
        add_phase(records_.query_s, records_.query_n, seconds_since(waited));
      }
    }
    if (seq_->failed()) return;  // the look-ahead job failed
    if (window_full()) {
      const auto t = std::chrono::steady_clock::now();
      offload_window_page();
      add_phase(records_.insert_s, records_.insert_n, seconds_since(t));
    }
    append_token(key_, value_, window_rows_);
    const int64_t* selection = select(ahead);
    {
      const auto t = std::chrono::steady_clock::now();
      stage_pages(selection);
      add_phase(records_.load_s, records_.load_n, seconds_since(t));
    }
    const double mean = write_counts();
    if (attended_ != nullptr) trace(attended_, trace_width_);
    seq_->release(nullptr);  // done with the team: the next layers' look-aheads may search
    std::lock_guard<std::mutex> lock(records_mutex_);
    records_.attended.push_back(mean);
    records_.host_step.push_back(seconds_since(start));
  }

  void add_phase(double& total, int& n, double seconds) {
    std::lock_guard<std::mutex> lock(records_mutex_);
    total += seconds;
    ++n;
  }

  // The new token [n_kv, dim] (float32) into the window's host copy at its next position; its flat pool rows (a
  // pool [slots, n_kv, page_size, dim] seen as rows of dim) into rows [n_kv].
  void append_token(const float* key, const float* value, int64_t* rows) {
    if (window_full()) throw std::runtime_error("the window is full");
    const int ps = cfg_.page_size, n_kv = cfg_.n_kv_heads, D = cfg_.head_dim;
    const int64_t cap = window_capacity();
    for (int h = 0; h < n_kv; ++h) {
      const size_t at = (static_cast<size_t>(h) * cap + window_count_) * row_bytes();
      store_row(key + static_cast<int64_t>(h) * D, D, cfg_.host_dtype, window_keys_ + at);
      store_row(value + static_cast<int64_t>(h) * D, D, cfg_.host_dtype, window_values_ + at);
    }
    const int page = window_count_ / ps, offset = window_count_ % ps;
    const int64_t slot = cfg_.first_window_slot + (window_head_ + page) % cfg_.n_window_pages;
    for (int h = 0; h < n_kv; ++h) rows[h] = (slot * n_kv) * ps + static_cast<int64_t>(h) * ps + offset;
    ++window_count_;
  }

  // The window's oldest page out of its host copy (the ring turns), into the token store and, on an owner, the
  // index as one batch; the pages that insert changed are stale where resident (in every layer of the group).
  void offload_window_page() {
    const int ps = cfg_.page_size, n_kv = cfg_.n_kv_heads, D = cfg_.head_dim;
    const size_t rb = row_bytes();
    const int64_t cap = window_capacity();
    if (window_count_ < ps) throw std::runtime_error("no full window page to offload");
    if (n_tokens_ + ps > capacity_)
      throw std::runtime_error("IceCache's token store must grow between decode steps (LayerKV.between_steps), not "
                               "inside a decode step's host work");
    page_keys_.resize(static_cast<size_t>(n_kv) * ps * rb);
    const bool store_keys = store_keys_ != nullptr;
    for (int h = 0; h < n_kv; ++h) {
      char* wk = window_keys_ + static_cast<size_t>(h) * cap * rb;
      char* wv = window_values_ + static_cast<size_t>(h) * cap * rb;
      std::memcpy(page_keys_.data() + static_cast<size_t>(h) * ps * rb, wk, ps * rb);
      const size_t to = (static_cast<size_t>(h) * store_stride_ + n_tokens_) * rb;
      std::memcpy(store_values_ + to, wv, ps * rb);
      if (store_keys) std::memcpy(store_keys_ + to, wk, ps * rb);
      std::memmove(wk, wk + ps * rb, (cap - ps) * rb);
      std::memmove(wv, wv + ps * rb, (cap - ps) * rb);
    }
    window_count_ -= ps;
    window_head_ = (window_head_ + 1) % cfg_.n_window_pages;
    for (int t = 0; t < ps; ++t) positions_.push_back(window_start_ + t);
    window_start_ += ps;
    n_tokens_ += ps;
    ReuseGroup& group = *group_;
    if (cfg_.owner) {
      Forest& f = group.index();
      const char* keys = page_keys_.data();
      if (f.cfg_.bf16_keys) {
        if (cfg_.host_dtype != kBFloat16) throw std::runtime_error("a bfloat16 index takes bfloat16 keys");
        float_keys_.resize(static_cast<size_t>(n_kv) * ps * D);
        const uint16_t* bits = reinterpret_cast<const uint16_t*>(keys);
        for (size_t i = 0; i < float_keys_.size(); ++i) float_keys_[i] = from_bfloat16(bits[i]);
        if (!all_finite(float_keys_.data(), float_keys_.size()))
          throw std::invalid_argument("keys contains NaN or infinite values");
      } else {
        float_keys_.resize(static_cast<size_t>(n_kv) * ps * D);
        if (cfg_.host_dtype == kFloat32) {
          std::memcpy(float_keys_.data(), keys, float_keys_.size() * 4);
        } else if (cfg_.host_dtype == kFloat16) {
          const uint16_t* bits = reinterpret_cast<const uint16_t*>(keys);
          for (size_t i = 0; i < float_keys_.size(); ++i) float_keys_[i] = dci::half_to_float(bits[i]);
        } else {
          throw std::runtime_error("a float32 index of bfloat16 keys is not made");
        }
        if (!all_finite(float_keys_.data(), float_keys_.size()))
          throw std::invalid_argument("keys contains NaN or infinite values");
        keys = reinterpret_cast<const char*>(float_keys_.data());
      }
      forest_insert_batch(f, keys, ps, cfg_.insert_field_of_view, cfg_.insert_prop_to_retrieve);
      group.changed_width = forest_pop_changed(f, group.changed);
      group.counts_valid = false;
    }
    if (group.changed_width > 0) {  // stale[:, :width] |= changed
      cover_pages(group.changed_width);
      for (int h = 0; h < n_kv; ++h)
        for (int64_t p = 0; p < group.changed_width; ++p)
          stale_[h * stale_width_ + p] |= group.changed[h * group.changed_width + p];
    }
  }

  // stale has a flag for each of n_pages pages (new pages are not stale).
  void cover_pages(int64_t n_pages) {
    if (n_pages <= stale_width_) return;
    std::vector<uint8_t> wider(static_cast<size_t>(cfg_.n_kv_heads) * n_pages, 0);
    for (int h = 0; h < cfg_.n_kv_heads; ++h)
      std::copy(stale_.begin() + h * stale_width_, stale_.begin() + (h + 1) * stale_width_,
                wider.begin() + h * n_pages);
    stale_.swap(wider);
    stale_width_ = n_pages;
  }

  // The owner's index searched for query [n_heads, dim]: each query head's ranked pages into pages [n_heads, K].
  dci::SearchCounters search(const float* query, int32_t* pages) {
    Forest& f = group_->index();
    if (!all_finite(query, static_cast<int64_t>(cfg_.n_heads) * cfg_.head_dim))
      throw std::invalid_argument("queries contains NaN or infinite values");
    const int fov = cfg_.query_field_of_view >= 0
                        ? cfg_.query_field_of_view
                        : std::max(static_cast<int>(1.5e-3 * static_cast<double>(group_->n_tokens())), 30);
    if (fov < 1) throw std::invalid_argument("field_of_view must be >= 1");
    if (!(cfg_.query_prop_to_retrieve > 0.0 && cfg_.query_prop_to_retrieve <= 1.0))
      throw std::invalid_argument("prop_to_retrieve must lie in (0, 1]");
    // the step reads only the pages: no token list is ranked (the same pages, docs/dci.md)
    dci::SearchConfig sc{fov, cfg_.query_prop_to_retrieve, 1.0, false};
    return forest_query(f, seq_->team(f.threads()), query, cfg_.n_heads, cfg_.n_selected, sc, group_size_, pages,
                        tokens_out_.data(), page_scores_.data(), token_scores_.data());
  }

  // K distinct pages per KV head [n_kv, K] (-1 padded) for this step's query: the owner searches (or takes its
  // look-ahead's pages when the speculation holds), a reusing layer reads its owner's choice.
  const int64_t* select(bool ahead) {
    ReuseGroup& group = *group_;
    const size_t size = static_cast<size_t>(cfg_.n_kv_heads) * cfg_.n_selected;
    if (!cfg_.owner) {
      if (group.selection.size() != size) throw std::runtime_error("the reuse group's owner has not selected");
      return group.selection.data();
    }
    group.selection.resize(size);
    if (group.n_tokens() == 0) {
      std::fill(group.selection.begin(), group.selection.end(), -1);
      return group.selection.data();
    }
    bool held = false;
    if (ahead && ahead_has_pages_) {
      held = min_head_cosine(ahead_query_.data(), query_, cfg_.n_heads, cfg_.head_dim, nullptr) >=
             cfg_.lookahead_min_cosine;
      std::lock_guard<std::mutex> lock(records_mutex_);
      ++records_.lookahead_searches;
      records_.lookahead_misses += !held;
    }
    dci::SearchCounters stats;
    const int32_t* pages;
    if (held) {
      pages = ahead_pages_.data();
      stats = ahead_stats_;
    } else {
      const auto t = std::chrono::steady_clock::now();
      stats = search(query_, pages_.data());
      pages = pages_.data();
      add_phase(records_.query_s, records_.query_n, seconds_since(t));
      std::lock_guard<std::mutex> lock(records_mutex_);
      records_.search_phases += group.index().last_phases_;
    }
    merge_group_pages(pages, cfg_.n_kv_heads, group_size_, cfg_.n_selected, cfg_.n_selected, group.selection.data());
    std::lock_guard<std::mutex> lock(records_mutex_);
    ++records_.searches;
    records_.rows_read += stats.rows;
    records_.bytes_read += stats.bytes;
    records_.scores += stats.scores;
    records_.lists += stats.lists;
    return group.selection.data();
  }

  // The selection diffed against the slots; the pages to load gathered into the block buffers with their slot and
  // head (values from the token store, keys from it or from the index); the entries after them marked unused.
  void stage_pages(const int64_t* selection) {
    const int K = cfg_.n_selected, ps = cfg_.page_size;
    const size_t rb = row_bytes();
    const Forest& f = group_->index();
    load_slots_.clear();
    load_pages_.clear();
    load_heads_.clear();
    for (int h = 0; h < cfg_.n_kv_heads; ++h) {
      const uint8_t* stale = stale_.data() + static_cast<size_t>(h) * stale_width_;
      const int64_t width = stale_width_;
      diff_head(resident_.data() + static_cast<size_t>(h) * K, selection + static_cast<size_t>(h) * K, K,
                [stale, width](int64_t page) { return page < width && stale[page] != 0; }, load_slots_, load_pages_,
                kept_, to_load_);
      load_heads_.resize(load_slots_.size(), h);
    }
    const int n = static_cast<int>(load_slots_.size());
    for (int i = 0; i < max_blocks_; ++i) slots_[i] = i < n ? load_slots_[i] + cfg_.n_sink_pages : -1;
    if (n == 0) return;
    const int64_t store_rows = (cfg_.n_kv_heads - 1) * store_stride_ + n_tokens_;
    for (int r = 0; r < n; ++r) {
      heads_[r] = load_heads_[r];
      if (load_pages_[r] < stale_width_) stale_[load_heads_[r] * stale_width_ + load_pages_[r]] = 0;
    }
    // Each block's 2 x 16 rows are scattered 256-byte reads, so one thread waits on memory latency (~0.25 ms for a
    // layer's ~95 blocks); a share of the index's threads, each with at least kBlocksPerGatherThread blocks, hides
    // it. Blocks are independent and each is written by one thread, so the bytes do not depend on the split.
    const int threads = std::max(1, std::min(std::max(1, f.threads() / 2), n / kBlocksPerGatherThread));
    std::atomic<bool> out_of_range{false};
    const auto gather = [&](const int tid, const int share) {
      for (int r = tid; r < n; r += share) {
        const int h = load_heads_[r];
        int32_t ids[dci::kPageSlots];
        forest_page_items(f, h, load_pages_[r], ids);
        char* out_k = block_keys_ + static_cast<size_t>(r) * ps * rb;
        char* out_v = block_values_ + static_cast<size_t>(r) * ps * rb;
        for (int t = 0; t < ps; ++t) {
          // an id of -1 reads row 0 of the head from the store (any finite content: the slot's count masks it) and
          // a zero row from the index, as the NumPy gather and DCIIndex.gather_keys did
          const int64_t row = std::min<int64_t>(h * store_stride_ + std::max<int32_t>(ids[t], 0), store_rows - 1);
          std::memcpy(out_v + t * rb, store_values_ + row * rb, rb);
          if (store_keys_ != nullptr) {
            std::memcpy(out_k + t * rb, store_keys_ + row * rb, rb);
          } else if (ids[t] < 0) {
            std::memset(out_k + t * rb, 0, rb);
          } else {
            const Instance& x = *f.inst_[h];
            if (ids[t] >= x.num_tokens()) {
              out_of_range.store(true, std::memory_order_relaxed);  // thrown below: nothing leaves a parallel region
              continue;
            }
            std::memcpy(out_k + t * rb, x.key_bytes_of(ids[t]), rb);
          }
        }
      }
    };
    // With the look-ahead, its search may hold the team: the gather then runs on this thread alone.
    dci::Team& team = seq_->team(f.threads());
    const int share = std::min(threads, team.size());
    if (share == 1 || !team.try_run(share, [&](const int tid) { gather(tid, share); })) gather(0, 1);
    if (out_of_range.load()) throw std::out_of_range("token id out of range");
    std::lock_guard<std::mutex> lock(records_mutex_);
    records_.pages_loaded += n;
    records_.bytes_to_gpu += 2 * static_cast<int64_t>(n) * ps * static_cast<int64_t>(rb);
  }

  // Valid tokens per slot (the sinks' were written once by Python; here the selected pages and the window); the
  // float32 mean over KV heads of the tokens attended, as the device reduction this replaced computed it.
  double write_counts() {
    const int K = cfg_.n_selected, ns = cfg_.n_sink_pages;
    const int32_t* page_counts = group_->page_counts();
    const int64_t width = group_->counts_width;
    int64_t total = 0;
    for (int h = 0; h < cfg_.n_kv_heads; ++h) {
      int32_t* row = counts_ + static_cast<int64_t>(h) * n_slots_;
      for (int s = 0; s < K; ++s) {
        const int64_t page = resident_[static_cast<size_t>(h) * K + s];
        row[ns + s] = page >= 0 ? page_counts[h * width + page] : 0;
      }
      for (int i = 0; i < cfg_.n_window_pages; ++i) row[ns + K + i] = window_slot_count(i);
      for (int s = 0; s < n_slots_; ++s) total += row[s];
    }
    return static_cast<double>(static_cast<float>(total) / static_cast<float>(cfg_.n_kv_heads));
  }

  // The trace into attended [n_kv, width]: the sinks, the window up to the new token, and the tokens of each KV
  // head's resident pages.
  void trace(uint8_t* attended, int64_t width) {
    std::memset(attended, 0, static_cast<size_t>(cfg_.n_kv_heads) * width);
    const Forest* f = group_->forest;
    for (int h = 0; h < cfg_.n_kv_heads; ++h) {
      uint8_t* row = attended + static_cast<int64_t>(h) * width;
      std::fill(row, row + std::min<int64_t>(sink_len_, width), 1);
      const int64_t first = std::min<int64_t>(window_start_, width);
      std::fill(row + first, row + std::min<int64_t>(window_start_ + window_count_, width), 1);
      for (int s = 0; s < cfg_.n_selected; ++s) {
        const int64_t page = resident_[static_cast<size_t>(h) * cfg_.n_selected + s];
        if (page < 0 || f == nullptr) continue;
        const dci::Leaf& lf = f->inst_[h]->leaves()[page];
        if (lf.owner == -2) continue;
        for (int t = 0; t < lf.count; ++t) {
          const int64_t position = positions_.at(lf.item[t]);
          if (position >= width) throw std::out_of_range("an attended position past the trace width");
          row[position] = 1;
        }
      }
    }
  }

  std::shared_ptr<NativeSequence> seq_;
  std::shared_ptr<ReuseGroup> group_;
  int item_ = 4, group_size_ = 1;
  // the window's host copy [n_kv, n_window_pages * page_size, dim], oldest token first
  char* window_keys_ = nullptr;
  char* window_values_ = nullptr;
  // the token store [n_kv, capacity, dim] with heads store_stride_ rows apart; keys null where the index holds them
  char* store_keys_ = nullptr;
  char* store_values_ = nullptr;
  int64_t store_stride_ = 0;
  std::vector<int64_t> positions_;  // token id -> absolute position
  std::vector<int64_t> resident_;   // [n_kv, K] page per selected slot, -1 for none
  std::vector<uint8_t> stale_;      // [n_kv, stale_width_] the page changed since it was loaded
  int64_t stale_width_ = 0;
  // the decode buffers (pinned host memory on CUDA)
  const float* query_ = nullptr;
  const float* key_ = nullptr;
  const float* value_ = nullptr;
  int64_t* window_rows_ = nullptr;
  int32_t* counts_ = nullptr;
  int n_slots_ = 0, max_blocks_ = 0;
  int32_t* slots_ = nullptr;
  int32_t* heads_ = nullptr;
  char* block_keys_ = nullptr;
  char* block_values_ = nullptr;
  uint8_t* attended_ = nullptr;
  int64_t trace_width_ = 0;
  // the look-ahead: its speculative query's exchange, its job's copy of it and what it found
  const float* speculative_ = nullptr;
  std::vector<float> ahead_query_;
  std::vector<int32_t> ahead_pages_;
  dci::SearchCounters ahead_stats_;
  bool ahead_has_pages_ = false;
  std::mutex job_mutex_;
  std::condition_variable job_wake_;
  bool job_pending_ = false, job_done_ = false;
  // scratch, kept across steps so that a step allocates nothing once they have grown
  std::vector<int32_t> pages_, tokens_out_;
  std::vector<float> page_scores_, token_scores_, float_keys_;
  std::vector<char> page_keys_;
  std::vector<int32_t> load_slots_, load_heads_;
  std::vector<int64_t> load_pages_, to_load_;
  std::vector<uint8_t> kept_;
  std::mutex records_mutex_;  // the look-ahead job records its span from the worker thread
  Records records_;
};

void NativeSequence::work() {
  for (;;) {
    DecodeStep* step;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      wake_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping, and every job done
      step = queue_.front();
      queue_.pop_front();
    }
    step->run_lookahead();
  }
}

}  // namespace icestep

extern "C" {
// The host work of one decode step of the DecodeStep at `state` (a host function of a captured step).
void icecache_decode_step(void* state) { static_cast<icestep::DecodeStep*>(state)->run_step(); }
// The look-ahead job of the DecodeStep at `state` handed to its sequence's worker; returns at once.
void icecache_start_lookahead(void* state) { static_cast<icestep::DecodeStep*>(state)->start_lookahead(); }
}

namespace icestep {
std::pair<uintptr_t, uintptr_t> DecodeStep::step_entry() {
  return {reinterpret_cast<uintptr_t>(&icecache_decode_step), reinterpret_cast<uintptr_t>(this)};
}
std::pair<uintptr_t, uintptr_t> DecodeStep::lookahead_entry() {
  return {reinterpret_cast<uintptr_t>(&icecache_start_lookahead), reinterpret_cast<uintptr_t>(this)};
}
}  // namespace icestep

void icecache_bind_decode_step(py::module_& m) {
  using namespace icestep;
  using I64 = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;
  py::class_<NativeSequence, std::shared_ptr<NativeSequence>>(m, "NativeSequence")
      .def(py::init<>())
      .def("stop", &NativeSequence::stop, py::call_guard<py::gil_scoped_release>())
      .def_property("team_spin", &NativeSequence::team_spin, &NativeSequence::set_team_spin,
                    "seconds the search team's workers spin for the next job before they sleep")
      .def_property_readonly("team_id", &NativeSequence::team_id,
                             "the team the sequence's searches run on: equal for sequences that share one, 0 before "
                             "its first search")
      .def_property_readonly("running", &NativeSequence::running)
      .def("error", &NativeSequence::error)
      .def("clear_error", &NativeSequence::clear_error);
  py::class_<ReuseGroup, std::shared_ptr<ReuseGroup>>(m, "ReuseGroup")
      .def(py::init<int, int>(), py::arg("n_kv_heads"), py::arg("n_selected"))
      .def("set_forest", &ReuseGroup::set_forest)
      .def("selection", [](const ReuseGroup& g) -> py::object {
        if (g.selection.empty()) return py::none();
        py::array_t<int64_t> out({g.n_kv, g.k});
        std::copy(g.selection.begin(), g.selection.end(), out.mutable_data());
        return out;
      });
  py::class_<DecodeStep>(m, "DecodeStep")
      .def(py::init([](std::shared_ptr<NativeSequence> seq, std::shared_ptr<ReuseGroup> group, int layer,
                       int n_heads, int n_kv_heads, int head_dim, int page_size, int n_sink_pages, int n_selected,
                       int n_window_pages, int first_window_slot, bool owner, bool keys_in_index, int host_dtype,
                       int query_field_of_view, double query_prop_to_retrieve, int insert_field_of_view,
                       double insert_prop_to_retrieve, double lookahead_min_cosine, bool lookahead_after_host_step) {
             StepConfig c;
             c.layer = layer;
             c.n_heads = n_heads;
             c.n_kv_heads = n_kv_heads;
             c.head_dim = head_dim;
             c.page_size = page_size;
             c.n_sink_pages = n_sink_pages;
             c.n_selected = n_selected;
             c.n_window_pages = n_window_pages;
             c.first_window_slot = first_window_slot;
             c.owner = owner;
             c.keys_in_index = keys_in_index;
             c.host_dtype = host_dtype;
             c.query_field_of_view = query_field_of_view;
             c.query_prop_to_retrieve = query_prop_to_retrieve;
             c.insert_field_of_view = insert_field_of_view;
             c.insert_prop_to_retrieve = insert_prop_to_retrieve;
             c.lookahead_min_cosine = lookahead_min_cosine;
             c.lookahead_after_host_step = lookahead_after_host_step;
             return std::make_unique<DecodeStep>(std::move(seq), std::move(group), c);
           }),
           py::arg("sequence"), py::arg("group"), py::arg("layer"), py::arg("n_heads"), py::arg("n_kv_heads"),
           py::arg("head_dim"), py::arg("page_size"), py::arg("n_sink_pages"), py::arg("n_selected"),
           py::arg("n_window_pages"), py::arg("first_window_slot"), py::arg("owner"), py::arg("keys_in_index"),
           py::arg("host_dtype"), py::arg("query_field_of_view"), py::arg("query_prop_to_retrieve"),
           py::arg("insert_field_of_view"), py::arg("insert_prop_to_retrieve"), py::arg("lookahead_min_cosine"),
           py::arg("lookahead_after_host_step") = true)
      .def("set_window", &DecodeStep::set_window)
      .def("set_positions", &DecodeStep::set_positions)
      .def("set_sink_len", &DecodeStep::set_sink_len)
      .def("set_tokens", &DecodeStep::set_tokens)
      .def("set_buffers", &DecodeStep::set_buffers)
      .def("set_speculative", &DecodeStep::set_speculative)
      .def("step_entry", &DecodeStep::step_entry)
      .def("lookahead_entry", &DecodeStep::lookahead_entry)
      .def("run_step", &DecodeStep::run_step, py::call_guard<py::gil_scoped_release>())
      .def("take_records", &DecodeStep::take_records)
      .def("resident", &DecodeStep::resident)
      .def("positions", &DecodeStep::positions)
      .def("stale", &DecodeStep::stale)
      .def("window_slot_counts", &DecodeStep::window_slot_counts)
      .def("trace_into", &DecodeStep::trace_into)
      .def("window_append", &DecodeStep::window_append)
      .def("window_offload", &DecodeStep::window_offload)
      .def_property_readonly("window_full", &DecodeStep::window_full)
      .def_property_readonly("lookahead_pending", &DecodeStep::lookahead_pending)
      .def_readonly("window_start", &DecodeStep::window_start_)
      .def_readonly("window_count", &DecodeStep::window_count_)
      .def_readonly("window_head", &DecodeStep::window_head_)
      .def_readonly("n_tokens", &DecodeStep::n_tokens_)
      .def_readonly("capacity", &DecodeStep::capacity_);
  m.def("merge_group_pages", [](py::array_t<int32_t, py::array::c_style | py::array::forcecast> pages,
                                int group_size, int k) {
    if (pages.ndim() != 2 || group_size < 1) throw std::invalid_argument("pages [Hq, K], group_size >= 1");
    const int n_kv = static_cast<int>(pages.shape(0) / group_size);
    py::array_t<int64_t> out({n_kv, k});
    merge_group_pages(pages.data(), n_kv, group_size, static_cast<int>(pages.shape(1)), k, out.mutable_data());
    return out;
  });
  m.def("diff_selection", [](py::array_t<int64_t, py::array::c_style> resident,
                             py::array_t<bool, py::array::c_style | py::array::forcecast> stale, I64 selection) {
    if (resident.ndim() != 2 || selection.ndim() != 2 || stale.ndim() != 2 || resident.shape(0) != selection.shape(0) ||
        resident.shape(1) != selection.shape(1) || stale.shape(0) != resident.shape(0))
      throw std::invalid_argument("resident and selection [Hkv, K], stale [Hkv, pages]");
    const int n_kv = static_cast<int>(resident.shape(0)), k = static_cast<int>(resident.shape(1));
    const int64_t width = stale.shape(1);
    std::vector<int32_t> slots;
    std::vector<int64_t> pages, heads, to_load;
    std::vector<uint8_t> kept;
    int64_t* res = resident.mutable_data();
    for (int h = 0; h < n_kv; ++h) {
      const bool* row = stale.data() + h * width;
      diff_head(res + static_cast<int64_t>(h) * k, selection.data() + static_cast<int64_t>(h) * k, k,
                [row, width](int64_t page) { return page < width && row[page]; }, slots, pages, kept, to_load);
      heads.resize(slots.size(), h);
    }
    py::array_t<int64_t> s(slots.size()), p(pages.size()), hd(heads.size());
    std::copy(slots.begin(), slots.end(), s.mutable_data());
    std::copy(pages.begin(), pages.end(), p.mutable_data());
    std::copy(heads.begin(), heads.end(), hd.mutable_data());
    return py::make_tuple(s, p, hd);
  });
  m.def("head_cosines", [](py::array_t<float, py::array::c_style | py::array::forcecast> speculative,
                           py::array_t<float, py::array::c_style | py::array::forcecast> exact) {
    if (speculative.ndim() != 2 || exact.ndim() != 2 || speculative.shape(0) != exact.shape(0) ||
        speculative.shape(1) != exact.shape(1))
      throw std::invalid_argument("speculative and exact [Hq, D]");
    py::array_t<double> out(speculative.shape(0));
    min_head_cosine(speculative.data(), exact.data(), static_cast<int>(speculative.shape(0)),
                    static_cast<int>(speculative.shape(1)), out.mutable_data());
    return out;
  });
}
