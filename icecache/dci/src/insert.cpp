// Incremental insertion (docs/dci.md, insertion). A point goes to the level the schedule gives it; below the top it joins the
// nearest point of the level above; on a new top level it adopts all old top-level points; on any level above 0 it
// takes over every point of the level below that is now closer to it than to its parent.
#include <algorithm>
#include <cmath>

#include "dci.hpp"

namespace dci {

void Instance::insert_point(int32_t id, const SearchConfig& sc, int brute_threshold, Scratch& s) {
  const int t = nodes_[id].level;
  const int dim = cfg_->dim;
  if (t >= num_levels()) {
    // New top level: the new point becomes the root's only child and adopts every old top-level point.
    std::vector<int32_t> old_top = kids_[kRootSlot].ids[0];
    for (int32_t c : old_top) remove_child(-1, c);
    levels_.resize(t + 1);
    const int slot = ensure_kids(id);
    ChildIndex& ci = kids_[slot];
    ci.children_sq_norm_max = M_;
    float mx = 0.0f;
    std::vector<float> child_buf(dim), new_buf(dim);
    const float* new_key = key_row(id, new_buf.data());
    for (int32_t c : old_top) {
      correct_projection(c);
      nodes_[c].parent = id;
      nodes_[c].parent_dist = key_dist(key_row(c, child_buf.data()), sq_norm_[c], new_key, sq_norm_[id]);
      mx = std::max(mx, nodes_[c].parent_dist);
    }
    std::vector<int32_t> pages;
    for (size_t i = 0; i < (old_top.size() + kPageSlots - 1) / kPageSlots; ++i) {
      pages.push_back(alloc_page());
      leaves_[pages.back()].owner = slot;
    }
    if (!old_top.empty()) bulk_load(id, old_top, pages.data());
    kids_[slot].max_child_dist = mx;
    nodes_[id].parent_dist = 0.0f;
    insert_child(-1, id);
    levels_[t].push_back(id);
    return;
  }
  const int top = num_levels() - 1;
  if (t == top) {
    nodes_[id].parent_dist = 0.0f;
    insert_child(-1, id);
  } else {
    auto r = nearest_parent(id, t + 1, sc, brute_threshold, s, true);
    nodes_[id].parent_dist = r.second;
    insert_child(r.first, id);
    ChildIndex& pc = kids_of(r.first);
    pc.max_child_dist = std::max(pc.max_child_dist, r.second);
  }
  levels_[t].push_back(id);
  if (t == 0) return;
  // Re-parent the level below: points strictly closer (by more than 1e-8) to the new point move under it.
  const std::vector<int32_t>& below = levels_[t - 1];
  std::vector<float> probe_buf(dim);
  const Probe probe{key_row(id, probe_buf.data()), sq_norm_[id], false};
  std::vector<float> d(below.size());
  score(probe, below.data(), static_cast<int>(below.size()), d.data());
  ensure_kids(id);
  for (size_t i = 0; i < below.size(); ++i) {
    const int32_t v = below[i];
    if (v == id || d[i] >= nodes_[v].parent_dist - kReparentEps) continue;
    remove_child(nodes_[v].parent, v);
    nodes_[v].parent_dist = d[i];
    insert_child(id, v);
    ChildIndex& ci = kids_of(id);
    ci.max_child_dist = std::max(ci.max_child_dist, d[i]);
  }
}

void Instance::insert(const void* keys, int64_t m, const SearchConfig& sc, bool as_batch, int brute_threshold) {
  if (m <= 0) return;
  Scratch s;
  const int64_t n0 = num_tokens();
  if (as_batch) {
    // dci_add with k > 1 points: M and the projections take in the whole batch first; the new points are then
    // merged top level first, so every new point finds its parent among old and new points of the level above and
    // old points may switch to a closer new upper point.
    append_points(keys, m, false);
    project(n0, n0 + m, 1);
    std::vector<int32_t> order(m);
    for (int64_t i = 0; i < m; ++i) {
      nodes_[n0 + i].level = next_level();
      order[i] = static_cast<int32_t>(n0 + i);
    }
    // Points that open new levels go first, lowest new level first, so each creates exactly the next level; the
    // others follow top level first.
    const int old_top = num_levels() - 1;
    auto rank = [&](int32_t a) {
      const int l = nodes_[a].level;
      return l > old_top ? l - (1 << 20) : -l;
    };
    std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return rank(a) < rank(b); });
    for (int32_t id : order) insert_point(id, sc, brute_threshold, s);
  } else {
    for (int64_t i = 0; i < m; ++i) {
      const size_t row_bytes = static_cast<size_t>(cfg_->dim) * (cfg_->bf16_keys ? 2 : 4);
      append_points(static_cast<const char*>(keys) + i * row_bytes, 1, false);
      project(n0 + i, n0 + i + 1, 1);
      nodes_[n0 + i].level = next_level();
      insert_point(static_cast<int32_t>(n0 + i), sc, brute_threshold, s);
    }
  }
  recount();
}

}  // namespace dci
