// kvstore._native.OffsetAllocatorCore: the thin binding of allocator.hpp.
#include <pybind11/pybind11.h>

#include "allocator.hpp"
#include "module.hpp"

namespace kvstore_native {


namespace py = pybind11;

static void register_allocator(py::module_& m) {
    py::class_<OffsetAllocatorCore>(m, "OffsetAllocatorCore",
        "Best-fit offset allocator over [0, capacity) (kvstore/native/allocator.hpp).\n\n"
        "Args: capacity (bytes), alignment (a power of two). Raises ValueError on a bad one.")
        .def(py::init<uint64_t, uint64_t>(), py::arg("capacity"), py::arg("alignment"))
        .def("allocate",
             [](OffsetAllocatorCore& a, uint64_t size) -> py::object {
                 Allocation out;
                 if (!a.allocate(size, &out)) return py::none();
                 return py::make_tuple(out.offset, out.reserved, out.serial);
             },
             py::arg("size"),
             "(offset, reserved, serial) of a new allocation of `size` bytes, or None: no room.")
        .def("free", &OffsetAllocatorCore::free, py::arg("offset"), py::arg("serial"),
             py::arg("reserved"),
             "Frees a live allocation; ValueError when it is not live (double free, foreign).")
        .def_property_readonly("capacity", &OffsetAllocatorCore::capacity)
        .def_property_readonly("alignment", &OffsetAllocatorCore::alignment)
        .def_property_readonly("used", &OffsetAllocatorCore::used)
        .def_property_readonly("free_bytes", &OffsetAllocatorCore::free_bytes)
        .def_property_readonly("largest_free", &OffsetAllocatorCore::largest_free)
        .def_property_readonly("num_allocations", &OffsetAllocatorCore::num_allocations)
        .def_property_readonly("num_free_extents", &OffsetAllocatorCore::num_free_extents)
        .def_property_readonly("last_serial", &OffsetAllocatorCore::last_serial)
        .def_property_readonly("live_table_bytes", &OffsetAllocatorCore::live_table_bytes)
        .def("check", &OffsetAllocatorCore::check,
             "'' when every invariant holds, else the first one broken; O(n).");
}

static Registered reg_allocator(&register_allocator);

}  // namespace kvstore_native
