// kvstore._native.OffsetAllocatorCore and kvstore._native.Allocation: the thin binding of
// allocator.hpp, and the handle of one live range.
//
// Allocation is a plain CPython type written against the C API, not a pybind11
// class: a node holds one per object copy in DRAM, so it is 48 bytes in all
// (the object header and four uint64 fields; no GC header, as it references no
// other object; no separate C++ allocation). The fields are read-only members.
#include <pybind11/pybind11.h>

#include <Python.h>
#include <structmember.h>

#include "allocation.hpp"
#include "allocator.hpp"
#include "module.hpp"

namespace kvstore_native {

namespace py = pybind11;

namespace {

struct AllocationObject {
    PyObject_HEAD
    unsigned long long offset;    // start of the range, a multiple of the alignment
    unsigned long long size;      // bytes requested: the object's bytes are [offset, offset + size)
    unsigned long long reserved;  // bytes taken from the free space; >= size, >= 1
    unsigned long long serial;    // unique among the process's allocations, ever (1, 2, ...)
};

PyMemberDef allocation_members[] = {
    {"offset", T_ULONGLONG, offsetof(AllocationObject, offset), READONLY,
     "Start of the range (bytes), a multiple of the alignment."},
    {"size_bytes", T_ULONGLONG, offsetof(AllocationObject, size), READONLY,
     "Bytes requested; the object's bytes are [offset, offset + size_bytes)."},
    {"reserved_bytes", T_ULONGLONG, offsetof(AllocationObject, reserved), READONLY,
     "Bytes taken from the free space; >= size_bytes, >= 1."},
    {"serial", T_ULONGLONG, offsetof(AllocationObject, serial), READONLY,
     "Unique among the process's allocations, ever (increasing from 1): names one lifetime\n"
     "of a range, so a reader can tell the same bytes from a later object at the same offset."},
    {nullptr, 0, 0, 0, nullptr}};

PyObject* allocation_end(PyObject* self, void*) {
    auto* a = reinterpret_cast<AllocationObject*>(self);
    return PyLong_FromUnsignedLongLong(a->offset + a->reserved);
}

PyGetSetDef allocation_getset[] = {
    {"end", allocation_end, nullptr, "One past the last reserved byte.", nullptr},
    {nullptr, nullptr, nullptr, nullptr, nullptr}};

PyTypeObject AllocationType = {PyVarObject_HEAD_INIT(nullptr, 0)};

bool field(PyObject* value, const char* name, unsigned long long* out) {
    *out = PyLong_AsUnsignedLongLong(value);
    if (*out == static_cast<unsigned long long>(-1) && PyErr_Occurred()) {
        PyErr_Format(PyExc_ValueError, "Allocation.%s must be an int in [0, 2**64), got %R",
                     name, value);
        return false;
    }
    return true;
}

PyObject* allocation_new(PyTypeObject*, PyObject* args, PyObject* kwargs) {
    static const char* names[] = {"offset", "size_bytes", "reserved_bytes", "serial", nullptr};
    PyObject *o, *s, *r, *n = nullptr;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOO|O:Allocation", const_cast<char**>(names),
                                     &o, &s, &r, &n))
        return nullptr;
    unsigned long long offset, size, reserved, serial = 0;
    if (!field(o, "offset", &offset) || !field(s, "size_bytes", &size) ||
        !field(r, "reserved_bytes", &reserved) || (n && !field(n, "serial", &serial)))
        return nullptr;
    return allocation_make(offset, size, reserved, serial);
}

// Equal ranges are equal handles; the serial is not compared (as the dataclass it replaces).
PyObject* allocation_richcompare(PyObject* a, PyObject* b, int op) {
    if (!PyObject_TypeCheck(b, &AllocationType) || (op != Py_EQ && op != Py_NE))
        Py_RETURN_NOTIMPLEMENTED;
    auto* x = reinterpret_cast<AllocationObject*>(a);
    auto* y = reinterpret_cast<AllocationObject*>(b);
    bool eq = x->offset == y->offset && x->size == y->size && x->reserved == y->reserved;
    if ((op == Py_EQ) == eq) Py_RETURN_TRUE;
    Py_RETURN_FALSE;
}

Py_hash_t allocation_hash(PyObject* self) {
    auto* a = reinterpret_cast<AllocationObject*>(self);
    uint64_t h = a->offset * 0x9E3779B97F4A7C15ull;
    h = (h ^ a->size) * 0xC2B2AE3D27D4EB4Full;
    h = (h ^ a->reserved) * 0x165667B19E3779F9ull;
    Py_hash_t out = static_cast<Py_hash_t>(h >> 1);
    return out == -1 ? -2 : out;
}

PyObject* allocation_repr(PyObject* self) {
    auto* a = reinterpret_cast<AllocationObject*>(self);
    return PyUnicode_FromFormat("Allocation(offset=%llu, size_bytes=%llu, reserved_bytes=%llu, "
                                "serial=%llu)", a->offset, a->size, a->reserved, a->serial);
}

void ready_allocation_type() {
    AllocationType.tp_name = "kvstore._native.Allocation";
    AllocationType.tp_basicsize = sizeof(AllocationObject);
    AllocationType.tp_flags = Py_TPFLAGS_DEFAULT;
    AllocationType.tp_doc =
        "Allocation(offset, size_bytes, reserved_bytes, serial=0): a live range handed out by\n"
        "an offset allocator (bytes). Immutable; equal when the range and sizes are.\n\n"
        "Raises ValueError: a field outside [0, 2**64).";
    AllocationType.tp_new = allocation_new;
    AllocationType.tp_members = allocation_members;
    AllocationType.tp_getset = allocation_getset;
    AllocationType.tp_richcompare = allocation_richcompare;
    AllocationType.tp_hash = allocation_hash;
    AllocationType.tp_repr = allocation_repr;
    if (PyType_Ready(&AllocationType) < 0) throw py::error_already_set();
}

}  // namespace

PyObject* allocation_make(unsigned long long offset, unsigned long long size,
                          unsigned long long reserved, unsigned long long serial) {
    auto* a = PyObject_New(AllocationObject, &AllocationType);
    if (!a) return nullptr;
    a->offset = offset;
    a->size = size;
    a->reserved = reserved;
    a->serial = serial;
    return reinterpret_cast<PyObject*>(a);
}

bool allocation_fields(PyObject* h, unsigned long long* offset, unsigned long long* size,
                       unsigned long long* reserved, unsigned long long* serial) {
    if (!PyObject_TypeCheck(h, &AllocationType)) return false;
    auto* a = reinterpret_cast<AllocationObject*>(h);
    *offset = a->offset;
    *size = a->size;
    *reserved = a->reserved;
    *serial = a->serial;
    return true;
}

namespace {

const AllocationObject& as_allocation(py::handle h) {
    if (!PyObject_TypeCheck(h.ptr(), &AllocationType))
        throw py::type_error("expected an Allocation, got " +
                             std::string(Py_TYPE(h.ptr())->tp_name));
    return *reinterpret_cast<AllocationObject*>(h.ptr());
}

}  // namespace

static void register_allocator(py::module_& m) {
    ready_allocation_type();
    m.add_object("Allocation", py::reinterpret_borrow<py::object>(
                                   reinterpret_cast<PyObject*>(&AllocationType)));

    py::class_<OffsetAllocatorCore>(m, "OffsetAllocatorCore",
        "Best-fit offset allocator over [0, capacity) (kvstore/native/allocator.hpp).\n\n"
        "Args: capacity (bytes), alignment (a power of two). Raises ValueError on a bad one.")
        .def(py::init<uint64_t, uint64_t>(), py::arg("capacity"), py::arg("alignment"))
        .def("allocate",
             [](OffsetAllocatorCore& a, uint64_t size) -> py::object {
                 Allocation out;
                 if (!a.allocate(size, &out)) return py::none();
                 PyObject* h = allocation_make(out.offset, out.size, out.reserved, out.serial);
                 if (!h) throw py::error_already_set();
                 return py::reinterpret_steal<py::object>(h);
             },
             py::arg("size"), "A new Allocation of `size` bytes, or None: no room.")
        .def("free",
             [](OffsetAllocatorCore& a, py::handle alloc) {
                 const AllocationObject& h = as_allocation(alloc);
                 a.free(h.offset, h.serial, h.size, h.reserved);
             },
             py::arg("alloc"),
             "Frees a live Allocation. Raises ValueError: not live here (double free, foreign);\n"
             "TypeError: not an Allocation.")
        .def_property_readonly("capacity", &OffsetAllocatorCore::capacity)
        .def_property_readonly("alignment", &OffsetAllocatorCore::alignment)
        .def_property_readonly("used", &OffsetAllocatorCore::used)
        .def_property_readonly("free_bytes", &OffsetAllocatorCore::free_bytes)
        .def_property_readonly("largest_free", &OffsetAllocatorCore::largest_free)
        .def_property_readonly("num_allocations", &OffsetAllocatorCore::num_allocations)
        .def_property_readonly("num_free_extents", &OffsetAllocatorCore::num_free_extents)
        .def_property_readonly("live_table_bytes", &OffsetAllocatorCore::live_table_bytes)
        .def("check", &OffsetAllocatorCore::check,
             "'' when every invariant holds, else the first one broken; O(n).");
}

static Registered reg_allocator(&register_allocator);

}  // namespace kvstore_native
