// Bulk build (docs/dci.md, bulk build): project, assign levels, then from the top level down give every point a parent on the
// level above (brute force, DCI search, or the anchor shortcut on level 0) and bulk-load each parent's pages.
#include <omp.h>

#include <algorithm>
#include <cmath>

#include "dci.hpp"

namespace dci {

void Instance::assign_parents(int level, const SearchConfig& sc, const AnchorConfig& ac, int brute_threshold,
                              int threads, bool reference, std::vector<int32_t>& parent, std::vector<float>& pdist) {
  const std::vector<int32_t>& pts = levels_[level];
  const int64_t n = static_cast<int64_t>(pts.size());
  parent.assign(n, -1);
  pdist.assign(n, 0.0f);
  auto exact = [&](const std::vector<int64_t>& which) {
    const int64_t m = static_cast<int64_t>(which.size());
    // what nearest_parent would do, for a block of points at a time (the reference asks it point by point)
    if (!reference && static_cast<int64_t>(levels_[level + 1].size()) <= brute_threshold) {
      brute_parents(pts, which, levels_[level + 1], threads, parent, pdist);
      return;
    }
#pragma omp parallel num_threads(threads) if (m > 64)
    {
      Scratch s;
#pragma omp for schedule(dynamic, 64)
      for (int64_t i = 0; i < m; ++i) {
        auto r = nearest_parent(pts[which[i]], level + 1, sc, brute_threshold, s, false);
        parent[which[i]] = r.first;
        pdist[which[i]] = r.second;
      }
    }
  };
  const bool anchored = level == 0 && ac.interval > 0 && cfg_->deterministic && n > 3000;
  if (!anchored) {
    std::vector<int64_t> all(n);
    for (int64_t i = 0; i < n; ++i) all[i] = i;
    exact(all);
    return;
  }
  // Anchors: every interval-th point in sequence order and the last point get an exact parent.
  std::vector<int64_t> anchors;
  for (int64_t i = 0; i < n; i += ac.interval) anchors.push_back(i);
  if (anchors.back() != n - 1) anchors.push_back(n - 1);
  exact(anchors);
  std::vector<float> max_child(nodes_.size(), 0.0f);
  for (int64_t a : anchors) max_child[parent[a]] = std::max(max_child[parent[a]], pdist[a]);
  // Every other point takes the closest of the distinct parents of its X nearest anchors on each side, if that is
  // within threshold x the parent's max child distance; the rest fall back to an exact search.
  std::vector<uint8_t> accepted(n, 0);
  for (int64_t a : anchors) accepted[a] = 1;
  const int X = std::max(1, ac.neighbours);
  if (reference) shortcut_points(anchors, X, ac.threshold, max_child, threads, parent, pdist, accepted);
  else shortcut_segments(anchors, X, ac.threshold, max_child, threads, parent, pdist, accepted);
  std::vector<int64_t> fallback;
  for (int64_t i = 0; i < n; ++i)
    if (!accepted[i]) fallback.push_back(i);
  exact(fallback);
}

// The reference shortcut: point by point, each candidate's distance through key_dist over the float32 copies.
void Instance::shortcut_points(const std::vector<int64_t>& anchors, int X, double threshold,
                               const std::vector<float>& max_child, int threads, std::vector<int32_t>& parent,
                               std::vector<float>& pdist, std::vector<uint8_t>& accepted) const {
  const std::vector<int32_t>& pts = levels_[0];
  const int64_t n = static_cast<int64_t>(pts.size());
  const float* keys = keys_.data();  // the reference build holds a float32 copy of every key
  const int dim = cfg_->dim;
#pragma omp parallel num_threads(threads)
  {
    std::vector<int32_t> cand;
    // Distinct parents in order of first appearance. A linear search of the list per anchor was a quarter of the
    // build; a stamp per parent (the point's index + 1, unique to this thread's iteration) gives the same list.
    std::vector<int64_t> seen_by(nodes_.size(), 0);
    auto add = [&](int32_t p, int64_t stamp) {
      if (seen_by[p] != stamp) {
        seen_by[p] = stamp;
        cand.push_back(p);
      }
    };
#pragma omp for schedule(dynamic, 256)
    for (int64_t i = 0; i < n; ++i) {
      if (accepted[i]) continue;
      const int64_t j = std::upper_bound(anchors.begin(), anchors.end(), i) - anchors.begin();
      cand.clear();
      for (int64_t a = j - 1; a >= std::max<int64_t>(0, j - X); --a) add(parent[anchors[a]], i + 1);
      for (int64_t a = j; a < std::min<int64_t>(static_cast<int64_t>(anchors.size()), j + X); ++a)
        add(parent[anchors[a]], i + 1);
      const int32_t v = pts[i];
      int32_t best = -1;
      float bd = INFINITY;
      for (int32_t c : cand) {
        const float d = key_dist(keys + static_cast<int64_t>(v) * dim, sq_norm_[v],
                                 keys + static_cast<int64_t>(c) * dim, sq_norm_[c]);
        if (best < 0 || d < bd) { bd = d; best = c; }
      }
      if (best >= 0 && bd <= threshold * max_child[best]) {
        parent[i] = best;
        pdist[i] = bd;
        accepted[i] = 1;
      }
    }
  }
}

void Instance::shortcut_segments(const std::vector<int64_t>& anchors, int X, double threshold,
                                 const std::vector<float>& max_child, int threads, std::vector<int32_t>& parent,
                                 std::vector<float>& pdist, std::vector<uint8_t>& accepted) const {
  const std::vector<int32_t>& pts = levels_[0];
  const int dim = cfg_->dim;
  const int64_t n_segments = static_cast<int64_t>(anchors.size());
#pragma omp parallel num_threads(threads) if (n_segments > 16)
  {
    std::vector<int32_t> cand;
    std::vector<int64_t> seen_by(nodes_.size(), 0);  // a stamp per parent: distinct, in order of first appearance
    std::vector<float> rows, dots;
    std::vector<const float*> qs;
#pragma omp for schedule(dynamic, 4)
    for (int64_t j = 1; j < n_segments; ++j) {
      const int64_t first = anchors[j - 1] + 1, last = anchors[j];
      if (first >= last) continue;
      // the reference's list for a point i of this segment (upper_bound(anchors, i) == j), in the same order
      cand.clear();
      auto add = [&](int64_t a) {
        if (seen_by[parent[anchors[a]]] != j) {
          seen_by[parent[anchors[a]]] = j;
          cand.push_back(parent[anchors[a]]);
        }
      };
      for (int64_t a = j - 1; a >= std::max<int64_t>(0, j - X); --a) add(a);
      for (int64_t a = j; a < std::min<int64_t>(n_segments, j + X); ++a) add(a);
      const int nq = static_cast<int>(last - first), nc = static_cast<int>(cand.size());
      rows.resize(static_cast<size_t>(nq) * dim);
      qs.resize(nq);
      for (int q = 0; q < nq; ++q) qs[q] = key_row(pts[first + q], rows.data() + static_cast<size_t>(q) * dim);
      dots.resize(static_cast<size_t>(nq) * nc);
      // point . candidate: the product key_dist takes, operand for operand (dot_keys_multi keeps dot's sequence)
      if (nc > 0) dot_keys_multi(qs.data(), nq, cand.data(), nc, dots.data(), nc);
      for (int q = 0; q < nq; ++q) {
        const int32_t v = pts[first + q];
        int32_t best = -1;
        float bd = INFINITY;
        for (int c = 0; c < nc; ++c) {
          const float d = key_dist_from_dot(dots[static_cast<size_t>(q) * nc + c], sq_norm_[v], sq_norm_[cand[c]]);
          if (best < 0 || d < bd) { bd = d; best = cand[c]; }
        }
        if (best >= 0 && bd <= threshold * max_child[best]) {
          parent[first + q] = best;
          pdist[first + q] = bd;
          accepted[first + q] = 1;
        }
      }
    }
  }
}

void Instance::build(const void* keys, int64_t n, const SearchConfig& sc, const AnchorConfig& ac,
                     int brute_threshold, int threads, bool reference) {
  reset();
  if (n <= 0) return;
  // Without a float32 copy of bf16 keys, every score widens the rows (widen_bf16_rows_): the same values, half the
  // memory written and faulted in per build.
  append_points(keys, n, reference);
  struct WidenWhileBuilding {
    bool& flag;
    explicit WidenWhileBuilding(bool& f) : flag(f) { flag = true; }
    ~WidenWhileBuilding() { flag = false; }
  } widen(widen_bf16_rows_);
  project(0, n, threads);
  for (int64_t i = 0; i < n; ++i) {
    const int l = next_level();
    nodes_[i].level = l;
    if (l >= static_cast<int>(levels_.size())) levels_.resize(l + 1);
    levels_[l].push_back(static_cast<int32_t>(i));
  }
  const int top = num_levels() - 1;
  kids_[kRootSlot].children_sq_norm_max = M_;
  {
    std::vector<int32_t> children = levels_[top];
    std::vector<int32_t> pages;
    for (size_t i = 0; i < (children.size() + kPageSlots - 1) / kPageSlots; ++i) pages.push_back(alloc_page());
    bulk_load(-1, children, pages.data());
    for (int32_t c : children) nodes_[c].parent = -1;
  }
  std::vector<int32_t> parent;
  std::vector<float> pdist;
  for (int l = top - 1; l >= 0; --l) {
    assign_parents(l, sc, ac, brute_threshold, threads, reference, parent, pdist);
    const std::vector<int32_t>& pts = levels_[l];
    const std::vector<int32_t>& ups = levels_[l + 1];
    // group the children by parent, in the parents' level order; page ids are handed out in that order
    std::vector<int64_t> start(nodes_.size() + 1, 0);
    for (size_t i = 0; i < pts.size(); ++i) {
      nodes_[pts[i]].parent = parent[i];
      nodes_[pts[i]].parent_dist = pdist[i];
      start[parent[i]] += 1;
    }
    std::vector<int32_t> slot_of(ups.size());
    std::vector<int64_t> first(ups.size() + 1, 0), page_first(ups.size() + 1, 0);
    for (size_t u = 0; u < ups.size(); ++u) {
      slot_of[u] = ensure_kids(ups[u]);
      kids_[slot_of[u]].children_sq_norm_max = M_;
      const int64_t c = start[ups[u]];
      first[u + 1] = first[u] + c;
      page_first[u + 1] = page_first[u] + (c + kPageSlots - 1) / kPageSlots;
    }
    std::vector<int32_t> pages(page_first.back());
    for (auto& p : pages) p = alloc_page();
    std::vector<int32_t> grouped(pts.size());
    {
      std::vector<int64_t> fill(nodes_.size(), 0);
      std::vector<int64_t> pos(ups.size());
      for (size_t u = 0; u < ups.size(); ++u) fill[ups[u]] = first[u];
      for (size_t i = 0; i < pts.size(); ++i) grouped[fill[parent[i]]++] = pts[i];
    }
    for (size_t u = 0; u < ups.size(); ++u) {
      float mx = 0.0f;
      for (int64_t i = first[u]; i < first[u + 1]; ++i) mx = std::max(mx, nodes_[grouped[i]].parent_dist);
      kids_[slot_of[u]].max_child_dist = mx;
    }
#pragma omp parallel for schedule(dynamic, 16) num_threads(threads) if (ups.size() > 64)
    for (int64_t u = 0; u < static_cast<int64_t>(ups.size()); ++u) {
      std::vector<int32_t> children(grouped.begin() + first[u], grouped.begin() + first[u + 1]);
      if (!children.empty()) bulk_load(ups[u], children, pages.data() + page_first[u]);
    }
  }
  recount();
  std::fill(changed_.begin(), changed_.end(), 1);
  if (cfg_->bf16_keys) RowVector<float>().swap(keys_);  // the bfloat16 rows are the index's keys from now on
  lay_out_rows_by_leaf();
}

}  // namespace dci
