// Points, levels and pages: the level schedule, the MIPS projection with its lazy correction
// and the page-leaf B+ tree of each parent (docs/dci.md: level schedule, MIPS transform, tree and pages).
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <numeric>
#include <sstream>

#include "dci.hpp"

namespace dci {

void Instance::reset() {
  keys_.clear();
  keys_bf16_.clear();
  row_of_.clear();
  sq_norm_.clear();
  proj_.clear();
  nodes_.clear();
  kids_.clear();
  levels_.clear();
  leaves_.clear();
  page_half_.clear();
  page_int8_.clear();
  page_scale_.clear();
  page_slack_.clear();
  page_rows_.clear();
  free_pages_.clear();
  changed_.clear();
  M_ = 0.0;
  level_count_.clear();
  next_target_ = 0;
  kids_.emplace_back();
  ChildIndex& root = kids_[kRootSlot];
  root.node = -1;
  root.proj.assign(cfg_->num_dirs(), {});
  root.ids.assign(cfg_->num_dirs(), {});
}

// Section 1.4. Deterministic: spaced promotions that keep level sizes n_{l+1} ~ p_l n_l; random: geometric climb,
// capped one above the current top so that no level is ever empty.
int Instance::next_level() {
  auto prob = [&](int l) {
    return (l == 0 || cfg_->promotion_prob_subseq <= 0.0) ? cfg_->promotion_prob : cfg_->promotion_prob_subseq;
  };
  const int top = static_cast<int>(level_count_.size()) - 1;
  int t;
  if (!cfg_->deterministic) {
    std::uniform_real_distribution<double> uni(0.0, 1.0);
    t = 0;
    while (t <= top && uni(rng_) <= prob(t)) ++t;
  } else {
    t = next_target_;
    if (t > top) {
      next_target_ = 0;
    } else if (t == top) {
      next_target_ = (level_count_[t] + 1 == static_cast<int64_t>(std::ceil(1.0 / prob(t)))) ? t + 1 : 0;
    } else {
      next_target_ = (static_cast<double>(level_count_[t] + 1) >= level_count_[t + 1] / prob(t)) ? t + 1 : 0;
    }
  }
  if (t > top) level_count_.push_back(0);
  level_count_[t] += 1;
  return t;
}

// `widen`: also hold float32 copies of bf16 keys (the reference build's; float32 keys are always held as they are).
void Instance::append_points(const void* keys, int64_t m, bool widen) {
  const int dim = cfg_->dim;
  const int64_t n0 = num_tokens();
  if (cfg_->bf16_keys) {
    const uint16_t* k = static_cast<const uint16_t*>(keys);
    keys_bf16_.insert(keys_bf16_.end(), k, k + m * dim);
    if (widen) {
      keys_.resize((n0 + m) * dim);
      bf16_to_float(k, static_cast<int>(m * dim), &keys_[n0 * dim]);
    }
  } else {
    const float* k = static_cast<const float*>(keys);
    keys_.insert(keys_.end(), k, k + m * dim);
  }
  if (!row_of_.empty())  // appended rows follow the laid-out ones
    for (int64_t i = n0; i < n0 + m; ++i) row_of_.push_back(static_cast<int32_t>(i));
  sq_norm_.resize(n0 + m);
  nodes_.resize(n0 + m);
  std::vector<float> buf(dim);
  for (int64_t i = n0; i < n0 + m; ++i) {
    const float* row = key_row(i, buf.data());
    sq_norm_[i] = dot(row, row, dim);
    if (cfg_->transform) M_ = std::max(M_, static_cast<double>(sq_norm_[i]));
  }
  proj_.resize((n0 + m) * cfg_->num_dirs());
}

const float* Instance::key_row(int64_t id, float* buf) const {
  const int dim = cfg_->dim;
  if (!keys_.empty()) return &keys_[row(id) * dim];
  bf16_to_float(&keys_bf16_[row(id) * dim], dim, buf);
  return buf;
}

namespace {
// The storage rows of `ids` (ids themselves while there is no row map).
const int32_t* rows_of(const std::vector<int32_t>& row_of, const int32_t* ids, int m) {
  if (row_of.empty()) return ids;
  thread_local std::vector<int32_t> rows;
  rows.resize(m);
  for (int r = 0; r < m; ++r) rows[r] = row_of[ids[r]];
  return rows.data();
}

// m key rows read and scored against nq query heads, counted at the width the rows are stored in.
void count_key_rows(int m, int nq, int dim, bool bf16) {
  SearchCounters& counted = search_counters();
  counted.rows += m;
  counted.bytes += static_cast<int64_t>(m) * dim * (bf16 ? 2 : 4);
  counted.scores += static_cast<int64_t>(m) * nq;
}
}  // namespace

void Instance::dot_keys(const float* q, const int32_t* ids, int m, float* out, const Bf16Split* split) const {
  count_key_rows(m, 1, cfg_->dim, keys_.empty());
  const int32_t* rows = rows_of(row_of_, ids, m);
  if (!keys_.empty()) dot_rows(q, keys_.data(), rows, m, cfg_->dim, out);
  else if (widen_bf16_rows_) dot_rows_bf16_widened(q, keys_bf16_.data(), rows, m, cfg_->dim, out);
  else dot_rows_bf16(q, keys_bf16_.data(), rows, m, cfg_->dim, out, split);
}

void Instance::dot_keys_multi(const float* const* qs, int nq, const int32_t* ids, int m, float* out, int stride,
                              const Bf16Split* splits) const {
  count_key_rows(m, nq, cfg_->dim, keys_.empty());
  const int32_t* rows = rows_of(row_of_, ids, m);
  if (!keys_.empty()) dot_rows_multi_ids(qs, nq, keys_.data(), rows, m, cfg_->dim, out, stride);
  else if (widen_bf16_rows_) dot_rows_multi_ids_bf16_widened(qs, nq, keys_bf16_.data(), rows, m, cfg_->dim, out, stride);
  else dot_rows_multi_ids_bf16(qs, nq, keys_bf16_.data(), rows, m, cfg_->dim, out, stride, RowsAhead{}, splits);
}

Bf16Split Instance::split_query(const float* q, std::vector<uint16_t>& buf) const {
  if (!keys_.empty()) return Bf16Split{};  // float32 rows: no kernel uses a split
  buf.resize(2 * static_cast<size_t>(cfg_->dim));
  return split_bf16(q, cfg_->dim, buf.data());
}

template <typename Rows>
static void permute_rows(Rows& rows, const std::vector<int32_t>& order, int dim) {
  Rows out;
  out.reserve(rows.capacity());  // the room reserved for the announced length stays
  out.resize(rows.size());
  for (size_t r = 0; r < order.size(); ++r)
    std::copy_n(&rows[static_cast<size_t>(order[r]) * dim], dim, &out[r * dim]);
  rows.swap(out);
}

void Instance::lay_out_rows_by_leaf() {
  const int64_t n = num_tokens();
  std::vector<int32_t> order;  // order[row] = id
  order.reserve(n);
  for (const ChildIndex& ci : kids_)
    for (int32_t page : ci.leaves) {
      const Leaf& lf = leaves_[page];
      order.insert(order.end(), lf.item, lf.item + lf.count);
    }
  row_of_.reserve(std::max<size_t>(nodes_.capacity(), n));
  row_of_.assign(n, -1);
  for (int64_t r = 0; r < n; ++r) row_of_[order[r]] = static_cast<int32_t>(r);
  if (cfg_->bf16_keys) permute_rows(keys_bf16_, order, cfg_->dim);
  else permute_rows(keys_, order, cfg_->dim);
  for (size_t p = 0; p < leaves_.size(); ++p) refresh_page_rows(static_cast<int32_t>(p));
}

void Instance::refresh_page_rows(int32_t page) {
  const Leaf& lf = leaves_[page];
  if (lf.owner == -2) return;
  int32_t* rows = &page_rows_[static_cast<int64_t>(page) * kPageSlots];
  for (int t = 0; t < lf.count; ++t) rows[t] = static_cast<int32_t>(row(lf.item[t]));
}

void Instance::reserve(int64_t n) {
  const int dim = cfg_->dim;
  if (cfg_->bf16_keys) keys_bf16_.reserve(n * dim);
  else keys_.reserve(n * dim);
  sq_norm_.reserve(n);
  row_of_.reserve(n);
  proj_.reserve(n * cfg_->num_dirs());
  nodes_.reserve(n);
}

int64_t Instance::key_bytes() const {
  return static_cast<int64_t>(keys_.capacity() * sizeof(float) + keys_bf16_.capacity() * sizeof(uint16_t));
}

int64_t Instance::structure_bytes() const {
  int64_t b = static_cast<int64_t>(sq_norm_.capacity() * sizeof(float) + proj_.capacity() * sizeof(float) +
                                   nodes_.capacity() * sizeof(Node) + leaves_.capacity() * sizeof(Leaf) +
                                   page_half_.capacity() * sizeof(uint16_t) + page_int8_.capacity() +
                                   page_scale_.capacity() * sizeof(float) + page_slack_.capacity() * sizeof(float) +
                                   free_pages_.capacity() * sizeof(int32_t) + changed_.capacity() +
                                   row_of_.capacity() * sizeof(int32_t) + page_rows_.capacity() * sizeof(int32_t) +
                                   kids_.capacity() * sizeof(ChildIndex));
  for (const ChildIndex& ci : kids_) {
    b += static_cast<int64_t>(ci.leaves.capacity() * sizeof(int32_t));
    for (const auto& v : ci.proj) b += static_cast<int64_t>(v.capacity() * sizeof(float));
    for (const auto& v : ci.ids) b += static_cast<int64_t>(v.capacity() * sizeof(int32_t));
  }
  for (const auto& l : levels_) b += static_cast<int64_t>(l.capacity() * sizeof(int32_t));
  return b;
}

// Projection of a key: u.k + sqrt(M - |k|^2) u_{d+1} (docs/dci.md, MIPS transform); plain u.k without the transform.
void Instance::project(int64_t first, int64_t last, int threads) {
  const int dim = cfg_->dim, L = cfg_->num_dirs(), stride = cfg_->dir_stride();
  const double M = M_;
#pragma omp parallel num_threads(threads) if (last - first > 4096)
  {
    std::vector<float> buf(dim);
#pragma omp for schedule(static)
    for (int64_t i = first; i < last; ++i) {
      const float aug = cfg_->transform ? static_cast<float>(std::sqrt(std::max(0.0, M - sq_norm_[i]))) : 0.0f;
      const float* key = key_row(i, buf.data());
      for (int j = 0; j < L; ++j) {
        const float* u = dirs_ + static_cast<int64_t>(j) * stride;
        proj_[i * L + j] = dot(u, key, dim) + (cfg_->transform ? aug * u[dim] : 0.0f);
      }
      nodes_[i].proj_sq_norm_max = M;
    }
  }
}

// update_local_dist: move a stale projection to the current M by adding the change of the augmented coordinate.
void Instance::correct_projection(int32_t id) {
  Node& nd = nodes_[id];
  if (!cfg_->transform || nd.proj_sq_norm_max >= M_) return;
  const int dim = cfg_->dim, L = cfg_->num_dirs(), stride = cfg_->dir_stride();
  const double sq = sq_norm_[id];
  const float delta = static_cast<float>(std::sqrt(std::max(0.0, M_ - sq)) -
                                         std::sqrt(std::max(0.0, nd.proj_sq_norm_max - sq)));
  for (int j = 0; j < L; ++j) proj_[static_cast<int64_t>(id) * L + j] += delta * dirs_[static_cast<int64_t>(j) * stride + dim];
  nd.proj_sq_norm_max = M_;
}

void Instance::mark(int32_t page) {
  changed_[page] = 1;
  refresh_page_rows(page);
  if (cfg_->first_pass == FirstPass::kNone) return;
  const Leaf& lf = leaves_[page];
  const int64_t row0 = static_cast<int64_t>(page) * kPageSlots;
  thread_local std::vector<float> buf;
  buf.resize(cfg_->dim);
  for (int t = 0; t < lf.count; ++t) encode_page_row(row0 + t, lf.item[t], buf.data());
}

void Instance::encode_page_row(int64_t row, int32_t id, float* buf) {
  const int dim = cfg_->dim;
  const float* key = key_row(id, buf);
  if (cfg_->first_pass == FirstPass::kHalf) encode_half_row(key, &page_half_[row * dim], &page_slack_[row]);
  else encode_int8_row(key, &page_int8_[row * dim], &page_scale_[row], &page_slack_[row]);
}

namespace {
// A first-pass row's slack (page_slack_) from |k - h|, |k| and |h|: the rounding of both dot products in any order,
// 2 max(dim, 16) 2^-24 (|k| + |h|); `scaled` |h| for a first pass whose dot is rounded once more; and 2^-17 |k| for
// the avx512bf16 kernels, which score a query that is not a bf16 vector as hi + lo, within 2^-18 |q| |k|. Rounded up,
// and a relative 2^-20 more for the roundings of this sum.
float row_slack(double err, double k_norm, double h_norm, int dim, double scaled) {
  const double s = err + 2.0 * std::max(dim, 16) * 0x1p-24 * (k_norm + h_norm) + scaled * h_norm + 0x1p-17 * k_norm;
  return std::nextafter(static_cast<float>(s * (1.0 + 0x1p-20)), INFINITY);
}
}  // namespace

void Instance::encode_half_row(const float* key, uint16_t* half, float* slack) const {
  const int dim = cfg_->dim;
  float sums[3];
  encode_half(key, dim, half, sums);
  // a value beyond the half range: a zero row, and a slack that makes every bound infinite
  if (!std::isfinite(sums[2])) {
    std::fill(half, half + dim, uint16_t{0});
    *slack = INFINITY;
    return;
  }
  // the sums are float32: allow them 4 dim 2^-24 of relative error
  const double sum_margin = 1.0 + 4.0 * dim * 0x1p-24;
  *slack = row_slack(std::sqrt(sums[0] * sum_margin), std::sqrt(sums[1] * sum_margin),
                     std::sqrt(sums[2] * sum_margin), dim, 0.0);
}

void Instance::encode_int8_row(const float* key, int8_t* code, float* scale, float* slack) const {
  const int dim = cfg_->dim;
  double sums[3];
  encode_int8(key, dim, code, scale, sums);
  if (!(sums[0] <= DBL_MAX)) {  // a value that is not finite: zero codes, every bound infinite
    *slack = INFINITY;
    return;
  }
  // float64 sums need no margin; the kernel rounds the code dot q.z (covered as for half, since c |z| = |h|) and
  // then its product with c: 2^-23 |h| more
  *slack = row_slack(std::sqrt(sums[0]), std::sqrt(sums[1]), std::sqrt(sums[2]), dim, 0x1p-23);
}

int32_t Instance::alloc_page() {
  int32_t page;
  if (!free_pages_.empty()) {
    page = free_pages_.back();
    free_pages_.pop_back();
  } else {
    page = static_cast<int32_t>(leaves_.size());
    leaves_.emplace_back();
    changed_.push_back(1);
    page_rows_.resize(leaves_.size() * kPageSlots);
    if (cfg_->first_pass == FirstPass::kHalf) page_half_.resize(leaves_.size() * kPageSlots * cfg_->dim);
    if (cfg_->first_pass == FirstPass::kInt8) {
      page_int8_.resize(leaves_.size() * kPageSlots * cfg_->dim);
      page_scale_.resize(leaves_.size() * kPageSlots);
    }
    if (cfg_->first_pass != FirstPass::kNone) page_slack_.resize(leaves_.size() * kPageSlots);
  }
  leaves_[page].count = 0;
  changed_[page] = 1;
  return page;
}

void Instance::free_page(int32_t page) {
  leaves_[page].owner = -2;
  leaves_[page].count = 0;
  changed_[page] = 1;
  free_pages_.push_back(page);
}

int32_t Instance::ensure_kids(int32_t node) {
  if (node < 0) return kRootSlot;
  Node& nd = nodes_[node];
  if (nd.kid_slot < 0) {
    nd.kid_slot = static_cast<int32_t>(kids_.size());
    kids_.emplace_back();
    ChildIndex& ci = kids_.back();
    ci.node = node;
    ci.proj.assign(cfg_->num_dirs(), {});
    ci.ids.assign(cfg_->num_dirs(), {});
    ci.children_sq_norm_max = M_;
  }
  return nd.kid_slot;
}

// btree_p_bulk_load: children sorted by direction-0 projection go into ceil(c/16) leaves, leaf i taking
// floor(remaining / (leaves - i)) so that the leaves are evenly filled. page_ids supplies the leaf ids.
void Instance::bulk_load(int32_t parent_node, std::vector<int32_t>& children, const int32_t* page_ids) {
  const int slot = ensure_kids(parent_node);
  ChildIndex& ci = kids_[slot];
  const int L = cfg_->num_dirs();
  const int64_t c = static_cast<int64_t>(children.size());
  for (int j = 0; j < L; ++j) {
    std::sort(children.begin(), children.end(), [&](int32_t a, int32_t b) {
      const float pa = proj_[static_cast<int64_t>(a) * L + j], pb = proj_[static_cast<int64_t>(b) * L + j];
      return pa < pb || (pa == pb && a < b);
    });
    ci.ids[j].assign(children.begin(), children.end());
    ci.proj[j].resize(c);
    for (int64_t i = 0; i < c; ++i) ci.proj[j][i] = proj_[static_cast<int64_t>(children[i]) * L + j];
    if (j == 0) {
      const int64_t nleaves = (c + kPageSlots - 1) / kPageSlots;
      ci.leaves.assign(page_ids, page_ids + nleaves);
      int64_t pos = 0;
      for (int64_t i = 0; i < nleaves; ++i) {
        const int64_t take = (c - pos) / (nleaves - i);
        Leaf& lf = leaves_[ci.leaves[i]];
        lf.owner = slot;
        lf.count = static_cast<int32_t>(take);
        for (int64_t t = 0; t < take; ++t, ++pos) {
          lf.key[t] = ci.proj[0][pos];
          lf.item[t] = children[pos];
          nodes_[children[pos]].page = ci.leaves[i];
          nodes_[children[pos]].slot = static_cast<int32_t>(t);
        }
        mark(ci.leaves[i]);
      }
    }
  }
  // children sorted by the last direction; direction 0 order lives in ci.ids[0]
}

// Insert one child into a parent's trees: into the direction-0 leaf whose range holds its projection, splitting a
// full leaf 8 + 8 first; into every sorted projection array.
void Instance::insert_child(int32_t parent_node, int32_t child) {
  refresh_stale(parent_node);
  correct_projection(child);
  const int slot = ensure_kids(parent_node);
  ChildIndex& ci = kids_[slot];
  const int L = cfg_->num_dirs();
  for (int j = 0; j < L; ++j) {
    const float x = proj_[static_cast<int64_t>(child) * L + j];
    auto pos = std::upper_bound(ci.proj[j].begin(), ci.proj[j].end(), x) - ci.proj[j].begin();
    ci.proj[j].insert(ci.proj[j].begin() + pos, x);
    ci.ids[j].insert(ci.ids[j].begin() + pos, child);
  }
  const float x = proj_[static_cast<int64_t>(child) * L];
  if (ci.leaves.empty()) {
    const int32_t page = alloc_page();
    leaves_[page].owner = slot;
    ci.leaves.push_back(page);
  }
  // last leaf whose first key is <= x (the first leaf when x is below all)
  int64_t li = 0;
  {
    int64_t lo = 0, hi = static_cast<int64_t>(ci.leaves.size()) - 1;
    while (lo < hi) {
      const int64_t mid = (lo + hi + 1) / 2;
      const Leaf& lf = leaves_[ci.leaves[mid]];
      if (lf.count > 0 && lf.key[0] <= x) lo = mid; else hi = mid - 1;
    }
    li = lo;
  }
  int32_t page = ci.leaves[li];
  if (leaves_[page].count == kPageSlots) {
    const int32_t right = alloc_page();
    Leaf& lf = leaves_[page];
    Leaf& rt = leaves_[right];
    rt.owner = slot;
    rt.count = kPageSlots - kSplitHalf;
    for (int t = kSplitHalf; t < kPageSlots; ++t) {
      rt.key[t - kSplitHalf] = lf.key[t];
      rt.item[t - kSplitHalf] = lf.item[t];
      nodes_[lf.item[t]].page = right;
      nodes_[lf.item[t]].slot = t - kSplitHalf;
    }
    lf.count = kSplitHalf;
    ci.leaves.insert(ci.leaves.begin() + li + 1, right);
    mark(page);
    mark(right);
    if (x >= rt.key[0]) page = right;
  }
  Leaf& lf = leaves_[page];
  int t = lf.count;
  while (t > 0 && lf.key[t - 1] > x) {
    lf.key[t] = lf.key[t - 1];
    lf.item[t] = lf.item[t - 1];
    nodes_[lf.item[t]].slot = t;
    --t;
  }
  lf.key[t] = x;
  lf.item[t] = child;
  lf.count += 1;
  nodes_[child].page = page;
  nodes_[child].slot = t;
  nodes_[child].parent = parent_node;
  mark(page);
}

// Remove one child; a leaf left with fewer than 8 entries borrows one from a sibling with more than 8, or merges
// with it (<= 7 + 8 entries), freeing a page id for reuse.
void Instance::remove_child(int32_t parent_node, int32_t child) {
  ChildIndex& ci = kids_of(parent_node);
  const int L = cfg_->num_dirs();
  for (int j = 0; j < L; ++j) {
    auto it = std::find(ci.ids[j].begin(), ci.ids[j].end(), child);
    const auto pos = it - ci.ids[j].begin();
    ci.ids[j].erase(it);
    ci.proj[j].erase(ci.proj[j].begin() + pos);
  }
  const int32_t page = nodes_[child].page;
  Leaf& lf = leaves_[page];
  for (int t = nodes_[child].slot; t + 1 < lf.count; ++t) {
    lf.key[t] = lf.key[t + 1];
    lf.item[t] = lf.item[t + 1];
    nodes_[lf.item[t]].slot = t;
  }
  lf.count -= 1;
  mark(page);
  nodes_[child].page = nodes_[child].slot = -1;
  const auto li = std::find(ci.leaves.begin(), ci.leaves.end(), page) - ci.leaves.begin();
  if (ci.leaves.size() == 1) {
    if (lf.count == 0) {
      free_page(page);
      ci.leaves.clear();
    }
    return;
  }
  if (lf.count >= kMinFill) return;
  // sibling: the right one when it exists, else the left one; (a, b) = (left, right) of the pair
  const bool has_right = li + 1 < static_cast<int64_t>(ci.leaves.size());
  const int64_t ai = has_right ? li : li - 1;
  Leaf& a = leaves_[ci.leaves[ai]];
  Leaf& b = leaves_[ci.leaves[ai + 1]];
  Leaf& sib = has_right ? b : a;
  auto relabel = [&](int32_t pg) {
    Leaf& l = leaves_[pg];
    for (int t = 0; t < l.count; ++t) {
      nodes_[l.item[t]].page = pg;
      nodes_[l.item[t]].slot = t;
    }
    mark(pg);
  };
  if (sib.count > kMinFill) {
    if (has_right) {  // move b's first entry to the end of a
      a.key[a.count] = b.key[0];
      a.item[a.count] = b.item[0];
      a.count += 1;
      for (int t = 0; t + 1 < b.count; ++t) { b.key[t] = b.key[t + 1]; b.item[t] = b.item[t + 1]; }
      b.count -= 1;
    } else {          // move a's last entry to the front of b
      for (int t = b.count; t > 0; --t) { b.key[t] = b.key[t - 1]; b.item[t] = b.item[t - 1]; }
      b.key[0] = a.key[a.count - 1];
      b.item[0] = a.item[a.count - 1];
      b.count += 1;
      a.count -= 1;
    }
    relabel(ci.leaves[ai]);
    relabel(ci.leaves[ai + 1]);
  } else {            // merge b into a
    for (int t = 0; t < b.count; ++t) { a.key[a.count + t] = b.key[t]; a.item[a.count + t] = b.item[t]; }
    a.count += b.count;
    const int32_t freed = ci.leaves[ai + 1];
    ci.leaves.erase(ci.leaves.begin() + ai + 1);
    relabel(ci.leaves[ai]);
    free_page(freed);
  }
}

// update_max_sq_norm: when M has grown since a parent's children were projected, correct their projections and
// re-sort and bulk-reload the parent's trees, reusing its page ids first (page membership changes).
void Instance::refresh_stale(int32_t parent_node) {
  if (!cfg_->transform) return;
  if (parent_node >= 0 && nodes_[parent_node].kid_slot < 0) return;
  ChildIndex& ci = kids_of(parent_node);
  if (ci.children_sq_norm_max >= M_) return;
  ci.children_sq_norm_max = M_;
  if (ci.size() == 0) return;
  std::vector<int32_t> children = ci.ids[0];
  for (int32_t c : children) correct_projection(c);
  const int64_t need = (static_cast<int64_t>(children.size()) + kPageSlots - 1) / kPageSlots;
  std::vector<int32_t> pages = ci.leaves;
  std::sort(pages.begin(), pages.end());
  while (static_cast<int64_t>(pages.size()) > need) {
    free_page(pages.back());
    pages.pop_back();
  }
  const int slot = parent_node < 0 ? kRootSlot : nodes_[parent_node].kid_slot;
  while (static_cast<int64_t>(pages.size()) < need) {
    const int32_t p = alloc_page();
    leaves_[p].owner = slot;
    pages.push_back(p);
  }
  bulk_load(parent_node, children, pages.data());
}

// Pages in each parent's subtree (num_finest_level_nodes), bottom-up over the upper levels only.
void Instance::recount() {
  for (auto& ci : kids_) ci.pages_under = static_cast<int32_t>(ci.leaves.size());
  for (size_t l = 1; l < levels_.size(); ++l)
    for (int32_t v : levels_[l]) {
      const int32_t p = nodes_[v].parent;
      if (p >= 0 && nodes_[v].kid_slot >= 0) kids_of(p).pages_under += kids_[nodes_[v].kid_slot].pages_under;
    }
}

std::string Instance::check() const {
  std::ostringstream err;
  const int64_t n = num_tokens();
  const int L = cfg_->num_dirs();
  std::vector<int32_t> seen(n, 0);
  if (!row_of_.empty()) {
    if (static_cast<int64_t>(row_of_.size()) != n) { err << "row map size " << row_of_.size(); return err.str(); }
    std::vector<uint8_t> used(n, 0);
    for (int64_t t = 0; t < n; ++t) {
      const int32_t r = row_of_[t];
      if (r < 0 || r >= n || used[r]) { err << "row map is not a permutation at token " << t; return err.str(); }
      used[r] = 1;
    }
  }
  std::vector<uint8_t> is_free(leaves_.size(), 0);
  for (int32_t p : free_pages_) {
    if (p < 0 || p >= num_pages() || is_free[p]) { err << "bad free page " << p; return err.str(); }
    is_free[p] = 1;
  }
  std::vector<int32_t> owned(leaves_.size(), 0);
  for (size_t s = 0; s < kids_.size(); ++s) {
    const ChildIndex& ci = kids_[s];
    int64_t total = 0;
    float prev = -INFINITY;
    for (size_t li = 0; li < ci.leaves.size(); ++li) {
      const int32_t p = ci.leaves[li];
      if (is_free[p]) { err << "free page " << p << " in use"; return err.str(); }
      owned[p] += 1;
      const Leaf& lf = leaves_[p];
      if (lf.owner != static_cast<int32_t>(s)) { err << "page " << p << " owner mismatch"; return err.str(); }
      if (lf.count < 1 || lf.count > kPageSlots) { err << "page " << p << " count " << lf.count; return err.str(); }
      if (ci.leaves.size() > 1 && lf.count < kMinFill) { err << "page " << p << " underfull " << lf.count; return err.str(); }
      for (int t = 0; t < lf.count; ++t) {
        const int32_t it = lf.item[t];
        if (it < 0 || it >= n) { err << "bad item"; return err.str(); }
        seen[it] += 1;
        const Node& nd = nodes_[it];
        if (nd.page != p || nd.slot != t) { err << "token " << it << " map mismatch"; return err.str(); }
        if (nd.parent != ci.node) { err << "token " << it << " parent mismatch"; return err.str(); }
        if (lf.key[t] < prev) { err << "page order broken at token " << it; return err.str(); }
        if (lf.key[t] != proj_[static_cast<int64_t>(it) * L]) { err << "stale leaf key of " << it; return err.str(); }
        if (page_rows_[static_cast<int64_t>(p) * kPageSlots + t] != row(it)) {
          err << "stale storage row of token " << it << " in page " << p; return err.str();
        }
        if (cfg_->first_pass != FirstPass::kNone) {  // the copy and slack as mark() would write them now
          const int64_t row = static_cast<int64_t>(p) * kPageSlots + t;
          const int dim = cfg_->dim;
          std::vector<float> buf(dim);
          const float* key = key_row(it, buf.data());
          bool current;
          float slack;
          if (cfg_->first_pass == FirstPass::kHalf) {
            std::vector<uint16_t> half(dim);
            encode_half_row(key, half.data(), &slack);
            current = std::equal(half.begin(), half.end(), &page_half_[row * dim]);
          } else {
            std::vector<int8_t> code(dim);
            float scale;
            encode_int8_row(key, code.data(), &scale, &slack);
            current = std::equal(code.begin(), code.end(), &page_int8_[row * dim]) && scale == page_scale_[row];
          }
          if (!current || slack != page_slack_[row]) {
            err << "first-pass page buffer of page " << p << " slot " << t << " stale"; return err.str();
          }
        }
        prev = lf.key[t];
      }
      total += lf.count;
    }
    if (total != ci.size()) { err << "parent " << ci.node << " leaf total " << total << " != " << ci.size(); return err.str(); }
    // the query scans a run of direction-0 positions leaf by leaf: the leaves must list ids[0] in order
    {
      int64_t i = 0;
      for (const int32_t p : ci.leaves)
        for (int t = 0; t < leaves_[p].count; ++t, ++i)
          if (leaves_[p].item[t] != ci.ids[0][i]) { err << "parent " << ci.node << " leaves differ from ids[0]"; return err.str(); }
    }
    for (int j = 0; j < L; ++j)
      for (int64_t i = 1; i < ci.size(); ++i)
        if (ci.proj[j][i - 1] > ci.proj[j][i]) { err << "sorted array broken"; return err.str(); }
  }
  for (int64_t i = 0; i < n; ++i)
    if (seen[i] != 1) { err << "token " << i << " in " << seen[i] << " leaves"; return err.str(); }
  for (size_t p = 0; p < leaves_.size(); ++p)
    if (owned[p] + is_free[p] != 1) { err << "page " << p << " neither used nor free"; return err.str(); }
  for (size_t l = 0; l < levels_.size(); ++l)
    for (int32_t v : levels_[l]) {
      const Node& nd = nodes_[v];
      if (nd.level != static_cast<int32_t>(l)) { err << "level mismatch"; return err.str(); }
      const int pl = nd.parent < 0 ? static_cast<int>(levels_.size()) : nodes_[nd.parent].level;
      if (pl != static_cast<int>(l) + 1) { err << "token " << v << " parent on level " << pl; return err.str(); }
    }
  return "";
}

}  // namespace dci
