// Python bindings of the native GET service (serving.hpp): ServingIndex,
// ServeOptions and serve_gets, reached through kvstore/store/native_gets.py only.
//
// The index keeps a raw pointer to the DRAM segment, not a buffer export (an
// export would keep the segment's mmap from closing): its owner (the DRAM tier)
// sets the lease to 0 before it unmaps the segment, so no copy is acquired
// after; a send already under way then fails with EFAULT (the kernel checks
// the range), which ends that connection.
#include <pybind11/stl.h>

#include <string>

#include "module.hpp"
#include "pybuffer.hpp"
#include "serving.hpp"

namespace py = pybind11;

namespace kvstore_native {
namespace {

using serving::Copy;
using serving::Index;
using serving::Options;

std::unique_ptr<Index> make_index(py::handle segment, size_t max_copies) {
    Buffer b(segment, true);
    return std::make_unique<Index>(b.data(), b.size(), max_copies);
}

py::tuple serve(Index& index, int fd, py::handle buffer, size_t start, size_t end,
                Options& opt) {
    Buffer b(buffer, true);
    if (start > end || end > b.size())
        throw py::value_error("serve_gets: start <= end <= len(buffer) is required");
    if (b.size() < 2 * (32 + opt.max_key_bytes))
        throw py::value_error("serve_gets: the buffer is smaller than two frames");
    serving::Result r;
    {
        py::gil_scoped_release nogil;
        r = serving::serve_gets(index, fd, b.data(), b.size(), start, end, opt);
    }
    py::bytes touches(reinterpret_cast<const char*>(r.touches.data()),
                      r.touches.size() * sizeof(int64_t));
    return py::make_tuple(static_cast<int>(r.status), r.error, r.start, r.end, r.gets, r.bytes,
                          r.histogram, r.seconds, touches, r.touch_histogram, r.touch_seconds);
}

void register_serving(py::module_& m) {
    py::class_<Index>(m, "ServingIndex",
                      "DRAM copies a data connection may send without Python "
                      "(kvstore/native/serving.hpp); ServingIndex(segment, max_copies).")
        .def(py::init(&make_index), py::arg("segment"), py::arg("max_copies"))
        .def("publish",
             [](Index& ix, const std::string& key, uint64_t serial, uint64_t offset,
                uint64_t size, uint64_t checksum, uint64_t object_id, int64_t slot) {
                 Copy c{offset, size, checksum, object_id, serial, slot};
                 return ix.publish(key, c);
             },
             py::arg("key"), py::arg("serial"), py::arg("offset"), py::arg("size"),
             py::arg("checksum"), py::arg("object_id"), py::arg("slot"))
        .def("withdraw", &Index::withdraw, py::arg("serial"))
        .def("serves",
             [](Index& ix, py::bytes key, uint64_t object_id) {
                 std::string_view k = key;
                 return ix.serves(k, object_id);
             },
             py::arg("key"), py::arg("object_id"))
        .def("take_released", &Index::take_released)
        .def("set_lease", &Index::set_lease, py::arg("until_s"))
        .def("__len__", &Index::size)
        .def_property_readonly("epoch", &Index::epoch)
        .def("bump_epoch", &Index::bump_epoch)
        .def_property_readonly("gets", &Index::gets);

    py::class_<Options>(m, "ServeOptions", "serve_gets' bounds (kvstore/native/serving.hpp)")
        .def(py::init([](double poll_s, int poll_limit, uint64_t max_gets, double max_s,
                         std::vector<double> buckets) {
                 Options o;
                 o.poll_ns = static_cast<int64_t>(poll_s * 1e9);
                 o.poll_limit = poll_limit;
                 o.max_gets = max_gets;
                 o.max_ns = static_cast<int64_t>(max_s * 1e9);
                 o.buckets = std::move(buckets);
                 return o;
             }),
             py::arg("poll_s"), py::arg("poll_limit"), py::arg("max_gets"), py::arg("max_s"),
             py::arg("buckets"))
        .def_readwrite("epoch", &Options::epoch,
                       "the index's epoch the connection's token was checked against")
        .def_readwrite("answered_ns", &Options::answered_ns,
                       "when the connection's last replies went out (CLOCK_MONOTONIC ns)");

    m.def("serve_gets", &serve, py::arg("index"), py::arg("fd"), py::arg("buffer"),
          py::arg("start"), py::arg("end"), py::arg("options"),
          "Serve a connection's GET and SHM_TOUCH frames natively (GIL released): (status, "
          "errno, start, end, gets, bytes, histogram, seconds, touches, touch_histogram, "
          "touch_seconds); gets and bytes count both ops, histogram and seconds the GETs.");
}

Registered reg(&register_serving);

}  // namespace
}  // namespace kvstore_native
