// The Forest class: many DCI instances (one per KV head) behind one object, each operation one call over all of
// them, threaded across instances and within one (docs/dci.md, threads), with the GIL released. In a header so that
// the module's other sources (IceCache's decode step, icecache/method/src/) can call its searches on raw buffers;
// it lives in a named namespace, not an anonymous one, so that every source of the module sees one type.
#pragma once

#include <omp.h>
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <memory>
#include <stdexcept>

#include "dci.hpp"
#include "team.hpp"

namespace dci_forest {

namespace py = pybind11;
using dci::Instance;
using FArray = py::array_t<float, py::array::c_style>;

class Forest {
 public:
  Forest(int dim, int num_instances, int num_comp, int num_simp, double p0, double p1, bool transform,
         bool deterministic, uint64_t seed, FArray directions, int threads, int first_pass, bool bf16_keys)
      : threads_(std::max(1, threads)) {
    cfg_.dim = dim;
    cfg_.num_comp = num_comp;
    cfg_.num_simp = num_simp;
    cfg_.transform = transform;
    cfg_.deterministic = deterministic;
    cfg_.promotion_prob = p0;
    cfg_.promotion_prob_subseq = p1;
    if (first_pass < 0 || first_pass > static_cast<int>(dci::FirstPass::kInt8))
      throw std::invalid_argument("first_pass must be 0 (none), 1 (half) or 2 (int8)");
    cfg_.first_pass = static_cast<dci::FirstPass>(first_pass);
    cfg_.bf16_keys = bf16_keys;
    if (num_comp * num_simp > 64) throw std::invalid_argument("at most 64 directions");
    if (num_simp > 255) throw std::invalid_argument("at most 255 simple indices per composite index");
    if (first_pass != 0 && num_comp * num_simp != 1)
      throw std::invalid_argument("a first pass needs num_comp * num_simp == 1");
    if (directions.ndim() != 2 || directions.shape(0) != cfg_.num_dirs() || directions.shape(1) != cfg_.dir_stride())
      throw std::invalid_argument("directions must have shape [num_comp*num_simp, dim(+1 with transform)]");
    dirs_.assign(directions.data(), directions.data() + directions.size());
    for (int i = 0; i < num_instances; ++i)
      inst_.emplace_back(std::make_unique<Instance>(&cfg_, dirs_.data(), seed * 1000003ULL + i));
  }

  void set_threads(int t) { threads_ = std::max(1, t); }
  int threads() const { return threads_; }

  // Keys [instances, n, dim], C-contiguous: float32, or uint16 holding bfloat16 bits when the index keeps
  // bfloat16 keys (checked in index.py; here only the element size is).
  const char* key_base(const py::array& keys) const {
    if (keys.itemsize() != (cfg_.bf16_keys ? 2 : 4) || !(keys.flags() & py::array::c_style) || keys.ndim() != 3)
      throw std::invalid_argument(cfg_.bf16_keys ? "keys must be C-contiguous bfloat16 bits (uint16)"
                                                 : "keys must be C-contiguous float32");
    return static_cast<const char*>(keys.data());
  }
  size_t row_bytes() const { return static_cast<size_t>(cfg_.dim) * (cfg_.bf16_keys ? 2 : 4); }

  void build(py::array keys, int fov, double pr, double pv, int interval, int X, double thr, int brute,
             bool reference) {
    const int I = static_cast<int>(inst_.size());
    const int64_t n = keys.shape(1);
    const char* base = key_base(keys);
    const size_t rb = row_bytes();
    dci::SearchConfig sc{fov, pr, pv};
    dci::AnchorConfig ac{interval, X, thr};
    py::gil_scoped_release nogil;
    const int outer = std::max(1, std::min(I, threads_));
    const int inner = std::max(1, threads_ / outer);
    omp_set_max_active_levels(2);
#pragma omp parallel for schedule(dynamic, 1) num_threads(outer)
    for (int i = 0; i < I; ++i) inst_[i]->build(base + static_cast<int64_t>(i) * n * rb, n, sc, ac, brute, inner, reference);
  }

  void insert(py::array keys, int fov, double pr, double pv, bool as_batch, int brute) {
    const int I = static_cast<int>(inst_.size());
    const int64_t m = keys.shape(1);
    const char* base = key_base(keys);
    const size_t rb = row_bytes();
    dci::SearchConfig sc{fov, pr, pv};
    py::gil_scoped_release nogil;
#pragma omp parallel for schedule(dynamic, 1) num_threads(std::max(1, std::min(I, threads_)))
    for (int i = 0; i < I; ++i) inst_[i]->insert(base + static_cast<int64_t>(i) * m * rb, m, sc, as_batch, brute);
  }

  void reserve(int64_t n) {
    for (auto& x : inst_) x->reserve(n);
  }

  // Instance i's stored keys [n, dim] by token id, copied (uint16 bfloat16 bits, or float32).
  py::array keys(int i) const {
    const Instance& x = at(i);
    const py::ssize_t n = x.num_tokens(), dim = cfg_.dim;
    py::array out = cfg_.bf16_keys ? py::array(py::array_t<uint16_t>({n, dim})) : py::array(py::array_t<float>({n, dim}));
    char* o = static_cast<char*>(out.mutable_data());
    const size_t rb = row_bytes();
    for (py::ssize_t t = 0; t < n; ++t) std::memcpy(o + t * rb, x.key_bytes_of(t), rb);
    return out;
  }

  // Instance i's storage row of every token id [n] (tests: a build lays the rows out in leaf order).
  py::array_t<int64_t> key_storage_rows(int i) const {
    const Instance& x = at(i);
    py::array_t<int64_t> out(x.num_tokens());
    for (int64_t t = 0; t < x.num_tokens(); ++t) out.mutable_data()[t] = x.row(t);
    return out;
  }

  // Token ids [n, 16] (-1 padded) of page pages[r] of instance heads[r]: the rows a load of those pages reads.
  py::array_t<int32_t> pages_items(py::array_t<int64_t, py::array::c_style> heads,
                                   py::array_t<int64_t, py::array::c_style> pages) const {
    const int64_t n = heads.size();
    if (pages.size() != n) throw std::invalid_argument("heads and pages must have the same length");
    py::array_t<int32_t> out({n, static_cast<int64_t>(dci::kPageSlots)});
    int32_t* o = out.mutable_data();
    const int64_t* h = heads.data();
    const int64_t* p = pages.data();
    for (int64_t r = 0; r < n; ++r) {
      const Instance& x = at(static_cast<int>(h[r]));
      if (p[r] < 0 || p[r] >= x.num_pages()) throw py::index_error("page out of range");
      const dci::Leaf& lf = x.leaves()[p[r]];
      const int count = lf.owner == -2 ? 0 : lf.count;
      for (int t = 0; t < dci::kPageSlots; ++t) o[r * dci::kPageSlots + t] = t < count ? lf.item[t] : -1;
    }
    return out;
  }

  // Copies the key rows of tokens ids[r][t] of instance heads[r] to row r * 16 + t of `out` (bytes, C-contiguous,
  // at least n * 16 rows); an id of -1 gives a zero row. The rows a load of pages_items(heads, pages) sends.
  void gather_keys(py::array_t<int64_t, py::array::c_style> heads, py::array_t<int32_t, py::array::c_style> ids,
                   py::array out) const {
    const int64_t n = heads.size();
    const size_t rb = row_bytes();
    if (ids.ndim() != 2 || ids.shape(0) != n || ids.shape(1) != dci::kPageSlots)
      throw std::invalid_argument("ids must have shape [len(heads), 16]");
    if (!(out.flags() & py::array::c_style) || !out.writeable() ||
        static_cast<size_t>(out.nbytes()) < static_cast<size_t>(n) * dci::kPageSlots * rb)
      throw std::invalid_argument("out must be a writable C-contiguous buffer of len(heads) * 16 key rows");
    char* o = static_cast<char*>(out.mutable_data());
    const int64_t* h = heads.data();
    const int32_t* id = ids.data();
    py::gil_scoped_release nogil;  // a look-ahead search may run on another thread meanwhile
    for (int64_t r = 0; r < n; ++r) {
      const Instance& x = at(static_cast<int>(h[r]));
      for (int t = 0; t < dci::kPageSlots; ++t) {
        const int32_t tok = id[r * dci::kPageSlots + t];
        char* dst = o + (static_cast<size_t>(r) * dci::kPageSlots + t) * rb;
        if (tok < 0) std::memset(dst, 0, rb);
        else if (tok >= x.num_tokens()) throw py::index_error("token id out of range");
        else std::memcpy(dst, x.key_bytes_of(tok), rb);
      }
    }
  }

  py::dict memory_bytes() const {
    int64_t keys = 0, structure = static_cast<int64_t>(dirs_.capacity() * sizeof(float));
    for (const auto& x : inst_) {
      keys += x->key_bytes();
      structure += x->structure_bytes();
    }
    py::dict d;
    d["keys"] = keys;
    d["structure"] = structure;
    return d;
  }

  py::tuple query(FArray queries, int K, int fov, double pr, double pv, int ratio, bool rank_tokens) {
    const int64_t nq = queries.shape(0);
    const float* q = queries.data();
    const int dim = cfg_.dim;
    py::array_t<int32_t> pages({nq, static_cast<int64_t>(K)}), tokens({nq, static_cast<int64_t>(K)});
    py::array_t<float> pscores({nq, static_cast<int64_t>(K)}), tscores({nq, static_cast<int64_t>(K)});
    int32_t* P = pages.mutable_data();
    int32_t* T = tokens.mutable_data();
    float* PS = pscores.mutable_data();
    float* TS = tscores.mutable_data();
    dci::SearchConfig sc{fov, pr, pv, rank_tokens};
    {
    py::gil_scoped_release nogil;
    std::atomic<int64_t> rows{0}, bytes{0}, scores{0}, lists{0};
    last_phases_ = dci::QueryPhases{};
    if (cfg_.num_dirs() == 1) {
      query_grouped(q, nq, K, sc, ratio, P, T, PS, TS, rows, bytes, scores, lists, own_team());
    } else {
      const int nthreads = std::max(1, static_cast<int>(std::min<int64_t>(nq, threads_)));
      if (static_cast<int>(scratch_.size()) < nthreads) scratch_.resize(nthreads);
#pragma omp parallel num_threads(nthreads)
      {
        // per-thread buffers kept across calls: a query allocates nothing once they have grown
        dci::Scratch& s = scratch_[omp_get_thread_num()];
        dci::search_counters() = dci::SearchCounters{};
#pragma omp for schedule(dynamic, 1)
        for (int64_t h = 0; h < nq; ++h)
          inst_[h / ratio]->query(q + h * dim, K, sc, s, P + h * K, T + h * K, PS + h * K, TS + h * K);
        add_counters(rows, bytes, scores, lists);
      }
    }
    last_query_ = {rows.load(), bytes.load(), scores.load(), lists.load()};
    }
    return py::make_tuple(pages, tokens, pscores, tscores);
  }

  // The query with one direction (IceCache): the query heads of a GQA group search the same tree, and most of the
  // time goes to scoring the key rows of the level-1 parents they expand, which the heads share. So:
  //   1. every head descends to the last level (parallel over heads); the runs of children it would scan there are
  //      recorded instead of scanned;
  //   2. per instance, the runs of its heads are grouped by parent, and each parent's rows are read once and scored
  //      against all heads that expand it (parallel over parents of all instances); every thread feeds its own
  //      per-head accumulators;
  //   3. per head, the accumulators of the descent and of every thread are merged and written out.
  // A head is fed exactly the points it is fed alone, with the same scores, and the accumulators keep the best K
  // in (distance, id) order with unique ids, so the result is the one of the per-head query for any thread count
  // and any grouping.
  // This thread's search counters added to a query's totals (once per thread and query).
  static void add_counters(std::atomic<int64_t>& rows, std::atomic<int64_t>& bytes, std::atomic<int64_t>& scores,
                           std::atomic<int64_t>& lists) {
    const dci::SearchCounters& mine = dci::search_counters();
    rows += mine.rows;
    bytes += mine.bytes;
    scores += mine.scores;
    lists += mine.lists;
  }

  // What the last query read (SearchCounters summed over its threads), as a dict for Python.
  py::dict last_query_stats() const {
    py::dict d;
    d["rows_read"] = last_query_.rows;
    d["bytes_read"] = last_query_.bytes;
    d["scores"] = last_query_.scores;
    d["lists"] = last_query_.lists;
    return d;
  }

  // Where the last query's time went (QueryPhases, nanoseconds), as a dict for Python; zeros for the per-head query.
  static py::dict phases_dict(const dci::QueryPhases& p) {
    py::dict d;
    d["fork"] = p.fork_ns;
    d["descend"] = p.descend_ns;
    d["group"] = p.group_ns;
    d["scan"] = p.scan_ns;
    d["merge"] = p.merge_ns;
    d["scan_busy"] = p.scan_busy_ns;
    return d;
  }
  py::dict last_query_phases() const { return phases_dict(last_phases_); }

  // The team the queries Python makes run on (the process's team of the index's threads): an IceCache decode
  // step passes its sequence's team instead (icecache/method/src/decode_step.cpp).
  dci::Team& own_team() {
    if (!own_team_ || own_team_->size() != std::max(1, threads_))
      own_team_ = dci::shared_team(std::max(1, threads_), kOwnTeamSpinNs);
    return *own_team_;
  }

  void query_grouped(const float* q, int64_t nq, int K, const dci::SearchConfig& sc, int ratio, int32_t* P,
                     int32_t* T, float* PS, float* TS, std::atomic<int64_t>& rows, std::atomic<int64_t>& bytes,
                     std::atomic<int64_t>& scores, std::atomic<int64_t>& lists, dci::Team& team) {
    const int dim = cfg_.dim;
    const int I = num_instances();
    // every instance has its `ratio` heads (both callers check it), so each is grouped once its last head descends
    if (ratio < 1 || nq != static_cast<int64_t>(I) * ratio) throw std::invalid_argument("nq must be instances * ratio");
    const int nthreads = std::max(1, std::min(threads_, team.size()));
    if (static_cast<int>(scratch_.size()) < nthreads) scratch_.resize(nthreads);
    if (static_cast<int>(acc_.size()) < nthreads) acc_.resize(nthreads);
    if (static_cast<int64_t>(heads_.size()) < nq) heads_.resize(nq);
    if (static_cast<int>(jobs_.size()) < I) jobs_.resize(I);
    // Items cut into chunks of at most chunk_rows rows (at leaf boundaries) end the shared loops balanced in any
    // order; with chunk_rows == 0 an item is a whole parent, and each instance's are sorted largest first.
    const int chunk_rows = dci::scan_tuning().chunk_rows;
    if (static_cast<int>(inst_items_.size()) < I) inst_items_.resize(I);
    if (bars_capacity_ < nq) {
      bars_.reset(new dci::SharedBars[nq]);
      bars_capacity_ = nq;
    }
    using Clock = std::chrono::steady_clock;
    const auto since = [](Clock::time_point t0) {
      return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - t0).count();
    };
    const Clock::time_point started = Clock::now();
    std::atomic<int64_t> last_start_ns{0}, scan_busy_ns{0};
    std::atomic<int64_t> next_head{0};  // the descents' shared loop
    // An instance is grouped by the thread that finishes the last of its heads' descents, and its items are
    // published at once (the next slot of `ready_`): a thread whose descents are done scans the instances in the
    // order they were published while other heads still descend, so no barrier separates the two phases and no
    // thread waits for the slowest descent or for the last grouping. Results do not depend on the order in which
    // items are scanned (the accumulators order by (distance, id); a bar only passes over rows that cannot enter).
    if (inst_done_capacity_ < I) {
      inst_done_.reset(new std::atomic<int>[I]);
      ready_.reset(new std::atomic<int>[I]);
      inst_next_.reset(new std::atomic<int64_t>[I]);
      inst_done_capacity_ = I;
    }
    for (int i = 0; i < I; ++i) {
      inst_done_[i].store(0, std::memory_order_relaxed);
      ready_[i].store(-1, std::memory_order_relaxed);
      inst_next_[i].store(0, std::memory_order_relaxed);
    }
    std::atomic<int> instances_grouped{0};
    std::atomic<int64_t> descents_end_ns{0}, grouped_end_ns{0};
    const auto raise_to = [](std::atomic<int64_t>& at, int64_t value) {
      int64_t seen = at.load(std::memory_order_relaxed);
      while (value > seen && !at.compare_exchange_weak(seen, value, std::memory_order_relaxed)) {
      }
    };
    const auto group_instance = [&](const int64_t i) {
      auto& jobs = jobs_[i];
      jobs.clear();
      for (int64_t h = i * ratio; h < (i + 1) * ratio; ++h)
        for (const dci::LastLevelRun& r : heads_[h].runs) jobs.push_back({r.kid_slot, static_cast<int32_t>(h), r.first, r.last});
      std::sort(jobs.begin(), jobs.end(), [](const Job& a, const Job& b) {
        return a.kid_slot < b.kid_slot || (a.kid_slot == b.kid_slot && a.head < b.head);
      });
      inst_items_[i].clear();
      if (chunk_rows > 0)
        inst_[i]->group_items(static_cast<int>(i), jobs.data(), static_cast<int32_t>(jobs.size()), chunk_rows,
                              inst_items_[i]);
      else
        parent_items(static_cast<int>(i), inst_items_[i]);
      const int slot = instances_grouped.fetch_add(1, std::memory_order_acq_rel);
      raise_to(grouped_end_ns, since(started));
      ready_[slot].store(static_cast<int>(i), std::memory_order_release);  // its items and heads, published
    };
    dci::QueryPhases& ph = last_phases_;
    ph = dci::QueryPhases{};
    Clock::time_point mark = started;
    const auto lap = [&](int64_t& phase) {  // thread 0, leaving a phase's barrier
      const Clock::time_point now = Clock::now();
      phase = std::chrono::duration_cast<std::chrono::nanoseconds>(now - mark).count();
      mark = now;
    };
    team.run(nthreads, [&](const int tid) {
      raise_to(last_start_ns, since(started));
      ThreadAcc& acc = acc_[tid];
      team.guarded([&] {
        dci::search_counters() = dci::SearchCounters{};
        // this thread's per-head accumulators, allocated by the thread itself (its own malloc arena)
        if (static_cast<int64_t>(acc.topk.size()) < 2 * nq) acc.topk.resize(2 * nq);
        for (int64_t i = 0; i < 2 * nq; ++i) acc.topk[i].reset(i % 2 == 0 ? sc.token_k(K) : K);
        acc.used = false;
        dci::Scratch& s = scratch_[tid];
        for (int64_t h; (h = dci::Team::next_index(next_head)) < nq;) {
          HeadState& hs = heads_[h];
          hs.runs.clear();
          // the head's bf16 split, made once: its descent and the group's scan both score with it
          hs.probe = dci::Probe{q + h * dim, dci::dot(q + h * dim, q + h * dim, dim), true,
                                inst_[h / ratio]->split_query(q + h * dim, hs.query_split)};
          inst_[h / ratio]->descend(q + h * dim, K, sc, s, &hs.runs, &hs.probe.bf16);
          std::swap(hs.best_tokens, s.best_tokens);
          std::swap(hs.best_pages, s.best_pages);
          // the descent's fed points are part of the head's result: their K-th best is a bar for the half scan
          bars_[h].tokens.store(hs.best_tokens.bar(), std::memory_order_relaxed);
          bars_[h].pages.store(hs.best_pages.bar(), std::memory_order_relaxed);
          raise_to(descents_end_ns, since(started));
          // the last of an instance's heads groups its runs by parent: one work item = one parent and up to
          // kMaxGroupHeads heads (the counter's acquire makes the other heads' runs visible)
          const int64_t i = h / ratio;
          if (inst_done_[i].fetch_add(1, std::memory_order_acq_rel) + 1 == ratio) group_instance(i);
        }
      });
      int64_t busy = 0;
      team.guarded([&] {
        for (int slot = 0; slot < I; ++slot) {
          // the slot's instance, once its last descent has grouped it (a teammate that failed never will)
          int i;
          for (uint32_t spins = 0; (i = ready_[slot].load(std::memory_order_acquire)) < 0;) {
            if (team.failed()) return;
            dci::spin_pause();
            if ((++spins & 0x3fffu) == 0) std::this_thread::yield();
          }
          const std::vector<Item>& items = inst_items_[i];
          const int64_t n_items = static_cast<int64_t>(items.size());
          // timed per instance, not per item: the only waits are for the next slot, above
          const Clock::time_point instance_start = Clock::now();
          for (int64_t w; (w = dci::Team::next_index(inst_next_[i])) < n_items;) {
            const Item& it = items[w];
            const Job* jb = jobs_[it.inst].data() + it.begin;
            dci::Probe probes[dci::kMaxGroupHeads];
            int32_t first[dci::kMaxGroupHeads], last[dci::kMaxGroupHeads];
            dci::TopK* bt[dci::kMaxGroupHeads];
            dci::TopK* bp[dci::kMaxGroupHeads];
            dci::SharedBars* sb[dci::kMaxGroupHeads];
            int nh = 0;
            for (int g = 0; g < it.end - it.begin; ++g) {
              // the head's run within the item's rows [lo, hi); a head with none there is left out
              const int32_t f = std::max(jb[g].first, it.lo), l = std::min(jb[g].last, it.hi);
              if (f >= l) continue;
              sb[nh] = &bars_[jb[g].head];
              probes[nh] = heads_[jb[g].head].probe;
              first[nh] = f;
              last[nh] = l;
              bt[nh] = &acc.topk[2 * static_cast<int64_t>(jb[g].head)];
              bp[nh] = &acc.topk[2 * static_cast<int64_t>(jb[g].head) + 1];
              ++nh;
            }
            if (nh > 0) inst_[it.inst]->scan_runs(jb[0].kid_slot, nh, probes, first, last, bt, bp, sb, it.start);
            acc.used = true;
          }
          busy += since(instance_start);
        }
      });
      scan_busy_ns.fetch_add(busy, std::memory_order_relaxed);
      team.barrier();
      if (tid == 0) {
        // From the start to here, on the wall clock: the fork (until the last thread had begun), the descents
        // (until the last ended; items already grouped were scanned meanwhile), the grouping of the last
        // instance, and the scan of what was left.
        int64_t total = 0;
        lap(total);
        ph.fork_ns = std::min(total, last_start_ns.load(std::memory_order_relaxed));
        const int64_t descents = std::clamp(descents_end_ns.load(std::memory_order_relaxed), ph.fork_ns, total);
        const int64_t grouped = std::clamp(grouped_end_ns.load(std::memory_order_relaxed), descents, total);
        ph.descend_ns = descents - ph.fork_ns;
        ph.group_ns = grouped - descents;
        ph.scan_ns = total - grouped;
      }
      team.guarded([&] {
        for (int64_t h = tid; h < nq; h += nthreads) {
          HeadState& hs = heads_[h];
          for (int t = 0; t < nthreads; ++t) {
            if (!acc_[t].used) continue;
            for (const dci::Candidate& c : acc_[t].topk[2 * h].items) hs.best_tokens.push(c);
            for (const dci::Candidate& c : acc_[t].topk[2 * h + 1].items) hs.best_pages.push(c);
          }
          inst_[h / ratio]->emit(hs.best_tokens, hs.best_pages, K, P + h * K, T + h * K, PS + h * K, TS + h * K);
        }
        add_counters(rows, bytes, scores, lists);
      });
    });
    lap(ph.merge_ns);
    ph.scan_busy_ns = scan_busy_ns.load();
  }

  // With chunk_rows == 0: instance i's items, one per parent (up to kMaxGroupHeads heads), largest first so that
  // the shared loop over them ends balanced.
  void parent_items(int i, std::vector<dci::GroupItem>& items) const {
    const auto& jobs = jobs_[i];
    size_t b = 0;
    while (b < jobs.size()) {
      size_t e = b + 1;
      int lo = jobs[b].first, hi = jobs[b].last;
      while (e < jobs.size() && jobs[e].kid_slot == jobs[b].kid_slot && e - b < dci::kMaxGroupHeads) {
        lo = std::min(lo, jobs[e].first);
        hi = std::max(hi, jobs[e].last);
        ++e;
      }
      items.push_back({i, static_cast<int32_t>(b), static_cast<int32_t>(e), lo, hi,
                       static_cast<int64_t>(hi - lo) * static_cast<int64_t>(e - b + 1)});
      b = e;
    }
    std::sort(items.begin(), items.end(), [](const dci::GroupItem& a, const dci::GroupItem& b) {
      return a.cost > b.cost || (a.cost == b.cost && a.begin < b.begin);
    });
  }

  int num_instances() const { return static_cast<int>(inst_.size()); }
  const Instance& at(int i) const {
    if (i < 0 || i >= num_instances()) throw py::index_error("instance out of range");
    return *inst_[i];
  }
  Instance& at(int i) {
    if (i < 0 || i >= num_instances()) throw py::index_error("instance out of range");
    return *inst_[i];
  }

  py::array_t<int32_t> num_pages() const {
    py::array_t<int32_t> out(num_instances());
    for (int i = 0; i < num_instances(); ++i) out.mutable_data()[i] = inst_[i]->num_pages();
    return out;
  }
  int max_pages() const {
    int m = 0;
    for (auto& x : inst_) m = std::max(m, x->num_pages());
    return m;
  }
  py::array_t<int32_t> page_tokens(int i) const {
    const Instance& x = at(i);
    const int64_t P = x.num_pages();
    py::array_t<int32_t> out({P, static_cast<int64_t>(dci::kPageSlots)});
    int32_t* o = out.mutable_data();
    std::fill(o, o + P * dci::kPageSlots, -1);
    for (int64_t p = 0; p < P; ++p) {
      const dci::Leaf& lf = x.leaves()[p];
      if (lf.owner == -2) continue;
      for (int t = 0; t < lf.count; ++t) o[p * dci::kPageSlots + t] = lf.item[t];
    }
    return out;
  }
  py::array_t<int32_t> page_valid_counts() const {
    const int64_t I = num_instances(), P = max_pages();
    py::array_t<int32_t> out({I, P});
    int32_t* o = out.mutable_data();
    std::fill(o, o + I * P, 0);
    for (int64_t i = 0; i < I; ++i)
      for (int64_t p = 0; p < inst_[i]->num_pages(); ++p) {
        const dci::Leaf& lf = inst_[i]->leaves()[p];
        o[i * P + p] = lf.owner == -2 ? 0 : lf.count;
      }
    return out;
  }
  py::tuple token_to_page(int i) const {
    const Instance& x = at(i);
    const int64_t n = x.num_tokens();
    py::array_t<int32_t> page(n), slot(n);
    for (int64_t t = 0; t < n; ++t) {
      page.mutable_data()[t] = x.nodes()[t].page;
      slot.mutable_data()[t] = x.nodes()[t].slot;
    }
    return py::make_tuple(page, slot);
  }
  py::array_t<bool> pop_changed_pages() {
    const int64_t I = num_instances(), P = max_pages();
    py::array_t<bool> out({I, P});
    bool* o = out.mutable_data();
    std::fill(o, o + I * P, false);
    for (int64_t i = 0; i < I; ++i) {
      auto& ch = inst_[i]->changed();
      for (size_t p = 0; p < ch.size(); ++p) {
        o[i * P + p] = ch[p] != 0;
        ch[p] = 0;
      }
    }
    return out;
  }
  py::dict node_info(int i) const {
    const Instance& x = at(i);
    const int64_t n = x.num_tokens();
    const int64_t L = cfg_.num_dirs();
    py::array_t<int32_t> level(n), parent(n);
    py::array_t<float> pdist(n), sq(n), proj({n, L});
    py::array_t<double> proj_m(n);
    for (int64_t t = 0; t < n; ++t) {
      const dci::Node& nd = x.nodes()[t];
      level.mutable_data()[t] = nd.level;
      parent.mutable_data()[t] = nd.parent;
      pdist.mutable_data()[t] = nd.parent_dist;
      proj_m.mutable_data()[t] = nd.proj_sq_norm_max;
      sq.mutable_data()[t] = x.sq_norms()[t];
      for (int64_t j = 0; j < L; ++j) proj.mutable_data()[t * L + j] = x.projections()[t * L + j];
    }
    py::dict d;
    d["level"] = level;
    d["parent"] = parent;
    d["parent_dist"] = pdist;
    d["sq_norm"] = sq;
    d["projections"] = proj;
    d["projection_sq_norm_max"] = proj_m;
    d["free_pages"] = py::cast(x.free_pages());
    return d;
  }
  py::array_t<double> max_sq_norm() const {
    py::array_t<double> out(num_instances());
    for (int i = 0; i < num_instances(); ++i) out.mutable_data()[i] = inst_[i]->max_sq_norm();
    return out;
  }
  py::array_t<float> directions() const {
    py::array_t<float> out({static_cast<int64_t>(cfg_.num_dirs()), static_cast<int64_t>(cfg_.dir_stride())});
    std::copy(dirs_.begin(), dirs_.end(), out.mutable_data());
    return out;
  }

  dci::IndexConfig cfg_;
  std::vector<float> dirs_;
  std::vector<std::unique_ptr<Instance>> inst_;
  std::vector<dci::Scratch> scratch_;  // one per query thread (a Forest is used from one Python thread at a time)
  // query_grouped's state, kept across calls so that a query allocates nothing once it has grown
  struct alignas(64) HeadState {
    dci::TopK best_tokens, best_pages;
    std::vector<dci::LastLevelRun> runs;
    dci::Probe probe;
    std::vector<uint16_t> query_split;  // probe's bf16 split (it outlives the descent's Scratch)
  };
  struct alignas(64) ThreadAcc {
    std::vector<dci::TopK> topk;  // [2 * nq]: best tokens, best pages of each head
    bool used = false;
  };
  using Job = dci::GroupJob;
  using Item = dci::GroupItem;  // jobs_[inst][begin, end): one parent, up to kMaxGroupHeads heads; rows [lo, hi)
  std::vector<HeadState> heads_;
  std::vector<ThreadAcc> acc_;
  std::vector<std::vector<Job>> jobs_;
  std::vector<std::vector<Item>> inst_items_;  // per instance, its work items
  std::unique_ptr<std::atomic<int>[]> inst_done_;  // per instance, its heads whose descent has ended
  std::unique_ptr<std::atomic<int>[]> ready_;  // [slot]: the instance grouped slot-th (-1 until then)
  std::unique_ptr<std::atomic<int64_t>[]> inst_next_;  // per instance, its items' shared loop
  int inst_done_capacity_ = 0;
  std::unique_ptr<dci::SharedBars[]> bars_;  // [nq], for the half-precision scan
  int64_t bars_capacity_ = 0;
  dci::SearchCounters last_query_;
  dci::QueryPhases last_phases_;
  // Python's queries come at irregular times: the team sleeps soon after each
  static constexpr int64_t kOwnTeamSpinNs = 50'000;
  std::shared_ptr<dci::Team> own_team_;  // the process's team of threads_ (dci::shared_team)
  int threads_;
};


}  // namespace dci_forest
