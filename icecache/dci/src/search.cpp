// Searching: distances in the transformed space, Prioritized DCI over one parent's children, the cumulative
// multi-level page query (docs/dci.md: MIPS transform, children search, page query) and the parent search used by
// construction and insertion (bulk build, insertion).
#include <algorithm>
#include <atomic>
#include <cfloat>
#include <cmath>
#include <stdexcept>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "dci.hpp"

namespace dci {

SearchCounters& search_counters() {
  thread_local SearchCounters counters;
  return counters;
}

namespace {
std::atomic<int> tuned_prefetch_rows{ScanTuning{}.prefetch_rows}, tuned_chunk_rows{ScanTuning{}.chunk_rows},
    tuned_prefetch_level{ScanTuning{}.prefetch_level};

// The largest of x[0, n), and whether any of them is NaN (then the largest means nothing).
float max_of(const float* x, int n, bool& nan) {
  float top = -INFINITY;
  int i = 0;
  nan = false;
#if defined(__SSE2__)
  __m128 top4 = _mm_set1_ps(-INFINITY), bad = _mm_setzero_ps();
  for (; i + 4 <= n; i += 4) {
    const __m128 v = _mm_loadu_ps(x + i);
    bad = _mm_or_ps(bad, _mm_cmpunord_ps(v, v));
    top4 = _mm_max_ps(top4, v);
  }
  top4 = _mm_max_ps(top4, _mm_shuffle_ps(top4, top4, _MM_SHUFFLE(1, 0, 3, 2)));
  top4 = _mm_max_ps(top4, _mm_shuffle_ps(top4, top4, _MM_SHUFFLE(2, 3, 0, 1)));
  top = _mm_cvtss_f32(top4);
  nan = _mm_movemask_ps(bad) != 0;
#endif
  for (; i < n; ++i) {
    nan |= x[i] != x[i];
    top = x[i] > top ? x[i] : top;
  }
  return top;
}
}  // namespace

ScanTuning scan_tuning() {
  return ScanTuning{tuned_prefetch_rows.load(std::memory_order_relaxed),
                    tuned_chunk_rows.load(std::memory_order_relaxed),
                    tuned_prefetch_level.load(std::memory_order_relaxed)};
}

void set_scan_tuning(const ScanTuning& tuning) {
  if (tuning.prefetch_rows < 0 || tuning.chunk_rows < 0)
    throw std::invalid_argument("prefetch_rows and chunk_rows must be >= 0");
  if (tuning.prefetch_level != 1 && tuning.prefetch_level != 2)
    throw std::invalid_argument("prefetch_level must be 1 (L1) or 2 (L2)");
  tuned_prefetch_rows.store(tuning.prefetch_rows, std::memory_order_relaxed);
  tuned_chunk_rows.store(tuning.chunk_rows, std::memory_order_relaxed);
  tuned_prefetch_level.store(tuning.prefetch_level, std::memory_order_relaxed);
}

// transform_compute_dist: M - a.b - sqrt((M - |a|^2)(M - |b|^2)) = |a' - b'|^2 / 2; squared Euclidean otherwise.
float Instance::key_dist(const float* a, float a_sq, const float* b, float b_sq) const {
  return key_dist_from_dot(dot(a, b, cfg_->dim), a_sq, b_sq);
}

void Instance::key_dists_from_dots(const float* dots, const double* b_sq, int64_t m, double a_sq, float* out) const {
  if (cfg_->transform) {
    key_dists_transform(dots, b_sq, m, M_, std::max(0.0, M_ - a_sq), out);
  } else {
    for (int64_t i = 0; i < m; ++i) out[i] = key_dist_from_dot(dots[i], a_sq, b_sq[i]);
  }
}

// Distances of rows `ids` to the probe: -q.k for a query in transform mode (transform_compute_dist_query),
// |q - k|^2 for a query without it, the key-key distance for a key.
void Instance::score(const Probe& p, const int32_t* ids, int m, float* out) const {
  dot_keys(p.vec, ids, m, out, &p.bf16);
  for (int r = 0; r < m; ++r) {
    const double ab = out[r];
    const double b_sq = sq_norm_[ids[r]];
    out[r] = p.is_query ? query_distance(p, ids[r], ab) : key_dist_from_dot(ab, p.sq_norm, b_sq);
  }
}

// dci_query_single_point_single_level: Prioritized DCI over the children of one parent. Each round pops a batch of
// up to 128 projections nearest to the query's from the highest-priority simple index of every composite index; a
// point popped by all simple indices of a composite index becomes a candidate and gets its exact distance. Stops once
// there are k candidates and either the visit or the retrieve budget is spent. Returns candidates sorted by
// distance: the best k, extended until they cover `coverage` finest-level pages (unsorted when !ordered).
void Instance::search_children(const ChildIndex& ci, const float* qproj, const Probe& p, int k, int coverage,
                               const SearchConfig& sc, Scratch& s, std::vector<Candidate>& out,
                               bool all_scored, bool ordered) const {
  out.clear();
  const int n = ci.size();
  if (n == 0 || k <= 0) return;
  search_counters().lists += 1;
  auto& cands = s.cands;
  cands.clear();
  // Brute force over all children when the budgets take them all anyway: with k >= n, or with both proportions at
  // 1 (the build's settings), the prioritized rounds below stop only once every child is a candidate, and the best
  // of a set do not depend on the order it was scored in.
  if (k >= n || (sc.prop_to_visit >= 1.0 && sc.prop_to_retrieve >= 1.0)) {
    if (s.dots.size() < static_cast<size_t>(n)) s.dots.resize(n);  // grown once, never shrunk: no refill per call
    score(p, ci.ids[0].data(), n, s.dots.data());
    cands.resize(n);
    for (int i = 0; i < n; ++i) cands[i] = {s.dots[i], ci.ids[0][i]};
  } else {
    const int nc = cfg_->num_comp, m = cfg_->num_simp, L = nc * m;
    const int64_t to_visit = static_cast<int64_t>(std::ceil(sc.prop_to_visit * n * m));
    const int64_t to_retrieve = static_cast<int64_t>(std::ceil(sc.prop_to_retrieve * n));
    int lo[64], hi[64];
    double prio[64];
    bool done[64];
    for (int j = 0; j < L; ++j) {
      const auto& arr = ci.proj[j];
      hi[j] = static_cast<int>(std::lower_bound(arr.begin(), arr.end(), qproj[j]) - arr.begin());
      lo[j] = hi[j] - 1;
      prio[j] = 0.0;
      done[j] = false;
    }
    // the processed mask is needed whenever a point can be popped twice: by several simple indices of one
    // composite index, or by several composite indices (each would otherwise make it a candidate again)
    const bool counting = m > 1 || nc > 1;
    if (counting) {
      const size_t need = static_cast<size_t>(nodes_.size());
      if (s.processed.size() < need) s.processed.assign(need, 0);
      if (s.counter.size() < need * nc) s.counter.assign(need * nc, 0);
    }
    s.touched.clear();
    int64_t visited = 0;
    for (;;) {
      bool progressed = false;
      s.pending.clear();
      for (int c = 0; c < nc; ++c) {
        int best = -1;
        for (int j = c * m; j < (c + 1) * m; ++j)
          if (!done[j] && (best < 0 || prio[j] < prio[best])) best = j;
        if (best < 0) continue;
        progressed = true;
        const auto& arr = ci.proj[best];
        const auto& ids = ci.ids[best];
        const float qp = qproj[best];
        double last = prio[best];
        for (int b = 0; b < kBatch && (lo[best] >= 0 || hi[best] < n); ++b) {
          int idx;
          if (lo[best] < 0) idx = hi[best]++;
          else if (hi[best] >= n) idx = lo[best]--;
          else if (std::fabs(arr[hi[best]] - qp) <= std::fabs(qp - arr[lo[best]])) idx = hi[best]++;
          else idx = lo[best]--;
          last = std::fabs(static_cast<double>(arr[idx]) - qp);
          ++visited;
          const int32_t id = ids[idx];
          if (!counting) {
            s.pending.push_back(id);
          } else {
            uint8_t& cnt = s.counter[static_cast<size_t>(c) * nodes_.size() + id];
            if (cnt == 0 && !s.processed[id]) s.touched.push_back(id);
            if (++cnt == m && !s.processed[id]) {
              s.processed[id] = 1;
              s.pending.push_back(id);
            }
          }
        }
        prio[best] = last;
        if (lo[best] < 0 && hi[best] >= n) done[best] = true;
      }
      if (!s.pending.empty()) {
        const int np = static_cast<int>(s.pending.size());
        if (s.dots.size() < static_cast<size_t>(np)) s.dots.resize(np);
        score(p, s.pending.data(), np, s.dots.data());
        const size_t had = cands.size();
        cands.resize(had + np);
        for (int i = 0; i < np; ++i) cands[had + i] = {s.dots[i], s.pending[i]};
      }
      if (!progressed) break;
      const int64_t got = static_cast<int64_t>(cands.size());
      if (got >= k && (visited >= to_visit || got >= to_retrieve)) break;
    }
    if (counting) {
      for (int32_t id : s.touched) {
        s.processed[id] = 0;
        for (int c = 0; c < nc; ++c) s.counter[static_cast<size_t>(c) * nodes_.size() + id] = 0;
      }
    }
  }
  if (all_scored) {
    out.assign(cands.begin(), cands.end());
    return;
  }
  // only the best k need ordering; the rest is sorted only when coverage asks for more
  int keep = std::min<int>(k, static_cast<int>(cands.size()));
  if (keep == 1 && coverage <= 0) {
    // the nearest alone (a parent search's last level, once per expanded parent): one pass, the same candidate
    // nth_element would put first (the order is total: ids are distinct)
    std::iter_swap(cands.begin(), std::min_element(cands.begin(), cands.end()));
  } else if (keep < static_cast<int>(cands.size())) {
    std::nth_element(cands.begin(), cands.begin() + keep, cands.end());
    if (ordered || coverage > 0) std::sort(cands.begin(), cands.begin() + keep);
  } else if (ordered || coverage > 0) {
    std::sort(cands.begin(), cands.end());
  }
  if (coverage > 0) {
    int64_t cov = 0;
    for (int i = 0; i < keep; ++i) cov += cover(cands[i].id);
    if (cov < coverage && keep < static_cast<int>(cands.size())) {
      std::sort(cands.begin() + keep, cands.end());
      while (cov < coverage && keep < static_cast<int>(cands.size())) cov += cover(cands[keep++].id);
    }
  }
  out.assign(cands.begin(), cands.begin() + keep);
}

// How many projections the children search pops with one simple index (L = 1): whole batches of 128 until there
// are at least k candidates and the visit or the retrieve budget is met, or the children run out. This is the
// stopping rule of search_children with got = visited.
static int popped_with_one_index(int n, int k, const SearchConfig& sc) {
  if (k >= n) return n;
  const int64_t to_visit = static_cast<int64_t>(std::ceil(sc.prop_to_visit * n * 1));
  const int64_t to_retrieve = static_cast<int64_t>(std::ceil(sc.prop_to_retrieve * n));
  const int64_t need = std::max<int64_t>(k, std::min(to_visit, to_retrieve));
  const int64_t rounds = (need + kBatch - 1) / kBatch;
  return static_cast<int>(std::min<int64_t>(n, rounds * kBatch));
}

// The c projections that the expanding left/right merge of search_children pops first from the sorted arr[0, n):
// from the insertion point of qp outwards, the right one first on equal distances. They are the run [s, s + c) for
// the least s at which the right end does not pop before the left one, |arr[s + c] - qp| > |qp - arr[s]|: the left
// distances fall and the right ones rise as s grows, so a binary search finds s, where the merge takes c steps
// (hundreds for a parent of a long prompt, once per parent and head). The comparisons are the merge's own, in
// float, so the run is the merge's to the bit.
std::pair<int, int> nearest_run(const float* arr, int n, float qp, int c) {
  if (c >= n) return {0, n};
  const int at = static_cast<int>(std::lower_bound(arr, arr + n, qp) - arr);  // arr[at - 1] < qp <= arr[at]
  int lo = std::max(0, at - c), hi = std::min(at, n - c);  // s's range: the run holds every point between
  while (lo < hi) {
    const int s = lo + (hi - lo) / 2;  // s < at <= s + c < n: arr[s] is left of qp, arr[s + c] right of it
    if (std::fabs(arr[s + c] - qp) <= std::fabs(qp - arr[s])) lo = s + 1;
    else hi = s;
  }
  return {lo, lo + c};
}

std::pair<int, int> Instance::last_level_run(const ChildIndex& ci, float qp, int k, const SearchConfig& sc) const {
  const int n = ci.size();
  return nearest_run(ci.proj[0].data(), n, qp, popped_with_one_index(n, k, sc));
}

void Instance::scan_last_level(const ChildIndex& ci, float qp, const Probe& p, int k, const SearchConfig& sc,
                               Scratch& s) const {
  if (ci.size() == 0 || k <= 0) return;
  const std::pair<int, int> run = last_level_run(ci, qp, k, sc);
  const int32_t first = run.first, last = run.second;
  TopK* best_tokens = &s.best_tokens;
  TopK* best_pages = &s.best_pages;
  scan_runs(static_cast<int32_t>(&ci - kids_.data()), 1, &p, &first, &last, &best_tokens, &best_pages);
}

void Instance::scan_runs(int32_t kid_slot, int nh, const Probe* probes, const int32_t* first, const int32_t* last,
                         TopK* const* best_tokens, TopK* const* best_pages, SharedBars* const* bars,
                         LeafStart start) const {
  if (cfg_->first_pass != FirstPass::kNone) {
    scan_runs_bounded(kid_slot, nh, probes, first, last, best_tokens, best_pages, bars, start);
    return;
  }
  const ChildIndex& ci = kids_[kid_slot];
  search_counters().lists += 1;
  int lo = first[0], hi = last[0];
  for (int j = 1; j < nh; ++j) {
    lo = std::min(lo, first[j]);
    hi = std::max(hi, last[j]);
  }
  const float* qs[kMaxGroupHeads];
  Bf16Split splits[kMaxGroupHeads];
  for (int j = 0; j < nh; ++j) {
    qs[j] = probes[j].vec;
    splits[j] = probes[j].bf16;
  }
  float dots[kMaxGroupHeads * kPageSlots];
  const ScanTuning tuning = scan_tuning();
  if (tuning.prefetch_rows > 0) {
    scan_rows_ahead(ci, nh, probes, qs, splits, first, last, lo, hi, tuning, best_tokens, best_pages, start);
    return;
  }
  int pos = start.pos;
  const size_t nleaves = ci.leaves.size();
  for (size_t li = start.leaf; li < nleaves; ++li) {
    if (pos >= hi) break;
    const int32_t page = ci.leaves[li];
    const Leaf& lf = leaves_[page];
    if (li + 1 < nleaves && pos + lf.count < hi) prefetch_rows(leaves_[ci.leaves[li + 1]]);
    const int s0 = std::max(lo - pos, 0), s1 = std::min(hi - pos, static_cast<int>(lf.count));
    const int base = pos;
    pos += lf.count;
    if (s0 >= s1) continue;
    dot_keys_multi(qs, nh, lf.item + s0, s1 - s0, dots, kPageSlots, splits);
    feed_page(lf, base, s0, s1, nh, probes, first, last, dots, best_tokens, best_pages);
  }
}

void Instance::feed_page(const Leaf& lf, int base, int s0, int s1, int nh, const Probe* probes, const int32_t* first,
                         const int32_t* last, const float* dots, TopK* const* best_tokens,
                         TopK* const* best_pages) const {
    const bool mips = cfg_->transform;  // the distance is -dot, exactly: query_distance
    for (int j = 0; j < nh; ++j) {
      // head j's own rows of this page, as scan_last_level would take them
      const int t0 = std::max(first[j] - base, s0), t1 = std::min(last[j] - base, s1);
      if (t0 >= t1) continue;
      const float* dj = dots + j * kPageSlots - s0;
      TopK& bt = *best_tokens[j];
      // Most pages hold nothing that either accumulator keeps: a page whose best distance (-dot) is strictly worse
      // than both bars feeds nothing, and one pass over its dots says so (a NaN takes the long way). The bar of an
      // accumulator that is not full yet is +inf, so then there is nothing to test.
      const float bar = std::max(bt.bar(), best_pages[j]->bar());
      if (mips && bar < INFINITY) {
        bool nan;
        const float top = max_of(dj + t0, t1 - t0, nan);
        if (!nan && -top > bar) continue;
      }
      Candidate best{INFINITY, -1};
      for (int t = t0; t < t1; ++t) {
        const int32_t id = lf.item[t];
        const Candidate cand{query_distance(probes[j], id, dj[t]), id};
        bt.push(cand);
        if (best.id < 0 || cand < best) best = cand;
      }
      best_pages[j]->push(best);
    }
}

namespace {
// The storage rows of one scan's run, and its pages' spans over them.
struct AheadSpan {
  int32_t page, base, s0, s1, k0;  // slots [s0, s1) of `page`, at position base + slot; rows[k0 + slot - s0]
};
struct AheadScanBuffers {
  std::vector<int32_t> rows;
  std::vector<AheadSpan> spans;
};
thread_local AheadScanBuffers ahead_scan_buffers;
}  // namespace

// scan_runs with the storage rows of the whole run listed first, so that while the rows of one page are scored the
// kernel requests those `ahead` rows further on (one row's lines per row scored): the loads of the next pages run
// under the arithmetic of this one, whichever pages they are, and no burst of requests stalls the scan. The scores
// and the points fed are scan_runs' own (the same kernel, the same rows, in the same order).
void Instance::scan_rows_ahead(const ChildIndex& ci, int nh, const Probe* probes, const float* const* qs,
                               const Bf16Split* splits, const int32_t* first, const int32_t* last, int lo, int hi,
                               const ScanTuning& tuning, TopK* const* best_tokens, TopK* const* best_pages,
                               LeafStart start) const {
  AheadScanBuffers& buf = ahead_scan_buffers;
  buf.rows.clear();
  buf.spans.clear();
  int pos = start.pos;
  for (size_t li = start.leaf; li < ci.leaves.size(); ++li) {
    const int32_t page = ci.leaves[li];
    if (pos >= hi) break;
    const Leaf& lf = leaves_[page];
    const int s0 = std::max(lo - pos, 0), s1 = std::min(hi - pos, static_cast<int>(lf.count));
    const int base = pos;
    pos += lf.count;
    if (s0 >= s1) continue;
    buf.spans.push_back({page, base, s0, s1, static_cast<int32_t>(buf.rows.size())});
    const int32_t* page_rows = &page_rows_[static_cast<int64_t>(page) * kPageSlots];
    buf.rows.insert(buf.rows.end(), page_rows + s0, page_rows + s1);
  }
  const int total = static_cast<int>(buf.rows.size());
  const int dim = cfg_->dim;
  const bool float_rows = !keys_.empty();
  SearchCounters& counted = search_counters();
  counted.rows += total;
  counted.bytes += static_cast<int64_t>(total) * dim * (float_rows ? 4 : 2);
  counted.scores += static_cast<int64_t>(total) * nh;
  const int32_t* rows = buf.rows.data();
  float dots[kMaxGroupHeads * kPageSlots];
  for (const AheadSpan& sp : buf.spans) {
    const Leaf& lf = leaves_[sp.page];
    const int m = sp.s1 - sp.s0;
    const int ahead = tuning.prefetch_rows;
    const RowsAhead next{rows + sp.k0 + ahead, std::max(0, std::min(m, total - (sp.k0 + ahead))),
                         tuning.prefetch_level == 2};
    if (float_rows) dot_rows_multi_ids(qs, nh, keys_.data(), rows + sp.k0, m, dim, dots, kPageSlots, next);
    else dot_rows_multi_ids_bf16(qs, nh, keys_bf16_.data(), rows + sp.k0, m, dim, dots, kPageSlots, next, splits);
    feed_page(lf, sp.base, sp.s0, sp.s1, nh, probes, first, last, dots, best_tokens, best_pages);
  }
}

void Instance::group_items(int32_t inst, const GroupJob* jobs, int32_t n_jobs, int chunk_rows,
                           std::vector<GroupItem>& out) const {
  const int max_rows = chunk_rows > 0 ? std::max(chunk_rows, kPageSlots) : 0;
  int32_t b = 0;
  while (b < n_jobs) {
    int32_t e = b + 1;
    int lo = jobs[b].first, hi = jobs[b].last;
    while (e < n_jobs && jobs[e].kid_slot == jobs[b].kid_slot && e - b < kMaxGroupHeads) {
      lo = std::min(lo, jobs[e].first);
      hi = std::max(hi, jobs[e].last);
      ++e;
    }
    const int64_t heads = e - b + 1;
    if (max_rows == 0 || hi - lo <= max_rows) {
      out.push_back({inst, b, e, lo, hi, static_cast<int64_t>(hi - lo) * heads});
    } else {
      // cut at the leaf boundaries of [lo, hi): an item ends before the leaf that would take it past max_rows. Each
      // item keeps its first leaf (the one holding its first position), where its scan begins.
      int pos = 0, cut = lo;
      LeafStart first{-1, 0};
      const std::vector<int32_t>& leaves = kids_[jobs[b].kid_slot].leaves;
      for (int32_t li = 0; li < static_cast<int32_t>(leaves.size()); ++li) {
        if (pos >= hi) break;
        const int count = leaves_[leaves[li]].count;
        if (first.leaf < 0 && pos + count > cut) first = {li, pos};
        const int end = std::min(pos + count, hi);
        if (end > cut && end - cut > max_rows && pos > cut) {
          out.push_back({inst, b, e, cut, pos, static_cast<int64_t>(pos - cut) * heads, first});
          cut = pos;
          first = {li, pos};
        }
        pos += count;
      }
      out.push_back({inst, b, e, cut, hi, static_cast<int64_t>(hi - cut) * heads,
                     first.leaf < 0 ? LeafStart{} : first});
    }
    b = e;
  }
}

namespace {

// The k smallest values of a stream; kth() is the k-th smallest, +inf until k values came.
struct KSmallest {
  std::vector<float> v;
  int k = 0, worst = -1;
  void reset(int kk) {
    v.clear();
    k = kk;
    worst = -1;
  }
  void push(float x) {
    if (k <= 0) return;
    if (static_cast<int>(v.size()) < k) {
      v.push_back(x);
      if (static_cast<int>(v.size()) < k) return;
    } else if (x < v[worst]) {
      v[worst] = x;
    } else {
      return;
    }
    worst = static_cast<int>(std::max_element(v.begin(), v.end()) - v.begin());
  }
  float kth() const { return k > 0 && static_cast<int>(v.size()) == k ? v[worst] : INFINITY; }
};

// Rows [s0, s1) of `page`; its slot t sits at position base + t of the parent's sorted children.
struct BoundedSpan {
  int32_t page, base, s0, s1;
};

struct BoundedScanBuffers {
  std::vector<BoundedSpan> spans;
  std::vector<float> lower;             // [nh][hi - lo]: approximate dots, then each row's lower distance bound
  std::vector<float> page_lb, page_ub;  // [nh][spans]: bounds of the distance of each page's best row
  KSmallest page_bars;
  std::vector<std::pair<int, int>> picked;  // (span, slot) of the rows to re-score
};

thread_local BoundedScanBuffers bounded_scan_buffers;

}  // namespace

// Approximate first pass, exact second pass. For head j and a row with approximate copy h (half, or 8-bit codes
// and a scale), the float32 dot q.k lies within a +- e of the first pass's dot a, e = |q| slack (page_slack_), so
// the row's distance lies in [lb, ub].
//   1. a for the union of the heads' runs, each approximate row read once for all heads;
//   2. per head, the bounds of every row and of every page (the min over its rows), and the K-th smallest page
//      upper bound: K pages, hence K rows, are at least that close;
//   3. per head, exact scores (from the stored key rows, with the exact path's kernel) of
//      * every row whose lb does not exceed the token bar: the smallest of that bound, the head's token
//        accumulator's K-th distance and the shared bar (it might enter the K best tokens), and
//      * for a page whose lb does not exceed the page bar (likewise), every row whose lb is within the page's ub:
//        one of them is its best, which is fed as the page's best.
//      The rows are picked first and their float rows prefetched (they lie anywhere in memory), then scored.
// Every token and page of the exact top K is therefore fed with its exact distance, and what is fed besides is exact
// and loses to it: the query's result is bit for bit the float32 path's.
void Instance::scan_runs_bounded(int32_t kid_slot, int nh, const Probe* probes, const int32_t* first,
                                 const int32_t* last, TopK* const* best_tokens, TopK* const* best_pages,
                                 SharedBars* const* bars, LeafStart start) const {
  const ChildIndex& ci = kids_[kid_slot];
  int lo = first[0], hi = last[0];
  for (int j = 1; j < nh; ++j) {
    lo = std::min(lo, first[j]);
    hi = std::max(hi, last[j]);
  }
  if (lo >= hi) return;
  const int dim = cfg_->dim;
  const int width = hi - lo;
  const bool int8 = cfg_->first_pass == FirstPass::kInt8;
  const int value_bytes = int8 ? 1 : 2;
  search_counters().lists += 1;
  search_counters().rows += width;  // the approximate rows (re-scored rows count again, as dot_keys_multi reads them)
  search_counters().bytes += static_cast<int64_t>(width) * dim * value_bytes;
  BoundedScanBuffers& buf = bounded_scan_buffers;
  const float* qs[kMaxGroupHeads];
  for (int j = 0; j < nh; ++j) qs[j] = probes[j].vec;
  if (buf.lower.size() < static_cast<size_t>(nh) * width) buf.lower.resize(static_cast<size_t>(nh) * width);
  float* lower = buf.lower.data();

  // 1. approximate dots
  auto& spans = buf.spans;
  spans.clear();
  int pos = start.pos;
  const size_t nleaves = ci.leaves.size();
  for (size_t li = start.leaf; li < nleaves; ++li) {
    if (pos >= hi) break;
    const int32_t page = ci.leaves[li];
    const Leaf& lf = leaves_[page];
    if (li + 2 < nleaves) __builtin_prefetch(&leaves_[ci.leaves[li + 2]].count);
    // The next page's copies, only if the scan will score some of its rows: the pages before the run are walked
    // for their counts alone, and prefetching their rows cost more than prefetching none.
    const int32_t next = li + 1 < nleaves ? ci.leaves[li + 1] : -1;
    if (next >= 0 && pos + lf.count < hi && pos + lf.count + leaves_[next].count > lo) {
      const int64_t row0 = static_cast<int64_t>(next) * kPageSlots;
      const char* rows = int8 ? reinterpret_cast<const char*>(&page_int8_[row0 * dim])
                              : reinterpret_cast<const char*>(&page_half_[row0 * dim]);
      const int bytes = leaves_[next].count * dim * value_bytes;
      for (int off = 0; off < bytes; off += 64) __builtin_prefetch(rows + off);
      __builtin_prefetch(&page_slack_[row0]);
      if (int8) __builtin_prefetch(&page_scale_[row0]);
    }
    const int s0 = std::max(lo - pos, 0), s1 = std::min(hi - pos, static_cast<int>(lf.count));
    const int base = pos;
    pos += lf.count;
    if (s0 >= s1) continue;
    const int64_t row0 = static_cast<int64_t>(page) * kPageSlots + s0;
    if (int8)
      dot_rows_multi_int8(qs, nh, &page_int8_[row0 * dim], &page_scale_[row0], s1 - s0, dim, lower + (base + s0 - lo),
                          width);
    else
      dot_rows_multi_half(qs, nh, &page_half_[row0 * dim], s1 - s0, dim, lower + (base + s0 - lo), width);
    spans.push_back({page, base, s0, s1});
  }
  const int ns = static_cast<int>(spans.size());
  if (buf.page_lb.size() < static_cast<size_t>(nh) * ns) {
    buf.page_lb.resize(static_cast<size_t>(nh) * ns);
    buf.page_ub.resize(static_cast<size_t>(nh) * ns);
  }

  for (int j = 0; j < nh; ++j) {
    TopK& bt = *best_tokens[j];
    TopK& bp = *best_pages[j];
    SharedBars* shared = bars ? bars[j] : nullptr;
    float* lj = lower + static_cast<int64_t>(j) * width - lo;  // lj[position]
    float* plb = buf.page_lb.data() + static_cast<int64_t>(j) * ns;
    float* pub = buf.page_ub.data() + static_cast<int64_t>(j) * ns;
    // |q|, rounded up: its float square carries a relative error of about dim 2^-24. The float roundings of e and of
    // a +- e below are far inside the second term of the slack, which is twice what the two dot products need.
    const float qn = std::nextafter(static_cast<float>(std::sqrt(static_cast<double>(probes[j].sq_norm)) *
                                                       (1.0 + 0x1p-12)), INFINITY);
    const double q_sq = probes[j].sq_norm;

    // 2. bounds
    KSmallest& page_ubs = buf.page_bars;
    page_ubs.reset(bp.cap);
    for (int si = 0; si < ns; ++si) {
      const BoundedSpan& sp = spans[si];
      const int t0 = std::max(first[j] - sp.base, sp.s0), t1 = std::min(last[j] - sp.base, sp.s1);
      float page_lb = INFINITY, page_ub = INFINITY;
      float* row = lj + sp.base;  // row[t]: slot t's approximate dot, then its lower bound
      const float* slack = &page_slack_[static_cast<int64_t>(sp.page) * kPageSlots];
      for (int t = t0; t < t1; ++t) {
        float e = qn * slack[t];
        if (!(e <= FLT_MAX)) e = INFINITY;  // a row beyond the copy's range (or 0 * inf): unbounded
        float lb, ub;
        if (cfg_->transform) {
          lb = -(row[t] + e);
          ub = -(row[t] - e);
        } else {
          const double base = q_sq + static_cast<double>(sq_norm_[leaves_[sp.page].item[t]]);
          lb = static_cast<float>(base - 2.0 * (static_cast<double>(row[t]) + e));
          ub = static_cast<float>(base - 2.0 * (static_cast<double>(row[t]) - e));
        }
        row[t] = lb;
        page_lb = std::min(page_lb, lb);
        page_ub = std::min(page_ub, ub);
      }
      if (t0 < t1) page_ubs.push(page_ub);
      plb[si] = page_lb;
      pub[si] = page_ub;
    }
    const float item_page_bar = page_ubs.kth();
    const float item_token_bar = bt.cap <= bp.cap ? item_page_bar : INFINITY;
    auto token_bar = [&] {
      const float b = std::min(item_token_bar, bt.bar());
      return shared ? std::min(b, shared->tokens.load(std::memory_order_relaxed)) : b;
    };
    auto page_bar = [&] {
      const float b = std::min(item_page_bar, bp.bar());
      return shared ? std::min(b, shared->pages.load(std::memory_order_relaxed)) : b;
    };

    // 3a. the rows to re-score, by the bars as they stand (they only fall); prefetch their float rows
    auto& picked = buf.picked;
    picked.clear();
    {
      const float tb = token_bar(), pb = page_bar();
      for (int si = 0; si < ns; ++si) {
        const BoundedSpan& sp = spans[si];
        const int t0 = std::max(first[j] - sp.base, sp.s0), t1 = std::min(last[j] - sp.base, sp.s1);
        if (t0 >= t1) continue;
        const bool page_in = !(plb[si] > pb);
        if (!page_in && plb[si] > tb) continue;
        const float row_bar = page_in ? std::max(tb, pub[si]) : tb;
        const float* row_lb = lj + sp.base;
        for (int t = t0; t < t1; ++t) {
          if (row_lb[t] > row_bar) continue;
          picked.push_back({si, t});
          prefetch_row(leaves_[sp.page].item[t]);
        }
      }
    }
    // 3b. exact scores, fed; a page's rows are consecutive in `picked`
    const size_t np = picked.size();
    size_t i = 0;
    while (i < np) {
      const int si = picked[i].first;
      const BoundedSpan& sp = spans[si];
      const Leaf& lf = leaves_[sp.page];
      const float* row_lb = lj + sp.base;
      const bool page_in = !(plb[si] > page_bar());
      Candidate best{INFINITY, -1};
      for (; i < np && picked[i].first == si; ++i) {
        const int t = picked[i].second;
        const bool for_page = page_in && !(row_lb[t] > pub[si]);
        if (!for_page && row_lb[t] > token_bar()) continue;
        float dot_f;
        dot_keys_multi(&qs[j], 1, &lf.item[t], 1, &dot_f, 1, &probes[j].bf16);
        const int32_t id = lf.item[t];
        const Candidate cand{query_distance(probes[j], id, dot_f), id};
        bt.push(cand);
        if (best.id < 0 || cand < best) best = cand;
      }
      if (page_in && best.id >= 0) bp.push(best);
    }
    if (shared) {
      SharedBars::lower(shared->tokens, bt.bar());
      SharedBars::lower(shared->pages, bp.bar());
    }
  }
}

// A fed point whose page may also receive other fed points: its page's best is settled at the end of the query.
void Instance::feed(const Candidate& c, Scratch& s) const {
  s.best_tokens.push(c);
  const int32_t pg = nodes_[c.id].page;
  Candidate& b = s.page_best[pg];
  if (b.id < 0) s.pages_hit.push_back(pg);
  if (b.id < 0 || c < b) b = c;
}

// dci_query_single_point, cumulative mode. Every point the descent retains, and every child scored at the last
// level, is fed to the two accumulators: the K best tokens, and the K pages with the best best-token distance
// (the first K distinct pages of the fed points in distance order).
//
// The last level feeds every scored child, not only the best K per expanded parent (docs/dci.md, deviations).
// The token list is the same either way: a token in the overall best K is among the best K of its parent. The
// page list is not: a parent's best K children can sit on fewer pages than it owns, so a page whose best token
// ranks below K among its parent's children was lost even when the budgets covered everything. Feeding every
// scored child gives the page list as if each parent had been extended until its candidates cover K distinct
// pages, and a query with fov >= n and prop_to_retrieve = 1 returns every page.
void Instance::query(const float* q, int K, const SearchConfig& sc, Scratch& s, int32_t* pages, int32_t* tokens,
                     float* page_scores, float* token_scores) const {
  descend(q, K, sc, s, nullptr);
  emit(s.best_tokens, s.best_pages, K, pages, tokens, page_scores, token_scores);
}

void Instance::descend(const float* q, int K, const SearchConfig& sc, Scratch& s,
                       std::vector<LastLevelRun>* runs, const Bf16Split* split) const {
  s.best_tokens.reset(sc.token_k(K));
  s.best_pages.reset(std::max(K, 0));
  if (levels_.empty() || K <= 0) return;
  const int dim = cfg_->dim, L = cfg_->num_dirs(), stride = cfg_->dir_stride();
  const float q_sq = dot(q, q, dim);
  // query_transform: (u.q) / |q| in transform mode, plain u.q without it
  const float qnorm = cfg_->transform && q_sq > 0 ? std::sqrt(q_sq) : 1.0f;
  float qproj[64];
  for (int j = 0; j < L; ++j) qproj[j] = dot(dirs_ + static_cast<int64_t>(j) * stride, q, dim) / qnorm;
  const Probe probe{q, q_sq, true, split ? *split : split_query(q, s.query_split)};

  std::vector<Candidate>& cur = s.level_out;
  std::vector<Candidate>& next = s.next;
  std::vector<Candidate>& part = s.part;
  if (s.page_best.size() < leaves_.size()) s.page_best.resize(leaves_.size(), Candidate{INFINITY, -1});
  if (s.page_seen.size() < leaves_.size()) s.page_seen.resize(leaves_.size(), 0);
  s.pages_hit.clear();
  // the last level: every scored child of `ci` is fed
  auto expand_last = [&](const ChildIndex& ci, int k) {
    if (L == 1 && runs) {
      if (ci.size() == 0 || k <= 0) return;
      const auto [first, last] = last_level_run(ci, qproj[0], k, sc);
      runs->push_back({static_cast<int32_t>(&ci - kids_.data()), first, last});
    } else if (L == 1) {
      scan_last_level(ci, qproj[0], probe, k, sc, s);
    } else {
      search_children(ci, qproj, probe, k, 0, sc, s, part, true);
      for (const Candidate& c : part) feed(c, s);
    }
  };
  const int top = num_levels() - 1;
  const int fov = std::max(1, sc.field_of_view);
  if (top == 0) {
    // the root's children are the finest level: it is the last level
    expand_last(kids_[kRootSlot], std::max(fov, K));
  } else {
    search_children(kids_[kRootSlot], qproj, probe, fov, K, sc, s, cur);
    for (int level = top; level >= 1; --level) {
      for (const Candidate& c : cur) feed(c, s);
      if (level == 1) {
        for (const Candidate& c : cur)
          if (nodes_[c.id].kid_slot >= 0) expand_last(kids_[nodes_[c.id].kid_slot], K);
        break;
      }
      next.clear();
      for (const Candidate& c : cur) {
        const int32_t slot = nodes_[c.id].kid_slot;
        if (slot < 0) continue;
        // a parent with at most fov children gives all of them, which need no order of their own: `next` is
        // ordered below
        const ChildIndex& ci = kids_[slot];
        search_children(ci, qproj, probe, fov, K, sc, s, part, /*all_scored=*/ci.size() <= fov);
        next.insert(next.end(), part.begin(), part.end());
      }
      // Only the first max(fov, needed) of `next` are kept, in order: the best fov are ordered first, and the rest
      // only if covering K pages needs more (ids are unique, so the order is total and the prefix the sort's).
      const int n_next = static_cast<int>(next.size());
      int ordered = std::min(fov, n_next);
      std::nth_element(next.begin(), next.begin() + ordered, next.end());
      std::sort(next.begin(), next.begin() + ordered);
      // keep enough to cover K pages: a new page counts its whole subtree, a repeated page one less
      int64_t cov = 0;
      int needed = 0;
      while (needed < n_next && cov < K) {
        if (needed == ordered) {
          std::sort(next.begin() + ordered, next.end());
          ordered = n_next;
        }
        const int32_t id = next[needed++].id;
        uint8_t& seen = s.page_seen[nodes_[id].page];
        cov += cover(id) - (seen ? 1 : 0);
        seen = 1;
      }
      for (int i = 0; i < needed; ++i) s.page_seen[nodes_[next[i].id].page] = 0;
      const int keep = std::max(std::min(fov, static_cast<int>(next.size())), needed);
      cur.assign(next.begin(), next.begin() + keep);
    }
  }
  for (int32_t pg : s.pages_hit) {
    s.best_pages.push(s.page_best[pg]);
    s.page_best[pg] = Candidate{INFINITY, -1};
  }
}

void Instance::emit(TopK& best_tokens, TopK& best_pages, int K, int32_t* pages, int32_t* tokens, float* page_scores,
                    float* token_scores) const {
  std::fill(pages, pages + K, -1);
  std::fill(tokens, tokens + K, -1);
  std::fill(page_scores, page_scores + K, NAN);
  std::fill(token_scores, token_scores + K, NAN);
  const float sign = -1.0f;  // distances are -q.k (or |q-k|^2): report the negated value as the score
  auto& bp = best_pages.items;
  std::sort(bp.begin(), bp.end());
  for (size_t i = 0; i < bp.size(); ++i) {
    pages[i] = nodes_[bp[i].id].page;
    page_scores[i] = sign * bp[i].dist;
  }
  auto& bt = best_tokens.items;
  std::sort(bt.begin(), bt.end());
  for (size_t i = 0; i < bt.size(); ++i) {
    tokens[i] = bt[i].id;
    token_scores[i] = sign * bt[i].dist;
  }
}

std::pair<int32_t, float> Instance::brute_parent(int32_t point, const std::vector<int32_t>& upper) const {
  std::vector<float> buf(cfg_->dim);
  const float* a = key_row(point, buf.data());
  const Probe probe{a, sq_norm_[point], false};
  std::vector<float> d(upper.size());
  score(probe, upper.data(), static_cast<int>(upper.size()), d.data());
  int32_t best = -1;
  float bd = INFINITY;
  for (size_t i = 0; i < upper.size(); ++i)
    if (d[i] < bd || best < 0) { bd = d[i]; best = upper[i]; }
  return {best, bd};
}

// brute_parent for points[which[i]], all i, at once: the upper level's keys are packed once, contiguous, and scanned
// for kBlock points at a time (dot_rows_multi_packed), so each row read serves several points and no row is gathered
// from the whole key array again. Every (point, row) dot product is the same sequence of operations as
// brute_parent's (dot_rows and dot_rows_multi_packed guarantee it), the distance is the same value
// (key_dists_from_dots), and ties go to the first row: the same parents and distances as brute_parent per point.
void Instance::brute_parents(const std::vector<int32_t>& points, const std::vector<int64_t>& which,
                             const std::vector<int32_t>& upper, int threads, std::vector<int32_t>& parent,
                             std::vector<float>& pdist) const {
  constexpr int kBlock = 4;
  const int dim = cfg_->dim;
  const int64_t nu = static_cast<int64_t>(upper.size()), m = static_cast<int64_t>(which.size());
  std::vector<float> packed(nu * dim);
  std::vector<double> upper_sq(nu);
  for (int64_t u = 0; u < nu; ++u) {
    const float* row = key_row(upper[u], packed.data() + u * dim);
    if (row != packed.data() + u * dim) std::copy_n(row, dim, packed.data() + u * dim);
    upper_sq[u] = sq_norm_[upper[u]];
  }
  const int64_t n_blocks = (m + kBlock - 1) / kBlock;
#pragma omp parallel num_threads(threads) if (n_blocks > 16)
  {
    std::vector<float> d(kBlock * std::max<int64_t>(nu, 1)), rows(kBlock * dim);
#pragma omp for schedule(dynamic, 8)
    for (int64_t b = 0; b < n_blocks; ++b) {
      const int64_t first = b * kBlock;
      const int nb = static_cast<int>(std::min<int64_t>(kBlock, m - first));
      const float* qs[kBlock];
      for (int j = 0; j < nb; ++j) qs[j] = key_row(points[which[first + j]], rows.data() + j * dim);
      if (nu > 0)
        dot_rows_multi_packed(qs, nb, packed.data(), static_cast<int>(nu), dim, d.data(), static_cast<int>(nu));
      for (int j = 0; j < nb; ++j) {
        float* dist = d.data() + j * nu;
        key_dists_from_dots(dist, upper_sq.data(), nu, sq_norm_[points[which[first + j]]], dist);
        int32_t best = -1;
        float bd = INFINITY;
        for (int64_t u = 0; u < nu; ++u) {
          if (dist[u] < bd || best < 0) {
            bd = dist[u];
            best = upper[u];
          }
        }
        parent[which[first + j]] = best;
        pdist[which[first + j]] = bd;
      }
    }
  }
}

// Multi-level k-NN with k = 1 from the root down to `upper_level`, with the construction settings. The probe is the
// key's own data projection (a key is searched for as a point of the transformed space). With `refresh`, a parent
// whose children are stale is corrected before it is searched (insertion only: it changes pages).
std::pair<int32_t, float> Instance::dci_parent(int32_t point, int upper_level, const SearchConfig& sc, Scratch& s,
                                               bool refresh) {
  const int L = cfg_->num_dirs();
  s.key_buf.resize(cfg_->dim);
  const float* a = key_row(point, s.key_buf.data());
  const Probe probe{a, sq_norm_[point], false};
  const float* qproj = &proj_[static_cast<int64_t>(point) * L];
  const int top = num_levels() - 1;
  const int fov = std::max(1, sc.field_of_view);
  // the Scratch's candidate lists (a build or insert never holds a descent's in them)
  std::vector<Candidate>& cur = s.level_out;
  std::vector<Candidate>& next = s.next;
  std::vector<Candidate>& part = s.part;
  if (refresh) refresh_stale(-1);
  search_children(kids_[kRootSlot], qproj, probe, top == upper_level ? 1 : fov, 0, sc, s, cur);
  for (int level = top; level > upper_level; --level) {
    next.clear();
    const bool last = level - 1 == upper_level;
    for (const Candidate& c : cur) {
      if (nodes_[c.id].kid_slot < 0) continue;
      if (refresh) refresh_stale(c.id);
      // each parent's best, in no order: the level's best are chosen from all of them below
      search_children(kids_[nodes_[c.id].kid_slot], qproj, probe, last ? 1 : fov, 0, sc, s, part, false,
                      /*ordered=*/false);
      next.insert(next.end(), part.begin(), part.end());
    }
    // the best `keep` in order: the ids are distinct (each child has one parent), so the order is total and this
    // prefix is the one a full sort gives
    const size_t keep = std::min<size_t>(next.size(), last ? 1 : fov);
    if (keep < next.size()) std::nth_element(next.begin(), next.begin() + keep, next.end());
    next.resize(keep);
    std::sort(next.begin(), next.end());
    cur.swap(next);
  }
  if (cur.empty()) return brute_parent(point, levels_[upper_level]);
  return {cur[0].id, cur[0].dist};
}

std::pair<int32_t, float> Instance::nearest_parent(int32_t point, int upper_level, const SearchConfig& sc,
                                                   int brute_threshold, Scratch& s, bool refresh) {
  if (static_cast<int64_t>(levels_[upper_level].size()) <= brute_threshold)
    return brute_parent(point, levels_[upper_level]);
  return dci_parent(point, upper_level, sc, s, refresh);
}

}  // namespace dci
