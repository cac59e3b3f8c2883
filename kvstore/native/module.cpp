// kvstore._native: the compiled core (the per-object and per-byte hot path).
//
// One extension module; each concept lives in its own source file and adds its
// functions and classes here through a register_* function (declared in
// module.hpp). Built from source by setup.py (pybind11, C++17) on every
// install; nothing prebuilt, nothing vendored.
#include "module.hpp"

PYBIND11_MODULE(_native, m) {
    m.doc() = "kvstore's compiled core (see kvstore/native/)";
    m.attr("ABI") = 1;
    for (auto reg : kvstore_native::registrations()) reg(m);
}
