// StoredObjectBase: the storage of a store node's per-object record
// (kvstore.store.objects.StoredObject derives from it and adds the methods).
//
// A node keeps one record per object it holds: tens of millions on a large
// node. As a Python class with __slots__, each record carried, beside its own
// 128 bytes, an int object for its object id (32 B), its checksum (40 B: a
// 64-bit hash) and its slot (32 B beyond 256 objects), and a float for its
// last access (24 B). Here those fields live inline, as C numbers, in a record
// of 128 bytes (the object header included); a read makes the Python number on
// demand. Its DRAM copy lives inline too (offset, serial, reserved bytes: 20 B)
// instead of in an Allocation of its own (48 B); ``_dram()`` hands it out as one.
// So do its key and its parent's key when they are 32 lowercase hex characters
// (every key kvstore.keys makes): their 16 bytes, instead of a string of 88 B
// (the key map, key_map.cpp, holds no string either); a read of ``key`` makes
// the string on demand. Any other key is kept as its string.
//
//     key, parent                    16 bytes each: a key's bytes (key_form says so)
//                                    or a reference (str; parent: str or None)
//     _copy, _extra                  object references (an extent or a list of
//                                    them, ObjectExtras)
//     object_id, size_bytes, checksum   unsigned 64-bit
//     last_access_s                  double (monotonic seconds)
//     dram_offset, dram_serial       unsigned 64-bit: its DRAM copy (level 0), valid
//       dram_pad                     while _flags has kDramInline (pad: reserved - size)
//     slot, refs                     32-bit int (slot -1: out of service)
//     _flags, replica_num, key_form  16, 8 and 8 bits
//
// 128 bytes in all: a pymalloc size class.
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

#include <cstring>
#include <string>

#include "allocation.hpp"
#include "module.hpp"
#include "stored_object.hpp"

namespace kvstore_native {
namespace {

// A key field: a key's 16 bytes, or a reference (see key_form).
union KeyField {
    PyObject* obj;
    unsigned char bin[kKeyBytes];
};

struct StoredObjectBase {
    PyObject_HEAD
    KeyField key;                  // null until set (reads None)
    KeyField parent;
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
    unsigned char key_form;        // kKeyInline / kParentInline: that field holds bytes
};

static_assert(sizeof(StoredObjectBase) <= 128, "a node keeps one per object: 128 bytes");

constexpr unsigned char kKeyInline = 1;
constexpr unsigned char kParentInline = 2;

constexpr int kDramInline = 128;   // a _flags bit (kvstore.store.objects._DRAM)

PyObject* stored_object_new(PyTypeObject* type, PyObject*, PyObject*) {
    auto* self = reinterpret_cast<StoredObjectBase*>(type->tp_alloc(type, 0));
    if (self == nullptr) return nullptr;
    self->slot = -1;
    self->key.obj = nullptr;
    Py_INCREF(Py_None);
    self->parent.obj = Py_None;
    Py_INCREF(Py_None);
    self->copy = Py_None;
    Py_INCREF(Py_None);
    self->extra = Py_None;
    return reinterpret_cast<PyObject*>(self);
}

void stored_object_dealloc(PyObject* obj) {
    auto* self = reinterpret_cast<StoredObjectBase*>(obj);
    PyTypeObject* type = Py_TYPE(obj);
    if (!(self->key_form & kKeyInline)) Py_CLEAR(self->key.obj);
    if (!(self->key_form & kParentInline)) Py_CLEAR(self->parent.obj);
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

// The field as Python reads it: a new string from its bytes, or its reference.
PyObject* key_field_get(const KeyField& f, bool inline_bytes) {
    if (inline_bytes) return key_text(f.bin);
    PyObject* v = f.obj ? f.obj : Py_None;
    Py_INCREF(v);
    return v;
}

// Sets the field (``inline_bit`` of key_form says which form it holds) from a str
// (or None where ``none_ok``); 0, or -1 with TypeError.
int key_field_set(StoredObjectBase* self, KeyField* f, unsigned char inline_bit,
                  PyObject* value, bool none_ok, const char* name) {
    if (value == nullptr || (value == Py_None ? !none_ok : !PyUnicode_Check(value))) {
        PyErr_Format(PyExc_TypeError, "%s must be a str%s", name, none_ok ? " or None" : "");
        return -1;
    }
    unsigned char bin[kKeyBytes];
    const bool as_bytes = value != Py_None && key_bytes(value, bin);
    PyObject* old = (self->key_form & inline_bit) ? nullptr : f->obj;
    if (as_bytes) {
        std::memcpy(f->bin, bin, kKeyBytes);
        self->key_form |= inline_bit;
    } else {
        Py_INCREF(value);
        f->obj = value;
        self->key_form &= static_cast<unsigned char>(~inline_bit);
    }
    Py_XDECREF(old);
    return 0;
}

PyObject* get_key(PyObject* obj, void*) {
    auto* self = reinterpret_cast<StoredObjectBase*>(obj);
    return key_field_get(self->key, self->key_form & kKeyInline);
}

int set_key(PyObject* obj, PyObject* value, void*) {
    auto* self = reinterpret_cast<StoredObjectBase*>(obj);
    return key_field_set(self, &self->key, kKeyInline, value, false, "key");
}

PyObject* get_parent(PyObject* obj, void*) {
    auto* self = reinterpret_cast<StoredObjectBase*>(obj);
    return key_field_get(self->parent, self->key_form & kParentInline);
}

int set_parent(PyObject* obj, PyObject* value, void*) {
    auto* self = reinterpret_cast<StoredObjectBase*>(obj);
    return key_field_set(self, &self->parent, kParentInline, value, true, "parent");
}

PyGetSetDef stored_object_getset[] = {
    {const_cast<char*>("key"), get_key, set_key,
     const_cast<char*>("Its key (str; kept as 16 bytes when 32 lowercase hex characters)."),
     nullptr},
    {const_cast<char*>("parent"), get_parent, set_parent,
     const_cast<char*>("The previous block's key of its prefix chain (str), or None."), nullptr},
    {nullptr, nullptr, nullptr, nullptr, nullptr},
};

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
    {const_cast<char*>("_key_form"), T_UBYTE, offsetof(StoredObjectBase, key_form), READONLY,
     nullptr},
    {nullptr, 0, 0, 0, nullptr},
};

#undef FIELD

PyType_Slot stored_object_slots[] = {
    {Py_tp_new, reinterpret_cast<void*>(stored_object_new)},
    {Py_tp_dealloc, reinterpret_cast<void*>(stored_object_dealloc)},
    {Py_tp_members, stored_object_members},
    {Py_tp_methods, stored_object_methods},
    {Py_tp_getset, stored_object_getset},
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

int hex_value(Py_UCS1 c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
}

}  // namespace

bool key_bytes(PyObject* str, unsigned char out[kKeyBytes]) noexcept {
    // Any str, a subclass's instance too (not compact): equal strings, one form.
    if (!PyUnicode_IS_ASCII(str) || PyUnicode_GET_LENGTH(str) != 2 * kKeyBytes) return false;
    const auto* text = static_cast<const Py_UCS1*>(PyUnicode_DATA(str));
    for (size_t i = 0; i < kKeyBytes; ++i) {
        int hi = hex_value(text[2 * i]), lo = hex_value(text[2 * i + 1]);
        if (hi < 0 || lo < 0) return false;
        out[i] = static_cast<unsigned char>(hi << 4 | lo);
    }
    return true;
}

PyObject* key_text(const unsigned char bin[kKeyBytes]) {
    static const char digits[] = "0123456789abcdef";
    PyObject* s = PyUnicode_New(2 * kKeyBytes, 127);
    if (s == nullptr) return nullptr;
    Py_UCS1* text = PyUnicode_1BYTE_DATA(s);
    for (size_t i = 0; i < kKeyBytes; ++i) {
        text[2 * i] = static_cast<Py_UCS1>(digits[bin[i] >> 4]);
        text[2 * i + 1] = static_cast<Py_UCS1>(digits[bin[i] & 15]);
    }
    return s;
}

bool key_ref(PyObject* key, KeyRef* out) noexcept {
    if (!PyUnicode_Check(key)) return false;
    out->bytes = key_bytes(key, out->bin);
    out->str = out->bytes ? nullptr : key;
    return true;
}

bool record_key(PyObject* record, KeyRef* out) noexcept {
    if (base_type == nullptr ||
        !PyObject_TypeCheck(record, reinterpret_cast<PyTypeObject*>(base_type)))
        return false;
    auto* self = reinterpret_cast<StoredObjectBase*>(record);
    if (self->key_form & kKeyInline) {
        out->bytes = true;
        std::memcpy(out->bin, self->key.bin, kKeyBytes);
        out->str = nullptr;
        return true;
    }
    if (self->key.obj == nullptr) return false;
    out->bytes = false;
    out->str = self->key.obj;
    return true;
}

bool key_equal(const KeyRef& a, const KeyRef& b) noexcept {
    if (a.bytes != b.bytes) return false;
    if (a.bytes) return std::memcmp(a.bin, b.bin, kKeyBytes) == 0;
    if (a.str == b.str) return true;
    const Py_ssize_t n = PyUnicode_GET_LENGTH(a.str);
    if (n != PyUnicode_GET_LENGTH(b.str) || PyUnicode_KIND(a.str) != PyUnicode_KIND(b.str))
        return false;
    return std::memcmp(PyUnicode_DATA(a.str), PyUnicode_DATA(b.str),
                       size_t(n) * PyUnicode_KIND(a.str)) == 0;
}

int record_slot(PyObject* record) noexcept {
    if (base_type == nullptr ||
        !PyObject_TypeCheck(record, reinterpret_cast<PyTypeObject*>(base_type)))
        return -1;
    return reinterpret_cast<StoredObjectBase*>(record)->slot;
}

}  // namespace kvstore_native
