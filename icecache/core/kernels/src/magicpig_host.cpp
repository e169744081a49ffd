// MagicPIG's host work of one decode step, per sparsified layer, as one C++ call on state C++ points at
// (baselines/magicpig.py is the Python side and describes the method; tests/magicpig_reference.py is the torch
// definition this file is held to).
//
// Why C++: the host part of a step (store the new token, count each query head's LSH collisions, sample, attend to
// the sample) runs at every layer of every step while the GPU waits for it. In torch it is a few hundred small
// operations under the GIL, taken once per layer on the hand-off's thread; here it is one call with the GIL never
// taken, parallel over query heads.
//
// One object per layer, `HostStep`, made by Python once the prompt is offloaded. Python allocates every buffer as
// a tensor and hands the step raw addresses: the token store (keys and values [Hkv, capacity, D] in the model's
// dtype, the centred-key norms [Hkv, capacity] float32, the codes of the tokens after the prompt [Hkv, capacity -
// prompt, L] int32), the mean key [Hkv, D], the prompt's hash tables (tokens in bucket order [Hkv, L, T] int32 and
// bucket starts [Hkv, L, 2^K + 1] int64) and the exchange's host buffers. The store grows only in Python, between
// steps, which then points the step at the new buffers. The step is exported as `extern "C" void f(void* state)`,
// whose address Python hands to HostExchange.run_native: called at once, or enqueued as a hand-off of a captured
// CUDA graph.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace py = pybind11;

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
// The row kernels are built three times (x86-64 baseline, AVX2 + FMA, AVX-512) and the loader picks the widest the
// CPU runs; the baseline build is always there. The builds may differ in the last bits (FMA contraction).
#define MAGICPIG_ROW_KERNEL __attribute__((target_clones("default", "arch=x86-64-v3", "arch=x86-64-v4")))
#else
#define MAGICPIG_ROW_KERNEL
#endif

namespace magicpig {

// The store's dtype (the model's): the codes Python passes.
enum StoreDtype : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

constexpr int kMinCollisions = 2;     // baselines/magicpig.py MIN_COLLISIONS
constexpr float kWeightFloor = 1e-4f;  // baselines/magicpig.py WEIGHT_FLOOR
constexpr double kPi = 3.141592653589793;
constexpr int kLinePositions = 16;  // int32 positions per 64-byte cache line
constexpr int kRowsAhead = 8;  // rows prefetched ahead of the one a row kernel reads
constexpr int kLanes = 16;            // independent partial sums of a row kernel (vectorised without -ffast-math)

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// ---------------------------------------------------------------------------------------------- the thinning draw
// splitmix64's output function: a bijection of 64-bit words whose outputs pass as independent uniform draws for
// consecutive inputs.
inline uint64_t mix64(uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// The step's stream: one word per (seed, layer, position), from which every token's draw follows.
inline uint64_t draw_stream(uint64_t seed, uint64_t layer, uint64_t position) {
  return mix64(mix64(mix64(seed) + layer) + position);
}

// Token `token`'s draw at the step of `stream`, as the 53-bit integer n of the uniform draw n / 2^53 in [0, 1):
// comparing these integers is comparing the draws.
inline uint64_t draw_bits(uint64_t stream, uint64_t token) { return mix64(stream + token) >> 11; }

// ---------------------------------------------------------------------------------------------- dtype conversion
inline float from_bfloat16(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// float32 to bfloat16 as torch rounds it: to nearest, ties to even; a NaN becomes the quiet NaN 0x7fc0.
uint16_t to_bfloat16(float f) {
  if (std::isnan(f)) return 0x7fc0u;
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  return static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

inline float from_half(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu;
  uint32_t bits;
  if (exponent == 0x1fu) {
    bits = sign | 0x7f800000u | (mantissa << 13);  // infinity, NaN
  } else if (exponent != 0) {
    bits = sign | ((exponent + 112u) << 23) | (mantissa << 13);
  } else {
    // zero or subnormal: mantissa * 2^-24, exact in float32
    float f = static_cast<float>(mantissa) * 5.9604644775390625e-8f;
    std::memcpy(&bits, &f, sizeof(bits));
    bits |= sign;
  }
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// float32 to IEEE half, rounded to nearest with ties to even (torch's rounding), overflow to infinity.
uint16_t to_half(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const uint32_t magnitude = bits & 0x7fffffffu;
  if (magnitude > 0x7f800000u) return sign | 0x7e00u;   // NaN
  if (magnitude >= 0x477ff000u) return sign | 0x7c00u;  // rounds past 65504: infinity
  if (magnitude < 0x38800000u) {
    // below the smallest normal half (2^-14): a multiple of 2^-24, rounded to nearest even by the float addition
    float absolute;
    std::memcpy(&absolute, &magnitude, sizeof(absolute));
    const float shifted = absolute + 0.5f;  // 0.5 = 2^-1: the sum's last mantissa bit is worth 2^-24
    uint32_t s;
    std::memcpy(&s, &shifted, sizeof(s));
    return sign | static_cast<uint16_t>(s - 0x3f000000u);
  }
  const uint32_t rounded = magnitude + 0xfffu + ((magnitude >> 13) & 1u);
  return sign | static_cast<uint16_t>((rounded - 0x38000000u) >> 13);
}

void store_row(const float* src, int n, int dtype, char* dst) {
  if (dtype == kFloat32) {
    std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(float));
    return;
  }
  uint16_t* out = reinterpret_cast<uint16_t*>(dst);
  for (int i = 0; i < n; ++i) out[i] = dtype == kBFloat16 ? to_bfloat16(src[i]) : to_half(src[i]);
}

// ---------------------------------------------------------------------------------------------- row kernels
// Rows of the store, widened to float32 one row at a time where they are read: `rows` is the head's first row,
// `ids` the positions to read, `dim` a row's length and `row` scratch for one widened row.

// Row `r` (`dim` values of the store's dtype) as float32 into `out`.
inline void widen_row(const char* r, int dtype, int dim, float* __restrict out) {
  if (dtype == kFloat32) {
    std::memcpy(out, r, static_cast<size_t>(dim) * sizeof(float));
    return;
  }
  const uint16_t* h = reinterpret_cast<const uint16_t*>(r);
  if (dtype == kBFloat16) {
    for (int d = 0; d < dim; ++d) {
      const uint32_t bits = static_cast<uint32_t>(h[d]) << 16;
      std::memcpy(out + d, &bits, sizeof(float));
    }
  } else {
    for (int d = 0; d < dim; ++d) out[d] = from_half(h[d]);
  }
}

// q . x in kLanes independent partial sums added in a fixed order (vectorised without reassociating).
inline float dot_lanes(const float* __restrict q, const float* __restrict x, int dim) {
  float lanes[kLanes] = {};
  int d = 0;
  for (; d + kLanes <= dim; d += kLanes)
    for (int j = 0; j < kLanes; ++j) lanes[j] += q[d + j] * x[d + j];
  float tail = 0.f;
  for (; d < dim; ++d) tail += q[d] * x[d];
  float sum = 0.f;
  for (int j = 0; j < kLanes; ++j) sum += lanes[j];
  return sum + tail;
}

// The rows are scattered reads of the store (a row of 128 bf16 values is 4 cache lines): the kernels ask for the
// row kRowsAhead ahead while they read this one.
inline void prefetch_row(const char* row, size_t bytes) {
  for (size_t b = 0; b < bytes; b += 64) __builtin_prefetch(row + b);
}

// out[i] = q . row(ids[i]) for i < n.
MAGICPIG_ROW_KERNEL
void dot_rows(const float* q, const char* rows, int dtype, const int32_t* ids, int64_t n, int dim, float* out,
              float* row) {
  const size_t row_bytes = static_cast<size_t>(dim) * (dtype == kFloat32 ? 4 : 2);
  for (int64_t i = 0; i < n; ++i) {
    if (i + kRowsAhead < n) prefetch_row(rows + static_cast<size_t>(ids[i + kRowsAhead]) * row_bytes, row_bytes);
    const char* r = rows + static_cast<size_t>(ids[i]) * row_bytes;
    if (dtype == kFloat32) {
      out[i] = dot_lanes(q, reinterpret_cast<const float*>(r), dim);
    } else {
      widen_row(r, dtype, dim, row);
      out[i] = dot_lanes(q, row, dim);
    }
  }
}

// out = sum_i weights[i] * row(ids[i]) (out [dim] overwritten).
MAGICPIG_ROW_KERNEL
void weighted_rows(const float* weights, const char* rows, int dtype, const int32_t* ids, int64_t n, int dim,
                   float* __restrict out, float* __restrict row) {
  std::fill(out, out + dim, 0.f);
  const size_t row_bytes = static_cast<size_t>(dim) * (dtype == kFloat32 ? 4 : 2);
  for (int64_t i = 0; i < n; ++i) {
    if (i + kRowsAhead < n) prefetch_row(rows + static_cast<size_t>(ids[i + kRowsAhead]) * row_bytes, row_bytes);
    widen_row(rows + static_cast<size_t>(ids[i]) * row_bytes, dtype, dim, row);
    const float w = weights[i];
    for (int d = 0; d < dim; ++d) out[d] += w * row[d];
  }
}

// ---------------------------------------------------------------------------------------------- the paper's rules
// The prompt's tables: per KV head and table the tokens in bucket order and each bucket's start.
struct Tables {
  const int64_t* offsets = nullptr;    // [Hkv, L, n_buckets]
  const int32_t* positions = nullptr;  // [Hkv, L, n_tokens]
  int64_t n_tokens = 0;
  int n_buckets = 0;
};

// counts[t] += the tables of KV head `kv` in which position t (below `limit`) shares the query's bucket, reading
// only the query's buckets; with `reached`, every position whose count reaches kMinCollisions is appended to it
// (once, in the order reached), so that no scan of the counts is needed to find them. Returns false for a query
// code outside the tables' buckets (counted as no bucket).
// Each table's bucket is a random read of the offsets and of the tokens, so the spans are read first and every
// span's first tokens prefetched before any is counted: the reads then overlap instead of waiting one by one.
bool count_table_collisions(const Tables& tables, int n_tables, int kv, const int32_t* query_codes, int64_t limit,
                            uint16_t* counts, std::vector<int64_t>& spans, std::vector<int32_t>* reached) {
  bool codes_valid = true;
  spans.resize(2 * static_cast<size_t>(n_tables));
  for (int l = 0; l < n_tables; ++l) {
    const int32_t code = query_codes[l];
    const int64_t row = static_cast<int64_t>(kv) * n_tables + l;
    if (code < 0 || code + 1 >= tables.n_buckets) {
      codes_valid = false;
      spans[2 * l] = spans[2 * l + 1] = 0;
      continue;
    }
    const int64_t* bucket = tables.offsets + row * tables.n_buckets + code;
    spans[2 * l] = row * tables.n_tokens + bucket[0];
    spans[2 * l + 1] = row * tables.n_tokens + bucket[1];
  }
  for (int l = 0; l < n_tables; ++l) {
    for (int64_t i = spans[2 * l]; i < spans[2 * l + 1]; i += kLinePositions)
      __builtin_prefetch(tables.positions + i);
  }
  for (int l = 0; l < n_tables; ++l) {
    for (int64_t i = spans[2 * l]; i < spans[2 * l + 1]; ++i) {
      const int32_t t = tables.positions[i];
      if (t >= limit) continue;
      if (++counts[t] == kMinCollisions && reached != nullptr) reached->push_back(t);
    }
  }
  return codes_valid;
}

// The chance that a key at this cosine to the query shares its bucket in at least two of L K-bit tables,
// 1 - (1 - p)^L - L p (1 - p)^(L - 1) with p = (1 - theta / pi)^K, in float64 (as sampling_probability).
double sampling_probability(double cos_angle, int K, int L) {
  const double theta = std::acos(std::clamp(cos_angle, -1.0, 1.0));
  const double p = std::pow(1.0 - theta / kPi, K);
  const double miss = 1.0 - p;
  return 1.0 - std::pow(miss, L) - L * p * std::pow(miss, L - 1);
}

// ---------------------------------------------------------------------------------------------- the step
struct StepConfig {
  int layer = 0, n_heads = 0, n_kv_heads = 0, head_dim = 0, K = 0, L = 0;
  int n_sink = 0, n_local = 1;
  int64_t cap = 0;  // sampled tokens a head may attend
  bool capped = true;
  uint64_t seed = 0;
  int64_t prompt_len = 0;
  int dtype = kFloat32;
  int threads = 1;
};

// What the step counted and timed since Python last took it (HostStep::take_records).
struct Records {
  std::vector<double> attended;  // each step's mean attended tokens per query head, the device's included
  std::vector<double> host_step;
  double select_s = 0, attention_s = 0;
  int steps = 0;
};

// One query head's part of a step: the positions it attends in the middle and their log-weights.
struct HeadSample {
  std::vector<int32_t> positions;
  std::vector<float> log_weights;
  std::vector<float> dots;  // q . k of each position (the scores before scaling and weights)
  std::vector<float> row;   // one widened row of the store
  std::vector<std::pair<uint64_t, int32_t>> draws;
};

class HostStep {
 public:
  explicit HostStep(const StepConfig& cfg) : cfg_(cfg) {
    if (cfg_.n_kv_heads < 1 || cfg_.n_heads % cfg_.n_kv_heads != 0) throw std::invalid_argument("bad head counts");
    if (cfg_.L < kMinCollisions || cfg_.L > std::numeric_limits<uint16_t>::max())
      throw std::invalid_argument("L out of range");
    if (cfg_.K < 1 || cfg_.K > 30) throw std::invalid_argument("K out of range");
    if (cfg_.dtype < kFloat32 || cfg_.dtype > kFloat16) throw std::invalid_argument("bad store dtype");
    if (cfg_.n_local < 1 || cfg_.n_sink < 0 || cfg_.cap < 0) throw std::invalid_argument("bad sinks, window or cap");
    item_ = cfg_.dtype == kFloat32 ? 4 : 2;
    group_ = cfg_.n_heads / cfg_.n_kv_heads;
    cfg_.threads = std::max(1, std::min(cfg_.threads, cfg_.n_heads));
    heads_.resize(cfg_.n_heads);
    counts_.resize(cfg_.threads);
    spans_.resize(cfg_.threads);
    query_norms_.resize(cfg_.n_heads);
    query_mean_dots_.resize(cfg_.n_heads);
  }

  // ------------------------------------------------------------------ what Python points the step at
  void set_store(uintptr_t keys, uintptr_t values, uintptr_t norms, uintptr_t tail_codes, int64_t capacity) {
    if (capacity <= cfg_.prompt_len) throw std::invalid_argument("the store must have room past the prompt");
    keys_ = reinterpret_cast<char*>(keys);
    values_ = reinterpret_cast<char*>(values);
    norms_ = reinterpret_cast<float*>(norms);
    tail_codes_ = reinterpret_cast<int32_t*>(tail_codes);
    capacity_ = capacity;
  }
  void set_tables(uintptr_t offsets, uintptr_t positions, int64_t n_tokens) {
    tables_.offsets = reinterpret_cast<const int64_t*>(offsets);
    tables_.positions = reinterpret_cast<const int32_t*>(positions);
    tables_.n_tokens = n_tokens;
    tables_.n_buckets = (1 << cfg_.K) + 1;
  }
  void set_mean_key(uintptr_t mean_key) { mean_key_ = reinterpret_cast<const float*>(mean_key); }
  void set_exchange(uintptr_t query, uintptr_t key, uintptr_t value, uintptr_t query_codes, uintptr_t key_codes,
                    uintptr_t position, uintptr_t out, uintptr_t lse, uintptr_t attended, uintptr_t log_weights,
                    int64_t trace_width) {
    query_ = reinterpret_cast<const float*>(query);
    key_ = reinterpret_cast<const float*>(key);
    value_ = reinterpret_cast<const float*>(value);
    query_codes_ = reinterpret_cast<const int32_t*>(query_codes);
    key_codes_ = reinterpret_cast<const int32_t*>(key_codes);
    position_ = reinterpret_cast<const int64_t*>(position);
    out_ = reinterpret_cast<float*>(out);
    lse_ = reinterpret_cast<float*>(lse);
    trace_attended_ = reinterpret_cast<uint8_t*>(attended);
    trace_log_weights_ = reinterpret_cast<float*>(log_weights);
    trace_width_ = trace_width;
  }
  void set_scaling(double scaling) { scaling_ = static_cast<float>(scaling); }

  // ------------------------------------------------------------------ the entry
  // The host work of one decode step. Never throws: an error is kept, and every later step does nothing (no
  // state an error left half-updated is built on) until Python raises it.
  void run_step() noexcept {
    if (failed_.load(std::memory_order_acquire)) return;
    try {
      step();
    } catch (const std::exception& error) {
      fail(error.what());
    } catch (...) {
      fail("unknown error");
    }
  }
  std::pair<uintptr_t, uintptr_t> step_entry();

  // ------------------------------------------------------------------ what Python reads
  std::string error() {
    std::lock_guard<std::mutex> lock(records_mutex_);
    return error_;
  }
  py::dict take_records() {
    Records r;
    {
      std::lock_guard<std::mutex> lock(records_mutex_);
      std::swap(r, records_);
    }
    py::dict d;
    d["attended"] = r.attended;
    d["host_step"] = r.host_step;
    py::dict phases;
    if (r.steps) {
      phases["select"] = r.select_s;
      phases["cpu_attention"] = r.attention_s;
    }
    d["phases"] = phases;
    return d;
  }
  // The last step's sample: positions [Hq, M] (int64), valid [Hq, M] and log_weights [Hq, M] (float32), M the
  // most any head attended; each head's positions in increasing order, then padding (position 0, not valid).
  py::tuple last_sample() const {
    size_t width = 0;
    for (const HeadSample& h : heads_) width = std::max(width, h.positions.size());
    const py::ssize_t n = cfg_.n_heads, m = static_cast<py::ssize_t>(width);
    py::array_t<int64_t> positions({n, m});
    py::array_t<bool> valid({n, m});
    py::array_t<float> weights({n, m});
    int64_t* p = positions.mutable_data();
    bool* v = valid.mutable_data();
    float* w = weights.mutable_data();
    for (int h = 0; h < cfg_.n_heads; ++h) {
      const HeadSample& s = heads_[h];
      for (size_t i = 0; i < width; ++i) {
        const bool used = i < s.positions.size();
        p[h * width + i] = used ? s.positions[i] : 0;
        v[h * width + i] = used;
        w[h * width + i] = used ? s.log_weights[i] : 0.f;
      }
    }
    return py::make_tuple(positions, valid, weights);
  }
  int threads() const { return cfg_.threads; }

 private:
  void fail(const std::string& message) {
    std::lock_guard<std::mutex> lock(records_mutex_);
    if (!failed_.load()) error_ = "layer " + std::to_string(cfg_.layer) + ": " + message;
    failed_.store(true, std::memory_order_release);
  }
  size_t row_bytes() const { return static_cast<size_t>(cfg_.head_dim) * item_; }

  void step() {
    const auto start = std::chrono::steady_clock::now();
    if (query_ == nullptr || keys_ == nullptr || mean_key_ == nullptr)
      throw std::runtime_error("the step's buffers are not set");
    const int64_t position = *position_;
    if (position < cfg_.prompt_len) throw std::runtime_error("a decode position inside the prompt");
    if (position >= capacity_)
      throw std::runtime_error("the token store must grow between decode steps (MagicPIGKV.between_steps), not "
                               "during one: position " + std::to_string(position) + ", capacity " +
                               std::to_string(capacity_));
    store_token(position);
    const int64_t end = position + 1 - cfg_.n_local;  // the middle is [n_sink, end): after the sinks, before the window
    const int64_t n_middle = end - cfg_.n_sink;
    auto t = std::chrono::steady_clock::now();
    if (n_middle <= 0) {
      for (HeadSample& h : heads_) {
        h.positions.clear();
        h.log_weights.clear();
        h.dots.clear();
      }
    } else if (n_middle <= cfg_.cap) {
      exact_middle(end);
    } else {
      prepare_query();
      sample_middle(end, position);
    }
    const double select_s = seconds_since(t);
    t = std::chrono::steady_clock::now();
    attend();
    const double attention_s = seconds_since(t);
    int64_t total = 0;
    for (const HeadSample& h : heads_) total += static_cast<int64_t>(h.positions.size());
    if (trace_attended_ != nullptr) write_trace(position);
    const int64_t on_device = std::min<int64_t>(position + 1, cfg_.n_sink + cfg_.n_local);
    std::lock_guard<std::mutex> lock(records_mutex_);
    records_.attended.push_back(static_cast<double>(on_device) + static_cast<double>(total) / cfg_.n_heads);
    records_.select_s += select_s;
    records_.attention_s += attention_s;
    records_.steps += 1;
    records_.host_step.push_back(seconds_since(start));
  }

  // The new token into the store at `position`: key and value in the store's dtype, the norm of its centred key
  // (float64 sum, as a float32 value), its codes among the tokens after the prompt.
  void store_token(int64_t position) {
    const int D = cfg_.head_dim, L = cfg_.L;
    const int64_t tail_rows = capacity_ - cfg_.prompt_len;
    for (int h = 0; h < cfg_.n_kv_heads; ++h) {
      const size_t row = static_cast<size_t>(h) * capacity_ + position;
      store_row(key_ + h * D, D, cfg_.dtype, keys_ + row * row_bytes());
      store_row(value_ + h * D, D, cfg_.dtype, values_ + row * row_bytes());
      double sum = 0;
      for (int d = 0; d < D; ++d) {
        const double centred = static_cast<double>(key_[h * D + d]) - mean_key_[h * D + d];
        sum += centred * centred;
      }
      norms_[row] = static_cast<float>(std::sqrt(sum));
      std::memcpy(tail_codes_ + (static_cast<int64_t>(h) * tail_rows + position - cfg_.prompt_len) * L,
                  key_codes_ + static_cast<int64_t>(h) * L, static_cast<size_t>(L) * sizeof(int32_t));
    }
  }

  // The query's norm and its dot with the mean key, per head: the parts of the cosine that do not depend on the key.
  void prepare_query() {
    const int D = cfg_.head_dim;
    for (int h = 0; h < cfg_.n_heads; ++h) {
      const float* q = query_ + static_cast<int64_t>(h) * D;
      const float* mean = mean_key_ + static_cast<int64_t>(h / group_) * D;
      double qq = 0;
      float qm = 0;
      for (int d = 0; d < D; ++d) {
        qq += static_cast<double>(q[d]) * q[d];
        qm += q[d] * mean[d];
      }
      query_norms_[h] = static_cast<float>(std::sqrt(qq));
      query_mean_dots_[h] = qm;
    }
  }

  // Every middle token, log-weight 0: the middle fits the sampled slots, so attention is exact.
  void exact_middle(int64_t end) {
    for (HeadSample& h : heads_) {
      h.positions.resize(end - cfg_.n_sink);
      for (int64_t t = cfg_.n_sink; t < end; ++t) h.positions[t - cfg_.n_sink] = static_cast<int32_t>(t);
      h.log_weights.assign(h.positions.size(), 0.f);
      h.dots.clear();
    }
  }

  // The LSH sample of each query head: the middle tokens sharing its bucket in at least kMinCollisions tables; when
  // capped and more than `cap`, the cap of them with the smallest draws; the importance log-weights.
  void sample_middle(int64_t end, int64_t position) {
    const int D = cfg_.head_dim, L = cfg_.L;
    const int64_t in_prompt = std::min(end, cfg_.prompt_len);
    const int64_t tail_rows = capacity_ - cfg_.prompt_len;
    const uint64_t stream = draw_stream(cfg_.seed, static_cast<uint64_t>(cfg_.layer), static_cast<uint64_t>(position));
    std::atomic<bool> codes_valid{true};
#pragma omp parallel for schedule(dynamic, 1) num_threads(cfg_.threads)
    for (int h = 0; h < cfg_.n_heads; ++h) {
      HeadSample& s = heads_[h];
      const int kv = h / group_;
      const int32_t* codes = query_codes_ + static_cast<int64_t>(h) * L;
      const float* q = query_ + static_cast<int64_t>(h) * D;
      std::vector<uint16_t>& counts = counts_[omp_get_thread_num()];
      s.positions.clear();
      if (tables_.offsets != nullptr && in_prompt > cfg_.n_sink) {
        counts.assign(in_prompt, 0);
        if (!count_table_collisions(tables_, L, kv, codes, in_prompt, counts.data(), spans_[omp_get_thread_num()],
                                    &s.positions))
          codes_valid.store(false, std::memory_order_relaxed);
        // the tables hold no sinks: every position reached is a candidate (in the order reached; sorted below)
      }
      const int64_t n_in_prompt = static_cast<int64_t>(s.positions.size());
      for (int64_t t = std::max<int64_t>(cfg_.prompt_len, cfg_.n_sink); t < end; ++t) {
        const int32_t* key_codes = tail_codes_ + (static_cast<int64_t>(kv) * tail_rows + t - cfg_.prompt_len) * L;
        int same = 0;
        for (int l = 0; l < L; ++l) same += key_codes[l] == codes[l];
        if (same >= kMinCollisions) s.positions.push_back(static_cast<int32_t>(t));
      }
      const int64_t n_candidates = static_cast<int64_t>(s.positions.size());
      float kept_fraction = 1.f;
      const bool thinned = cfg_.capped && n_candidates > cfg_.cap;
      if (!thinned) std::sort(s.positions.begin(), s.positions.begin() + n_in_prompt);  // the thinning sorts its own
      if (thinned) {
        // A uniform random subset of cap candidates: the cap smallest draws (the position breaks a tie), kept in
        // position order.
        s.draws.resize(n_candidates);
        for (int64_t i = 0; i < n_candidates; ++i) s.draws[i] = {draw_bits(stream, s.positions[i]), s.positions[i]};
        std::nth_element(s.draws.begin(), s.draws.begin() + cfg_.cap, s.draws.end());
        s.positions.resize(cfg_.cap);
        for (int64_t i = 0; i < cfg_.cap; ++i) s.positions[i] = s.draws[i].second;
        std::sort(s.positions.begin(), s.positions.end());
        kept_fraction = static_cast<float>(static_cast<double>(cfg_.cap) / static_cast<double>(n_candidates));
      }
      // The estimator's weights: 1 / u at the angle of the centred key to the query, and the thinning's 1 / kept.
      const int64_t m = static_cast<int64_t>(s.positions.size());
      const size_t head_row = static_cast<size_t>(kv) * capacity_;
      s.dots.resize(m);
      s.row.resize(D);
      dot_rows(q, keys_ + head_row * row_bytes(), cfg_.dtype, s.positions.data(), m, D, s.dots.data(),
               s.row.data());
      s.log_weights.resize(m);
      // The keys' norms first, in a loop of independent reads (scattered over the head's norms, which the cache
      // does not hold), so that they overlap rather than each waiting inside the loop of transcendentals below.
      for (int64_t i = 0; i < m; ++i) s.log_weights[i] = norms_[head_row + s.positions[i]];
      const float log_kept = std::log(kept_fraction);
      const float q_norm = query_norms_[h], q_mean = query_mean_dots_[h];
      for (int64_t i = 0; i < m; ++i) {
        const float norms = q_norm * s.log_weights[i];
        const float cos_angle = (s.dots[i] - q_mean) / std::max(norms, std::numeric_limits<float>::min());
        const float chance = static_cast<float>(sampling_probability(cos_angle, cfg_.K, L));
        s.log_weights[i] = -std::log(chance + kWeightFloor) - log_kept;
      }
    }
    if (!codes_valid.load()) throw std::runtime_error("a query code outside the hash tables' buckets");
  }

  // Each head's attention over its sample, the log-weights added to the scores: out [Hq, D] and the log of its
  // normaliser lse [Hq] (-inf and a zero row where the head attends nothing).
  void attend() {
    const int D = cfg_.head_dim;
#pragma omp parallel for schedule(dynamic, 1) num_threads(cfg_.threads)
    for (int h = 0; h < cfg_.n_heads; ++h) {
      HeadSample& s = heads_[h];
      const int64_t m = static_cast<int64_t>(s.positions.size());
      float* out = out_ + static_cast<int64_t>(h) * D;
      if (m == 0) {
        std::fill(out, out + D, 0.f);
        lse_[h] = -std::numeric_limits<float>::infinity();
        continue;
      }
      const size_t head_row = static_cast<size_t>(h / group_) * capacity_;
      s.row.resize(D);
      if (static_cast<int64_t>(s.dots.size()) != m) {  // exact mode: the dots were not needed for weights
        s.dots.resize(m);
        dot_rows(query_ + static_cast<int64_t>(h) * D, keys_ + head_row * row_bytes(), cfg_.dtype,
                 s.positions.data(), m, D, s.dots.data(), s.row.data());
      }
      float top = -std::numeric_limits<float>::infinity();
      for (int64_t i = 0; i < m; ++i) {
        s.dots[i] = s.dots[i] * scaling_ + s.log_weights[i];  // the scores, in place
        top = std::max(top, s.dots[i]);
      }
      double sum = 0;
      for (int64_t i = 0; i < m; ++i) sum += std::exp(static_cast<double>(s.dots[i] - top));
      const float lse = top + static_cast<float>(std::log(sum));
      for (int64_t i = 0; i < m; ++i) s.dots[i] = std::exp(s.dots[i] - lse);  // the probabilities
      weighted_rows(s.dots.data(), values_ + head_row * row_bytes(), cfg_.dtype, s.positions.data(), m, D, out,
                    s.row.data());
      lse_[h] = lse;
      s.dots.clear();
    }
  }

  // The step's trace into [Hq, width]: the sinks and the window the device holds (log-weight 0) and each head's
  // sample with its log-weights.
  void write_trace(int64_t position) {
    const int64_t width = trace_width_;
    if (position >= width) throw std::out_of_range("a decode position past the trace width");
    std::memset(trace_attended_, 0, static_cast<size_t>(cfg_.n_heads) * width);
    std::fill(trace_log_weights_, trace_log_weights_ + cfg_.n_heads * width, 0.f);
    for (int h = 0; h < cfg_.n_heads; ++h) {
      uint8_t* row = trace_attended_ + static_cast<int64_t>(h) * width;
      float* weights = trace_log_weights_ + static_cast<int64_t>(h) * width;
      std::fill(row, row + std::min<int64_t>(cfg_.n_sink, position + 1), 1);
      std::fill(row + std::max<int64_t>(cfg_.n_sink, position + 1 - cfg_.n_local), row + position + 1, 1);
      const HeadSample& s = heads_[h];
      for (size_t i = 0; i < s.positions.size(); ++i) {
        row[s.positions[i]] = 1;
        weights[s.positions[i]] = s.log_weights[i];
      }
    }
  }

 private:
  StepConfig cfg_;
  int item_ = 4, group_ = 1;
  float scaling_ = 1.f;
  // the store [Hkv, capacity, D], its norms [Hkv, capacity] and the codes after the prompt [Hkv, capacity - prompt, L]
  char* keys_ = nullptr;
  char* values_ = nullptr;
  float* norms_ = nullptr;
  int32_t* tail_codes_ = nullptr;
  int64_t capacity_ = 0;
  const float* mean_key_ = nullptr;
  Tables tables_;
  // the exchange's host buffers (pinned on CUDA)
  const float* query_ = nullptr;
  const float* key_ = nullptr;
  const float* value_ = nullptr;
  const int32_t* query_codes_ = nullptr;
  const int32_t* key_codes_ = nullptr;
  const int64_t* position_ = nullptr;
  float* out_ = nullptr;
  float* lse_ = nullptr;
  uint8_t* trace_attended_ = nullptr;
  float* trace_log_weights_ = nullptr;
  int64_t trace_width_ = 0;
  // scratch kept across steps, so that a step allocates nothing once it has grown
  std::vector<HeadSample> heads_;
  std::vector<std::vector<uint16_t>> counts_;  // per thread, [in_prompt]
  std::vector<std::vector<int64_t>> spans_;    // per thread, [2 L]: each table's bucket in the flat positions
  std::vector<float> query_norms_, query_mean_dots_;
  std::mutex records_mutex_;
  Records records_;
  std::string error_;
  std::atomic<bool> failed_{false};
};

}  // namespace magicpig

extern "C" {
// The host work of one decode step of the HostStep at `state` (a hand-off of a captured step, or called at once).
void icecache_magicpig_host_step(void* state) { static_cast<magicpig::HostStep*>(state)->run_step(); }
}

namespace magicpig {
std::pair<uintptr_t, uintptr_t> HostStep::step_entry() {
  return {reinterpret_cast<uintptr_t>(&icecache_magicpig_host_step), reinterpret_cast<uintptr_t>(this)};
}
}  // namespace magicpig

PYBIND11_MODULE(_magicpig_host, m) {
  using namespace magicpig;
  m.doc() = "MagicPIG's host step (baselines/magicpig.py): LSH sampling and the sampled attention, in C++.";
  py::class_<HostStep>(m, "HostStep")
      .def(py::init([](int layer, int n_heads, int n_kv_heads, int head_dim, int K, int L, int n_sink, int n_local,
                       int64_t cap, bool capped, int64_t seed, int64_t prompt_len, int store_dtype, int threads) {
             StepConfig c;
             c.layer = layer;
             c.n_heads = n_heads;
             c.n_kv_heads = n_kv_heads;
             c.head_dim = head_dim;
             c.K = K;
             c.L = L;
             c.n_sink = n_sink;
             c.n_local = n_local;
             c.cap = cap;
             c.capped = capped;
             c.seed = static_cast<uint64_t>(seed);  // two's complement: what numpy's uint64 view of it holds
             c.prompt_len = prompt_len;
             c.dtype = store_dtype;
             c.threads = threads;
             return std::make_unique<HostStep>(c);
           }),
           py::arg("layer"), py::arg("n_heads"), py::arg("n_kv_heads"), py::arg("head_dim"), py::arg("K"),
           py::arg("L"), py::arg("n_sink"), py::arg("n_local"), py::arg("cap"), py::arg("capped"), py::arg("seed"),
           py::arg("prompt_len"), py::arg("store_dtype"), py::arg("threads"))
      .def("set_store", &HostStep::set_store, py::arg("keys"), py::arg("values"), py::arg("norms"),
           py::arg("tail_codes"), py::arg("capacity"))
      .def("set_tables", &HostStep::set_tables, py::arg("offsets"), py::arg("positions"), py::arg("n_tokens"))
      .def("set_mean_key", &HostStep::set_mean_key)
      .def("set_exchange", &HostStep::set_exchange, py::arg("query"), py::arg("key"), py::arg("value"),
           py::arg("query_codes"), py::arg("key_codes"), py::arg("position"), py::arg("out"), py::arg("lse"),
           py::arg("attended"), py::arg("log_weights"), py::arg("trace_width"))
      .def("set_scaling", &HostStep::set_scaling)
      .def("step_entry", &HostStep::step_entry)
      .def("error", &HostStep::error)
      .def("take_records", &HostStep::take_records)
      .def("last_sample", &HostStep::last_sample)
      .def_property_readonly("threads", &HostStep::threads);
  m.def(
      "table_collision_counts",
      [](py::array_t<int64_t, py::array::c_style | py::array::forcecast> offsets,
         py::array_t<int32_t, py::array::c_style | py::array::forcecast> positions,
         py::array_t<int32_t, py::array::c_style | py::array::forcecast> query_codes, int group, int64_t n_positions) {
        if (offsets.ndim() != 3 || positions.ndim() != 3 || query_codes.ndim() != 2 || group < 1 ||
            offsets.shape(0) != positions.shape(0) || offsets.shape(1) != positions.shape(1) ||
            query_codes.shape(1) != offsets.shape(1) || query_codes.shape(0) != offsets.shape(0) * group)
          throw std::invalid_argument("offsets [Hkv, L, buckets], positions [Hkv, L, T], query_codes [Hq, L]");
        Tables tables{offsets.data(), positions.data(), positions.shape(2), static_cast<int>(offsets.shape(2))};
        const int n_heads = static_cast<int>(query_codes.shape(0)), n_tables = static_cast<int>(offsets.shape(1));
        py::array_t<int64_t> out({static_cast<py::ssize_t>(n_heads), static_cast<py::ssize_t>(n_positions)});
        std::vector<uint16_t> counts;
        std::vector<int64_t> spans;
        for (int h = 0; h < n_heads; ++h) {
          counts.assign(n_positions, 0);
          if (!count_table_collisions(tables, n_tables, h / group, query_codes.data() + h * n_tables, n_positions,
                                      counts.data(), spans, nullptr))
            throw std::invalid_argument("a query code outside the tables' buckets");
          std::copy(counts.begin(), counts.end(), out.mutable_data() + h * n_positions);
        }
        return out;
      },
      py::arg("offsets"), py::arg("positions"), py::arg("query_codes"), py::arg("group"), py::arg("n_positions"),
      "[Hq, n_positions] int64: in how many tables each position below n_positions shares each query head's bucket "
      "(the count the host step makes).");
  m.def(
      "thinning_draws",
      [](int64_t seed, int layer, int64_t position, int64_t n_tokens) {
        py::array_t<double> out(n_tokens);
        const uint64_t stream = draw_stream(static_cast<uint64_t>(seed), static_cast<uint64_t>(layer),
                                            static_cast<uint64_t>(position));
        for (int64_t t = 0; t < n_tokens; ++t)
          out.mutable_data()[t] = static_cast<double>(draw_bits(stream, static_cast<uint64_t>(t))) * 0x1p-53;
        return out;
      },
      py::arg("seed"), py::arg("layer"), py::arg("position"), py::arg("n_tokens"),
      "float64 [n_tokens]: the uniform draw in [0, 1) of each token at the step of `position` (the thinning's).");
  m.def(
      "convert_rows",
      [](py::array_t<float, py::array::c_style | py::array::forcecast> rows, int store_dtype) {
        if (store_dtype < kFloat32 || store_dtype > kFloat16) throw std::invalid_argument("bad store dtype");
        const int64_t n = rows.size();
        const int item = store_dtype == kFloat32 ? 4 : 2;
        py::array_t<uint8_t> stored(n * item);
        store_row(rows.data(), static_cast<int>(n), store_dtype, reinterpret_cast<char*>(stored.mutable_data()));
        py::array_t<float> widened(n);
        const uint16_t* half = reinterpret_cast<const uint16_t*>(stored.data());
        for (int64_t i = 0; i < n; ++i)
          widened.mutable_data()[i] = store_dtype == kFloat32 ? rows.data()[i]
                                      : store_dtype == kBFloat16 ? from_bfloat16(half[i]) : from_half(half[i]);
        return py::make_tuple(stored, widened);
      },
      py::arg("rows"), py::arg("store_dtype"),
      "float32 values stored in a store dtype (its bytes) and widened back: the step's conversions, for tests.");
}
