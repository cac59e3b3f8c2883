// kvstore._native.EvictionCore: the thin binding of eviction.hpp.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string_view>

#include "eviction.hpp"
#include "module.hpp"

namespace kvstore_native {

namespace py = pybind11;

static void register_eviction(py::module_& m) {
    py::class_<EvictionCore>(m, "EvictionCore",
        "A tier's eviction bookkeeping by object slot (kvstore/native/eviction.hpp).\n\n"
        "Args: kind (0 LRU, 1 LFU, 2 DEFAULT, 3 NONE), leaf_first, protect_s, ghost_factor,\n"
        "fade_ratio, retention_weight. Raises ValueError: an unknown kind.")
        .def(py::init([](int kind, bool leaf_first, double protect_s, double ghost_factor,
                         double fade_ratio, double retention_weight) {
                 PolicyParams p;
                 p.kind = PolicyKind(kind);
                 p.leaf_first = leaf_first;
                 p.protect_s = protect_s;
                 p.ghost_factor = ghost_factor;
                 p.fade_ratio = fade_ratio;
                 p.retention_weight = retention_weight;
                 return new EvictionCore(p);
             }),
             py::arg("kind"), py::arg("leaf_first") = false, py::arg("protect_s") = 0.0,
             py::arg("ghost_factor") = 0.0, py::arg("fade_ratio") = 1.0,
             py::arg("retention_weight") = 1.0)
        .def("insert",
             [](EvictionCore& c, int64_t slot, uint64_t size, double now, int64_t parent,
                std::string_view key) {
                 c.insert(slot, size, now, parent, key.empty() ? 0 : fnv1a64(key));
             },
             py::arg("slot"), py::arg("size"), py::arg("now"), py::arg("parent") = -1,
             py::arg("key") = std::string_view(),
             "A new object at slot (tracked: an access); key feeds the ghost history.")
        .def("access", &EvictionCore::access, py::arg("slot"), py::arg("now"))
        .def("prefetch", &EvictionCore::prefetch, py::arg("slot"), py::arg("now"))
        .def("remove",
             [](EvictionCore& c, int64_t slot, std::string_view key) {
                 c.remove(slot, key.empty() ? 0 : fnv1a64(key));
             },
             py::arg("slot"), py::arg("key") = std::string_view(),
             "The object at slot left (untracked: ignored); key feeds the ghost history.")
        .def("pop", &EvictionCore::pop, "The best slot, out of the heap; -1 when empty.")
        .def("propose", &EvictionCore::propose, py::arg("slot"))
        .def("restore", &EvictionCore::restore, py::arg("held"))
        .def("__contains__", &EvictionCore::contains)
        .def("__len__", &EvictionCore::size)
        .def_property_readonly("used_bytes", &EvictionCore::used_bytes)
        .def("size_of", &EvictionCore::size_of, py::arg("slot"))
        .def("freq", &EvictionCore::freq, py::arg("slot"))
        .def_property_readonly("heap_size", &EvictionCore::heap_size)
        .def_property_readonly("retention_s", &EvictionCore::retention_s)
        .def_property_readonly("credit_s", &EvictionCore::credit_s)
        .def_property_readonly("ghosts", &EvictionCore::ghosts)
        .def_property_readonly("native_bytes", &EvictionCore::native_bytes)
        .def("check", &EvictionCore::check, "'' when the bookkeeping holds; O(n).");
}

static Registered reg_eviction(&register_eviction);

}  // namespace kvstore_native
