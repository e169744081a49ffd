// Dot-product kernels. Built for the portable x86-64 baseline plus an x86-64-v3 (AVX2 + FMA) clone that the loader
// picks at run time, so one wheel runs on any x86-64 host and uses AVX2 where it exists. GCC vector types give
// 8-lane arithmetic without -ffast-math; lanes are summed in a fixed order, so a result never depends on the
// thread count.
#include <cmath>
#include <cstring>
#include <vector>

#include "dci.hpp"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define DCI_HAVE_V3_HALF 1
#endif

namespace dci {

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define DCI_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define DCI_CLONES
#endif

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

static inline float hsum(v8 a, v8 b, float tail) {
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

DCI_CLONES
float dot(const float* a, const float* b, int dim) { return dot_impl(a, b, dim); }

DCI_CLONES
void bf16_to_float(const uint16_t* src, int n, float* dst) {
  for (int i = 0; i < n; ++i) dst[i] = widen(src[i]);
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

DCI_CLONES
void dot_rows(const float* q, const float* rows, const int32_t* ids, int m, int dim, float* out) {
  dot_rows_t(q, rows, ids, m, dim, out);
}

DCI_CLONES
void dot_rows_bf16(const float* q, const uint16_t* rows, const int32_t* ids, int m, int dim, float* out) {
  dot_rows_t(q, rows, ids, m, dim, out);
}

// NH queries against one row at a time: the row is loaded once for all of them (the heads of a GQA group share the
// keys). Query j's sum over a row is the same sequence of operations as in dot_rows, so the values are identical.
// Rows are rows[ids[r]] (ids may be null: rows r).
template <int NH, typename R>
__attribute__((always_inline)) static inline void dot_rows_heads(const float* const* qs, const R* rows,
                                                                 const int32_t* ids, int m, int dim, float* out,
                                                                 int out_stride) {
  for (int r = 0; r < m; ++r) {
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
}

template <typename R>
__attribute__((always_inline)) static inline void dot_rows_multi_t(const float* const* qs, int nq, const R* rows,
                                                                   const int32_t* ids, int m, int dim, float* out,
                                                                   int out_stride) {
  if ((dim & 15) != 0) {
    for (int j = 0; j < nq; ++j)
      for (int r = 0; r < m; ++r)
        out[j * out_stride + r] = dot_impl(qs[j], rows + static_cast<int64_t>(ids ? ids[r] : r) * dim, dim);
    return;
  }
  int j = 0;
  for (; j + 4 <= nq; j += 4) dot_rows_heads<4>(qs + j, rows, ids, m, dim, out + j * out_stride, out_stride);
  switch (nq - j) {
    case 3: dot_rows_heads<3>(qs + j, rows, ids, m, dim, out + j * out_stride, out_stride); break;
    case 2: dot_rows_heads<2>(qs + j, rows, ids, m, dim, out + j * out_stride, out_stride); break;
    case 1: dot_rows_heads<1>(qs + j, rows, ids, m, dim, out + j * out_stride, out_stride); break;
    default: break;
  }
}

DCI_CLONES
void dot_rows_multi(const float* const* qs, int nq, const float* rows, int m, int dim, float* out, int out_stride) {
  dot_rows_multi_t(qs, nq, rows, static_cast<const int32_t*>(nullptr), m, dim, out, out_stride);
}

DCI_CLONES
void dot_rows_multi_ids(const float* const* qs, int nq, const float* rows, const int32_t* ids, int m, int dim,
                        float* out, int out_stride) {
  dot_rows_multi_t(qs, nq, rows, ids, m, dim, out, out_stride);
}

DCI_CLONES
void dot_rows_multi_ids_bf16(const float* const* qs, int nq, const uint16_t* rows, const int32_t* ids, int m, int dim,
                             float* out, int out_stride) {
  dot_rows_multi_t(qs, nq, rows, ids, m, dim, out, out_stride);
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

#ifdef DCI_HAVE_V3_HALF
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

static bool cpu_has_v3_half() {
  static const bool yes = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  }();
  return yes;
}
#endif

void encode_half(const float* src, int n, uint16_t* dst, float* sums) {
#ifdef DCI_HAVE_V3_HALF
  if (cpu_has_v3_half()) {
    encode_half_v3(src, n, dst, sums);
    return;
  }
#endif
  encode_half_portable(src, n, dst, sums);
}

void dot_rows_multi_half(const float* const* qs, int nq, const uint16_t* rows, int m, int dim, float* out,
                         int out_stride) {
#ifdef DCI_HAVE_V3_HALF
  if ((dim & 15) == 0 && cpu_has_v3_half()) {
    dot_rows_multi_half_v3(qs, nq, rows, m, dim, out, out_stride);
    return;
  }
#endif
  dot_rows_multi_half_portable(qs, nq, rows, m, dim, out, out_stride);
}

}  // namespace dci
