// msgpack encoding and strict decoding of every message kind (docs/protocol.md sections 3 to 8), following
// edge/protocol/wire.py rule for rule. Decoding uses msgpack-cxx's object API with limits; encoding is a small
// writer of its own so that the bytes are exactly msgpack-python's (minimal ints, float 64, str 8, bin).
#include "wire.hpp"

#include <msgpack.hpp>

#include <cmath>
#include <cstring>
#include <limits>
#include <set>

#include "codec.hpp"

namespace fedge {

namespace {

constexpr size_t kMaxStr = 256;        // characters
constexpr size_t kMaxTensors = 4096;
constexpr size_t kMaxScalars = 256;
constexpr size_t kMaxNdim = 8;
constexpr int64_t kMaxElements = int64_t(1) << 40;
constexpr int64_t kMaxDim = int64_t(1) << 31;  // exclusive

using Obj = msgpack::object;

[[noreturn]] void fail(const std::string& what) { throw WireError(what); }

// ---------------------------------------------------------------- utf-8 (Python's strict decoder)

bool valid_utf8(const char* p, size_t n, size_t* chars) {
  size_t i = 0, c = 0;
  const auto* s = reinterpret_cast<const unsigned char*>(p);
  while (i < n) {
    unsigned char b = s[i];
    size_t len;
    uint32_t cp;
    if (b < 0x80) { ++i; ++c; continue; }
    if (b >= 0xC2 && b <= 0xDF) { len = 2; cp = b & 0x1F; }
    else if (b >= 0xE0 && b <= 0xEF) { len = 3; cp = b & 0x0F; }
    else if (b >= 0xF0 && b <= 0xF4) { len = 4; cp = b & 0x07; }
    else return false;
    if (i + len > n) return false;
    for (size_t j = 1; j < len; ++j) {
      if ((s[i + j] & 0xC0) != 0x80) return false;
      cp = (cp << 6) | (s[i + j] & 0x3F);
    }
    if ((len == 3 && (cp < 0x800 || (cp >= 0xD800 && cp <= 0xDFFF))) || (len == 4 && (cp < 0x10000 || cp > 0x10FFFF)))
      return false;
    i += len;
    ++c;
  }
  if (chars) *chars = c;
  return true;
}

size_t utf8_chars(const std::string& s) {
  size_t c = 0;
  for (unsigned char ch : s) c += (ch & 0xC0) != 0x80;
  return c;
}

std::string short_repr(const std::string& s) { return s.size() <= 60 ? s : s.substr(0, 60) + "..."; }

// Every str valid UTF-8 (msgpack-python, raw=False), every key a str (strict_map_key; a bin key is refused by
// every field check after), no ext anywhere, no key twice in one map (Python keeps the last; refused here).
void check_tree(const Obj& o) {
  switch (o.type) {
    case msgpack::type::STR:
      if (!valid_utf8(o.via.str.ptr, o.via.str.size, nullptr)) fail("malformed msgpack: invalid utf-8 in a str");
      return;
    case msgpack::type::EXT:
      fail("malformed msgpack: ext types are not used");
    case msgpack::type::ARRAY:
      for (uint32_t i = 0; i < o.via.array.size; ++i) check_tree(o.via.array.ptr[i]);
      return;
    case msgpack::type::MAP: {
      std::set<std::string> seen;
      for (uint32_t i = 0; i < o.via.map.size; ++i) {
        const Obj& k = o.via.map.ptr[i].key;
        if (k.type != msgpack::type::STR) fail("malformed msgpack: a map key that is not a str");
        check_tree(k);
        if (!seen.emplace(k.via.str.ptr, k.via.str.size).second)
          fail("malformed msgpack: key " + short_repr(std::string(k.via.str.ptr, k.via.str.size)) + " twice");
        check_tree(o.via.map.ptr[i].val);
      }
      return;
    }
    default:
      return;
  }
}

std::string str_of(const Obj& o) { return std::string(o.via.str.ptr, o.via.str.size); }

const char* type_name(const Obj& o) {
  switch (o.type) {
    case msgpack::type::NIL: return "NoneType";
    case msgpack::type::BOOLEAN: return "bool";
    case msgpack::type::POSITIVE_INTEGER:
    case msgpack::type::NEGATIVE_INTEGER: return "int";
    case msgpack::type::FLOAT32:
    case msgpack::type::FLOAT64: return "float";
    case msgpack::type::STR: return "str";
    case msgpack::type::BIN: return "bytes";
    case msgpack::type::ARRAY: return "list";
    case msgpack::type::MAP: return "dict";
    default: return "ext";
  }
}

bool is_int(const Obj& o) {
  return o.type == msgpack::type::POSITIVE_INTEGER || o.type == msgpack::type::NEGATIVE_INTEGER;
}
bool is_float(const Obj& o) { return o.type == msgpack::type::FLOAT32 || o.type == msgpack::type::FLOAT64; }

// A msgpack integer as int64; one above 2^63 - 1 is refused (no field of v1 can hold one: see the report).
int64_t int_of(const Obj& o, const std::string& what) {
  if (o.type == msgpack::type::POSITIVE_INTEGER) {
    if (o.via.u64 > uint64_t(std::numeric_limits<int64_t>::max())) fail(what + " out of range");
    return static_cast<int64_t>(o.via.u64);
  }
  return o.via.i64;
}

// A map's fields by key (keys are checked str and unique by check_tree).
class Fields {
 public:
  Fields(const Obj& o, std::string what) : o_(o), what_(std::move(what)) {}
  const Obj* get(const char* key) const {
    size_t n = std::strlen(key);
    for (uint32_t i = 0; i < o_.via.map.size; ++i) {
      const Obj& k = o_.via.map.ptr[i].key;
      if (k.via.str.size == n && std::memcmp(k.via.str.ptr, key, n) == 0) return &o_.via.map.ptr[i].val;
    }
    return nullptr;
  }
  bool has(const char* key) const { return get(key) != nullptr; }
  void only(std::initializer_list<const char*> allowed) const {
    for (uint32_t i = 0; i < o_.via.map.size; ++i) {
      const Obj& k = o_.via.map.ptr[i].key;
      bool ok = false;
      for (const char* a : allowed)
        if (k.via.str.size == std::strlen(a) && std::memcmp(k.via.str.ptr, a, k.via.str.size) == 0) ok = true;
      if (!ok) fail(what_ + ": unknown fields ['" + short_repr(str_of(k)) + "']");
    }
  }
  const Obj& need(const char* key) const {
    const Obj* v = get(key);
    if (!v) fail(what_ + ": missing field '" + key + "'");
    return *v;
  }
  [[noreturn]] void wrong(const char* key, const Obj& v) const {
    fail(what_ + ": field '" + key + "' has type " + type_name(v));
  }
  int64_t integer(const char* key) const {
    const Obj& v = need(key);
    if (!is_int(v)) wrong(key, v);
    return int_of(v, what_ + ": " + key);
  }
  double num(const char* key) const {
    const Obj& v = need(key);
    if (is_int(v)) return v.type == msgpack::type::POSITIVE_INTEGER ? double(v.via.u64) : double(v.via.i64);
    if (!is_float(v)) wrong(key, v);
    if (!std::isfinite(v.via.f64)) fail(what_ + ": field '" + key + "' is not finite");
    return v.via.f64;
  }
  std::string str(const char* key) const {
    const Obj& v = need(key);
    if (v.type != msgpack::type::STR) wrong(key, v);
    std::string s = str_of(v);
    if (utf8_chars(s) > kMaxStr) fail(what_ + ": field '" + key + "' is too long");
    return s;
  }
  std::string id(const char* key) const {
    std::string s = str(key);
    if (!valid_id(s)) fail(what_ + ": " + key + " '" + short_repr(s) + "' is not a valid id");
    return s;
  }
  Bytes bin(const char* key) const {
    const Obj& v = need(key);
    if (v.type != msgpack::type::BIN) wrong(key, v);
    return Bytes(v.via.bin.ptr, v.via.bin.ptr + v.via.bin.size);
  }
  const std::string& what() const { return what_; }

 private:
  const Obj& o_;
  std::string what_;
};

// ---------------------------------------------------------------- arrays

bool good_shape(const Obj* o, size_t min_ndim, std::vector<int64_t>* out) {
  if (!o || o->type != msgpack::type::ARRAY) return false;
  size_t n = o->via.array.size;
  if (n < min_ndim || n > kMaxNdim) return false;
  out->clear();
  int64_t prod = 1;
  for (size_t i = 0; i < n; ++i) {
    const Obj& d = o->via.array.ptr[i];
    if (d.type != msgpack::type::POSITIVE_INTEGER || d.via.u64 >= uint64_t(kMaxDim)) return false;
    int64_t v = static_cast<int64_t>(d.via.u64);
    if (v) {
      if (prod > kMaxElements / v) return false;  // the product passes 2^40 (checked without overflow)
      prod *= v;
    }
    out->push_back(v);
  }
  return prod <= kMaxElements;
}

const std::set<std::string> kPlain = {"f4", "f2", "f8", "u1", "i4", "i8"};
const std::set<std::string> kCoded = {"bf16", "q8", "q8r"};
const std::set<std::string> kFloatCodes = {"f4", "f2", "f8", "bf16", "q8", "q8r"};

int itemsize(const std::string& code) {
  if (code == "u1") return 1;
  if (code == "f2") return 2;
  if (code == "f4" || code == "i4") return 4;
  return 8;
}

bool finite_bits(const std::string& code, const uint8_t* p) {
  if (code == "f4") {
    uint32_t u;
    std::memcpy(&u, p, 4);
    return (u & 0x7F800000u) != 0x7F800000u;
  }
  if (code == "f2") {
    uint16_t u = uint16_t(p[0] | (p[1] << 8));
    return (u & 0x7C00u) != 0x7C00u;
  }
  uint64_t u;
  std::memcpy(&u, p, 8);
  return (u & 0x7FF0000000000000ull) != 0x7FF0000000000000ull;
}

// unpack_array: the length against dtype and shape, and (finite) no NaN or infinity.
WireArray unpack_array(const Obj* obj, const std::string& what) {
  if (!obj || obj->type != msgpack::type::MAP || obj->via.map.size != 3) fail(what + ": not an array record");
  Fields f(*obj, what);
  const Obj *d = f.get("d"), *s = f.get("s"), *b = f.get("b");
  if (!d || !s || !b) fail(what + ": not an array record");
  WireArray a;
  if (d->type != msgpack::type::STR || (!kPlain.count(str_of(*d)) && !kCoded.count(str_of(*d))))
    fail(what + ": dtype " + (d->type == msgpack::type::STR ? short_repr(str_of(*d)) : type_name(*d)) + " is not allowed");
  a.dtype = str_of(*d);
  if (!good_shape(s, 0, &a.shape)) fail(what + ": bad shape");
  if (b->type != msgpack::type::BIN) fail(what + ": array data is not bytes");
  a.data.assign(b->via.bin.ptr, b->via.bin.ptr + b->via.bin.size);
  if (kCoded.count(a.dtype)) {
    try {
      decode_values(a);  // length, scales, -128, finiteness
    } catch (const WireError& e) {
      fail(what + ": " + e.what());
    }
    return a;
  }
  int64_t count = 1;
  for (auto x : a.shape) count *= x;
  const int size = itemsize(a.dtype);
  if (uint64_t(count) * uint64_t(size) != a.data.size())
    fail(what + ": shape and " + std::to_string(a.data.size()) + " data bytes disagree");
  if (a.dtype[0] == 'f')
    for (size_t i = 0; i < a.data.size(); i += size)
      if (!finite_bits(a.dtype, a.data.data() + i)) fail(what + ": non-finite values");
  return a;
}

Scalars unpack_scalars(const Obj* obj, const std::string& what) {
  if (!obj || obj->type != msgpack::type::MAP || obj->via.map.size > kMaxScalars) fail(what + ": not a small map");
  Scalars out;
  for (uint32_t i = 0; i < obj->via.map.size; ++i) {
    std::string k = str_of(obj->via.map.ptr[i].key);
    if (utf8_chars(k) > kMaxStr) fail(what + ": bad key");
    const Obj& v = obj->via.map.ptr[i].val;
    switch (v.type) {
      case msgpack::type::NIL: out.emplace_back(k, Scalar::nil()); break;
      case msgpack::type::BOOLEAN: out.emplace_back(k, Scalar::of_bool(v.via.boolean)); break;
      case msgpack::type::POSITIVE_INTEGER:
      case msgpack::type::NEGATIVE_INTEGER: out.emplace_back(k, Scalar::of_int(int_of(v, what + ": " + k))); break;
      case msgpack::type::FLOAT32:
      case msgpack::type::FLOAT64:
        if (!std::isfinite(v.via.f64)) fail(what + ": " + short_repr(k) + " is not finite");
        out.emplace_back(k, Scalar::of_float(v.via.f64));
        break;
      case msgpack::type::STR: {
        std::string s = str_of(v);
        if (utf8_chars(s) > kMaxStr) fail(what + ": " + short_repr(k) + " is too long");
        out.emplace_back(k, Scalar::of_str(std::move(s)));
        break;
      }
      default:
        fail(what + ": " + short_repr(k) + " is not a scalar");
    }
  }
  return out;
}

Ordered<WireArray> unpack_arrays(const Obj* obj, const std::string& what) {
  if (!obj || obj->type != msgpack::type::MAP || obj->via.map.size > kMaxTensors) fail(what + ": not a map of arrays");
  Ordered<WireArray> out;
  for (uint32_t i = 0; i < obj->via.map.size; ++i) {
    std::string k = str_of(obj->via.map.ptr[i].key);
    if (k.empty() || utf8_chars(k) > kMaxStr) fail(what + ": bad tensor name");
    out.emplace_back(k, unpack_array(&obj->via.map.ptr[i].val, what + "[" + short_repr(k) + "]"));
  }
  return out;
}

// ---------------------------------------------------------------- update records

const char* const kMaskKeys[] = {"m", "i", "g", "e"};

// The mask field of a record or a sample map (none -> Dense); the caller has checked there is at most one.
MaskField mask_field(const Fields& f, const std::string& what, bool sample) {
  MaskField m;
  const char* key = nullptr;
  for (const char* k : kMaskKeys)
    if (f.has(k)) key = k;
  if (!key) {
    if (f.has("w")) fail(what + ": index width without an index list");
    return m;
  }
  const Obj& data = f.need(key);
  if (data.type != msgpack::type::BIN) fail(what + (sample ? ": sample mask is not bytes" : ": mask is not bytes"));
  m.bytes.assign(data.via.bin.ptr, data.via.bin.ptr + data.via.bin.size);
  switch (key[0]) {
    case 'm': m.format = MaskField::Bitmask; break;
    case 'g': m.format = MaskField::Golomb; break;
    case 'e': m.format = MaskField::Enum; break;
    default: {
      m.format = MaskField::Index;
      const Obj* w = f.get("w");
      if (!w || w->type != msgpack::type::POSITIVE_INTEGER || (w->via.u64 != 2 && w->via.u64 != 4))
        fail(what + (sample ? ": bad sample index list" : ": bad index list"));
      m.width = int(w->via.u64);
    }
  }
  if (m.format != MaskField::Index && f.has("w")) fail(what + ": index width without an index list");
  return m;
}

UpdateRecord unpack_update(const Obj& obj, const std::string& what) {
  if (obj.type != msgpack::type::MAP) fail(what + ": not an update record");
  Fields f(obj, what);
  f.only({"s", "x", "m", "i", "w", "g", "e", "h"});
  UpdateRecord r;
  if (!good_shape(f.get("s"), 1, &r.shape)) fail(what + ": bad shape");
  r.x = unpack_array(f.get("x"), what + ".values");
  if (!kFloatCodes.count(r.x.dtype)) fail(what + ": values must be floating point");
  const int64_t rows = r.shape[0];
  int masks = 0;
  for (const char* k : kMaskKeys) masks += f.has(k);
  if (masks > 1) fail(what + ": more than one mask");
  const Obj* h = f.get("h");
  if (h && h->type == msgpack::type::NIL) h = nullptr;  // wire.py: h = obj.get("h"); if h is not None
  int64_t k_active = -1;
  if (h) {
    if (h->type != msgpack::type::MAP) fail(what + ": sample is not a map");
    const Obj* k = Fields(*h, what).get("k");
    if (!k || k->type != msgpack::type::POSITIVE_INTEGER || k->via.u64 > uint64_t(rows))
      fail(what + ": sample declares a bad number of active rows of " + std::to_string(rows));
    k_active = int64_t(k->via.u64);
  }
  const auto& xs = r.x.shape;
  r.mask = mask_field(f, what, false);
  int64_t n_active = rows;
  switch (r.mask.format) {
    case MaskField::Golomb:
    case MaskField::Enum: {
      int64_t inner = 1;
      for (size_t i = 1; i < r.shape.size(); ++i) inner *= r.shape[i];
      if (xs.size() != r.shape.size() || !std::equal(xs.begin() + 1, xs.end(), r.shape.begin() + 1) || inner == 0)
        fail(what + ": values and the tensor's shape disagree");
      if (xs[0] > rows) fail(what + ": more rows of values than the tensor has");
      int64_t k = k_active >= 0 ? k_active : xs[0];
      try {
        decode_support(r.mask, rows, k);
      } catch (const WireError& e) {
        fail(what + ": " + e.what());
      }
      n_active = k;
      break;
    }
    case MaskField::Bitmask: {
      if (r.mask.bytes.size() != size_t((rows + 7) / 8))
        fail(what + ": mask of " + std::to_string(r.mask.bytes.size()) + " bytes for " + std::to_string(rows) + " rows");
      // padding bits are ignored, as wire.py does (np.unpackbits(count=rows))
      int64_t c = 0;
      for (int64_t i = 0; i < rows; ++i) c += (r.mask.bytes[i >> 3] >> (7 - (i & 7))) & 1;
      n_active = c;
      break;
    }
    case MaskField::Index: {
      const size_t w = size_t(r.mask.width);
      if (r.mask.bytes.size() % w) fail(what + ": bad index list");
      int64_t prev = -1;
      for (size_t p = 0; p < r.mask.bytes.size(); p += w) {
        int64_t v = r.mask.bytes[p] | (r.mask.bytes[p + 1] << 8);
        if (w == 4) v |= int64_t(r.mask.bytes[p + 2]) << 16 | int64_t(r.mask.bytes[p + 3]) << 24;
        if (v >= rows || v <= prev) fail(what + ": index list out of range or not increasing");
        prev = v;
      }
      n_active = int64_t(r.mask.bytes.size() / w);
      break;
    }
    case MaskField::Dense:
      break;
  }
  int64_t n_sent = n_active;
  if (h) {
    Fields hf(*h, what + ".sample");
    hf.only({"k", "p", "m", "i", "w", "g", "e"});
    if (n_active != k_active)
      fail(what + ": sample says " + std::to_string(k_active) + " active rows, the mask " + std::to_string(n_active));
    if (xs.empty()) fail(what + ": sampled values need rows");
    const int64_t k = xs[0];
    if (k > k_active) fail(what + ": more rows of values than active rows");
    const Obj* p = hf.get("p");
    if (!p || p->type != msgpack::type::BIN || int64_t(p->via.bin.size) != k)
      fail(what + ": probabilities and rows of values disagree");
    Sample s;
    s.k = k_active;
    s.p.assign(p->via.bin.ptr, p->via.bin.ptr + p->via.bin.size);
    for (uint8_t c : s.p)
      if (!c) fail(what + ": a row sent with probability 0");
    int sm = 0;
    for (const char* key : kMaskKeys) sm += hf.has(key);
    if (sm != 1) fail(what + ": the sample needs exactly one mask");
    s.mask = mask_field(hf, what, true);
    try {
      decode_support(s.mask, k_active, k, true);
    } catch (const WireError& e) {
      fail(what + ": sample: " + e.what());
    }
    r.h = std::move(s);
    n_sent = k;
  }
  // _check_values: the values are [n_sent, *s[1:]]
  if (xs.size() != r.shape.size() || xs[0] != n_sent || !std::equal(xs.begin() + 1, xs.end(), r.shape.begin() + 1))
    fail(what + ": values and the shape the " + std::string(h ? "sample" : "mask") + " says disagree");
  return r;
}

// ---------------------------------------------------------------- the kinds

CheckIn dec_checkin(const Fields& f) {
  f.only({"v", "k", "device_id", "caps", "programs", "n", "last"});
  const Obj& progs = f.need("programs");
  if (progs.type != msgpack::type::ARRAY) f.wrong("programs", progs);
  CheckIn m;
  if (progs.via.array.size > 1024) fail(f.what() + ": bad program list");
  for (uint32_t i = 0; i < progs.via.array.size; ++i) {
    const Obj& p = progs.via.array.ptr[i];
    if (p.type != msgpack::type::STR || !valid_id(str_of(p))) fail(f.what() + ": bad program list");
    m.programs.push_back(str_of(p));
  }
  m.n = f.integer("n");
  if (m.n < 0) fail(f.what() + ": sample count out of range");
  if (f.has("last")) m.last = f.id("last");
  m.device_id = f.id("device_id");
  m.caps = unpack_scalars(f.get("caps"), f.what() + ".caps");
  return m;
}

Plan dec_plan(const Fields& f) {
  f.only({"v", "k", "task_id", "round", "device_id", "deadline", "strategy", "runtime", "program_hash", "weights",
          "hparams", "seed", "upload", "program", "tag", "base"});
  Plan m;
  const Obj* prog = f.get("program");
  if (prog && prog->type != msgpack::type::NIL) {
    if (prog->type != msgpack::type::BIN) fail(f.what() + ": program is not bytes");
    m.program = Bytes(prog->via.bin.ptr, prog->via.bin.ptr + prog->via.bin.size);
  }
  int64_t seed = f.integer("seed");
  m.round = f.integer("round");
  if (seed < 0 || m.round < 0) fail(f.what() + ": seed or round out of range");
  m.seed = uint64_t(seed);
  m.task_id = f.id("task_id");
  m.device_id = f.id("device_id");
  m.deadline = f.num("deadline");
  m.strategy = f.str("strategy");
  m.runtime = f.str("runtime");
  m.program_hash = f.id("program_hash");
  m.weights = unpack_arrays(f.get("weights"), f.what() + ".weights");
  m.hparams = unpack_scalars(f.get("hparams"), f.what() + ".hparams");
  m.upload = unpack_scalars(f.get("upload"), f.what() + ".upload");
  if (f.has("tag")) m.tag = f.id("tag");
  if (f.has("base")) m.base = f.id("base");
  return m;
}

Report dec_report(const Fields& f) {
  f.only({"v", "k", "task_id", "device_id", "n", "metrics", "tensors", "extras"});
  Report m;
  m.n = f.integer("n");
  if (m.n <= 0) fail(f.what() + ": sample count must be positive");
  const Obj* tens = f.get("tensors");
  if (!tens || tens->type != msgpack::type::MAP || tens->via.map.size > kMaxTensors)
    fail(f.what() + ": tensors is not a map");
  for (uint32_t i = 0; i < tens->via.map.size; ++i) {
    std::string k = str_of(tens->via.map.ptr[i].key);
    if (k.empty() || utf8_chars(k) > kMaxStr) fail(f.what() + ": bad tensor name");
    m.tensors.emplace_back(k, unpack_update(tens->via.map.ptr[i].val, f.what() + ".tensors[" + short_repr(k) + "]"));
  }
  m.task_id = f.id("task_id");
  m.device_id = f.id("device_id");
  m.metrics = unpack_scalars(f.get("metrics"), f.what() + ".metrics");
  if (f.has("extras")) m.extras = unpack_arrays(f.get("extras"), f.what() + ".extras");
  return m;
}

Ack dec_ack(const Fields& f) {
  f.only({"v", "k", "task_id", "device_id", "status", "reason"});
  Ack m;
  m.status = f.str("status");
  if (m.status != "accepted" && m.status != "duplicate" && m.status != "late" && m.status != "rejected")
    fail(f.what() + ": unknown ack status '" + short_repr(m.status) + "'");
  m.task_id = f.id("task_id");
  m.device_id = f.id("device_id");
  m.reason = f.str("reason");
  return m;
}

Status dec_status(const Fields& f) {
  f.only({"v", "k", "device_id", "state", "ts"});
  Status m;
  m.state = f.str("state");
  if (m.state != "online" && m.state != "offline" && m.state != "training" && m.state != "idle")
    fail(f.what() + ": unknown state '" + short_repr(m.state) + "'");
  m.device_id = f.id("device_id");
  m.ts = f.num("ts");
  return m;
}

Pace dec_pace(const Fields& f) {
  f.only({"v", "k", "device_id", "after"});
  Pace m;
  m.after = f.num("after");
  if (!(m.after >= 0.0 && m.after <= 86400.0)) fail(f.what() + ": after is outside 0..86400");
  m.device_id = f.id("device_id");
  return m;
}

Chunk dec_chunk(const Fields& f) {
  f.only({"v", "k", "id", "i", "n", "t", "b"});
  Chunk m;
  m.i = f.integer("i");
  m.n = f.integer("n");
  m.t = f.integer("t");
  m.b = f.bin("b");
  if (!(0 <= m.i && m.i < m.n && m.n <= (int64_t(1) << 20)) || m.t < 0)
    fail(f.what() + ": chunk " + std::to_string(m.i) + " of " + std::to_string(m.n) + " is out of range");
  m.id = f.id("id");
  return m;
}

// ---------------------------------------------------------------- the writer (msgpack-python's choices)

struct Writer {
  Bytes out;
  void byte(uint8_t b) { out.push_back(b); }
  void be(uint64_t v, int n) {
    for (int i = n - 1; i >= 0; --i) out.push_back(uint8_t(v >> (8 * i)));
  }
  void nil() { byte(0xc0); }
  void boolean(bool b) { byte(b ? 0xc3 : 0xc2); }
  void uint(uint64_t v) {
    if (v < 0x80) byte(uint8_t(v));
    else if (v <= 0xff) { byte(0xcc); be(v, 1); }
    else if (v <= 0xffff) { byte(0xcd); be(v, 2); }
    else if (v <= 0xffffffffu) { byte(0xce); be(v, 4); }
    else { byte(0xcf); be(v, 8); }
  }
  void integer(int64_t v) {
    if (v >= 0) return uint(uint64_t(v));
    if (v >= -32) byte(uint8_t(v));
    else if (v >= -128) { byte(0xd0); be(uint64_t(v), 1); }
    else if (v >= -32768) { byte(0xd1); be(uint64_t(v), 2); }
    else if (v >= -2147483648LL) { byte(0xd2); be(uint64_t(v), 4); }
    else { byte(0xd3); be(uint64_t(v), 8); }
  }
  void f64(double d) {
    uint64_t u;
    std::memcpy(&u, &d, 8);
    byte(0xcb);
    be(u, 8);
  }
  void str(const std::string& s) {
    size_t n = s.size();
    if (n < 32) byte(uint8_t(0xa0 | n));
    else if (n <= 0xff) { byte(0xd9); be(n, 1); }
    else if (n <= 0xffff) { byte(0xda); be(n, 2); }
    else { byte(0xdb); be(n, 4); }
    out.insert(out.end(), s.begin(), s.end());
  }
  void bin(const Bytes& b) {
    size_t n = b.size();
    if (n <= 0xff) { byte(0xc4); be(n, 1); }
    else if (n <= 0xffff) { byte(0xc5); be(n, 2); }
    else { byte(0xc6); be(n, 4); }
    out.insert(out.end(), b.begin(), b.end());
  }
  void array(size_t n) {
    if (n < 16) byte(uint8_t(0x90 | n));
    else if (n <= 0xffff) { byte(0xdc); be(n, 2); }
    else { byte(0xdd); be(n, 4); }
  }
  void map(size_t n) {
    if (n < 16) byte(uint8_t(0x80 | n));
    else if (n <= 0xffff) { byte(0xde); be(n, 2); }
    else { byte(0xdf); be(n, 4); }
  }
  void scalar(const Scalar& s) {
    switch (s.kind) {
      case Scalar::Nil: nil(); break;
      case Scalar::Bool: boolean(s.b); break;
      case Scalar::Int: integer(s.i); break;
      case Scalar::Float: f64(s.f); break;
      case Scalar::Str: str(s.s); break;
    }
  }
  void scalars(const Scalars& m) {
    map(m.size());
    for (const auto& kv : m) {
      str(kv.first);
      scalar(kv.second);
    }
  }
  void shape(const std::vector<int64_t>& s) {
    array(s.size());
    for (auto d : s) integer(d);
  }
  void warray(const WireArray& a) {
    map(3);
    str("d"); str(a.dtype);
    str("s"); shape(a.shape);
    str("b"); bin(a.data);
  }
  void arrays(const Ordered<WireArray>& m) {
    map(m.size());
    for (const auto& kv : m) {
      str(kv.first);
      warray(kv.second);
    }
  }
  size_t mask_entries(const MaskField& m) { return m.format == MaskField::Dense ? 0 : m.format == MaskField::Index ? 2 : 1; }
  void mask(const MaskField& m) {
    switch (m.format) {
      case MaskField::Dense: return;
      case MaskField::Bitmask: str("m"); break;
      case MaskField::Golomb: str("g"); break;
      case MaskField::Enum: str("e"); break;
      case MaskField::Index: str("i"); break;
    }
    bin(m.bytes);
    if (m.format == MaskField::Index) {
      str("w");
      integer(m.width);
    }
  }
  // pack_update's order: s, x, h (k, p, its mask), the row mask
  void update(const UpdateRecord& r) {
    map(2 + (r.h ? 1 : 0) + mask_entries(r.mask));
    str("s"); shape(r.shape);
    str("x"); warray(r.x);
    if (r.h) {
      str("h");
      map(2 + mask_entries(r.h->mask));
      str("k"); integer(r.h->k);
      str("p"); bin(r.h->p);
      mask(r.h->mask);
    }
    mask(r.mask);
  }
  void head(size_t fields, const char* kind) {
    map(fields + 2);
    str("v"); integer(1);
    str("k"); str(kind);
  }

  void operator()(const CheckIn& m) {
    head(4 + !m.last.empty(), "checkin");
    str("device_id"); str(m.device_id);
    str("caps"); scalars(m.caps);
    str("programs"); array(m.programs.size());
    for (const auto& p : m.programs) str(p);
    str("n"); integer(m.n);
    if (!m.last.empty()) { str("last"); str(m.last); }
  }
  void operator()(const Plan& m) {
    head(12 + !m.tag.empty() + !m.base.empty(), "plan");
    str("task_id"); str(m.task_id);
    str("round"); integer(m.round);
    str("device_id"); str(m.device_id);
    str("deadline"); f64(m.deadline);
    str("strategy"); str(m.strategy);
    str("runtime"); str(m.runtime);
    str("program_hash"); str(m.program_hash);
    str("weights"); arrays(m.weights);
    str("hparams"); scalars(m.hparams);
    str("seed"); uint(m.seed);
    str("upload"); scalars(m.upload);
    str("program");
    if (m.program) bin(*m.program); else nil();
    if (!m.tag.empty()) { str("tag"); str(m.tag); }
    if (!m.base.empty()) { str("base"); str(m.base); }
  }
  void operator()(const Report& m) {
    head(6, "report");
    str("task_id"); str(m.task_id);
    str("device_id"); str(m.device_id);
    str("n"); integer(m.n);
    str("metrics"); scalars(m.metrics);
    str("tensors"); map(m.tensors.size());
    for (const auto& kv : m.tensors) {
      str(kv.first);
      update(kv.second);
    }
    str("extras"); arrays(m.extras);
  }
  void operator()(const Ack& m) {
    head(4, "ack");
    str("task_id"); str(m.task_id);
    str("device_id"); str(m.device_id);
    str("status"); str(m.status);
    str("reason"); str(m.reason);
  }
  void operator()(const Status& m) {
    head(3, "status");
    str("device_id"); str(m.device_id);
    str("state"); str(m.state);
    str("ts"); f64(m.ts);
  }
  void operator()(const Pace& m) {
    head(2, "pace");
    str("device_id"); str(m.device_id);
    str("after"); f64(m.after);
  }
  void operator()(const Chunk& m) {
    head(5, "chunk");
    str("id"); str(m.id);
    str("i"); integer(m.i);
    str("n"); integer(m.n);
    str("t"); integer(m.t);
    str("b"); bin(m.b);
  }
};

}  // namespace

const char* kind_of(const Message& m) {
  static const char* const kinds[] = {"checkin", "plan", "report", "ack", "status", "pace", "chunk"};
  return kinds[m.index()];
}

bool valid_id(const std::string& s) {
  if (s.empty() || s.size() > 128) return false;
  for (unsigned char c : s)
    if (!(std::isalnum(c) && c < 0x80) && c != '_' && c != '.' && c != ':' && c != '-') return false;
  return true;
}

Message decode(const uint8_t* data, size_t size, size_t max_bytes) {
  if (size > max_bytes)
    throw WireError("message of " + std::to_string(size) + " bytes exceeds the limit of " + std::to_string(max_bytes));
  msgpack::object_handle oh;
  size_t off = 0;
  try {
    // Limits that refuse only what a field check would refuse anyway: no array of v1 is longer than 1024 (programs),
    // no map larger than 4096 (tensors, weights), no str longer than 256 characters (<= 1024 bytes).
    msgpack::unpack_limit limit(1024, 4096, 1024, size, 0xffffffff, 32);
    oh = msgpack::unpack(reinterpret_cast<const char*>(data), size, off, nullptr, nullptr, limit);
  } catch (const std::exception& e) {
    throw WireError(std::string("malformed msgpack: ") + e.what());
  }
  if (off != size) throw WireError("malformed msgpack: " + std::to_string(size - off) + " trailing bytes");
  const Obj& o = oh.get();
  check_tree(o);
  if (o.type != msgpack::type::MAP) throw WireError("message is not a map");
  Fields top(o, "message");
  const Obj* v = top.get("v");
  if (!v || v->type != msgpack::type::POSITIVE_INTEGER || v->via.u64 != 1)
    throw WireError("protocol version is not 1");
  const Obj* k = top.get("k");
  std::string kind = k && k->type == msgpack::type::STR ? str_of(*k) : std::string();
  Fields f(o, kind);
  try {
    if (kind == "checkin") return dec_checkin(f);
    if (kind == "plan") return dec_plan(f);
    if (kind == "report") return dec_report(f);
    if (kind == "ack") return dec_ack(f);
    if (kind == "status") return dec_status(f);
    if (kind == "pace") return dec_pace(f);
    if (kind == "chunk") return dec_chunk(f);
  } catch (const WireError&) {
    throw;
  } catch (const std::exception& e) {  // a decoder bug on hostile input is still a dropped message
    throw WireError(kind + ": " + e.what());
  }
  throw WireError("unknown message kind '" + short_repr(kind) + "'");
}

Bytes encode(const Message& m) {
  Writer w;
  std::visit(w, m);
  return std::move(w.out);
}

}  // namespace fedge
