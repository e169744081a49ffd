// Multi-level Prioritized DCI with M-DCI's page leaves and the MIPS transform (docs/dci.md).
//
// One `Instance` is one independent index (one KV head). Every token is a node stored at exactly one level;
// each upper-level node (and the virtual root) keeps its children in
//   * one B+-tree leaf chain over direction 0: the leaves are the *pages* (<= 16 tokens, ids dense per instance);
//   * one sorted projection array per direction: the simple indices the query walks.
#pragma once

#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <new>
#include <random>
#include <string>
#include <utility>
#include <vector>

namespace dci {

// The key rows' allocator. Rows of a multiple of 64 bytes (bf16 at dims 32k, float32 at 16k) start on cache lines, so
// no 64-byte load of a row spans two. An array of 2 MiB or more starts on a 2 MiB boundary, and its whole 2 MiB
// chunks are offered to the kernel as transparent huge pages (madvise; where THP is off they stay in 4 KiB pages):
// a search reads rows all over an instance's keys, and with 4 KiB pages nearly every row it reads costs a TLB miss.
// The tail past the last whole chunk keeps 4 KiB pages, so no huge page is backed beyond the array.
template <typename T>
struct CacheLineAllocator {
  using value_type = T;
  static constexpr std::align_val_t kAlign{64};
  static constexpr size_t kHugePage = size_t{2} << 20;
  CacheLineAllocator() = default;
  template <typename U>
  CacheLineAllocator(const CacheLineAllocator<U>&) {}
  T* allocate(size_t n) {
    const size_t bytes = n * sizeof(T);
    if (bytes < kHugePage) return static_cast<T*>(::operator new(bytes, kAlign));
    void* p = nullptr;
    if (posix_memalign(&p, kHugePage, bytes) != 0) throw std::bad_alloc();
    madvise(p, bytes / kHugePage * kHugePage, MADV_HUGEPAGE);  // advice only: its failure leaves 4 KiB pages
    return static_cast<T*>(p);
  }
  void deallocate(T* p, size_t n) {
    if (n * sizeof(T) < kHugePage) ::operator delete(p, kAlign);
    else free(p);
  }
  template <typename U>
  bool operator==(const CacheLineAllocator<U>&) const { return true; }
  template <typename U>
  bool operator!=(const CacheLineAllocator<U>&) const { return false; }
};
template <typename T>
using RowVector = std::vector<T, CacheLineAllocator<T>>;

constexpr int kPageSlots = 16;           // BTREE_LEAF_MAX_NUM_SLOTS
constexpr int kSplitHalf = 8;            // a full leaf splits 8 + 8
constexpr int kMinFill = 8;              // below this a leaf borrows from or merges with a sibling
constexpr int kBatch = 128;              // CLOSEST: projections popped per round from one simple index
constexpr double kReparentEps = 1e-8;    // re-parent only when strictly closer by more than this
constexpr int kRootSlot = 0;             // kids[0] is the virtual root

// The copy of the page key rows a bounded first pass scores (IndexConfig::first_pass).
enum class FirstPass : int { kNone = 0, kHalf = 1, kInt8 = 2 };

struct IndexConfig {
  int dim = 0;
  int num_comp = 1;
  int num_simp = 1;
  bool transform = true;
  bool deterministic = true;
  double promotion_prob = 0.01;
  double promotion_prob_subseq = 0.2;
  // Keep an approximate copy of the page key rows (IEEE half, or 8-bit codes with a per-row scale) and score the
  // last level of a query with it first; only the rows that can still enter a result are re-scored from the keys
  // (Instance::scan_runs_bounded). L = 1 only.
  FirstPass first_pass = FirstPass::kNone;
  // Keys are held as bfloat16 (the model's KV dtype) and widened to float32 as they are scored: the widening is
  // exact, so every dot product, and so every result, is the one of the float32 index over the same values, from
  // half the bytes. The float32 index keeps float32 keys.
  bool bf16_keys = false;
  int num_dirs() const { return num_comp * num_simp; }
  int dir_stride() const { return transform ? dim + 1 : dim; }
};

struct SearchConfig {
  int field_of_view = 30;
  double prop_to_retrieve = 1.0;
  double prop_to_visit = 1.0;
  // false: no token list is kept (its accumulators hold nothing, so a scanned page is tested against the page bar
  // alone and no row is pushed), for a caller that reads only the pages. The pages are the same either way: no
  // page decision reads the token list.
  bool rank_tokens = true;
  int token_k(int K) const { return rank_tokens ? (K > 0 ? K : 0) : 0; }
};

struct AnchorConfig {
  int interval = 0;       // 0 disables the shortcut
  int neighbours = 0;     // X anchors on each side
  double threshold = 1.02;
};

struct Leaf {
  int32_t owner = -2;     // kid slot of the parent owning this leaf, -2 when free
  int32_t count = 0;
  float key[kPageSlots];
  int32_t item[kPageSlots];
};

// The children of one parent.
struct ChildIndex {
  int32_t node = -1;                          // token id of the parent, -1 for the root
  std::vector<int32_t> leaves;                // page ids in direction-0 projection order
  std::vector<std::vector<float>> proj;       // [L][children] sorted projections
  std::vector<std::vector<int32_t>> ids;      // [L][children] node ids in the same order
  double children_sq_norm_max = 0.0;          // the M every child's projection is current at
  float max_child_dist = 0.0f;
  int32_t pages_under = 0;                    // pages in the subtree below this parent
  int size() const { return ids.empty() ? 0 : static_cast<int>(ids[0].size()); }
};

struct Node {
  int32_t level = 0;
  int32_t parent = -1;        // token id, -1 = root
  int32_t kid_slot = -1;      // index into Instance::kids when this node has a child index
  int32_t page = -1;
  int32_t slot = -1;
  float parent_dist = 0.0f;
  double proj_sq_norm_max = 0.0;  // M this node's projections were computed with
};

struct Candidate {
  float dist;
  int32_t id;
  bool operator<(const Candidate& o) const { return dist < o.dist || (dist == o.dist && id < o.id); }
};

// [first, last) of the c entries of the sorted arr[0, n) nearest qp, as the children search pops them (search.cpp).
std::pair<int, int> nearest_run(const float* arr, int n, float qp, int c);

// The k best of a stream of candidates in (dist, id) order. Ids are unique, so the result does not depend on the
// order in which candidates arrive (nor on the thread count). Once full, `items` is a max-heap on (dist, id): the
// worst kept item is items[0], and a replacement costs log2(k) steps where finding the new worst by a scan would
// cost k, at every admitted candidate of a scan and of a query's merge (up to threads x k per head and
// accumulator). Callers that need the items in order sort them (Instance::emit).
struct TopK {
  std::vector<Candidate> items;
  int cap = 0;
  void reset(int k) {
    items.clear();
    cap = k;
  }
  bool full() const { return static_cast<int>(items.size()) == cap; }
  // The distance a candidate must beat to be kept (by distance alone; equal distances are decided by id).
  float bar() const {
    if (cap <= 0) return -INFINITY;
    return full() ? items[0].dist : INFINITY;
  }
  // true when c would be kept; cheap enough to run before building c's page/best bookkeeping
  bool admits(const Candidate& c) const { return !full() || c < items[0]; }
  void push(const Candidate& c) {
    if (cap <= 0) return;
    if (!full()) {
      items.push_back(c);
      if (full()) std::make_heap(items.begin(), items.end());
      return;
    }
    if (!(c < items[0])) return;
    // the root (the worst) gives way to c, which sinks to its place
    const int n = cap;
    Candidate* h = items.data();
    int i = 0;
    for (;;) {
      int child = 2 * i + 1;
      if (child >= n) break;
      if (child + 1 < n && h[child] < h[child + 1]) ++child;
      if (!(c < h[child])) break;
      h[i] = h[child];
      i = child;
    }
    h[i] = c;
  }
};

// Per-thread buffers of a search, reused across calls. Aligned to a cache line so that two threads' buffers never
// share one (their TopK headers are written on every fed point).
struct alignas(64) Scratch {
  std::vector<uint8_t> counter;     // [num_comp * n] pops per point per composite index
  std::vector<uint8_t> processed;   // [n]
  std::vector<int32_t> touched;
  std::vector<int32_t> pending;
  std::vector<float> dots;
  std::vector<Candidate> cands;
  std::vector<Candidate> level_out;
  std::vector<Candidate> next;
  std::vector<Candidate> part;
  std::vector<Candidate> fed;
  std::vector<Candidate> page_best;    // [pages] best fed point of each page; dist = +inf when none yet
  std::vector<int32_t> pages_hit;      // pages whose page_best is set, to reset them afterwards
  std::vector<uint8_t> page_seen;      // [pages] distinct-page marks of the intermediate-level coverage
  TopK best_tokens, best_pages;        // the query's two result accumulators (the K best tokens, the K best pages)
  std::vector<uint16_t> query_split;   // the descending query's bf16 split (Instance::split_query)
  std::vector<float> key_buf;          // a key row widened to float32 (the parent search of a point)
};

// A query's bfloat16 split, made once per query (split_bf16) for the avx512bf16 kernels, which score bf16 rows
// with it: hi = bf16(q), lo = bf16(q - hi), dim values each. hi == nullptr: none made (those kernels split the
// query themselves on every call; the other instruction sets never use it).
struct Bf16Split {
  const uint16_t* hi = nullptr;
  const uint16_t* lo = nullptr;
  bool inexact = false;  // some lo value is non-zero: q is not a bf16 vector
};

// What the distance of a child is measured against: a query (score -q.k in transform mode) or another key.
struct Probe {
  const float* vec = nullptr;   // query or key row, dim floats
  float sq_norm = 0.0f;
  bool is_query = true;
  Bf16Split bf16;               // vec's split, where one was made
};

// The last level of one query head's descent, deferred (L = 1): positions [first, last) of the sorted children of
// kids_[kid_slot] are to be scored and fed. Recording them instead of scanning at once lets the heads of one GQA
// group that expand the same parent score its key rows in one pass (`scan_runs`).
struct LastLevelRun {
  int32_t kid_slot;
  int32_t first, last;
};

// Distances that a query head's final K tokens and K pages are already known to reach: the K-th best of a set of
// exact candidates that will all be merged into its result (its descent's, or one thread's accumulator). Shared by
// the threads of a grouped query, so that the bounded first pass of one thread prunes with what others found.
// Only lowered; any value they hold is a valid bar, so the result does not depend on the order of updates.
struct alignas(64) SharedBars {
  std::atomic<float> tokens{INFINITY}, pages{INFINITY};
  static void lower(std::atomic<float>& bar, float v) {
    float cur = bar.load(std::memory_order_relaxed);
    while (v < cur && !bar.compare_exchange_weak(cur, v, std::memory_order_relaxed)) {
    }
  }
};

// What a search read, counted per thread (search_counters) and summed per query by the binding: key rows loaded
// (a row a grouped scan scores for several heads counts once) and their bytes (a first pass's rows at 2 or 1
// bytes a value, re-scored rows again at the keys' own width), (row, head) dot products, and children lists
// searched (a parent's children searched or scanned).
struct SearchCounters {
  int64_t rows = 0, bytes = 0, scores = 0, lists = 0;  // bytes: of the rows read, at the width each was read in
};

// Where a grouped query's wall-clock time went, in nanoseconds, read by the thread that started it as it leaves
// each phase's barrier (so a phase includes the wait for its slowest thread). fork: until the last thread of the
// team had begun (what waking a sleeping team costs); descend, group, scan, merge: the phases of
// Forest::query_grouped. An instance is grouped as soon as its heads have descended, under the other heads'
// descents, so descend ends when the last descent does and group is what grouping and the items' collection added
// after it. The scan begins when its first thread starts (thread 0 may be descheduled past that moment).
// scan_busy: the scan phase's time in work items summed over threads; over threads * scan it is how busy the
// team was while scanning.
struct QueryPhases {
  int64_t fork_ns = 0, descend_ns = 0, group_ns = 0, scan_ns = 0, merge_ns = 0, scan_busy_ns = 0;
  QueryPhases& operator+=(const QueryPhases& o) {
    fork_ns += o.fork_ns;
    descend_ns += o.descend_ns;
    group_ns += o.group_ns;
    scan_ns += o.scan_ns;
    merge_ns += o.merge_ns;
    scan_busy_ns += o.scan_busy_ns;
    return *this;
  }
};
SearchCounters& search_counters();  // this thread's

constexpr int kMaxGroupHeads = 16;  // query heads scored together in one pass over a parent's rows

// Knobs of the last-level scan that change its speed, never its results (docs/dci.md, kernels), process-wide:
//   prefetch_rows  how far ahead (in rows of the run) key rows are requested while the current rows are scored;
//                  0: the next leaf's rows, requested before each leaf is scored;
//   chunk_rows     the most rows of a parent's run that one work item of a grouped query scans (cut at leaf
//                  boundaries, so a page is never split); 0: one item per parent, items sorted largest first;
//   prefetch_level the cache those rows are requested into: 2 (L2, prefetcht1) or 1 (L1 too, prefetcht0), which
//                  holds an L1 miss buffer per line until it arrives, and the scan stalled on them.
struct ScanTuning {
  int prefetch_rows = 32;
  int chunk_rows = 256;
  int prefetch_level = 2;
};
ScanTuning scan_tuning();
void set_scan_tuning(const ScanTuning& tuning);  // throws std::invalid_argument for a value out of range

// One query head's last-level run over kids_[kid_slot], as Forest::query_grouped groups them.
struct GroupJob {
  int32_t kid_slot, head, first, last;
};
// Where a scan of one parent's children may begin its walk over the parent's leaves: ci.leaves[leaf], which starts
// at position `pos` of the sorted children, at or before the run. The default is the first leaf.
struct LeafStart {
  int32_t leaf = 0, pos = 0;
};
// One work item of a grouped query: jobs [begin, end) of instance `inst` (one parent, up to kMaxGroupHeads heads),
// scanned over positions [lo, hi) of the parent's sorted children only, its walk begun at `start`. An item cut from a
// long run starts at the leaf its cut found, so that the scans of a run's items do not each walk its leaves from
// the first (each leaf's count is a cache miss of its own).
struct GroupItem {
  int32_t inst, begin, end, lo, hi;
  int64_t cost;
  LeafStart start{};
};

struct QueryResult {
  std::vector<int32_t> pages, tokens;
  std::vector<float> page_scores, token_scores;
};

class Instance {
 public:
  Instance(const IndexConfig* cfg, const float* dirs, uint64_t seed) : cfg_(cfg), dirs_(dirs), rng_(seed) { reset(); }

  // bulk build (docs/dci.md)
  // `keys` is float32 [n][dim], or bfloat16 bit patterns [n][dim] when the index holds bfloat16 keys.
  // `reference`: the build as first written (a float32 copy of bf16 keys, the shortcut's distances one pair at a
  // time), which the default build must match node for node (tests).
  void build(const void* keys, int64_t n, const SearchConfig& sc, const AnchorConfig& ac, int brute_threshold,
             int threads, bool reference = false);
  // insertion (docs/dci.md); `keys` as for build
  void insert(const void* keys, int64_t m, const SearchConfig& sc, bool as_batch, int brute_threshold);
  // Room for n tokens in every per-token array, so that inserting up to n tokens reallocates none of them.
  void reserve(int64_t n);
  // Bytes the instance holds (capacity, not size), its keys and its structure apart.
  int64_t key_bytes() const;
  int64_t structure_bytes() const;
  // q's bf16 split in buf where the rows are bf16 and the kernels use one (split_bf16), else none.
  Bf16Split split_query(const float* q, std::vector<uint16_t>& buf) const;
  // The stored key rows, [n][dim] in row order (row(id)): bfloat16 bit patterns (bf16_keys) or float32. Valid
  // until the next insert.
  const void* key_data() const { return cfg_->bf16_keys ? static_cast<const void*>(keys_bf16_.data())
                                                        : static_cast<const void*>(keys_.data()); }
  // The storage row of token `id`: after a build the rows follow the leaves (see row_of_), later tokens are
  // appended in id order.
  int64_t row(int64_t id) const { return row_of_.empty() ? id : row_of_[id]; }
  const char* key_bytes_of(int64_t id) const {
    return static_cast<const char*>(key_data()) + row(id) * cfg_->dim * (cfg_->bf16_keys ? 2 : 4);
  }
  // page query (docs/dci.md)
  void query(const float* q, int K, const SearchConfig& sc, Scratch& s, int32_t* pages, int32_t* tokens,
             float* page_scores, float* token_scores) const;
  // The query without its output: leaves s.best_tokens / s.best_pages holding every fed point. With `runs` (and
  // L = 1) the last level is not scanned but appended to *runs, to be finished by scan_runs.
  // `split`: q's bf16 split when the caller made one (it keeps it for the scan), else made here in s.
  void descend(const float* q, int K, const SearchConfig& sc, Scratch& s, std::vector<LastLevelRun>* runs,
               const Bf16Split* split = nullptr) const;
  // Scores the union of the heads' runs over one parent's children once, each key row against all `nh` probes
  // (nh <= kMaxGroupHeads), and feeds head j only the rows of its own run [first[j], last[j]). Per head this feeds
  // exactly what scan_last_level would, with bit-identical scores.
  // With a first pass the rows are scored by scan_runs_bounded, which reads and lowers `bars` (per head; may be
  // null).
  // `start`: where the walk over the parent's leaves may begin (a leaf at or before the heads' runs).
  void scan_runs(int32_t kid_slot, int nh, const Probe* probes, const int32_t* first, const int32_t* last,
                 TopK* const* best_tokens, TopK* const* best_pages, SharedBars* const* bars = nullptr,
                 LeafStart start = {}) const;
  // The work items of this instance's jobs (sorted by parent, then head), appended to `out`: consecutive jobs of one
  // parent, at most kMaxGroupHeads, are one group; a group whose run is longer than chunk_rows (> 0) is cut at leaf
  // boundaries into items of at most max(chunk_rows, kPageSlots) rows. Each head is then fed, over all of a group's
  // items, exactly the pages and rows it is fed by one item.
  void group_items(int32_t inst, const GroupJob* jobs, int32_t n_jobs, int chunk_rows,
                   std::vector<GroupItem>& out) const;
  // Each head's own rows of one page's scored slots [s0, s1) (the page starts at run position `base`; dots[j * 16 +
  // slot - s0] is head j's score of that slot), fed to its accumulators as scan_last_level would feed them.
  void feed_page(const Leaf& lf, int base, int s0, int s1, int nh, const Probe* probes, const int32_t* first,
                 const int32_t* last, const float* dots, TopK* const* best_tokens, TopK* const* best_pages) const;
  // scan_runs' float32 scan with rows prefetched `ahead` rows ahead of the one being scored (ScanTuning).
  void scan_rows_ahead(const ChildIndex& ci, int nh, const Probe* probes, const float* const* qs,
                       const Bf16Split* splits, const int32_t* first, const int32_t* last, int lo, int hi,
                       const ScanTuning& tuning, TopK* const* best_tokens, TopK* const* best_pages,
                       LeafStart start) const;
  // scan_runs over the first pass's rows: the same fed points with the same scores, as far as they can matter.
  void scan_runs_bounded(int32_t kid_slot, int nh, const Probe* probes, const int32_t* first, const int32_t* last,
                         TopK* const* best_tokens, TopK* const* best_pages, SharedBars* const* bars,
                         LeafStart start) const;
  // A query's distance to point `id` from their inner product `ab`: -ab under the MIPS transform (the ranking is by
  // inner product), else the squared Euclidean distance. One definition for every scan, so that paths agree bitwise.
  float query_distance(const Probe& probe, int32_t id, double ab) const {
    return cfg_->transform ? static_cast<float>(-ab)
                           : static_cast<float>(probe.sq_norm + static_cast<double>(sq_norm_[id]) - 2.0 * ab);
  }
  // Writes the two accumulators (which they sort) as the query's K pages and K tokens, -1 / NaN padded.
  void emit(TopK& best_tokens, TopK& best_pages, int K, int32_t* pages, int32_t* tokens, float* page_scores,
            float* token_scores) const;

  int64_t num_tokens() const { return static_cast<int64_t>(nodes_.size()); }
  int num_levels() const { return static_cast<int>(levels_.size()); }
  int num_pages() const { return static_cast<int>(leaves_.size()); }
  double max_sq_norm() const { return M_; }
  const std::vector<Leaf>& leaves() const { return leaves_; }
  const std::vector<Node>& nodes() const { return nodes_; }
  const std::vector<float>& sq_norms() const { return sq_norm_; }
  const std::vector<float>& projections() const { return proj_; }
  const std::vector<int32_t>& free_pages() const { return free_pages_; }
  std::vector<uint8_t>& changed() { return changed_; }
  // Self-check of every structural invariant; returns a description of the first violation, or "".
  std::string check() const;

 private:
  // level schedule (docs/dci.md)
  int next_level();
  void reset();
  void append_points(const void* keys, int64_t m, bool widen);
  // At the end of a build: the key rows rewritten in leaf order (every parent's leaves in order, each leaf's slots
  // in order), so that a scan over a parent's children reads one contiguous block.
  void lay_out_rows_by_leaf();
  // Key row `id` as float32: a pointer into the float32 rows when they are held (always without bf16_keys; during
  // a reference build with them), else the bfloat16 row widened into `buf` (dim floats), which is returned.
  const float* key_row(int64_t id, float* buf) const;
  // Dot products of q with the key rows `ids` (one query), and of qs[j] with them (several, out[j * stride + r]):
  // the same sequence of operations whichever the storage, so a value never depends on it (during a build, bf16
  // rows are widened whatever the instruction set: see widen_bf16_rows_).
  void dot_keys(const float* q, const int32_t* ids, int m, float* out, const Bf16Split* split = nullptr) const;
  void dot_keys_multi(const float* const* qs, int nq, const int32_t* ids, int m, float* out, int stride,
                      const Bf16Split* splits = nullptr) const;
  // A key row's cache lines requested ahead of its scoring (a page's rows lie anywhere in the key array).
  void prefetch_row(int32_t id) const {
    const int row_bytes = cfg_->dim * (cfg_->bf16_keys ? 2 : 4);
    const char* row = key_bytes_of(id);
    for (int off = 0; off < row_bytes; off += 64) __builtin_prefetch(row + off);
  }
  void prefetch_rows(const Leaf& lf) const {
    for (int t = 0; t < lf.count; ++t) prefetch_row(lf.item[t]);
  }
  void project(int64_t first, int64_t last, int threads);
  void correct_projection(int32_t id);
  // pages (docs/dci.md, tree and pages)
  int32_t alloc_page();
  void free_page(int32_t page);
  // Flags a page as changed, and with a first pass refreshes the approximate copies and error bounds of its rows.
  void mark(int32_t page);
  void refresh_page_rows(int32_t page);
  // The half copy of one key row and its error slack (see page_slack_).
  void encode_half_row(const float* key, uint16_t* half, float* slack) const;
  // The 8-bit codes of one key row, their scale and its error slack (see page_int8_).
  void encode_int8_row(const float* key, int8_t* code, float* scale, float* slack) const;
  // The first pass's copy of page slot `row` (page * kPageSlots + slot) from the key of token `id`.
  void encode_page_row(int64_t row, int32_t id, float* buf);
  int32_t ensure_kids(int32_t node);
  ChildIndex& kids_of(int32_t node) { return kids_[node < 0 ? kRootSlot : nodes_[node].kid_slot]; }
  const ChildIndex& kids_of(int32_t node) const { return kids_[node < 0 ? kRootSlot : nodes_[node].kid_slot]; }
  void bulk_load(int32_t parent_node, std::vector<int32_t>& children, const int32_t* page_ids);
  void insert_child(int32_t parent_node, int32_t child);
  void remove_child(int32_t parent_node, int32_t child);
  void refresh_stale(int32_t parent_node);
  void recount();
  // distances and search (sections 1.3, 1.7)
  float key_dist(const float* a, float a_sq, const float* b, float b_sq) const;
  // The key-key distance from a.b and the squared norms: every parent search computes it through here.
  float key_dist_from_dot(double ab, double a_sq, double b_sq) const {
    if (cfg_->transform)
      return static_cast<float>(M_ - ab - std::sqrt(std::max(0.0, M_ - a_sq) * std::max(0.0, M_ - b_sq)));
    return static_cast<float>(a_sq + b_sq - 2.0 * ab);
  }
  // key_dist_from_dot(dots[i], a_sq, b_sq[i]) for i < m (out may be dots): the same value element by element, eight
  // at a time where the CPU has AVX-512 (key_dists_transform).
  void key_dists_from_dots(const float* dots, const double* b_sq, int64_t m, double a_sq, float* out) const;
  void score(const Probe& p, const int32_t* ids, int m, float* out) const;
  // all_scored: return every scored child unsorted (the last level of a query) instead of the best k.
  // ordered = false (with coverage 0): the best k in no particular order, for a caller that selects again.
  void search_children(const ChildIndex& ci, const float* qproj, const Probe& p, int k, int coverage,
                       const SearchConfig& sc, Scratch& s, std::vector<Candidate>& out,
                       bool all_scored = false, bool ordered = true) const;
  // Last level of a query with one direction (L = 1): the children search pops a contiguous run of the sorted
  // projections, and the leaves hold the children in that same order, so the run is scored leaf by leaf straight
  // from the page key buffers and fed to the accumulators without building a candidate list.
  void scan_last_level(const ChildIndex& ci, float qproj, const Probe& p, int k, const SearchConfig& sc,
                       Scratch& s) const;
  // The run [first, last) of ci's sorted children that the children search pops with one simple index.
  std::pair<int, int> last_level_run(const ChildIndex& ci, float qproj, int k, const SearchConfig& sc) const;
  void feed(const Candidate& c, Scratch& s) const;
  int32_t cover(int32_t node) const {
    const Node& nd = nodes_[node];
    return 1 + (nd.kid_slot >= 0 ? kids_[nd.kid_slot].pages_under : 0);
  }
  // parent assignment (sections 1.5, 1.6)
  std::pair<int32_t, float> nearest_parent(int32_t point, int upper_level, const SearchConfig& sc,
                                           int brute_threshold, Scratch& s, bool refresh);
  std::pair<int32_t, float> brute_parent(int32_t point, const std::vector<int32_t>& upper) const;
  void brute_parents(const std::vector<int32_t>& points, const std::vector<int64_t>& which,
                     const std::vector<int32_t>& upper, int threads, std::vector<int32_t>& parent,
                     std::vector<float>& pdist) const;
  std::pair<int32_t, float> dci_parent(int32_t point, int upper_level, const SearchConfig& sc, Scratch& s,
                                       bool refresh);
  void assign_parents(int level, const SearchConfig& sc, const AnchorConfig& ac, int brute_threshold, int threads,
                      bool reference, std::vector<int32_t>& parent, std::vector<float>& pdist);
  // The anchor shortcut's candidates for every point strictly between anchors[j - 1] and anchors[j], for every j:
  // such points share their X nearest anchors on each side, so each segment scores its points against its list in
  // one multi-query call. Sets parent, pdist and accepted for the points it places.
  void shortcut_segments(const std::vector<int64_t>& anchors, int X, double threshold,
                         const std::vector<float>& max_child, int threads, std::vector<int32_t>& parent,
                         std::vector<float>& pdist, std::vector<uint8_t>& accepted) const;
  // The same, point by point over the float32 copies of the keys (the reference build's).
  void shortcut_points(const std::vector<int64_t>& anchors, int X, double threshold,
                       const std::vector<float>& max_child, int threads, std::vector<int32_t>& parent,
                       std::vector<float>& pdist, std::vector<uint8_t>& accepted) const;
  void insert_point(int32_t id, const SearchConfig& sc, int brute_threshold, Scratch& s);

  const IndexConfig* cfg_;
  const float* dirs_;   // [L][dir_stride]
  std::mt19937_64 rng_;

  // Key rows by token id, [n][dim]: float32 (keys_), or bfloat16 (keys_bf16_) with bf16_keys, where keys_ holds a
  // float32 copy only while a reference build runs (build(reference=true)) and is released at its end.
  RowVector<float> keys_;
  RowVector<uint16_t> keys_bf16_;
  // row_of_[id]: the storage row of token id (empty during a build: row = id). Only the layout changes with it:
  // ids, and so every tie-break and result, are those of id-ordered storage.
  std::vector<int32_t> row_of_;
  std::vector<float> sq_norm_;    // [n]
  std::vector<float> proj_;       // [n][L]
  std::vector<Node> nodes_;
  std::vector<ChildIndex> kids_;  // kids_[0] = root
  std::vector<std::vector<int32_t>> levels_;
  std::vector<Leaf> leaves_;      // indexed by page id
  // FirstPass::kHalf only. page_half_[pages][16][dim]: each page's key rows in slot order rounded to IEEE half.
  // FirstPass::kInt8 only. page_int8_[pages][16][dim] and page_scale_[pages][16]: each row k as codes z with
  // |z_i| <= 127 and a scale c = max_i |k_i| / 127, h = c z (within c/2 of k in every coordinate).
  // Both: page_slack_[pages][16]: for a row k with approximate copy h, an s such that the float32 dot products of
  // any q with k and with h (as the first pass computes it) differ by at most |q| s: s = |k - h| + 2 max(dim, 16)
  // 2^-24 (|k| + |h|) (+ 2^-23 |h| for int8's product with the scale), the second term covering the rounding of both
  // sums. +inf (and a zero row) when a value is beyond the copy's range (half) or not finite: that row is always
  // re-scored.
  std::vector<uint16_t> page_half_;
  std::vector<int8_t> page_int8_;
  std::vector<float> page_scale_;
  std::vector<float> page_slack_;
  // page_rows_[pages][16]: the storage row of each slot's token, row(item), kept by mark() (and rebuilt when a build
  // lays the rows out), so that a scan lists a page's rows from one cache line instead of one row_of_ entry each.
  std::vector<int32_t> page_rows_;
  std::vector<int32_t> free_pages_;
  std::vector<uint8_t> changed_;
  double M_ = 0.0;                // running max squared key norm
  // Set while a build runs over bf16 keys without a float32 copy: the key scores widen the rows in every
  // instruction set, so the tree is the one the float32 copy gave (avx512bf16's kernels sum in another order).
  bool widen_bf16_rows_ = false;
  std::vector<int64_t> level_count_;
  int next_target_ = 0;
};

// kernels.cpp
// The instruction set the dot-product kernels run with (docs/dci.md, kernels): portable x86-64, x86-64-v3 (AVX2 +
// FMA) or AVX-512 (x86-64-v4). AVX2 and AVX-512 give bit-identical values; the portable build rounds each product
// before adding it (no FMA). By default the widest the CPU runs; ICECACHE_DCI_ISA (read once) or set_isa choose.
// Narrowest first. kAvx512Bf16 is kAvx512 with bf16 rows scored by vdpbf16ps (kernels.cpp).
enum class Isa : int { kPortable = 0, kAvx2 = 1, kAvx512 = 2, kAvx512Bf16 = 3 };
Isa supported_isa();  // the widest this CPU runs
Isa active_isa();
void set_isa(Isa isa);  // throws std::invalid_argument when the CPU cannot run it
// Throws std::invalid_argument when ICECACHE_DCI_ISA names an unknown set or one the CPU cannot run.
void check_isa_environment();
const char* isa_name(Isa isa);
bool parse_isa(const std::string& name, Isa* isa);
// Bytes per second that `threads` OpenMP threads read from a fresh buffer of n_bytes (each thread sums its share),
// the best of `passes` passes.
double measure_read_rate(int64_t n_bytes, int threads, int passes);

void dot_rows(const float* q, const float* rows, const int32_t* ids, int m, int dim, float* out);
// dot_rows over bfloat16 rows (bit patterns), widened exactly: the values of dot_rows over their float32 copies,
// except with the avx512bf16 kernels (kernels.cpp), which sum the exact products in their own order. `split` is
// q's split (or null, or one with hi == nullptr); it changes the speed, never a value.
void dot_rows_bf16(const float* q, const uint16_t* rows, const int32_t* ids, int m, int dim, float* out,
                   const Bf16Split* split = nullptr);
// q's split into hi and lo (2 * dim values of buf) when the active instruction set scores bf16 rows with it; a
// Bf16Split with hi == nullptr otherwise. `buf` must live as long as the split is used.
Bf16Split split_bf16(const float* q, int dim, uint16_t* buf);
float dot(const float* a, const float* b, int dim);
// out[j * out_stride + r] = qs[j] . rows[r] for j < nq (any nq), reading each row once; every value is bit-identical
// to dot_rows' value for the same query and row.
void dot_rows_multi(const float* const* qs, int nq, const float* rows, int m, int dim, float* out, int out_stride);
// dot_rows_multi for many queries over contiguous rows (the build's brute-force parents): the same values, four
// queries by four rows at a time where the CPU has AVX-512.
void dot_rows_multi_packed(const float* const* qs, int nq, const float* rows, int m, int dim, float* out,
                           int out_stride);
// Rows of the same array to be scored next: their cache lines are requested while the current rows are scored (one
// row's lines per row scored; what is left after the last one).
struct RowsAhead {
  const int32_t* ids = nullptr;
  int n = 0;
  bool to_l2 = true;  // into L2 only (ScanTuning::prefetch_level 2), else into L1
};
// dot_rows_multi over rows ids[0..m) of `rows` (float32 or bfloat16 bit patterns): the same values as dot_rows_multi
// over those rows copied out contiguously. Rows ahead.ids[0..n) are prefetched meanwhile.
void dot_rows_multi_ids(const float* const* qs, int nq, const float* rows, const int32_t* ids, int m, int dim,
                        float* out, int out_stride, const RowsAhead& ahead = RowsAhead{});
void dot_rows_multi_ids_bf16(const float* const* qs, int nq, const uint16_t* rows, const int32_t* ids, int m, int dim,
                             float* out, int out_stride, const RowsAhead& ahead = RowsAhead{},
                             const Bf16Split* splits = nullptr);  // splits: nq of them, or null
// dot_rows_bf16 and dot_rows_multi_ids_bf16 with the rows widened to float32 in every instruction set, avx512bf16
// included: bit for bit the values of dot_rows and dot_rows_multi over the rows' float32 copies. A build scores
// with these, so that its tree never depends on the bf16 kernels.
void dot_rows_bf16_widened(const float* q, const uint16_t* rows, const int32_t* ids, int m, int dim, float* out);
void dot_rows_multi_ids_bf16_widened(const float* const* qs, int nq, const uint16_t* rows, const int32_t* ids, int m,
                                     int dim, float* out, int out_stride);
// out[i] = float(M - dots[i] - sqrt(a_room * max(0, M - b_sq[i]))), bit for bit in every instruction set (out may
// be dots): the MIPS-transformed key-key distance of Instance::key_dist_from_dot for m rows at once.
void key_dists_transform(const float* dots, const double* b_sq, int64_t m, double M, double a_room, float* out);
// bfloat16 bit patterns to float32 (exact).
void bf16_to_float(const uint16_t* src, int n, float* dst);
// IEEE binary16 conversions (round to nearest even; overflow gives infinity) and dot_rows_multi over half rows.
// The half kernel's values are approximate in their order of summation; only the bound in page_slack_ is relied on.
uint16_t float_to_half(float f);
float half_to_float(uint16_t h);
// Rounds src[0, n) to half into dst; sums = float32 sums of |src - half|^2, |src|^2 and |half|^2 (summation order
// unspecified: each carries a relative error of at most n 2^-24).
void encode_half(const float* src, int n, uint16_t* dst, float* sums);
void dot_rows_multi_half(const float* const* qs, int nq, const uint16_t* rows, int m, int dim, float* out,
                         int out_stride);
// 8-bit codes of a row: z_i = round(src_i / c), c = max_i |src_i| / 127 (0 and zero codes for a zero row); sums =
// float64 sums of |src - c z|^2, |src|^2 and |c z|^2. A row with a value that is not finite gets zero codes, c = 0
// and sums[0] = +inf. Scalar IEEE arithmetic: every host stores the same codes.
void encode_int8(const float* src, int n, int8_t* dst, float* scale, double* sums);
// out[j * out_stride + r] = scales[r] * (qs[j] . z_r) over m consecutive code rows; approximate in its order of
// summation, like the half kernel (only the bound in page_slack_ is relied on).
void dot_rows_multi_int8(const float* const* qs, int nq, const int8_t* rows, const float* scales, int m, int dim,
                         float* out, int out_stride);

}  // namespace dci
