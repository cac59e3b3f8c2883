// StoredObjectBase: the storage of a store node's per-object record
// (kvstore.store.objects.StoredObject derives from it and adds the methods).
//
// A node keeps one record per object it holds: tens of millions on a large
// node. As a Python class with __slots__, each record carried, beside its own
// 128 bytes, an int object for its object id (32 B), its checksum (40 B: a
// 64-bit hash) and its slot (32 B beyond 256 objects), and a float for its
// last access (24 B). Here those fields live inline, as C numbers, in a record
// of the same 128 bytes; a read makes the Python number on demand.
//
//     key, parent, _copy, _extra     object references (str, str or None, an
//                                    extent or a list of them, ObjectExtras)
//     object_id, size_bytes, checksum   unsigned 64-bit
//     last_access_s                  double (monotonic seconds)
//     slot                           Py_ssize_t (-1: out of service)
//     refs, replica_num, _flags      int
//
// Not tracked by the cycle collector: a record refers to strings, extents and
// ObjectExtras only, none of which refers back to it (Python subclasses that add
// no instance variables stay untracked too). Thread safety: as any Python
// object, under the GIL; the node's lock orders its users.
#include <Python.h>
#include <structmember.h>

#include "module.hpp"

namespace kvstore_native {
namespace {

struct StoredObjectBase {
    PyObject_HEAD
    PyObject* key;
    PyObject* parent;
    PyObject* copy;
    PyObject* extra;
    unsigned long long object_id;
    unsigned long long size_bytes;
    unsigned long long checksum;
    double last_access_s;
    Py_ssize_t slot;
    int refs;
    int replica_num;
    int flags;
};

PyObject* stored_object_new(PyTypeObject* type, PyObject*, PyObject*) {
    auto* self = reinterpret_cast<StoredObjectBase*>(type->tp_alloc(type, 0));
    if (self == nullptr) return nullptr;
    self->slot = -1;
    Py_INCREF(Py_None);
    self->parent = Py_None;
    Py_INCREF(Py_None);
    self->copy = Py_None;
    Py_INCREF(Py_None);
    self->extra = Py_None;
    return reinterpret_cast<PyObject*>(self);
}

void stored_object_dealloc(PyObject* obj) {
    auto* self = reinterpret_cast<StoredObjectBase*>(obj);
    PyTypeObject* type = Py_TYPE(obj);
    Py_CLEAR(self->key);
    Py_CLEAR(self->parent);
    Py_CLEAR(self->copy);
    Py_CLEAR(self->extra);
    type->tp_free(obj);
    Py_DECREF(type);   // a heap type: each instance holds a reference to it
}

#define FIELD(name, kind, member) \
    {const_cast<char*>(name), kind, offsetof(StoredObjectBase, member), 0, nullptr}

PyMemberDef stored_object_members[] = {
    FIELD("key", T_OBJECT, key),
    FIELD("parent", T_OBJECT, parent),
    FIELD("_copy", T_OBJECT, copy),
    FIELD("_extra", T_OBJECT, extra),
    FIELD("object_id", T_ULONGLONG, object_id),
    FIELD("size_bytes", T_ULONGLONG, size_bytes),
    FIELD("checksum", T_ULONGLONG, checksum),
    FIELD("last_access_s", T_DOUBLE, last_access_s),
    FIELD("slot", T_PYSSIZET, slot),
    FIELD("refs", T_INT, refs),
    FIELD("replica_num", T_INT, replica_num),
    FIELD("_flags", T_INT, flags),
    {nullptr, 0, 0, 0, nullptr},
};

#undef FIELD

PyType_Slot stored_object_slots[] = {
    {Py_tp_new, reinterpret_cast<void*>(stored_object_new)},
    {Py_tp_dealloc, reinterpret_cast<void*>(stored_object_dealloc)},
    {Py_tp_members, stored_object_members},
    {Py_tp_doc, const_cast<char*>(
        "The fields of a node's object record, stored inline "
        "(kvstore.store.objects.StoredObject adds the methods).")},
    {0, nullptr},
};

PyType_Spec stored_object_spec = {
    "kvstore._native.StoredObjectBase",
    sizeof(StoredObjectBase),
    0,
    Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    stored_object_slots,
};

void register_stored_object(pybind11::module_& m) {
    PyObject* type = PyType_FromSpec(&stored_object_spec);
    if (type == nullptr) throw pybind11::error_already_set();
    m.add_object("StoredObjectBase", pybind11::reinterpret_steal<pybind11::object>(type));
}

Registered reg(&register_stored_object);

}  // namespace
}  // namespace kvstore_native
