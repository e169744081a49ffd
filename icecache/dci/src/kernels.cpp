// Dot-product kernels. Built for the portable x86-64 baseline plus an x86-64-v3 (AVX2 + FMA) clone that the loader
// picks at run time, so one wheel runs on any x86-64 host and uses AVX2 where it exists. GCC vector types give
// 8-lane arithmetic without -ffast-math; lanes are summed in a fixed order, so a result never depends on the
// thread count.
#include <cstring>

#include "dci.hpp"

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

static inline float hsum(v8 a, v8 b, float tail) {
  const v8 s = a + b;
  return (((s[0] + s[4]) + (s[1] + s[5])) + ((s[2] + s[6]) + (s[3] + s[7]))) + tail;
}

static inline float dot_impl(const float* a, const float* b, int dim) {
  v8 x = {0}, y = {0};
  int i = 0;
  for (; i + 16 <= dim; i += 16) {
    x += load8(a + i) * load8(b + i);
    y += load8(a + i + 8) * load8(b + i + 8);
  }
  for (; i + 8 <= dim; i += 8) x += load8(a + i) * load8(b + i);
  float tail = 0.0f;
  for (; i < dim; ++i) tail += a[i] * b[i];
  return hsum(x, y, tail);
}

DCI_CLONES
float dot(const float* a, const float* b, int dim) { return dot_impl(a, b, dim); }

// Four rows at a time share the query loads and give the FMA units independent chains. Each row's sum is the same
// sequence of operations as dot_impl, so a row's value does not depend on its position in a block.
DCI_CLONES
void dot_rows(const float* q, const float* rows, const int32_t* ids, int m, int dim, float* out) {
  auto row = [&](int r) { return rows + static_cast<int64_t>(ids ? ids[r] : r) * dim; };
  int r = 0;
  if ((dim & 15) == 0) {
    for (; r + 4 <= m; r += 4) {
      const float *p0 = row(r), *p1 = row(r + 1), *p2 = row(r + 2), *p3 = row(r + 3);
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

// NH queries against one row at a time: the row is loaded once for all of them (the heads of a GQA group share the
// keys). Query j's sum over a row is the same sequence of operations as in dot_rows, so the values are identical.
template <int NH>
__attribute__((always_inline)) static inline void dot_rows_heads(const float* const* qs, const float* rows, int m,
                                                                 int dim, float* out, int out_stride) {
  for (int r = 0; r < m; ++r) {
    const float* p = rows + static_cast<int64_t>(r) * dim;
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

DCI_CLONES
void dot_rows_multi(const float* const* qs, int nq, const float* rows, int m, int dim, float* out, int out_stride) {
  if ((dim & 15) != 0) {
    for (int j = 0; j < nq; ++j)
      for (int r = 0; r < m; ++r) out[j * out_stride + r] = dot_impl(qs[j], rows + static_cast<int64_t>(r) * dim, dim);
    return;
  }
  int j = 0;
  for (; j + 4 <= nq; j += 4) dot_rows_heads<4>(qs + j, rows, m, dim, out + j * out_stride, out_stride);
  switch (nq - j) {
    case 3: dot_rows_heads<3>(qs + j, rows, m, dim, out + j * out_stride, out_stride); break;
    case 2: dot_rows_heads<2>(qs + j, rows, m, dim, out + j * out_stride, out_stride); break;
    case 1: dot_rows_heads<1>(qs + j, rows, m, dim, out + j * out_stride, out_stride); break;
    default: break;
  }
}

}  // namespace dci
