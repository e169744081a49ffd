// Python binding of the DCI index (the Forest class, forest.hpp) and of the sources compiled into the same module
// (IceCache's decode step, icecache/method/src/decode_step.cpp, registered by icecache_bind_decode_step).
#include <pybind11/pybind11.h>

#include "forest.hpp"

namespace py = pybind11;
using dci_forest::FArray;
using dci_forest::Forest;

void icecache_bind_decode_step(py::module_& m);  // decode_step.cpp

PYBIND11_MODULE(_dci, m) {
  m.doc() = "Multi-level Prioritized DCI with M-DCI page leaves and the MIPS transform (see icecache/dci/index.py)";
  m.attr("PAGE_SLOTS") = dci::kPageSlots;
  py::class_<Forest>(m, "Forest")
      .def(py::init<int, int, int, int, double, double, bool, bool, uint64_t, FArray, int, bool, bool>())
      .def_property_readonly("half_scores", [](const Forest& f) { return f.cfg_.half_scores; })
      .def_property_readonly("bf16_keys", [](const Forest& f) { return f.cfg_.bf16_keys; })
      .def("reserve", &Forest::reserve)
      .def("keys", &Forest::keys)
      .def("key_storage_rows", &Forest::key_storage_rows)
      .def("pages_items", &Forest::pages_items)
      .def("memory_bytes", &Forest::memory_bytes)
      .def("gather_keys", &Forest::gather_keys)
      .def("last_query_stats", &Forest::last_query_stats)
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
