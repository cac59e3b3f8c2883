// A C-contiguous Python buffer export, released on scope exit (the bindings' one
// way to take bytes from Python: bytes, bytearray, memoryview, mmap, numpy).
#pragma once
#include <Python.h>
#include <pybind11/pybind11.h>

#include <cstddef>
#include <cstdint>

namespace kvstore_native {

class Buffer {
public:
    Buffer(pybind11::handle obj, bool writable) {
        int flags = PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0);
        if (PyObject_GetBuffer(obj.ptr(), &view_, flags) != 0)
            throw pybind11::error_already_set();
    }
    ~Buffer() { PyBuffer_Release(&view_); }
    Buffer(const Buffer&) = delete;
    Buffer& operator=(const Buffer&) = delete;

    uint8_t* data() const { return static_cast<uint8_t*>(view_.buf); }
    size_t size() const { return static_cast<size_t>(view_.len); }

private:
    Py_buffer view_{};
};

}  // namespace kvstore_native
