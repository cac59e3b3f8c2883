// Inventory chunks on the wire (see inventory_wire.hpp).
#include "inventory_wire.hpp"

#include "xxh3.hpp"

namespace kvstore_native {

namespace {

struct Reader {
    const uint8_t* p;
    const uint8_t* end;
    bool ok = true;

    uint64_t varint() {
        uint64_t v = 0;
        for (int shift = 0; shift < 64; shift += 7) {
            if (p >= end) {
                ok = false;
                return 0;
            }
            uint8_t b = *p++;
            v |= uint64_t(b & 0x7f) << shift;
            if (!(b & 0x80)) return v;
        }
        ok = false;   // an 11th byte, or a 10th with its continuation bit: not a varint
        return 0;
    }

    // A length-delimited field's bytes: [p, p + n) checked against the bytes left.
    bool bytes(const uint8_t** start, size_t* n) {
        uint64_t len = varint();
        if (!ok || len > uint64_t(end - p)) return ok = false;
        *start = p;
        *n = size_t(len);
        p += len;
        return true;
    }

    // Skips one field's value of wire type `wt`; false on a bad type or a truncation.
    bool skip(uint32_t wt) {
        const uint8_t* s;
        size_t n;
        switch (wt) {
            case 0: varint(); return ok;
            case 1: if (end - p < 8) return ok = false; p += 8; return true;
            case 2: return bytes(&s, &n);
            case 5: if (end - p < 4) return ok = false; p += 4; return true;
            default: return ok = false;   // groups (3, 4) and 6, 7: not in kvstore.proto
        }
    }

    // The next field's (number, wire type); false at a bad tag.
    bool tag(uint32_t* field, uint32_t* wt) {
        uint64_t t = varint();
        if (!ok || (t >> 3) == 0 || (t >> 3) > 0x1fffffff) return ok = false;
        *field = uint32_t(t >> 3);
        *wt = uint32_t(t & 7);
        return true;
    }
};

std::string_view view(const uint8_t* p, size_t n) {
    return std::string_view(reinterpret_cast<const char*>(p), n);
}

std::string decode_item(const uint8_t* base, const uint8_t* p, const uint8_t* end, bool store,
                        InventoryChunk& out) {
    Reader r{p, end};
    const uint8_t* key = base;
    size_t key_size = 0;
    uint64_t object_id = 0, size_bytes = 0, checksum = 0;
    uint32_t replica_num = 0;
    int32_t tier = 0;
    bool pending = false;
    while (r.p < r.end) {
        uint32_t field, wt;
        if (!r.tag(&field, &wt)) return "a bad item field tag";
        if (field == 1 && wt == 2) {
            if (!r.bytes(&key, &key_size)) return "a truncated key";
            if (!valid_utf8(view(key, key_size))) return "a key that is not UTF-8";
        } else if (field >= 2 && field <= 7 && wt == 0) {
            uint64_t v = r.varint();
            if (!r.ok) return "a truncated item varint";
            switch (field) {
                case 2: object_id = v; break;
                case 3: size_bytes = v; break;
                case 4: checksum = v; break;
                case 5: tier = int32_t(uint32_t(v)); break;   // int32: the low 32 bits
                case 6: pending = v != 0; break;
                case 7: replica_num = uint32_t(v); break;
            }
        } else if (!r.skip(wt)) {
            return "a bad item field";
        }
    }
    if (!store) return "";
    out.key_offset.push_back(uint32_t(key - base));
    out.key_size.push_back(uint32_t(key_size));
    out.key_hash.push_back(xxh3::hash64(key, key_size));
    out.object_id.push_back(object_id);
    out.size_bytes.push_back(size_bytes);
    out.checksum.push_back(checksum);
    out.tier.push_back(tier);
    out.pending.push_back(pending);
    out.replica_num.push_back(replica_num);
    return "";
}

// Marks the items whose key hash came earlier (a hash set of the chunk's size).
void mark_repeated(InventoryChunk& c) {
    size_t n = c.size(), cap = 16;
    while (cap < 2 * n) cap <<= 1;
    std::vector<uint64_t> set(cap, 0);
    c.repeated.assign(n, 0);
    for (size_t i = 0; i < n; ++i) {
        uint64_t h = c.key_hash[i] | 1;           // 0 marks an empty bucket
        for (size_t j = (h >> 7) & (cap - 1);; j = (j + 1) & (cap - 1)) {
            if (set[j] == 0) {
                set[j] = h;
                break;
            }
            if (set[j] == h) {
                c.repeated[i] = 1;
                break;
            }
        }
    }
}

void put_varint(uint64_t v, std::string& out) {
    while (v >= 0x80) {
        out.push_back(char(uint8_t(v) | 0x80));
        v >>= 7;
    }
    out.push_back(char(v));
}

void put_string(uint32_t field, std::string_view s, std::string& out) {
    if (s.empty()) return;
    put_varint(field << 3 | 2, out);
    put_varint(s.size(), out);
    out.append(s.data(), s.size());
}

void put_uint(uint32_t field, uint64_t v, std::string& out) {
    if (!v) return;
    put_varint(field << 3, out);
    put_varint(v, out);
}

size_t varint_size(uint64_t v) {
    size_t n = 1;
    while (v >= 0x80) {
        v >>= 7;
        ++n;
    }
    return n;
}

}  // namespace

bool valid_utf8(std::string_view s) {
    const auto* p = reinterpret_cast<const uint8_t*>(s.data());
    const uint8_t* end = p + s.size();
    while (p < end) {
        uint8_t b = *p;
        if (b < 0x80) {
            ++p;
            continue;
        }
        int n;
        uint32_t cp, min;
        if ((b & 0xe0) == 0xc0) n = 1, cp = b & 0x1f, min = 0x80;
        else if ((b & 0xf0) == 0xe0) n = 2, cp = b & 0x0f, min = 0x800;
        else if ((b & 0xf8) == 0xf0) n = 3, cp = b & 0x07, min = 0x10000;
        else return false;
        if (end - p <= n) return false;
        for (int i = 1; i <= n; ++i) {
            if ((p[i] & 0xc0) != 0x80) return false;
            cp = cp << 6 | (p[i] & 0x3f);
        }
        if (cp < min || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) return false;
        p += n + 1;
    }
    return true;
}

std::string decode_inventory(std::string raw, size_t max_items, InventoryChunk& out) {
    out = InventoryChunk{};
    if (raw.size() > 0xffffffffu) return "a chunk over 4 GiB";
    out.raw = std::move(raw);
    const auto* base = reinterpret_cast<const uint8_t*>(out.raw.data());
    Reader r{base, base + out.raw.size()};
    while (r.p < r.end) {
        uint32_t field, wt;
        if (!r.tag(&field, &wt)) return "a bad field tag";
        const uint8_t* s;
        size_t n;
        if ((field == 1 || field == 2 || field == 5) && wt == 2) {
            if (!r.bytes(&s, &n)) return "a truncated field";
            if (field == 5) {
                std::string err = decode_item(base, s, s + n, out.count < max_items, out);
                if (!err.empty()) return err;
                ++out.count;
            } else {
                if (!valid_utf8(view(s, n))) return "a string that is not UTF-8";
                (field == 1 ? out.node_id : out.incarnation).assign(view(s, n));
            }
        } else if ((field == 3 || field == 4 || field == 6) && wt == 0) {
            uint64_t v = r.varint();
            if (!r.ok) return "a truncated varint";
            if (field == 3) out.sync_id = v;
            else if (field == 4) out.seq = uint32_t(v);
            else out.last = v != 0;
        } else if (!r.skip(wt)) {
            return "a bad field";
        }
    }
    mark_repeated(out);
    return "";
}

int64_t first_invalid_item(const InventoryChunk& c, uint64_t max_object_id,
                           uint32_t max_replicas) {
    for (size_t i = 0; i < c.size(); ++i) {
        if (c.object_id[i] == 0 || c.object_id[i] > max_object_id ||
            c.replica_num[i] > max_replicas || c.tier[i] < 0 || c.tier[i] > 3)
            return int64_t(i);
    }
    return -1;
}

void encode_inventory(std::string_view node_id, std::string_view incarnation, uint64_t sync_id,
                      uint32_t seq, bool last, const std::vector<InventoryRow>& rows,
                      std::string& out) {
    put_string(1, node_id, out);
    put_string(2, incarnation, out);
    put_uint(3, sync_id, out);
    put_uint(4, seq, out);
    std::string item;
    for (const InventoryRow& x : rows) {
        item.clear();
        put_string(1, x.key, item);
        put_uint(2, x.object_id, item);
        put_uint(3, x.size_bytes, item);
        put_uint(4, x.checksum, item);
        // int32 enum: a negative value is sent as its 64-bit two's complement (10 bytes).
        put_uint(5, uint64_t(int64_t(x.tier)), item);
        put_uint(6, x.pending ? 1 : 0, item);
        put_uint(7, x.replica_num, item);
        out.reserve(out.size() + 1 + varint_size(item.size()) + item.size());
        put_varint(5 << 3 | 2, out);
        put_varint(item.size(), out);
        out += item;
    }
    put_uint(6, last ? 1 : 0, out);
}

}  // namespace kvstore_native
