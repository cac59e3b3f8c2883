// StoredObjectBase: the storage of a store node's per-object record
// (kvstore.store.objects.StoredObject derives from it and adds the methods).
//
// A node keeps one record per object it holds: tens of millions on a large
// node. As a Python class with __slots__, each record carried, beside its own
// 128 bytes, an int object for its object id (32 B), its checksum (40 B: a
// 64-bit hash) and its slot (32 B beyond 256 objects), and a float for its
// last access (24 B). Here those fields live inline, as C numbers, in a record
// of 112 bytes (the object header included); a read makes the Python number on
// demand. Its DRAM copy lives inline too (offset, serial, reserved bytes: 20 B)
// instead of in an Allocation of its own (48 B); ``_dram()`` hands it out as one.
//
//     key, parent, _copy, _extra     object references (str, str or None, an
//                                    extent or a list of them, ObjectExtras)
//     object_id, size_bytes, checksum   unsigned 64-bit
//     last_access_s                  double (monotonic seconds)
//     dram_offset, dram_serial       unsigned 64-bit: its DRAM copy (level 0), valid
//       dram_pad                     while _flags has kDramInline (pad: reserved - size)
//     slot, refs                     32-bit int (slot -1: out of service)
//     _flags, replica_num            16 and 8 bits
//
// 112 bytes in all: a pymalloc size class (a 113-byte record would take 128).
//
// Not tracked by the cycle collector: a record refers to strings, extents and
// ObjectExtras only, none of which refers back to it. A Python class statement
// deriving from it would make a GC-tracked type (16 B more per record, and
// every new record walked by the young collections), so ``untracked_subclass``
// builds kvstore.store.objects.StoredObject natively, without GC, from the class
// that declares its methods. Thread safety: as any Python object, under the
// GIL; the node's lock orders its users.
#include <Python.h>
#include <structmember.h>

#include <string>

#include "allocation.hpp"
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
    unsigned long long dram_offset;
    unsigned long long dram_serial;
    int slot;                      // < 2**31 (the eviction core's bound too)
    int refs;
    unsigned int dram_pad;         // reserved bytes - size_bytes (< the alignment, or one unit)
    unsigned short flags;          // the bits of kvstore.store.objects (level in bits 8..15)
    unsigned char replica_num;     // at most kvstore.rpc's bound (a byte on the wire too)
};

static_assert(sizeof(StoredObjectBase) <= 112, "a node keeps one per object: 112 bytes");

constexpr int kDramInline = 128;   // a _flags bit (kvstore.store.objects._DRAM)

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

// Its DRAM copy as an Allocation (a new handle, equal to the one installed), or None.
PyObject* stored_object_dram(PyObject* obj, PyObject*) {
    auto* self = reinterpret_cast<StoredObjectBase*>(obj);
    if (!(self->flags & kDramInline)) Py_RETURN_NONE;
    return allocation_make(self->dram_offset, self->size_bytes,
                           self->size_bytes + self->dram_pad, self->dram_serial);
}

// Installs ``extent`` as its inline DRAM copy (True), or forgets it (None: True);
// False, changing nothing, for an extent that is not an Allocation of exactly
// size_bytes (the caller keeps it as an object).
PyObject* stored_object_set_dram(PyObject* obj, PyObject* extent) {
    auto* self = reinterpret_cast<StoredObjectBase*>(obj);
    if (extent == Py_None) {
        self->flags &= ~kDramInline;
        Py_RETURN_TRUE;
    }
    unsigned long long offset, size, reserved, serial;
    if (!allocation_fields(extent, &offset, &size, &reserved, &serial) ||
        size != self->size_bytes || reserved < size || reserved - size > 0xFFFFFFFFull)
        Py_RETURN_FALSE;
    self->dram_offset = offset;
    self->dram_pad = static_cast<unsigned int>(reserved - size);
    self->dram_serial = serial;
    self->flags |= kDramInline;
    Py_RETURN_TRUE;
}

PyMethodDef stored_object_methods[] = {
    {"_dram", stored_object_dram, METH_NOARGS,
     "Its inline DRAM copy as a new Allocation (equal to the one installed), or None."},
    {"_set_dram", stored_object_set_dram, METH_O,
     "Install an Allocation of exactly size_bytes as its inline DRAM copy (True), or\n"
     "forget it (None: True); False, changing nothing, for any other extent."},
    {nullptr, nullptr, 0, nullptr},
};

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
    FIELD("slot", T_INT, slot),
    FIELD("refs", T_INT, refs),
    FIELD("replica_num", T_UBYTE, replica_num),
    FIELD("_flags", T_USHORT, flags),
    {nullptr, 0, 0, 0, nullptr},
};

#undef FIELD

PyType_Slot stored_object_slots[] = {
    {Py_tp_new, reinterpret_cast<void*>(stored_object_new)},
    {Py_tp_dealloc, reinterpret_cast<void*>(stored_object_dealloc)},
    {Py_tp_members, stored_object_members},
    {Py_tp_methods, stored_object_methods},
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

PyObject* base_type = nullptr;

// untracked_subclass(cls): a type deriving from StoredObjectBase, named and shaped as
// ``cls`` (a class statement's subclass of it that adds no instance variables), with
// ``cls``'s attributes, and without the cyclic GC. Raises TypeError: ``cls`` adds
// instance variables or does not derive from StoredObjectBase.
PyObject* untracked_subclass(PyObject*, PyObject* cls) {
    if (!PyType_Check(cls) || !PyType_IsSubtype(reinterpret_cast<PyTypeObject*>(cls),
                                                 reinterpret_cast<PyTypeObject*>(base_type))) {
        PyErr_SetString(PyExc_TypeError, "untracked_subclass: not a StoredObjectBase subclass");
        return nullptr;
    }
    auto* tp = reinterpret_cast<PyTypeObject*>(cls);
    if (tp->tp_basicsize != reinterpret_cast<PyTypeObject*>(base_type)->tp_basicsize ||
        tp->tp_dictoffset || tp->tp_weaklistoffset) {
        PyErr_SetString(PyExc_TypeError,
                        "untracked_subclass: the class adds instance variables (use __slots__ = ())");
        return nullptr;
    }
    PyObject* module = PyObject_GetAttrString(cls, "__module__");
    PyObject* qualname = module ? PyObject_GetAttrString(cls, "__qualname__") : nullptr;
    if (!qualname) {
        Py_XDECREF(module);
        return nullptr;
    }
    const char* m = PyUnicode_AsUTF8(module);
    const char* q = m ? PyUnicode_AsUTF8(qualname) : nullptr;
    if (!q) {
        Py_DECREF(module);
        Py_DECREF(qualname);
        return nullptr;
    }
    // Python 3.11 keeps the spec's name as tp_name: it lives as long as the type (ever).
    auto* name = new std::string(std::string(m) + "." + q);
    Py_DECREF(module);
    Py_DECREF(qualname);
    static PyType_Slot slots[] = {{0, nullptr}};
    auto* spec = new PyType_Spec{name->c_str(), 0, 0, Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
                                 slots};
    PyObject* type = PyType_FromSpecWithBases(spec, base_type);
    if (!type) return nullptr;
    // Its methods, properties and docs (setting __init__ or __repr__ fills their slots).
    PyObject* attrs = PyObject_GetAttrString(cls, "__dict__");
    if (!attrs) {
        Py_DECREF(type);
        return nullptr;
    }
    PyObject* items = PyMapping_Items(attrs);
    Py_DECREF(attrs);
    if (!items) {
        Py_DECREF(type);
        return nullptr;
    }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(items); ++i) {
        PyObject* item = PyList_GET_ITEM(items, i);
        PyObject* key = PyTuple_GET_ITEM(item, 0);
        PyObject* value = PyTuple_GET_ITEM(item, 1);
        const char* k = PyUnicode_AsUTF8(key);
        if (!k) {
            Py_DECREF(items);
            Py_DECREF(type);
            return nullptr;
        }
        std::string kk(k);
        if (kk == "__dict__" || kk == "__weakref__" || kk == "__slots__" || kk == "__module__")
            continue;
        if (PyObject_SetAttr(type, key, value) < 0) {
            Py_DECREF(items);
            Py_DECREF(type);
            return nullptr;
        }
    }
    Py_DECREF(items);
    return type;
}

PyMethodDef untracked_subclass_def = {
    "untracked_subclass", untracked_subclass, METH_O,
    "untracked_subclass(cls): cls (a StoredObjectBase subclass adding no instance variables)\n"
    "rebuilt without the cyclic GC (16 B less per instance, never walked by a collection)."};

void register_stored_object(pybind11::module_& m) {
    PyObject* type = PyType_FromSpec(&stored_object_spec);
    if (type == nullptr) throw pybind11::error_already_set();
    base_type = type;
    Py_INCREF(type);      // kept for untracked_subclass, for the module's life
    m.add_object("StoredObjectBase", pybind11::reinterpret_steal<pybind11::object>(type));
    PyObject* fn = PyCFunction_New(&untracked_subclass_def, nullptr);
    if (fn == nullptr) throw pybind11::error_already_set();
    m.add_object("untracked_subclass", pybind11::reinterpret_steal<pybind11::object>(fn));
}

Registered reg(&register_stored_object);

}  // namespace
}  // namespace kvstore_native
