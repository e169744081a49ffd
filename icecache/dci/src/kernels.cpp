// Dot-product kernels, in three builds of the same source picked at run time (`active_isa`): the portable x86-64
// baseline, x86-64-v3 (AVX2 + FMA) and AVX-512 (docs/dci.md, kernels). GCC vector types give 8-lane arithmetic
// without -ffast-math; lanes are summed in a fixed order, so a result never depends on the thread count.
//
// The AVX2 and AVX-512 builds compute bit-identical values: GCC contracts `x += a * b` into one FMA in the AVX2
// build (-ffp-contract=fast is its default for C++), and the AVX-512 kernels do the same FMAs into the same lanes
// (one 16-lane register holds the two 8-lane accumulators of the AVX2 kernels side by side) and sum them in the
// same order. The portable build has no FMA: it rounds each product before adding it, so its values can differ
// from the other two in the last bits (and with them a near-tie between two keys). A fourth build, avx512bf16,
// scores bf16 rows with vdpbf16ps (its section below): exact products, summed in another order.
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "dci.hpp"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#include <immintrin.h>
#define DCI_X86 1
#define DCI_TARGET_AVX2 __attribute__((target("arch=x86-64-v3")))
#define DCI_TARGET_AVX512 __attribute__((target("arch=x86-64-v4")))
#define DCI_TARGET_AVX512BF16 __attribute__((target("arch=x86-64-v4,avx512bf16")))
#endif

namespace dci {

// ---------------------------------------------------------------------------------------------------------------
// The instruction set the kernels run with.

namespace {

Isa widest_supported() {
#ifdef DCI_X86
  __builtin_cpu_init();
  const bool v3 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                  __builtin_cpu_supports("f16c") && __builtin_cpu_supports("bmi2");
  const bool v4 = v3 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                  __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
                  __builtin_cpu_supports("avx512cd");
  const bool bf16 = v4 && __builtin_cpu_supports("avx512bf16");
  return bf16 ? Isa::kAvx512Bf16 : v4 ? Isa::kAvx512 : v3 ? Isa::kAvx2 : Isa::kPortable;
#else
  return Isa::kPortable;
#endif
}

// ICECACHE_DCI_ISA (portable | avx2 | avx512 | avx512bf16) when set, else the widest of the exact ones that the CPU
// runs (avx512bf16 changes the order of the sums, so it is asked for by name). A name that is unknown, or that the
// CPU cannot run, is remembered and raised by check_isa_environment (the module's import).
struct IsaState {
  std::atomic<int> active;
  std::string error;
  IsaState() : active(std::min(static_cast<int>(supported_isa()), static_cast<int>(Isa::kAvx512))) {
    const char* env = std::getenv("ICECACHE_DCI_ISA");
    if (env == nullptr || *env == '\0') return;
    Isa isa;
    if (!parse_isa(env, &isa))
      error = std::string("ICECACHE_DCI_ISA=") + env + ": not one of portable, avx2, avx512, avx512bf16";
    else if (static_cast<int>(isa) > static_cast<int>(supported_isa()))
      error = std::string("ICECACHE_DCI_ISA=") + env + ": this CPU runs at most " + isa_name(supported_isa());
    else
      active.store(static_cast<int>(isa));
  }
};

IsaState& isa_state() {
  static IsaState state;
  return state;
}

}  // namespace

Isa supported_isa() {
  static const Isa widest = widest_supported();
  return widest;
}

Isa active_isa() { return static_cast<Isa>(isa_state().active.load(std::memory_order_relaxed)); }

void set_isa(Isa isa) {
  if (static_cast<int>(isa) > static_cast<int>(supported_isa()))
    throw std::invalid_argument(std::string("this CPU runs the DCI kernels at most as ") + isa_name(supported_isa()) +
                                ", not " + isa_name(isa));
  isa_state().active.store(static_cast<int>(isa), std::memory_order_relaxed);
}

void check_isa_environment() {
  if (!isa_state().error.empty()) throw std::invalid_argument(isa_state().error);
}

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kAvx512Bf16: return "avx512bf16";
    case Isa::kAvx512: return "avx512";
    case Isa::kAvx2: return "avx2";
    default: return "portable";
  }
}

bool parse_isa(const std::string& name, Isa* isa) {
  for (Isa i : {Isa::kPortable, Isa::kAvx2, Isa::kAvx512, Isa::kAvx512Bf16})
    if (name == isa_name(i)) {
      *isa = i;
      return true;
    }
  return false;
}

// ---------------------------------------------------------------------------------------------------------------
// The generic kernels: one source, compiled once per instruction set below.

typedef float v8 __attribute__((vector_size(32)));

static inline v8 load8(const float* p) {
  v8 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// A bfloat16 is the top half of a float32: widening it is a shift, exact, so a row scored from its bfloat16 bits
// gives the values of the same row held as float32.
typedef uint16_t v8h __attribute__((vector_size(16)));
typedef uint32_t v8u __attribute__((vector_size(32)));

static inline v8 load8(const uint16_t* p) {
  v8h h;
  std::memcpy(&h, p, sizeof(h));
  const v8u w = __builtin_convertvector(h, v8u) << 16;
  v8 v;
  std::memcpy(&v, &w, sizeof(v));
  return v;
}

static inline float widen(float x) { return x; }
static inline float widen(uint16_t x) {
  const uint32_t w = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &w, sizeof(f));
  return f;
}

__attribute__((always_inline)) static inline float hsum(v8 a, v8 b, float tail) {
  const v8 s = a + b;
  return (((s[0] + s[4]) + (s[1] + s[5])) + ((s[2] + s[6]) + (s[3] + s[7]))) + tail;
}

template <typename R>
__attribute__((always_inline)) static inline float dot_impl(const float* a, const R* b, int dim) {
  v8 x = {0}, y = {0};
  int i = 0;
  for (; i + 16 <= dim; i += 16) {
    x += load8(a + i) * load8(b + i);
    y += load8(a + i + 8) * load8(b + i + 8);
  }
  for (; i + 8 <= dim; i += 8) x += load8(a + i) * load8(b + i);
  float tail = 0.0f;
  for (; i < dim; ++i) tail += a[i] * widen(b[i]);
  return hsum(x, y, tail);
}

// Four rows at a time share the query loads and give the FMA units independent chains. Each row's sum is the same
// sequence of operations as dot_impl, so a row's value does not depend on its position in a block.
template <typename R>
__attribute__((always_inline)) static inline void dot_rows_t(const float* q, const R* rows, const int32_t* ids, int m,
                                                             int dim, float* out) {
  auto row = [&](int r) { return rows + static_cast<int64_t>(ids ? ids[r] : r) * dim; };
  int r = 0;
  if ((dim & 15) == 0) {
    for (; r + 4 <= m; r += 4) {
      const R *p0 = row(r), *p1 = row(r + 1), *p2 = row(r + 2), *p3 = row(r + 3);
      v8 x0 = {0}, y0 = {0}, x1 = {0}, y1 = {0}, x2 = {0}, y2 = {0}, x3 = {0}, y3 = {0};
      for (int i = 0; i < dim; i += 16) {
        const v8 qa = load8(q + i), qb = load8(q + i + 8);
        x0 += qa * load8(p0 + i); y0 += qb * load8(p0 + i + 8);
        x1 += qa * load8(p1 + i); y1 += qb * load8(p1 + i + 8);
        x2 += qa * load8(p2 + i); y2 += qb * load8(p2 + i + 8);
        x3 += qa * load8(p3 + i); y3 += qb * load8(p3 + i + 8);
      }
      out[r] = hsum(x0, y0, 0.0f);
      out[r + 1] = hsum(x1, y1, 0.0f);
      out[r + 2] = hsum(x2, y2, 0.0f);
      out[r + 3] = hsum(x3, y3, 0.0f);
    }
  }
  for (; r < m; ++r) out[r] = dot_impl(q, row(r), dim);
}

// The cache lines of row ids[r] of `rows` requested (software prefetch), for r < n: the rows a scan scores next,
// requested one per row scored now, so that their loads overlap this arithmetic and no burst of requests stalls it.
template <typename R>
__attribute__((always_inline)) static inline void prefetch_ahead(const R* rows, int dim, const RowsAhead& ahead,
                                                                 int r) {
  if (r >= ahead.n) return;
  const char* p = reinterpret_cast<const char*>(rows + static_cast<int64_t>(ahead.ids[r]) * dim);
  const int bytes = dim * static_cast<int>(sizeof(R));
  if (ahead.to_l2)
    for (int off = 0; off < bytes; off += 64) __builtin_prefetch(p + off, 0, 2);
  else
    for (int off = 0; off < bytes; off += 64) __builtin_prefetch(p + off, 0, 3);
}
template <typename R>
__attribute__((always_inline)) static inline void prefetch_rest(const R* rows, int dim, const RowsAhead& ahead, int m) {
  for (int r = m; r < ahead.n; ++r) prefetch_ahead(rows, dim, ahead, r);
}

// NH queries against one row at a time: the row is loaded once for all of them (the heads of a GQA group share the
// keys). Query j's sum over a row is the same sequence of operations as in dot_rows, so the values are identical.
// Rows are rows[ids[r]] (ids may be null: rows r).
template <int NH, typename R>
__attribute__((always_inline)) static inline void dot_rows_heads(const float* const* qs, const R* rows,
                                                                 const int32_t* ids, int m, int dim, float* out,
                                                                 int out_stride, const RowsAhead& ahead) {
  for (int r = 0; r < m; ++r) {
    prefetch_ahead(rows, dim, ahead, r);
    const R* p = rows + static_cast<int64_t>(ids ? ids[r] : r) * dim;
    v8 x[NH], y[NH];
    for (int j = 0; j < NH; ++j) x[j] = y[j] = v8{0};
    for (int i = 0; i < dim; i += 16) {
      const v8 pa = load8(p + i), pb = load8(p + i + 8);
      for (int j = 0; j < NH; ++j) {
        x[j] += load8(qs[j] + i) * pa;
        y[j] += load8(qs[j] + i + 8) * pb;
      }
    }
    for (int j = 0; j < NH; ++j) out[j * out_stride + r] = hsum(x[j], y[j], 0.0f);
  }
  prefetch_rest(rows, dim, ahead, m);
}

template <typename R>
__attribute__((always_inline)) static inline void dot_rows_multi_t(const float* const* qs, int nq, const R* rows,
                                                                   const int32_t* ids, int m, int dim, float* out,
                                                                   int out_stride, const RowsAhead& ahead) {
  if ((dim & 15) != 0) {
    prefetch_rest(rows, dim, ahead, 0);
    for (int j = 0; j < nq; ++j)
      for (int r = 0; r < m; ++r)
        out[j * out_stride + r] = dot_impl(qs[j], rows + static_cast<int64_t>(ids ? ids[r] : r) * dim, dim);
    return;
  }
  // the rows ahead are requested during the first pass over the rows only
  int j = 0;
  for (; j + 4 <= nq; j += 4)
    dot_rows_heads<4>(qs + j, rows, ids, m, dim, out + j * out_stride, out_stride, j == 0 ? ahead : RowsAhead{});
  const RowsAhead rest = j == 0 ? ahead : RowsAhead{};
  switch (nq - j) {
    case 3: dot_rows_heads<3>(qs + j, rows, ids, m, dim, out + j * out_stride, out_stride, rest); break;
    case 2: dot_rows_heads<2>(qs + j, rows, ids, m, dim, out + j * out_stride, out_stride, rest); break;
    case 1: dot_rows_heads<1>(qs + j, rows, ids, m, dim, out + j * out_stride, out_stride, rest); break;
    default: break;
  }
}

// One build of the generic kernels per instruction set: `kernels_<suffix>::...`, compiled with `target`.
#define DCI_GENERIC_KERNELS(NS, TARGET)                                                                             \
  namespace NS {                                                                                                    \
  TARGET float dot(const float* a, const float* b, int dim) { return dot_impl(a, b, dim); }                         \
  TARGET void bf16_to_float(const uint16_t* src, int n, float* dst) {                                               \
    for (int i = 0; i < n; ++i) dst[i] = widen(src[i]);                                                             \
  }                                                                                                                 \
  TARGET void dot_rows(const float* q, const float* rows, const int32_t* ids, int m, int dim, float* out) {         \
    dot_rows_t(q, rows, ids, m, dim, out);                                                                          \
  }                                                                                                                 \
  TARGET void dot_rows_bf16(const float* q, const uint16_t* rows, const int32_t* ids, int m, int dim, float* out) { \
    dot_rows_t(q, rows, ids, m, dim, out);                                                                          \
  }                                                                                                                 \
  TARGET void dot_rows_multi(const float* const* qs, int nq, const float* rows, const int32_t* ids, int m, int dim, \
                             float* out, int out_stride, const RowsAhead& ahead) {                                  \
    dot_rows_multi_t(qs, nq, rows, ids, m, dim, out, out_stride, ahead);                                            \
  }                                                                                                                 \
  TARGET void dot_rows_multi_bf16(const float* const* qs, int nq, const uint16_t* rows, const int32_t* ids, int m,  \
                                  int dim, float* out, int out_stride, const RowsAhead& ahead) {                    \
    dot_rows_multi_t(qs, nq, rows, ids, m, dim, out, out_stride, ahead);                                            \
  }                                                                                                                 \
  }

#define DCI_NO_TARGET
DCI_GENERIC_KERNELS(portable, DCI_NO_TARGET)
#ifdef DCI_X86
DCI_GENERIC_KERNELS(avx2, DCI_TARGET_AVX2)
#endif

// ---------------------------------------------------------------------------------------------------------------
// AVX-512 kernels for dims that are a multiple of 16 (every other dim goes to the AVX2 build, whose arithmetic
// they repeat). Lanes 0-7 of a 16-lane accumulator are the AVX2 kernels' x, lanes 8-15 their y: element i of a
// row goes to lane i mod 16 in both, with one FMA per element, and hsum16 then adds x + y and sums the 8 lanes as
// hsum does, so every value is the AVX2 build's bit for bit.

#ifdef DCI_X86
namespace avx512 {

DCI_TARGET_AVX512 static inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
DCI_TARGET_AVX512 static inline __m512 load16(const uint16_t* p) {
  const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}

// hsum(x, y, 0.0f) of the AVX2 kernels, for z = [x, y].
DCI_TARGET_AVX512 static inline float hsum16(__m512 z) {
  const __m256 s = _mm256_add_ps(_mm512_castps512_ps256(z), _mm512_extractf32x8_ps(z, 1));  // s_k = x_k + y_k
  const __m128 t = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));      // t_k = s_k + s_k+4
  const __m128 u = _mm_add_ps(t, _mm_movehdup_ps(t));                                      // t0 + t1, t2 + t3
  return _mm_cvtss_f32(_mm_add_ss(u, _mm_movehl_ps(u, u))) + 0.0f;                         // (..) + (..) + 0
}

// hsum16 of four accumulators at once, in the same order of additions: [z0, z1, z2, z3] -> 4 sums.
DCI_TARGET_AVX512 static inline __m128 hsum16x4(__m512 z0, __m512 z1, __m512 z2, __m512 z3) {
  // s01 = [s(z0), s(z1)], s23 = [s(z2), s(z3)]: the low 8 lanes plus the high 8 of each
  const __m512 s01 = _mm512_add_ps(_mm512_shuffle_f32x4(z0, z1, 0x44), _mm512_shuffle_f32x4(z0, z1, 0xee));
  const __m512 s23 = _mm512_add_ps(_mm512_shuffle_f32x4(z2, z3, 0x44), _mm512_shuffle_f32x4(z2, z3, 0xee));
  // t = [t(z0), t(z1), t(z2), t(z3)], 4 lanes each: the low 4 lanes of each s plus its high 4
  const __m512 t = _mm512_add_ps(_mm512_shuffle_f32x4(s01, s23, 0x88), _mm512_shuffle_f32x4(s01, s23, 0xdd));
  const __m512 u = _mm512_add_ps(t, _mm512_movehdup_ps(t));                // per 4 lanes: t0 + t1, ., t2 + t3, .
  const __m512 v = _mm512_add_ps(u, _mm512_permute_ps(u, 0x02));           // lane 0 of each 4: (t0+t1) + (t2+t3)
  const __m512i pick = _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 12, 8, 4, 0);
  return _mm_add_ps(_mm512_castps512_ps128(_mm512_permutexvar_ps(pick, v)), _mm_setzero_ps());
}

template <typename R>
DCI_TARGET_AVX512 static inline float dot16(const float* q, const R* p, int dim) {
  __m512 z = _mm512_setzero_ps();
  for (int i = 0; i < dim; i += 16) z = _mm512_fmadd_ps(_mm512_loadu_ps(q + i), load16(p + i), z);
  return hsum16(z);
}

template <typename R>
DCI_TARGET_AVX512 static void dot_rows16(const float* q, const R* rows, const int32_t* ids, int m, int dim,
                                         float* out) {
  auto row = [&](int r) { return rows + static_cast<int64_t>(ids ? ids[r] : r) * dim; };
  int r = 0;
  for (; r + 4 <= m; r += 4) {
    const R *p0 = row(r), *p1 = row(r + 1), *p2 = row(r + 2), *p3 = row(r + 3);
    __m512 z0 = _mm512_setzero_ps(), z1 = z0, z2 = z0, z3 = z0;
    for (int i = 0; i < dim; i += 16) {
      const __m512 qa = _mm512_loadu_ps(q + i);
      z0 = _mm512_fmadd_ps(qa, load16(p0 + i), z0);
      z1 = _mm512_fmadd_ps(qa, load16(p1 + i), z1);
      z2 = _mm512_fmadd_ps(qa, load16(p2 + i), z2);
      z3 = _mm512_fmadd_ps(qa, load16(p3 + i), z3);
    }
    _mm_storeu_ps(out + r, hsum16x4(z0, z1, z2, z3));
  }
  for (; r < m; ++r) out[r] = dot16(q, row(r), dim);
}

// NH queries against each row; rows taken two at a time so that each query load serves two FMAs.
template <int NH, typename R>
DCI_TARGET_AVX512 static void heads16(const float* const* qs, const R* rows, const int32_t* ids, int m, int dim,
                                      float* out, int out_stride, const RowsAhead& ahead) {
  auto row = [&](int r) { return rows + static_cast<int64_t>(ids ? ids[r] : r) * dim; };
  int r = 0;
  for (; r + 2 <= m; r += 2) {
    prefetch_ahead(rows, dim, ahead, r);
    prefetch_ahead(rows, dim, ahead, r + 1);
    const R *p0 = row(r), *p1 = row(r + 1);
    __m512 a[NH], b[NH];
    for (int j = 0; j < NH; ++j) a[j] = b[j] = _mm512_setzero_ps();
    for (int i = 0; i < dim; i += 16) {
      const __m512 r0 = load16(p0 + i), r1 = load16(p1 + i);
      for (int j = 0; j < NH; ++j) {
        const __m512 qj = _mm512_loadu_ps(qs[j] + i);
        a[j] = _mm512_fmadd_ps(qj, r0, a[j]);
        b[j] = _mm512_fmadd_ps(qj, r1, b[j]);
      }
    }
    if constexpr (NH == 4) {
      const __m128 sa = hsum16x4(a[0], a[1], a[2], a[3]), sb = hsum16x4(b[0], b[1], b[2], b[3]);
      alignas(16) float va[4], vb[4];
      _mm_store_ps(va, sa);
      _mm_store_ps(vb, sb);
      for (int j = 0; j < 4; ++j) {
        out[j * out_stride + r] = va[j];
        out[j * out_stride + r + 1] = vb[j];
      }
    } else {
      for (int j = 0; j < NH; ++j) {
        out[j * out_stride + r] = hsum16(a[j]);
        out[j * out_stride + r + 1] = hsum16(b[j]);
      }
    }
  }
  for (; r < m; ++r) {
    prefetch_ahead(rows, dim, ahead, r);
    for (int j = 0; j < NH; ++j) out[j * out_stride + r] = dot16(qs[j], row(r), dim);
  }
  prefetch_rest(rows, dim, ahead, m);
}

template <typename R>
DCI_TARGET_AVX512 static void multi16(const float* const* qs, int nq, const R* rows, const int32_t* ids, int m,
                                      int dim, float* out, int out_stride, const RowsAhead& ahead) {
  int j = 0;
  for (; j + 4 <= nq; j += 4)
    heads16<4>(qs + j, rows, ids, m, dim, out + j * out_stride, out_stride, j == 0 ? ahead : RowsAhead{});
  const RowsAhead rest = j == 0 ? ahead : RowsAhead{};
  switch (nq - j) {
    case 3: heads16<3>(qs + j, rows, ids, m, dim, out + j * out_stride, out_stride, rest); break;
    case 2: heads16<2>(qs + j, rows, ids, m, dim, out + j * out_stride, out_stride, rest); break;
    case 1: heads16<1>(qs + j, rows, ids, m, dim, out + j * out_stride, out_stride, rest); break;
    default: break;
  }
}

// Four queries against four contiguous rows at a time, 16 accumulators: each row load serves four FMAs and each
// query load four, where heads16 loads six vectors for eight FMAs. Every (query, row) value is dot16's: one FMA per
// 16 elements into one accumulator, in order, then hsum16x4 (hsum16's sums for four registers).
DCI_TARGET_AVX512 static void tile4x4(const float* const* qs, const float* rows, int m, int dim, float* out,
                                      int out_stride) {
  int r = 0;
  for (; r + 4 <= m; r += 4) {
    const float* p = rows + static_cast<int64_t>(r) * dim;
    __m512 z[4][4];
    for (int j = 0; j < 4; ++j)
      for (int k = 0; k < 4; ++k) z[j][k] = _mm512_setzero_ps();
    for (int i = 0; i < dim; i += 16) {
      const __m512 r0 = _mm512_loadu_ps(p + i), r1 = _mm512_loadu_ps(p + dim + i),
                   r2 = _mm512_loadu_ps(p + 2 * dim + i), r3 = _mm512_loadu_ps(p + 3 * dim + i);
      for (int j = 0; j < 4; ++j) {
        const __m512 qj = _mm512_loadu_ps(qs[j] + i);
        z[j][0] = _mm512_fmadd_ps(qj, r0, z[j][0]);
        z[j][1] = _mm512_fmadd_ps(qj, r1, z[j][1]);
        z[j][2] = _mm512_fmadd_ps(qj, r2, z[j][2]);
        z[j][3] = _mm512_fmadd_ps(qj, r3, z[j][3]);
      }
    }
    for (int j = 0; j < 4; ++j) _mm_storeu_ps(out + j * out_stride + r, hsum16x4(z[j][0], z[j][1], z[j][2], z[j][3]));
  }
  for (; r < m; ++r)
    for (int j = 0; j < 4; ++j) out[j * out_stride + r] = dot16(qs[j], rows + static_cast<int64_t>(r) * dim, dim);
}

DCI_TARGET_AVX512 void dot_rows_multi_packed(const float* const* qs, int nq, const float* rows, int m, int dim,
                                             float* out, int out_stride) {
  if ((dim & 15) != 0) return avx2::dot_rows_multi(qs, nq, rows, nullptr, m, dim, out, out_stride, RowsAhead{});
  int j = 0;
  for (; j + 4 <= nq; j += 4) tile4x4(qs + j, rows, m, dim, out + static_cast<int64_t>(j) * out_stride, out_stride);
  if (j < nq) multi16(qs + j, nq - j, rows, static_cast<const int32_t*>(nullptr), m, dim,
                      out + static_cast<int64_t>(j) * out_stride, out_stride, RowsAhead{});
}

DCI_TARGET_AVX512 float dot(const float* a, const float* b, int dim) {
  return (dim & 15) == 0 ? dot16(a, b, dim) : avx2::dot(a, b, dim);
}
DCI_TARGET_AVX512 void dot_rows(const float* q, const float* rows, const int32_t* ids, int m, int dim, float* out) {
  if ((dim & 15) == 0) dot_rows16(q, rows, ids, m, dim, out);
  else avx2::dot_rows(q, rows, ids, m, dim, out);
}
DCI_TARGET_AVX512 void dot_rows_bf16(const float* q, const uint16_t* rows, const int32_t* ids, int m, int dim, float* out) {
  if ((dim & 15) == 0) dot_rows16(q, rows, ids, m, dim, out);
  else avx2::dot_rows_bf16(q, rows, ids, m, dim, out);
}
DCI_TARGET_AVX512 void dot_rows_multi(const float* const* qs, int nq, const float* rows, const int32_t* ids, int m,
                                      int dim, float* out, int out_stride, const RowsAhead& ahead) {
  if ((dim & 15) == 0) multi16(qs, nq, rows, ids, m, dim, out, out_stride, ahead);
  else avx2::dot_rows_multi(qs, nq, rows, ids, m, dim, out, out_stride, ahead);
}
DCI_TARGET_AVX512 void dot_rows_multi_bf16(const float* const* qs, int nq, const uint16_t* rows, const int32_t* ids,
                                           int m, int dim, float* out, int out_stride, const RowsAhead& ahead) {
  if ((dim & 15) == 0) multi16(qs, nq, rows, ids, m, dim, out, out_stride, ahead);
  else avx2::dot_rows_multi_bf16(qs, nq, rows, ids, m, dim, out, out_stride, ahead);
}
DCI_TARGET_AVX512 void bf16_to_float(const uint16_t* src, int n, float* dst) {
  int i = 0;
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(dst + i, load16(src + i));
  for (; i < n; ++i) dst[i] = widen(src[i]);
}

}  // namespace avx512
#endif

// ---------------------------------------------------------------------------------------------------------------
// AVX-512 BF16 kernels for bfloat16 rows whose dim is a multiple of 32, up to 512 (every other call runs the
// avx512 code). vdpbf16ps takes 32 bf16 elements of the row as they lie in memory, no widening, against the query
// in bf16: lane l of a 16-lane accumulator adds the product of elements 2l+1, then that of element 2l (each
// product of two bf16 values is exact in float32, each addition rounded to nearest even; subnormal inputs and
// results are flushed to zero). The query is split once per call into hi = bf16(q) and lo = bf16(q - hi), and a
// chunk of 32 elements adds hi's products, then lo's: 16 bits of the query's 24. A query that came from a bf16
// model (IceCache's on a GPU) is bf16 already, so lo is zero, its pass is skipped (adding +0 changes no lane)
// and every product is the exact product of the avx512 kernels; only the order of the additions differs, so a
// score can differ from theirs in the last bits and a near-tie can go the other way (docs/dci.md, kernels).
// The lanes are then summed as the avx512 kernels sum theirs (hsum16, hsum16x4).

#ifdef DCI_X86
namespace avx512bf16 {

using avx512::bf16_to_float;
using avx512::dot;
using avx512::dot_rows;
using avx512::dot_rows_multi;

constexpr int kMaxChunks = 16;  // dim <= 512

DCI_TARGET_AVX512BF16 static inline __m512bh as_bh(__m512i x) {
  __m512bh y;
  std::memcpy(&y, &x, sizeof(y));
  return y;
}
DCI_TARGET_AVX512BF16 static inline __m512i as_i(__m512bh x) {
  __m512i y;
  std::memcpy(&y, &x, sizeof(y));
  return y;
}
DCI_TARGET_AVX512BF16 static inline __m512bh load_bh(const uint16_t* p) { return as_bh(_mm512_loadu_si512(p)); }

// The float32 values of 16 bf16 bit patterns (exact).
DCI_TARGET_AVX512BF16 static inline __m512 widen16(__m256i h) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// q's hi and lo (dim values each; dim a multiple of 32); whether some lo is non-zero.
DCI_TARGET_AVX512BF16 static bool split_query(const float* q, int dim, uint16_t* hi, uint16_t* lo) {
  __mmask32 inexact = 0;
  for (int i = 0; i < dim; i += 32) {
    const __m512 a = _mm512_loadu_ps(q + i), b = _mm512_loadu_ps(q + i + 16);
    const __m512i h = as_i(_mm512_cvtne2ps_pbh(b, a));  // elements 0-15 from a, 16-31 from b
    const __m512 ha = widen16(_mm512_castsi512_si256(h)), hb = widen16(_mm512_extracti64x4_epi64(h, 1));
    const __m512i l = as_i(_mm512_cvtne2ps_pbh(_mm512_sub_ps(b, hb), _mm512_sub_ps(a, ha)));
    inexact |= _mm512_test_epi16_mask(l, l);
    _mm512_storeu_si512(hi + i, h);
    _mm512_storeu_si512(lo + i, l);
  }
  return inexact != 0;
}

// NH queries (hi[j], lo[j]) against ROWS rows at a time (ROWS * NH independent accumulators keep the dot-product
// unit busy). LO: add lo's products too.
template <int NH, int ROWS, bool LO>
DCI_TARGET_AVX512BF16 static void heads_bf16(const uint16_t* const* hi, const uint16_t* const* lo, const uint16_t* rows,
                                             const int32_t* ids, int m, int dim, float* out, int out_stride,
                                             const RowsAhead& ahead) {
  auto row = [&](int r) { return rows + static_cast<int64_t>(ids ? ids[r] : r) * dim; };
  int r = 0;
  for (; r + ROWS <= m; r += ROWS) {
    const uint16_t* p[ROWS];
    for (int k = 0; k < ROWS; ++k) {
      prefetch_ahead(rows, dim, ahead, r + k);
      p[k] = row(r + k);
    }
    __m512 acc[ROWS][NH];
    for (int k = 0; k < ROWS; ++k)
      for (int j = 0; j < NH; ++j) acc[k][j] = _mm512_setzero_ps();
    for (int i = 0; i < dim; i += 32) {
      __m512bh key[ROWS];
      for (int k = 0; k < ROWS; ++k) key[k] = load_bh(p[k] + i);
      for (int j = 0; j < NH; ++j) {
        const __m512bh h = load_bh(hi[j] + i);
        for (int k = 0; k < ROWS; ++k) acc[k][j] = _mm512_dpbf16_ps(acc[k][j], h, key[k]);
        if constexpr (LO) {
          const __m512bh l = load_bh(lo[j] + i);
          for (int k = 0; k < ROWS; ++k) acc[k][j] = _mm512_dpbf16_ps(acc[k][j], l, key[k]);
        }
      }
    }
    if constexpr (NH == 4) {
      for (int k = 0; k < ROWS; ++k) {
        alignas(16) float v[4];
        _mm_store_ps(v, avx512::hsum16x4(acc[k][0], acc[k][1], acc[k][2], acc[k][3]));
        for (int j = 0; j < 4; ++j) out[j * out_stride + r + k] = v[j];
      }
    } else if constexpr (NH == 1 && ROWS == 4) {
      _mm_storeu_ps(out + r, avx512::hsum16x4(acc[0][0], acc[1][0], acc[2][0], acc[3][0]));
    } else {
      for (int k = 0; k < ROWS; ++k)
        for (int j = 0; j < NH; ++j) out[j * out_stride + r + k] = avx512::hsum16(acc[k][j]);
    }
  }
  if (r < m)
    heads_bf16<NH, 1, LO>(hi, lo, rows, ids ? ids + r : nullptr, m - r, dim, out + r, out_stride,
                          RowsAhead{ahead.ids ? ahead.ids + r : nullptr, std::max(0, ahead.n - r), ahead.to_l2});
  else
    prefetch_rest(rows, dim, ahead, m);
}

static inline bool fits(int dim) { return (dim & 31) == 0 && dim <= 32 * kMaxChunks; }

// Up to 4 queries, with their splits (made here where none was given: a split changes no value).
template <int NH, int ROWS>
DCI_TARGET_AVX512BF16 static void score_group(const float* const* qs, const Bf16Split* splits, const uint16_t* rows,
                                              const int32_t* ids, int m, int dim, float* out, int out_stride,
                                              const RowsAhead& ahead) {
  alignas(64) uint16_t made[NH][2][32 * kMaxChunks];
  const uint16_t *hi[NH], *lo[NH];
  bool inexact = false;
  for (int j = 0; j < NH; ++j) {
    if (splits != nullptr && splits[j].hi != nullptr) {
      hi[j] = splits[j].hi;
      lo[j] = splits[j].lo;
      inexact |= splits[j].inexact;
    } else {
      inexact |= split_query(qs[j], dim, made[j][0], made[j][1]);
      hi[j] = made[j][0];
      lo[j] = made[j][1];
    }
  }
  // an exact query's lo is zero, and adding 0 * key leaves every lane as it is: its pass is skipped
  if (inexact) heads_bf16<NH, ROWS, true>(hi, lo, rows, ids, m, dim, out, out_stride, ahead);
  else heads_bf16<NH, ROWS, false>(hi, lo, rows, ids, m, dim, out, out_stride, ahead);
}

DCI_TARGET_AVX512BF16 Bf16Split split_bf16(const float* q, int dim, uint16_t* buf) {
  if (!fits(dim)) return Bf16Split{};
  const bool inexact = split_query(q, dim, buf, buf + dim);
  return Bf16Split{buf, buf + dim, inexact};
}

DCI_TARGET_AVX512BF16 void dot_rows_bf16(const float* q, const uint16_t* rows, const int32_t* ids, int m, int dim,
                                         float* out, const Bf16Split* split) {
  if (!fits(dim)) return avx512::dot_rows_bf16(q, rows, ids, m, dim, out);
  score_group<1, 4>(&q, split, rows, ids, m, dim, out, 0, RowsAhead{});
}

DCI_TARGET_AVX512BF16 void dot_rows_multi_bf16(const float* const* qs, int nq, const uint16_t* rows,
                                               const int32_t* ids, int m, int dim, float* out, int out_stride,
                                               const RowsAhead& ahead, const Bf16Split* splits) {
  if (!fits(dim)) return avx512::dot_rows_multi_bf16(qs, nq, rows, ids, m, dim, out, out_stride, ahead);
  // the rows ahead are requested during the first pass over the rows only
  for (int j = 0; j < nq; j += 4) {
    const RowsAhead a = j == 0 ? ahead : RowsAhead{};
    const Bf16Split* sp = splits ? splits + j : nullptr;
    float* o = out + static_cast<int64_t>(j) * out_stride;
    switch (std::min(4, nq - j)) {
      case 4: score_group<4, 2>(qs + j, sp, rows, ids, m, dim, o, out_stride, a); break;
      case 3: score_group<3, 2>(qs + j, sp, rows, ids, m, dim, o, out_stride, a); break;
      case 2: score_group<2, 2>(qs + j, sp, rows, ids, m, dim, o, out_stride, a); break;
      default: score_group<1, 2>(qs + j, sp, rows, ids, m, dim, o, out_stride, a); break;
    }
  }
}

}  // namespace avx512bf16
#endif

// ---------------------------------------------------------------------------------------------------------------
// The kernels the index calls: the build of the active instruction set.

#ifdef DCI_X86
// BF16_CALL is what the avx512bf16 build runs (qualified), CALL what the others run in their namespace.
#define DCI_SWITCH_ISA(BF16_CALL, CALL)        \
  switch (active_isa()) {                      \
    case Isa::kAvx512Bf16: return BF16_CALL;   \
    case Isa::kAvx512: return avx512::CALL;    \
    case Isa::kAvx2: return avx2::CALL;        \
    default: return portable::CALL;            \
  }
// The bf16-row kernels of the avx512bf16 build take the query's split (CALL_SPLIT), the others' do not (CALL).
#define DCI_DISPATCH_BF16(CALL_SPLIT, CALL) DCI_SWITCH_ISA(avx512bf16::CALL_SPLIT, CALL)
#define DCI_DISPATCH(CALL) DCI_DISPATCH_BF16(CALL, CALL)
// The avx512bf16 build scores bf16 rows with the avx512 kernels here: widened, the float32 kernels' values.
#define DCI_DISPATCH_WIDENED(CALL) DCI_SWITCH_ISA(avx512::CALL, CALL)
#else
#define DCI_DISPATCH(CALL) return portable::CALL;
#define DCI_DISPATCH_BF16(CALL_SPLIT, CALL) return portable::CALL;
#define DCI_DISPATCH_WIDENED(CALL) return portable::CALL;
#endif

float dot(const float* a, const float* b, int dim) { DCI_DISPATCH(dot(a, b, dim)) }

void bf16_to_float(const uint16_t* src, int n, float* dst) { DCI_DISPATCH(bf16_to_float(src, n, dst)) }

void dot_rows(const float* q, const float* rows, const int32_t* ids, int m, int dim, float* out) {
  DCI_DISPATCH(dot_rows(q, rows, ids, m, dim, out))
}

void dot_rows_bf16(const float* q, const uint16_t* rows, const int32_t* ids, int m, int dim, float* out,
                   const Bf16Split* split) {
  DCI_DISPATCH_BF16(dot_rows_bf16(q, rows, ids, m, dim, out, split), dot_rows_bf16(q, rows, ids, m, dim, out))
}

Bf16Split split_bf16(const float* q, int dim, uint16_t* buf) {
#ifdef DCI_X86
  if (active_isa() == Isa::kAvx512Bf16) return avx512bf16::split_bf16(q, dim, buf);
#endif
  return Bf16Split{};
}

void dot_rows_multi(const float* const* qs, int nq, const float* rows, int m, int dim, float* out, int out_stride) {
  DCI_DISPATCH(dot_rows_multi(qs, nq, rows, nullptr, m, dim, out, out_stride, RowsAhead{}))
}

void dot_rows_multi_packed(const float* const* qs, int nq, const float* rows, int m, int dim, float* out,
                           int out_stride) {
#ifdef DCI_X86
  if (static_cast<int>(active_isa()) >= static_cast<int>(Isa::kAvx512))
    return avx512::dot_rows_multi_packed(qs, nq, rows, m, dim, out, out_stride);
#endif
  dot_rows_multi(qs, nq, rows, m, dim, out, out_stride);
}

void dot_rows_multi_ids(const float* const* qs, int nq, const float* rows, const int32_t* ids, int m, int dim,
                        float* out, int out_stride, const RowsAhead& ahead) {
  DCI_DISPATCH(dot_rows_multi(qs, nq, rows, ids, m, dim, out, out_stride, ahead))
}

void dot_rows_multi_ids_bf16(const float* const* qs, int nq, const uint16_t* rows, const int32_t* ids, int m, int dim,
                             float* out, int out_stride, const RowsAhead& ahead, const Bf16Split* splits) {
  DCI_DISPATCH_BF16(dot_rows_multi_bf16(qs, nq, rows, ids, m, dim, out, out_stride, ahead, splits),
                    dot_rows_multi_bf16(qs, nq, rows, ids, m, dim, out, out_stride, ahead))
}

// key_dists_transform: out[i] = float(M - dots[i] - sqrt(a_room * max(0, M - b_sq[i]))), key_dist_from_dot's
// expression with a_room = max(0, M - a_sq). Square roots, products and differences of doubles are rounded alike in
// every lane and in scalar code, and no product feeds a sum (nothing to contract), so every build gives the same bits.
static void key_dists_transform_scalar(const float* dots, const double* b_sq, int64_t m, double M, double a_room,
                                       float* out) {
  for (int64_t i = 0; i < m; ++i)
    out[i] = static_cast<float>(M - dots[i] - std::sqrt(a_room * std::max(0.0, M - b_sq[i])));
}
#ifdef DCI_X86
// max(x, 0) with 0 as the second operand returns 0 for a NaN x and +0 for -0, as std::max(0.0, x) does.
DCI_TARGET_AVX512 static void key_dists_transform_avx512(const float* dots, const double* b_sq, int64_t m, double M,
                                                         double a_room, float* out) {
  const __m512d vm = _mm512_set1_pd(M), va = _mm512_set1_pd(a_room), zero = _mm512_setzero_pd();
  int64_t i = 0;
  for (; i + 8 <= m; i += 8) {
    const __m512d room = _mm512_max_pd(_mm512_sub_pd(vm, _mm512_loadu_pd(b_sq + i)), zero);
    const __m512d root = _mm512_sqrt_pd(_mm512_mul_pd(va, room));
    const __m512d d = _mm512_sub_pd(_mm512_sub_pd(vm, _mm512_cvtps_pd(_mm256_loadu_ps(dots + i))), root);
    _mm256_storeu_ps(out + i, _mm512_cvtpd_ps(d));
  }
  key_dists_transform_scalar(dots + i, b_sq + i, m - i, M, a_room, out + i);
}
#endif

void key_dists_transform(const float* dots, const double* b_sq, int64_t m, double M, double a_room, float* out) {
#ifdef DCI_X86
  if (static_cast<int>(active_isa()) >= static_cast<int>(Isa::kAvx512))
    return key_dists_transform_avx512(dots, b_sq, m, M, a_room, out);
#endif
  key_dists_transform_scalar(dots, b_sq, m, M, a_room, out);
}

void dot_rows_bf16_widened(const float* q, const uint16_t* rows, const int32_t* ids, int m, int dim, float* out) {
  DCI_DISPATCH_WIDENED(dot_rows_bf16(q, rows, ids, m, dim, out))
}

void dot_rows_multi_ids_bf16_widened(const float* const* qs, int nq, const uint16_t* rows, const int32_t* ids, int m,
                                     int dim, float* out, int out_stride) {
  DCI_DISPATCH_WIDENED(dot_rows_multi_bf16(qs, nq, rows, ids, m, dim, out, out_stride, RowsAhead{}))
}

// ---------------------------------------------------------------------------------------------------------------
// The host's read rate: every thread sums its share of one large buffer (first touched by that thread, so that its
// pages lie near it), the best of a few passes. What the last-level scan's rate is set against.

namespace {
#ifdef DCI_X86
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#endif
uint64_t sum_words(const uint64_t* p, int64_t n) {
  uint64_t a = 0, b = 0, c = 0, d = 0;
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    a += p[i];
    b += p[i + 1];
    c += p[i + 2];
    d += p[i + 3];
  }
  for (; i < n; ++i) a += p[i];
  return (a + b) + (c + d);
}
}  // namespace

double measure_read_rate(int64_t n_bytes, int threads, int passes) {
  threads = std::max(1, threads);
  const int64_t words = std::max<int64_t>(n_bytes / 8, 8 * threads);
  std::unique_ptr<uint64_t[]> buf(new uint64_t[words]);
  uint64_t* data = buf.get();
  uint64_t sink = 0;
  double best = INFINITY;
#pragma omp parallel num_threads(threads)
  {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    const int64_t begin = words * t / nt, end = words * (t + 1) / nt;
    for (int64_t i = begin; i < end; ++i) data[i] = static_cast<uint64_t>(i);
    for (int pass = 0; pass < std::max(1, passes); ++pass) {
#pragma omp barrier
      std::chrono::steady_clock::time_point start;
#pragma omp master
      start = std::chrono::steady_clock::now();
#pragma omp barrier
      const uint64_t s = sum_words(data + begin, end - begin);
#pragma omp atomic
      sink += s;
#pragma omp barrier
#pragma omp master
      best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    }
  }
  volatile uint64_t keep = sink;  // the sums are used
  (void)keep;
  return static_cast<double>(words) * 8.0 / best;
}

// ---------------------------------------------------------------------------------------------------------------
// IEEE binary16 ("half") key rows for the approximate first pass of the last-level scan.
//
// The conversions are written out in integers so that a row is encoded the same way on every host (round to
// nearest even, overflow to infinity); decoding is exact. The scoring kernel has an AVX2 + FMA + F16C version
// (vcvtph2ps turns 8 halves into 8 floats in one instruction) picked at run time, and a portable one.

uint16_t float_to_half(float f) {
  uint32_t x;
  std::memcpy(&x, &f, sizeof(x));
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  x &= 0x7fffffffu;
  if (x > 0x7f800000u) return sign | 0x7e00u;               // NaN
  if (x >= 0x47800000u) return sign | 0x7c00u;              // >= 2^16 (or inf): infinity
  if (x < 0x38800000u) {                                    // below 2^-14: a subnormal half (or zero)
    float a;
    std::memcpy(&a, &x, sizeof(a));
    // a * 2^24 is exact; nearbyint rounds half to even in the default rounding mode. 1024 is the smallest normal.
    return sign | static_cast<uint16_t>(std::nearbyint(a * 16777216.0f));
  }
  const uint32_t mant = x & 0x7fffffu;
  uint32_t h = ((((x >> 23) - 127u + 15u)) << 10) | (mant >> 13);
  const uint32_t rest = mant & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ++h;  // a carry moves into the exponent, up to infinity
  return sign | static_cast<uint16_t>(h);
}

float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  uint32_t x;
  if (e == 0) {
    const float v = static_cast<float>(m) * (1.0f / 16777216.0f);  // m * 2^-24, exact
    std::memcpy(&x, &v, sizeof(x));
    x |= sign;
  } else if (e == 31) {
    x = sign | 0x7f800000u | (m << 13);
  } else {
    x = sign | ((e - 15u + 127u) << 23) | (m << 13);
  }
  float f;
  std::memcpy(&f, &x, sizeof(f));
  return f;
}

static void encode_half_portable(const float* src, int n, uint16_t* dst, float* sums) {
  float err_sq = 0.0f, src_sq = 0.0f, half_sq = 0.0f;
  for (int i = 0; i < n; ++i) {
    dst[i] = float_to_half(src[i]);
    const float h = half_to_float(dst[i]), d = src[i] - h;
    err_sq += d * d;
    src_sq += src[i] * src[i];
    half_sq += h * h;
  }
  sums[0] = err_sq;
  sums[1] = src_sq;
  sums[2] = half_sq;
}

static void dot_rows_multi_half_portable(const float* const* qs, int nq, const uint16_t* rows, int m, int dim,
                                         float* out, int out_stride) {
  thread_local std::vector<float> row;
  row.resize(dim);
  for (int r = 0; r < m; ++r) {
    const uint16_t* p = rows + static_cast<int64_t>(r) * dim;
    for (int i = 0; i < dim; ++i) row[i] = half_to_float(p[i]);
    dot_rows_multi(qs, nq, row.data(), 1, dim, out + r, out_stride);
  }
}

#ifdef DCI_X86
#define DCI_V3 __attribute__((target("avx2,fma,f16c")))

DCI_V3 static inline float hsum256(__m256 a) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}

// One half row is converted once (16 values per step) and multiplied into NH queries.
template <int NH>
DCI_V3 static inline void half_rows_heads(const float* const* qs, const uint16_t* rows, int m, int dim, float* out,
                                          int out_stride) {
  for (int r = 0; r < m; ++r) {
    const uint16_t* p = rows + static_cast<int64_t>(r) * dim;
    __m256 x[NH], y[NH];
    for (int j = 0; j < NH; ++j) x[j] = y[j] = _mm256_setzero_ps();
    for (int i = 0; i < dim; i += 16) {
      const __m256 a = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + i)));
      const __m256 b = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + i + 8)));
      for (int j = 0; j < NH; ++j) {
        x[j] = _mm256_fmadd_ps(_mm256_loadu_ps(qs[j] + i), a, x[j]);
        y[j] = _mm256_fmadd_ps(_mm256_loadu_ps(qs[j] + i + 8), b, y[j]);
      }
    }
    for (int j = 0; j < NH; ++j) out[j * out_stride + r] = hsum256(_mm256_add_ps(x[j], y[j]));
  }
}

DCI_V3 static void dot_rows_multi_half_v3(const float* const* qs, int nq, const uint16_t* rows, int m, int dim,
                                          float* out, int out_stride) {
  int j = 0;
  for (; j + 4 <= nq; j += 4) half_rows_heads<4>(qs + j, rows, m, dim, out + j * out_stride, out_stride);
  switch (nq - j) {
    case 3: half_rows_heads<3>(qs + j, rows, m, dim, out + j * out_stride, out_stride); break;
    case 2: half_rows_heads<2>(qs + j, rows, m, dim, out + j * out_stride, out_stride); break;
    case 1: half_rows_heads<1>(qs + j, rows, m, dim, out + j * out_stride, out_stride); break;
    default: break;
  }
}

DCI_V3 static void encode_half_v3(const float* src, int n, uint16_t* dst, float* sums) {
  __m256 err = _mm256_setzero_ps(), ssq = _mm256_setzero_ps(), hsq = _mm256_setzero_ps();
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 k = _mm256_loadu_ps(src + i);
    const __m128i h = _mm256_cvtps_ph(k, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), h);
    const __m256 hf = _mm256_cvtph_ps(h), d = _mm256_sub_ps(k, hf);
    err = _mm256_fmadd_ps(d, d, err);
    ssq = _mm256_fmadd_ps(k, k, ssq);
    hsq = _mm256_fmadd_ps(hf, hf, hsq);
  }
  float tail[3];
  encode_half_portable(src + i, n - i, dst + i, tail);
  sums[0] = hsum256(err) + tail[0];
  sums[1] = hsum256(ssq) + tail[1];
  sums[2] = hsum256(hsq) + tail[2];
}

// The F16C kernels run with the AVX2 and the AVX-512 kernels (x86-64-v3 includes F16C).
static bool cpu_has_v3_half() { return active_isa() != Isa::kPortable; }
#endif

void encode_half(const float* src, int n, uint16_t* dst, float* sums) {
#ifdef DCI_X86
  if (cpu_has_v3_half()) {
    encode_half_v3(src, n, dst, sums);
    return;
  }
#endif
  encode_half_portable(src, n, dst, sums);
}

void dot_rows_multi_half(const float* const* qs, int nq, const uint16_t* rows, int m, int dim, float* out,
                         int out_stride) {
#ifdef DCI_X86
  if ((dim & 15) == 0 && cpu_has_v3_half()) {
    dot_rows_multi_half_v3(qs, nq, rows, m, dim, out, out_stride);
    return;
  }
#endif
  dot_rows_multi_half_portable(qs, nq, rows, m, dim, out, out_stride);
}

// ---------------------------------------------------------------------------------------------------------------
// 8-bit key rows with a per-row scale for the approximate first pass (score_precision="int8"): half the bytes of a
// bfloat16 row, for a scan that waits on memory (docs/dci.md measures when that pays).

void encode_int8(const float* src, int n, int8_t* dst, float* scale, double* sums) {
  float amax = 0.0f;
  bool finite = true;
  for (int i = 0; i < n; ++i) {
    finite = finite && std::isfinite(src[i]);
    amax = std::max(amax, std::fabs(src[i]));
  }
  const float c = finite ? amax / 127.0f : 0.0f;
  double err_sq = 0.0, src_sq = 0.0, code_sq = 0.0;
  for (int i = 0; i < n; ++i) {
    // |src_i / c| <= 127 up to a rounding of the division; the clamp keeps a code of 127 there
    const float z = c > 0.0f ? std::min(127.0f, std::max(-127.0f, std::nearbyint(src[i] / c))) : 0.0f;
    dst[i] = static_cast<int8_t>(z);
    const double h = static_cast<double>(c) * z;  // exact: a float times an integer below 2^7
    err_sq += (src[i] - h) * (src[i] - h);
    src_sq += static_cast<double>(src[i]) * src[i];
    code_sq += h * h;
  }
  *scale = c;
  sums[0] = finite ? err_sq : INFINITY;
  sums[1] = src_sq;
  sums[2] = code_sq;
}

static void dot_rows_multi_int8_portable(const float* const* qs, int nq, const int8_t* rows, const float* scales,
                                         int m, int dim, float* out, int out_stride) {
  for (int r = 0; r < m; ++r) {
    const int8_t* p = rows + static_cast<int64_t>(r) * dim;
    for (int j = 0; j < nq; ++j) {
      float acc = 0.0f;
      for (int i = 0; i < dim; ++i) acc += qs[j][i] * static_cast<float>(p[i]);
      out[j * out_stride + r] = scales[r] * acc;
    }
  }
}

#ifdef DCI_X86
// One code row is widened once (16 values per step) and multiplied into NH queries.
template <int NH>
DCI_V3 static inline void int8_rows_heads_v3(const float* const* qs, const int8_t* rows, const float* scales, int m,
                                             int dim, float* out, int out_stride) {
  for (int r = 0; r < m; ++r) {
    const int8_t* p = rows + static_cast<int64_t>(r) * dim;
    __m256 x[NH], y[NH];
    for (int j = 0; j < NH; ++j) x[j] = y[j] = _mm256_setzero_ps();
    for (int i = 0; i < dim; i += 16) {
      const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + i));
      const __m256 a = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(c));
      const __m256 b = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(c, c)));
      for (int j = 0; j < NH; ++j) {
        x[j] = _mm256_fmadd_ps(_mm256_loadu_ps(qs[j] + i), a, x[j]);
        y[j] = _mm256_fmadd_ps(_mm256_loadu_ps(qs[j] + i + 8), b, y[j]);
      }
    }
    for (int j = 0; j < NH; ++j) out[j * out_stride + r] = scales[r] * hsum256(_mm256_add_ps(x[j], y[j]));
  }
}

template <int NH>
DCI_TARGET_AVX512 static inline void int8_rows_heads_v4(const float* const* qs, const int8_t* rows,
                                                        const float* scales, int m, int dim, float* out,
                                                        int out_stride) {
  for (int r = 0; r < m; ++r) {
    const int8_t* p = rows + static_cast<int64_t>(r) * dim;
    __m512 x[NH], y[NH];
    for (int j = 0; j < NH; ++j) x[j] = y[j] = _mm512_setzero_ps();
    int i = 0;
    for (; i + 32 <= dim; i += 32) {
      const __m512 a = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + i))));
      const __m512 b =
          _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + i + 16))));
      for (int j = 0; j < NH; ++j) {
        x[j] = _mm512_fmadd_ps(_mm512_loadu_ps(qs[j] + i), a, x[j]);
        y[j] = _mm512_fmadd_ps(_mm512_loadu_ps(qs[j] + i + 16), b, y[j]);
      }
    }
    if (i < dim) {  // dim is a multiple of 16
      const __m512 a = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + i))));
      for (int j = 0; j < NH; ++j) x[j] = _mm512_fmadd_ps(_mm512_loadu_ps(qs[j] + i), a, x[j]);
    }
    for (int j = 0; j < NH; ++j) out[j * out_stride + r] = scales[r] * _mm512_reduce_add_ps(_mm512_add_ps(x[j], y[j]));
  }
}

template <void (*Heads1)(const float* const*, const int8_t*, const float*, int, int, float*, int),
          void (*Heads2)(const float* const*, const int8_t*, const float*, int, int, float*, int),
          void (*Heads3)(const float* const*, const int8_t*, const float*, int, int, float*, int),
          void (*Heads4)(const float* const*, const int8_t*, const float*, int, int, float*, int)>
static void int8_rows_groups(const float* const* qs, int nq, const int8_t* rows, const float* scales, int m, int dim,
                             float* out, int out_stride) {
  int j = 0;
  for (; j + 4 <= nq; j += 4) Heads4(qs + j, rows, scales, m, dim, out + j * out_stride, out_stride);
  switch (nq - j) {
    case 3: Heads3(qs + j, rows, scales, m, dim, out + j * out_stride, out_stride); break;
    case 2: Heads2(qs + j, rows, scales, m, dim, out + j * out_stride, out_stride); break;
    case 1: Heads1(qs + j, rows, scales, m, dim, out + j * out_stride, out_stride); break;
    default: break;
  }
}
#endif

void dot_rows_multi_int8(const float* const* qs, int nq, const int8_t* rows, const float* scales, int m, int dim,
                         float* out, int out_stride) {
#ifdef DCI_X86
  if ((dim & 15) == 0 && static_cast<int>(active_isa()) >= static_cast<int>(Isa::kAvx512)) {
    int8_rows_groups<int8_rows_heads_v4<1>, int8_rows_heads_v4<2>, int8_rows_heads_v4<3>, int8_rows_heads_v4<4>>(
        qs, nq, rows, scales, m, dim, out, out_stride);
    return;
  }
  if ((dim & 15) == 0 && cpu_has_v3_half()) {
    int8_rows_groups<int8_rows_heads_v3<1>, int8_rows_heads_v3<2>, int8_rows_heads_v3<3>, int8_rows_heads_v3<4>>(
        qs, nq, rows, scales, m, dim, out, out_stride);
    return;
  }
#endif
  dot_rows_multi_int8_portable(qs, nq, rows, scales, m, dim, out, out_stride);
}

}  // namespace dci
