// .npz reading and writing (see npz.hpp). Zip: the central directory is read (with its ZIP64 extras: numpy
// writes every member with force_zip64), each member must be stored (method 0).
#include "npz.hpp"

#include <cstring>
#include <fstream>
#include <sstream>

#include "algorithms.hpp"

namespace fedge {

namespace {

uint16_t rd16(const uint8_t* p) { return static_cast<uint16_t>(p[0] | (p[1] << 8)); }
uint32_t rd32(const uint8_t* p) { return static_cast<uint32_t>(rd16(p)) | (static_cast<uint32_t>(rd16(p + 2)) << 16); }
uint64_t rd64(const uint8_t* p) { return static_cast<uint64_t>(rd32(p)) | (static_cast<uint64_t>(rd32(p + 4)) << 32); }
void wr16(Bytes& b, uint16_t v) { b.push_back(v & 0xff); b.push_back(v >> 8); }
void wr32(Bytes& b, uint32_t v) { wr16(b, v & 0xffff); wr16(b, v >> 16); }

uint32_t crc32(const uint8_t* p, size_t n) {
  static uint32_t table[256];
  static bool ready = false;
  if (!ready) {
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
      table[i] = c;
    }
    ready = true;
  }
  uint32_t c = 0xFFFFFFFFu;
  for (size_t i = 0; i < n; ++i) c = table[(c ^ p[i]) & 0xff] ^ (c >> 8);
  return c ^ 0xFFFFFFFFu;
}

size_t itemsize(const std::string& d) {
  if (d.size() < 3) return 0;
  return static_cast<size_t>(std::atoi(d.c_str() + 2));
}

NpyArray parse_npy(const uint8_t* p, size_t n, const std::string& name) {
  auto bad = [&](const std::string& why) { return std::runtime_error(name + ".npy: " + why); };
  if (n < 10 || std::memcmp(p, "\x93NUMPY", 6) != 0) throw bad("not an .npy array");
  const int major = p[6];
  size_t hlen, off;
  if (major == 1) {
    hlen = rd16(p + 8);
    off = 10;
  } else if (major == 2 || major == 3) {
    if (n < 12) throw bad("truncated");
    hlen = rd32(p + 8);
    off = 12;
  } else {
    throw bad("unknown .npy version " + std::to_string(major));
  }
  if (off + hlen > n) throw bad("truncated header");
  const std::string h(reinterpret_cast<const char*>(p + off), hlen);
  auto value = [&](const std::string& key) -> std::string {
    size_t k = h.find("'" + key + "'");
    if (k == std::string::npos) throw bad("header has no " + key);
    k = h.find(':', k);
    if (k == std::string::npos) throw bad("bad header");
    ++k;
    while (k < h.size() && h[k] == ' ') ++k;
    return h.substr(k);
  };
  NpyArray a;
  std::string d = value("descr");
  if (d.empty() || (d[0] != '\'' && d[0] != '"')) throw bad("bad descr");
  a.dtype = d.substr(1, d.find(d[0], 1) - 1);
  if (a.dtype.size() >= 1 && a.dtype[0] == '|') a.dtype[0] = '<';  // single-byte types
  if (a.dtype.size() < 3 || a.dtype[0] != '<') throw bad("dtype " + a.dtype + " is not little-endian numeric");
  if (value("fortran_order").rfind("False", 0) != 0) throw bad("Fortran-order arrays are not read");
  std::string s = value("shape");
  if (s.empty() || s[0] != '(') throw bad("bad shape");
  s = s.substr(1, s.find(')') - 1);
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) {
    size_t b = item.find_first_not_of(' ');
    if (b == std::string::npos) continue;
    a.shape.push_back(std::stoll(item.substr(b)));
  }
  const size_t bytes = static_cast<size_t>(a.numel()) * itemsize(a.dtype);
  if (off + hlen + bytes != n) throw bad("data size does not match dtype and shape");
  a.data.assign(p + off + hlen, p + n);
  return a;
}

Bytes npy_bytes(const NpyArray& a) {
  std::string h = "{'descr': '" + a.dtype + "', 'fortran_order': False, 'shape': (";
  for (size_t i = 0; i < a.shape.size(); ++i) h += std::to_string(a.shape[i]) + (a.shape.size() == 1 ? "," : i + 1 < a.shape.size() ? ", " : "");
  h += "), }";
  size_t total = 10 + h.size() + 1;
  size_t pad = (64 - total % 64) % 64;
  h += std::string(pad, ' ') + "\n";
  Bytes b = {0x93, 'N', 'U', 'M', 'P', 'Y', 1, 0};
  wr16(b, static_cast<uint16_t>(h.size()));
  b.insert(b.end(), h.begin(), h.end());
  b.insert(b.end(), a.data.begin(), a.data.end());
  return b;
}

}  // namespace

int64_t NpyArray::numel() const {
  int64_t c = 1;
  for (auto d : shape) c *= d;
  return c;
}

Ordered<NpyArray> read_npz(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw std::runtime_error("cannot open " + path);
  Bytes z((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  auto bad = [&](const std::string& why) { return std::runtime_error(path + ": " + why); };
  if (z.size() < 22) throw bad("not a zip file");
  size_t eocd = std::string::npos;
  for (size_t i = z.size() - 22 + 1; i-- > 0 && z.size() - i <= 22 + 65535;)
    if (rd32(&z[i]) == 0x06054b50) {
      eocd = i;
      break;
    }
  if (eocd == std::string::npos) throw bad("not a zip file (no end of central directory)");
  uint64_t count = rd16(&z[eocd + 10]), cd_off = rd32(&z[eocd + 16]);
  if ((count == 0xffff || cd_off == 0xffffffffu) && eocd >= 20 && rd32(&z[eocd - 20]) == 0x07064b50) {
    uint64_t z64 = rd64(&z[eocd - 20 + 8]);
    if (z64 + 56 > z.size() || rd32(&z[z64]) != 0x06064b50) throw bad("bad zip64 end record");
    count = rd64(&z[z64 + 32]);
    cd_off = rd64(&z[z64 + 48]);
  }
  Ordered<NpyArray> out;
  size_t p = cd_off;
  for (uint64_t e = 0; e < count; ++e) {
    if (p + 46 > z.size() || rd32(&z[p]) != 0x02014b50) throw bad("bad central directory");
    const uint16_t method = rd16(&z[p + 10]);
    uint64_t csize = rd32(&z[p + 20]), usize = rd32(&z[p + 24]);
    const uint16_t nlen = rd16(&z[p + 28]), xlen = rd16(&z[p + 30]), clen = rd16(&z[p + 32]);
    uint64_t loff = rd32(&z[p + 42]);
    if (p + 46 + nlen + xlen > z.size()) throw bad("bad central directory");
    std::string name(reinterpret_cast<const char*>(&z[p + 46]), nlen);
    // ZIP64 extra: the fields that are 0xFFFFFFFF, in order usize, csize, offset
    for (size_t x = p + 46 + nlen; x + 4 <= p + 46 + nlen + xlen;) {
      uint16_t id = rd16(&z[x]), len = rd16(&z[x + 2]);
      if (id == 0x0001) {
        size_t q = x + 4;
        if (usize == 0xffffffffu) { usize = rd64(&z[q]); q += 8; }
        if (csize == 0xffffffffu) { csize = rd64(&z[q]); q += 8; }
        if (loff == 0xffffffffu) { loff = rd64(&z[q]); q += 8; }
      }
      x += 4 + len;
    }
    p += 46 + nlen + xlen + clen;
    if (method != 0) throw bad(name + " is compressed (np.savez_compressed); only np.savez files are read");
    if (csize != usize) throw bad(name + ": stored sizes differ");
    if (loff + 30 > z.size() || rd32(&z[loff]) != 0x04034b50) throw bad("bad local header of " + name);
    size_t data = loff + 30 + rd16(&z[loff + 26]) + rd16(&z[loff + 28]);
    if (data + csize > z.size()) throw bad(name + " is truncated");
    if (name.size() > 4 && name.compare(name.size() - 4, 4, ".npy") == 0) name.resize(name.size() - 4);
    out.emplace_back(name, parse_npy(&z[data], static_cast<size_t>(csize), name));
  }
  return out;
}

std::vector<float> npy_floats(const NpyArray& a, const std::string& what) {
  const size_t n = static_cast<size_t>(a.numel());
  std::vector<float> v(n);
  if (a.dtype == "<f4") {
    std::memcpy(v.data(), a.data.data(), n * 4);
  } else if (a.dtype == "<f8") {
    for (size_t i = 0; i < n; ++i) {
      double d;
      std::memcpy(&d, &a.data[i * 8], 8);
      v[i] = static_cast<float>(d);
    }
  } else {
    throw std::runtime_error(what + ": dtype " + a.dtype + ", expected float32 or float64");
  }
  return v;
}

std::vector<int64_t> npy_ints(const NpyArray& a, const std::string& what) {
  const size_t n = static_cast<size_t>(a.numel());
  std::vector<int64_t> v(n);
  if (a.dtype == "<i8") {
    std::memcpy(v.data(), a.data.data(), n * 8);
  } else if (a.dtype == "<i4") {
    for (size_t i = 0; i < n; ++i) {
      int32_t x;
      std::memcpy(&x, &a.data[i * 4], 4);
      v[i] = x;
    }
  } else if (a.dtype == "<u1" || a.dtype == "<i1") {
    for (size_t i = 0; i < n; ++i) v[i] = a.dtype == "<u1" ? a.data[i] : static_cast<int8_t>(a.data[i]);
  } else {
    throw std::runtime_error(what + ": dtype " + a.dtype + ", expected int64 or int32");
  }
  return v;
}

NpyArray npy_of(const Tensor& t) {
  NpyArray a;
  a.dtype = "<f4";
  a.shape = t.shape;
  a.data.resize(t.data.size() * 4);
  std::memcpy(a.data.data(), t.data.data(), a.data.size());
  return a;
}

NpyArray npy_of(const std::vector<int64_t>& shape, const std::vector<int64_t>& v) {
  NpyArray a;
  a.dtype = "<i8";
  a.shape = shape;
  a.data.resize(v.size() * 8);
  std::memcpy(a.data.data(), v.data(), a.data.size());
  return a;
}

NpyArray npy_scalar(double v) {
  NpyArray a;
  a.dtype = "<f8";
  a.data.resize(8);
  std::memcpy(a.data.data(), &v, 8);
  return a;
}

void write_npz(const std::string& path, const Ordered<NpyArray>& arrays) {
  Bytes out, cd;
  uint16_t n = 0;
  for (const auto& kv : arrays) {
    const Bytes body = npy_bytes(kv.second);
    const std::string name = kv.first + ".npy";
    const uint32_t crc = crc32(body.data(), body.size());
    if (body.size() >= 0xffffffffu || out.size() >= 0xffffffffu) throw std::runtime_error("npz too large to write");
    const uint32_t off = static_cast<uint32_t>(out.size());
    wr32(out, 0x04034b50); wr16(out, 20); wr16(out, 0); wr16(out, 0); wr16(out, 0); wr16(out, 0x21);
    wr32(out, crc); wr32(out, static_cast<uint32_t>(body.size())); wr32(out, static_cast<uint32_t>(body.size()));
    wr16(out, static_cast<uint16_t>(name.size())); wr16(out, 0);
    out.insert(out.end(), name.begin(), name.end());
    out.insert(out.end(), body.begin(), body.end());
    wr32(cd, 0x02014b50); wr16(cd, 20); wr16(cd, 20); wr16(cd, 0); wr16(cd, 0); wr16(cd, 0); wr16(cd, 0x21);
    wr32(cd, crc); wr32(cd, static_cast<uint32_t>(body.size())); wr32(cd, static_cast<uint32_t>(body.size()));
    wr16(cd, static_cast<uint16_t>(name.size())); wr16(cd, 0); wr16(cd, 0); wr16(cd, 0); wr16(cd, 0);
    wr32(cd, 0); wr32(cd, off);
    cd.insert(cd.end(), name.begin(), name.end());
    ++n;
  }
  const uint32_t cd_off = static_cast<uint32_t>(out.size());
  out.insert(out.end(), cd.begin(), cd.end());
  wr32(out, 0x06054b50); wr16(out, 0); wr16(out, 0); wr16(out, n); wr16(out, n);
  wr32(out, static_cast<uint32_t>(cd.size())); wr32(out, cd_off); wr16(out, 0);
  std::ofstream f(path, std::ios::binary);
  if (!f) throw std::runtime_error("cannot write " + path);
  f.write(reinterpret_cast<const char*>(out.data()), static_cast<std::streamsize>(out.size()));
  if (!f) throw std::runtime_error("cannot write " + path);
}

Dataset load_npz(const std::string& path) {
  const auto arrays = read_npz(path);
  const NpyArray* x = find(arrays, std::string("x"));
  const NpyArray* y = find(arrays, std::string("y"));
  if (!x || !y) throw std::runtime_error(path + ": needs arrays x and y");
  if (x->shape.empty()) throw std::runtime_error(path + ": x has no rows");
  if (y->shape.size() != 1 || y->shape[0] != x->shape[0])
    throw std::runtime_error(path + ": y must be one label per row of x");
  Dataset d;
  d.n = x->shape[0];
  d.features = d.n ? x->numel() / d.n : 1;
  if (!d.n) {
    d.features = 1;
    for (size_t i = 1; i < x->shape.size(); ++i) d.features *= x->shape[i];
  }
  d.x = npy_floats(*x, path + ": x");
  d.y = npy_ints(*y, path + ": y");
  return d;
}

}  // namespace fedge
