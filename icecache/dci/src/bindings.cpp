// Python binding of the DCI index (the Forest class, forest.hpp) and of the sources compiled into the same module
// (IceCache's decode step, icecache/method/src/decode_step.cpp, registered by icecache_bind_decode_step).
#include <pybind11/pybind11.h>

#include <atomic>
#include <string>
#include <vector>

#include "forest.hpp"

namespace py = pybind11;
using dci_forest::FArray;
using dci_forest::Forest;

void icecache_bind_decode_step(py::module_& m);  // decode_step.cpp

PYBIND11_MODULE(_dci, m) {
  m.doc() = "Multi-level Prioritized DCI with M-DCI page leaves and the MIPS transform (see icecache/dci/index.py)";
  m.attr("PAGE_SLOTS") = dci::kPageSlots;
  // The kernels' instruction set (docs/dci.md, kernels) and the host's read rate.
  dci::check_isa_environment();
  m.def("isa", [] { return std::string(dci::isa_name(dci::active_isa())); });
  m.def("supported_isa", [] { return std::string(dci::isa_name(dci::supported_isa())); });
  m.def("set_isa", [](const std::string& name) {
    dci::Isa isa;
    if (!dci::parse_isa(name, &isa)) throw std::invalid_argument("isa must be portable, avx2, avx512 or avx512bf16, not " + name);
    dci::set_isa(isa);
  });
  // The run of projections a last-level scan reads (nearest_run), for its test against the merge it replaces.
  m.def("_nearest_run", [](const std::vector<float>& sorted, float qp, int count) {
    return dci::nearest_run(sorted.data(), static_cast<int>(sorted.size()), qp, count);
  });
  // The search team (team.hpp) exercised on its own, for its tests: `runs` runs of 1..size threads in turn, each
  // with `phases` phases of a shared loop of `items` indices and a barrier. Returns, per run, whether after every
  // barrier all of the run's threads had finished the phase and the loop had given out each index exactly once.
  // Thread `fail_tid` throws in phase `fail_phase` of the last run (-1: never), which run rethrows.
  m.def("_team_check", [](int size, int runs, int phases, int items, double spin_s, int fail_tid, int fail_phase) {
    std::vector<bool> held;
    {
      py::gil_scoped_release nogil;
      dci::Team team(size, static_cast<int64_t>(spin_s * 1e9));
      for (int r = 0; r < runs; ++r) {
        const int n = 1 + r % team.size();
        const bool failing = r == runs - 1 && fail_tid >= 0;
        std::vector<std::atomic<int>> finished(phases);
        std::vector<std::atomic<int>> given(static_cast<size_t>(phases) * items);
        std::vector<std::atomic<int64_t>> next(phases);
        for (auto& x : finished) x = 0;
        for (auto& x : given) x = 0;
        for (auto& x : next) x = 0;
        std::atomic<bool> ok{true};
        team.run(n, [&](const int tid) {
          for (int p = 0; p < phases; ++p) {
            team.guarded([&] {
              if (failing && tid == fail_tid && p == fail_phase)
                throw std::runtime_error("thread " + std::to_string(tid) + " failed in phase " + std::to_string(p));
              for (int64_t i; (i = dci::Team::next_index(next[p])) < items;) ++given[p * items + i];
              ++finished[p];
            });
            team.barrier();
            if (finished[p].load() != n) ok = false;
            for (int i = 0; i < items; ++i)
              if (given[p * items + i].load() != 1) ok = false;
            team.barrier();  // nobody starts the next phase before everyone has checked this one
          }
        });
        held.push_back(ok.load());
      }
    }
    return held;
  }, py::arg("size"), py::arg("runs"), py::arg("phases"), py::arg("items"), py::arg("spin_s"),
     py::arg("fail_tid") = -1, py::arg("fail_phase") = -1);
  m.def("measure_read_rate", [](int64_t n_bytes, int threads, int passes) {
    py::gil_scoped_release nogil;
    return dci::measure_read_rate(n_bytes, threads, passes);
  }, py::arg("n_bytes"), py::arg("num_threads"), py::arg("passes") = 5);
  // The last-level scan's speed knobs (dci::ScanTuning; never a result): benchmarks compare settings with them.
  m.def("scan_tuning", [] {
    const dci::ScanTuning t = dci::scan_tuning();
    py::dict d;
    d["prefetch_rows"] = t.prefetch_rows;
    d["chunk_rows"] = t.chunk_rows;
    d["prefetch_level"] = t.prefetch_level;
    return d;
  });
  m.def("set_scan_tuning", [](int prefetch_rows, int chunk_rows, int prefetch_level) {
    dci::set_scan_tuning(dci::ScanTuning{prefetch_rows, chunk_rows, prefetch_level});
  }, py::arg("prefetch_rows"), py::arg("chunk_rows"), py::arg("prefetch_level"));
  // The scoring kernels called directly (tests compare the instruction sets on them): queries [nq, dim] against
  // rows[ids] (float32, or uint16 bfloat16 bits) with `kernel` "dot", "rows" (one query at a time) or "multi".
  m.def("kernel_scores", [](const std::string& kernel, FArray queries, py::array rows,
                            py::array_t<int32_t, py::array::c_style> ids) {
    if (queries.ndim() != 2 || rows.ndim() != 2 || rows.shape(1) != queries.shape(1) || ids.ndim() != 1 ||
        !(rows.flags() & py::array::c_style) || (rows.itemsize() != 2 && rows.itemsize() != 4))
      throw std::invalid_argument("queries [nq, dim] float32, rows [n, dim] float32 or uint16, ids [m] int32");
    const int nq = static_cast<int>(queries.shape(0)), dim = static_cast<int>(queries.shape(1));
    const int m = static_cast<int>(ids.size());
    for (int r = 0; r < m; ++r)
      if (ids.data()[r] < 0 || ids.data()[r] >= rows.shape(0)) throw py::index_error("row id out of range");
    const bool bf16 = rows.itemsize() == 2;
    if (kernel == "dot" && bf16) throw std::invalid_argument("the dot kernel takes float32 rows");
    py::array_t<float> out({nq, m});
    float* o = out.mutable_data();
    const float* q = queries.data();
    const int32_t* id = ids.data();
    std::vector<const float*> qs(nq);
    for (int j = 0; j < nq; ++j) qs[j] = q + static_cast<int64_t>(j) * dim;
    if (kernel == "dot") {
      const float* base = static_cast<const float*>(rows.data());
      for (int j = 0; j < nq; ++j)
        for (int r = 0; r < m; ++r) o[j * m + r] = dci::dot(qs[j], base + static_cast<int64_t>(id[r]) * dim, dim);
    } else if (kernel == "rows") {
      for (int j = 0; j < nq; ++j) {
        if (bf16) dci::dot_rows_bf16(qs[j], static_cast<const uint16_t*>(rows.data()), id, m, dim, o + j * m);
        else dci::dot_rows(qs[j], static_cast<const float*>(rows.data()), id, m, dim, o + j * m);
      }
    } else if (kernel == "multi") {
      if (bf16) dci::dot_rows_multi_ids_bf16(qs.data(), nq, static_cast<const uint16_t*>(rows.data()), id, m, dim, o, m);
      else dci::dot_rows_multi_ids(qs.data(), nq, static_cast<const float*>(rows.data()), id, m, dim, o, m);
    } else {
      throw std::invalid_argument("kernel must be dot, rows or multi, not " + kernel);
    }
    return out;
  });
  py::class_<Forest>(m, "Forest")
      .def(py::init<int, int, int, int, double, double, bool, bool, uint64_t, FArray, int, int, bool>())
      .def_property_readonly("first_pass", [](const Forest& f) { return static_cast<int>(f.cfg_.first_pass); })
      .def_property_readonly("bf16_keys", [](const Forest& f) { return f.cfg_.bf16_keys; })
      .def("reserve", &Forest::reserve)
      .def("keys", &Forest::keys)
      .def("key_storage_rows", &Forest::key_storage_rows)
      .def("pages_items", &Forest::pages_items)
      .def("memory_bytes", &Forest::memory_bytes)
      .def("gather_keys", &Forest::gather_keys)
      .def("last_query_stats", &Forest::last_query_stats)
      .def("last_query_phases", &Forest::last_query_phases)
      .def_property("num_threads", &Forest::threads, &Forest::set_threads)
      .def("build", &Forest::build)
      .def("insert", &Forest::insert)
      .def("query", &Forest::query)
      .def("num_instances", &Forest::num_instances)
      .def("num_tokens", [](const Forest& f, int i) { return f.at(i).num_tokens(); })
      .def("num_levels", [](const Forest& f, int i) { return f.at(i).num_levels(); })
      .def("num_pages", &Forest::num_pages)
      .def("page_tokens", &Forest::page_tokens)
      .def("page_valid_counts", &Forest::page_valid_counts)
      .def("token_to_page", &Forest::token_to_page)
      .def("pop_changed_pages", &Forest::pop_changed_pages)
      .def("node_info", &Forest::node_info)
      .def("max_sq_norm", &Forest::max_sq_norm)
      .def("directions", &Forest::directions)
      .def("check", [](const Forest& f, int i) { return f.at(i).check(); });
  icecache_bind_decode_step(m);
}
