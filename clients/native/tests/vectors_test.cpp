// The protocol layer against the golden vectors (firmware_tests/protocol/, docs/protocol.md section 12), plus unit
// checks of the codec, chunking and SHA-256. Usage: vectors_test <vectors dir>. Prints one line per failure and
// "N passed, M failed"; exits non-zero on any failure.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>

#include "chunks.hpp"
#include "codec.hpp"
#include "sha256.hpp"
#include "wire.hpp"

#include <msgpack.hpp>

using namespace fedge;
using json = nlohmann::json;
namespace fs = std::filesystem;

static int passed = 0, failed = 0;

static void check(bool ok, const std::string& what) {
  if (ok) {
    ++passed;
  } else {
    ++failed;
    std::cout << "FAIL " << what << "\n";
  }
}

static Bytes read_file(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  return Bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
}

static std::string hex(const Bytes& b) {
  static const char* h = "0123456789abcdef";
  std::string s;
  for (uint8_t c : b) {
    s.push_back(h[c >> 4]);
    s.push_back(h[c & 15]);
  }
  return s;
}

// ---------------------------------------------------------------- the decoded form (section 12)

static json scalar_json(const Scalar& s) {
  switch (s.kind) {
    case Scalar::Nil: return nullptr;
    case Scalar::Bool: return s.b;
    case Scalar::Int: return s.i;
    case Scalar::Float: return s.f;
    case Scalar::Str: return s.s;
  }
  return nullptr;
}

static json scalars_json(const Scalars& m) {
  json o = json::object();
  for (const auto& kv : m) o[kv.first] = scalar_json(kv.second);
  return o;
}

// nested lists of `shape` from flat values
template <class F>
static json nest(const std::vector<int64_t>& shape, size_t dim, size_t& at, F value) {
  if (dim == shape.size()) return value(at++);
  json a = json::array();
  for (int64_t i = 0; i < shape[dim]; ++i) a.push_back(nest(shape, dim + 1, at, value));
  return a;
}

static uint64_t le(const uint8_t* p, int n) {
  uint64_t v = 0;
  for (int i = n - 1; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

static json array_json(const WireArray& a) {
  json o = {{"dtype", a.dtype}, {"shape", a.shape}};
  size_t at = 0;
  const uint8_t* p = a.data.data();
  if (a.dtype == "f8") {
    o["values"] = nest(a.shape, 0, at, [&](size_t i) {
      uint64_t u = le(p + 8 * i, 8);
      double d;
      std::memcpy(&d, &u, 8);
      return json(d);
    });
  } else if (a.dtype == "u1") {
    o["values"] = nest(a.shape, 0, at, [&](size_t i) { return json(uint64_t(p[i])); });
  } else if (a.dtype == "i4") {
    o["values"] = nest(a.shape, 0, at, [&](size_t i) { return json(int64_t(int32_t(uint32_t(le(p + 4 * i, 4))))); });
  } else if (a.dtype == "i8") {
    o["values"] = nest(a.shape, 0, at, [&](size_t i) { return json(int64_t(le(p + 8 * i, 8))); });
  } else {
    Tensor t = decode_values(a);
    o["values"] = nest(a.shape, 0, at, [&](size_t i) { return json(double(t.data[i])); });
  }
  return o;
}

static json arrays_json(const Ordered<WireArray>& m) {
  json o = json::object();
  for (const auto& kv : m) o[kv.first] = array_json(kv.second);
  return o;
}

static const char* mask_name(const MaskField& m) {
  switch (m.format) {
    case MaskField::Bitmask: return "bitmask";
    case MaskField::Index: return m.width == 2 ? "index16" : "index32";
    case MaskField::Golomb: return "golomb";
    case MaskField::Enum: return "enum";
    default: return "dense";
  }
}

static json update_json(const UpdateRecord& r) {
  json mask = nullptr;
  if (r.mask.format != MaskField::Dense) {
    int64_t k = r.h ? r.h->k : r.x.shape[0];
    // a record's own bitmask: padding ignored, as wire.py
    Support s = decode_support(r.mask, r.shape[0], k, r.mask.format != MaskField::Bitmask);
    mask = {{"format", mask_name(r.mask)}, {"active", s.active()}};
  }
  json out = {{"shape", r.shape}, {"mask", mask}, {"values", array_json(r.x)}};
  if (r.h) {  // which of the active rows carry values (over the k active rows), the tensor rows sent, the codes
    Support s = decode_support(r.h->mask, r.h->k, r.x.shape[0]);
    std::vector<int64_t> picked = s.active(), rows;
    std::vector<int64_t> act = r.mask.format == MaskField::Dense ? std::vector<int64_t>()
                             : decode_support(r.mask, r.shape[0], r.h->k, r.mask.format != MaskField::Bitmask).active();
    for (auto j : picked) rows.push_back(r.mask.format == MaskField::Dense ? j : act[size_t(j)]);
    std::vector<int> p(r.h->p.begin(), r.h->p.end());
    out["sample"] = {{"k", r.h->k}, {"format", mask_name(r.h->mask)}, {"active", picked}, {"rows", rows}, {"p", p}};
  }
  return out;
}

// A msgpack value with every map's entries sorted by key: equal canonical forms differ at most in key order.
static std::string canonical(const msgpack::object& o) {
  std::ostringstream s;
  if (o.type == msgpack::type::MAP) {
    std::vector<std::pair<std::string, std::string>> kv;
    for (uint32_t i = 0; i < o.via.map.size; ++i)
      kv.emplace_back(canonical(o.via.map.ptr[i].key), canonical(o.via.map.ptr[i].val));
    std::sort(kv.begin(), kv.end());
    s << "{";
    for (auto& e : kv) s << e.first << ":" << e.second << ",";
    s << "}";
  } else if (o.type == msgpack::type::ARRAY) {
    s << "[";
    for (uint32_t i = 0; i < o.via.array.size; ++i) s << canonical(o.via.array.ptr[i]) << ",";
    s << "]";
  } else if (o.type == msgpack::type::STR || o.type == msgpack::type::BIN) {
    const char* p = o.type == msgpack::type::STR ? o.via.str.ptr : o.via.bin.ptr;
    uint32_t n = o.type == msgpack::type::STR ? o.via.str.size : o.via.bin.size;
    s << int(o.type) << "'" << hex(Bytes(p, p + n)) << "'";
  } else {
    s << o;
  }
  return s.str();
}

static bool same_but_key_order(const Bytes& a, const Bytes& b) {
  auto ha = msgpack::unpack(reinterpret_cast<const char*>(a.data()), a.size());
  auto hb = msgpack::unpack(reinterpret_cast<const char*>(b.data()), b.size());
  return canonical(ha.get()) == canonical(hb.get());
}

struct ToJson {
  json operator()(const CheckIn& m) {
    json o = {{"kind", "checkin"}, {"device_id", m.device_id}, {"caps", scalars_json(m.caps)},
              {"programs", m.programs}, {"n", m.n}};
    if (!m.last.empty()) o["last"] = m.last;
    return o;
  }
  json operator()(const Plan& m) {
    json o = {{"kind", "plan"}, {"task_id", m.task_id}, {"round", m.round}, {"device_id", m.device_id},
              {"deadline", m.deadline}, {"strategy", m.strategy}, {"runtime", m.runtime},
              {"program_hash", m.program_hash}, {"weights", arrays_json(m.weights)},
              {"hparams", scalars_json(m.hparams)}, {"seed", m.seed}, {"upload", scalars_json(m.upload)}};
    o["program"] = m.program ? json{{"hex", hex(*m.program)}} : json(nullptr);
    if (!m.tag.empty()) o["tag"] = m.tag;
    if (!m.base.empty()) o["base"] = m.base;
    return o;
  }
  json operator()(const Report& m) {
    json t = json::object();
    for (const auto& kv : m.tensors) t[kv.first] = update_json(kv.second);
    return {{"kind", "report"}, {"task_id", m.task_id}, {"device_id", m.device_id}, {"n", m.n},
            {"metrics", scalars_json(m.metrics)}, {"tensors", t}, {"extras", arrays_json(m.extras)}};
  }
  json operator()(const Ack& m) {
    return {{"kind", "ack"}, {"task_id", m.task_id}, {"device_id", m.device_id}, {"status", m.status}, {"reason", m.reason}};
  }
  json operator()(const Status& m) {
    return {{"kind", "status"}, {"device_id", m.device_id}, {"state", m.state}, {"ts", m.ts}};
  }
  json operator()(const Pace& m) { return {{"kind", "pace"}, {"device_id", m.device_id}, {"after", m.after}}; }
  json operator()(const Chunk& m) {
    return {{"kind", "chunk"}, {"id", m.id}, {"i", m.i}, {"n", m.n}, {"t", m.t}, {"b", {{"hex", hex(m.b)}}}};
  }
};

// Exact comparison, ints and floats distinct (Python's json writes 1 and 1.0 apart); differences by path.
static void diff(const json& want, const json& got, const std::string& path, std::vector<std::string>& out) {
  auto cls = [](const json& j) {
    if (j.is_number_float()) return 1;
    if (j.is_number_integer()) return 2;
    return 0;
  };
  if (want.is_number() && got.is_number()) {
    if (cls(want) != cls(got)) out.push_back(path + ": int vs float (" + want.dump() + " / " + got.dump() + ")");
    else if (want.is_number_float() ? want.get<double>() != got.get<double>() : want.get<int64_t>() != got.get<int64_t>())
      out.push_back(path + ": " + want.dump() + " != " + got.dump());
    return;
  }
  if (want.type() != got.type()) {
    out.push_back(path + ": type " + want.type_name() + " vs " + got.type_name());
    return;
  }
  if (want.is_object()) {
    for (auto it = want.begin(); it != want.end(); ++it) {
      if (!got.contains(it.key())) out.push_back(path + "." + it.key() + ": missing");
      else diff(it.value(), got[it.key()], path + "." + it.key(), out);
    }
    for (auto it = got.begin(); it != got.end(); ++it)
      if (!want.contains(it.key())) out.push_back(path + "." + it.key() + ": not in the vector");
  } else if (want.is_array()) {
    if (want.size() != got.size()) {
      out.push_back(path + ": " + std::to_string(want.size()) + " items vs " + std::to_string(got.size()));
      return;
    }
    for (size_t i = 0; i < want.size(); ++i) diff(want[i], got[i], path + "[" + std::to_string(i) + "]", out);
  } else if (want != got) {
    out.push_back(path + ": " + want.dump() + " != " + got.dump());
  }
}

// ---------------------------------------------------------------- the vectors

static void run_vector(const fs::path& jpath) {
  json meta = json::parse(std::ifstream(jpath));
  const std::string name = jpath.stem().string();
  const fs::path dir = jpath.parent_path();
  const bool valid = meta.value("valid", false);
  const std::string topic_kind = meta.value("kind", "");
  std::string why;  // why it was refused, empty if accepted
  Bytes payload;
  bool have = false;
  std::optional<Message> msg;
  try {
    if (meta.contains("chunks")) {
      const int n = meta["chunks"].get<int>();
      Reassembler ra;
      std::vector<Bytes> parts;
      size_t chunk_bytes = 0;
      // every chunk is fed, in file order, as a receiver would (a chunk after a refusal starts a new transfer);
      // the series must yield exactly one message when valid, and none when not
      std::string refusals;
      for (int i = 0; i < n; ++i) {
        Bytes b = read_file(dir / (name + "." + std::to_string(i) + ".msgpack"));
        parts.push_back(b);
        try {
          Message m = decode(b);
          if (!std::holds_alternative<Chunk>(m))
            throw WireError(std::string("part ") + std::to_string(i) + " is a " + kind_of(m) + ", not a chunk");
          const Chunk& c = std::get<Chunk>(m);
          if (i == 0) chunk_bytes = c.b.size();
          check(encode(m) == b, name + "." + std::to_string(i) + ": chunk re-encodes to other bytes");
          auto got = ra.add(c, 0.0);
          if (got) {
            check(!have, name + ": the series yields two payloads");
            payload = *got;
            have = true;
          }
        } catch (const WireError& e) {
          refusals += std::string(refusals.empty() ? "" : "; ") + e.what();
        }
      }
      if (!refusals.empty() && (valid || !have)) throw WireError(refusals);
      if (!have) throw WireError("the series completes no transfer");
      if (valid) {
        fs::path whole = dir / (name + ".msgpack");
        if (fs::exists(whole)) check(read_file(whole) == payload, name + ": reassembly differs from " + name + ".msgpack");
        auto again = split(payload, std::get<Chunk>(decode(parts[0])).id, chunk_bytes);
        check(again == parts, name + ": split does not reproduce the series");
      }
      msg = decode_reassembled(payload);
    } else {
      payload = read_file(dir / (name + ".msgpack"));
      msg = decode(payload);
    }
    if (std::string(kind_of(*msg)) != topic_kind && !std::holds_alternative<Chunk>(*msg))
      throw WireError(std::string("a ") + kind_of(*msg) + " on a " + topic_kind + " topic");
  } catch (const WireError& e) {
    why = e.what();
  } catch (const std::exception& e) {
    check(false, name + ": not a WireError: " + e.what());
    return;
  }
  if (!valid) {
    if (std::getenv("VERBOSE")) std::cout << "  " << name << ": refused: " << why << " (vector: " << meta.value("error", "") << ")\n";
    check(!why.empty(), name + ": accepted, but the vector says it must be dropped (" + meta.value("error", "") + ")");
    return;
  }
  if (!why.empty()) {
    check(false, name + ": refused: " + why);
    return;
  }
  std::vector<std::string> diffs;
  diff(meta["decoded"], std::visit(ToJson{}, *msg), "decoded", diffs);
  for (const auto& d : diffs) std::cout << "  " << name << ": " << d << "\n";
  check(diffs.empty(), name + ": decoded form differs from the json");
  Bytes again = encode(*msg);
  if (again != payload && same_but_key_order(again, payload)) {
    // key order is not significant (section 3); the encoder writes pack_update's order (s, x, h, mask)
    std::cout << "NOTE " << name << ": re-encoding differs from the vector only in map key order\n";
    ++passed;
  } else {
    check(again == payload, name + ": re-encoding gives other bytes");
  }
}

// ---------------------------------------------------------------- unit checks

static std::vector<int64_t> random_support(std::mt19937_64& rng, int64_t n, int64_t k) {
  std::vector<int64_t> all(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) all[size_t(i)] = i;
  std::shuffle(all.begin(), all.end(), rng);
  all.resize(size_t(k));
  std::sort(all.begin(), all.end());
  return all;
}

static void mask_round_trips() {
  std::mt19937_64 rng(1);
  std::vector<int64_t> ns = {0, 1, 2, 3, 7, 8, 9, 10, 31, 64, 65, 100, 255, 256, 1000, 2999, 3000};
  int bad = 0, cases = 0;
  for (int64_t n : ns) {
    std::vector<int64_t> ks = {0, n};
    for (int r = 0; r < 8 && n > 0; ++r) ks.push_back(int64_t(rng() % uint64_t(n + 1)));
    if (n >= 2) ks.insert(ks.end(), {1, n - 1, n / 2, std::min<int64_t>(n, 64), std::max<int64_t>(0, n - 64)});
    for (int64_t k : ks) {
      auto act = random_support(rng, n, k);
      std::vector<std::pair<MaskField::Format, int>> fmts = {
          {MaskField::Bitmask, 0}, {MaskField::Index, 4}, {MaskField::Golomb, 0}};
      if (n <= 65536) fmts.push_back({MaskField::Index, 2});
      if (std::min(k, n - k) <= 64) fmts.push_back({MaskField::Enum, 0});
      for (auto f : fmts) {
        ++cases;
        try {
          MaskField m = encode_mask_as(act, n, f.first, f.second);
          if (decode_mask(m, n, k) != act) {
            ++bad;
            std::cout << "FAIL mask " << int(f.first) << " n=" << n << " k=" << k << " does not round-trip\n";
          }
          if (k < n && (f.first == MaskField::Bitmask || f.first == MaskField::Index)) {  // disagreeing k refused
            bool refused = false;
            try { decode_mask(m, n, k + 1); } catch (const WireError&) { refused = true; }
            if (!refused) { ++bad; std::cout << "FAIL mask " << int(f.first) << " accepted a wrong k\n"; }
          }
        } catch (const std::exception& e) {
          ++bad;
          std::cout << "FAIL mask " << int(f.first) << " n=" << n << " k=" << k << ": " << e.what() << "\n";
        }
      }
      ++cases;
      MaskField best = encode_mask(act, n);
      try {
        if (decode_mask(best, n, k) != act) ++bad;
      } catch (const std::exception& e) {
        ++bad;
        std::cout << "FAIL encode_mask n=" << n << " k=" << k << ": " << e.what() << "\n";
      }
      // the smallest: no format is shorter
      for (auto f : fmts) {
        MaskField m = encode_mask_as(act, n, f.first, f.second);
        if (m.bytes.size() < best.bytes.size()) {
          ++bad;
          std::cout << "FAIL encode_mask n=" << n << " k=" << k << " not the smallest\n";
        }
      }
    }
  }
  check(bad == 0, "mask round trips (" + std::to_string(cases) + " cases, " + std::to_string(bad) + " bad)");
  // vectors of codec.py's own encoder (the golden reports) decode; a truncated golomb and an enum rank out of range fail
  MaskField g;
  g.format = MaskField::Golomb;
  g.bytes = {0x00};
  bool refused = false;
  try { decode_mask(g, 10, 3); } catch (const WireError&) { refused = true; }
  check(refused, "golomb: a stream of zeros is refused");
  MaskField e;
  e.format = MaskField::Enum;
  e.bytes = {0xFF};  // C(10, 2) = 45: one byte, rank 255 out of range
  refused = false;
  try { decode_mask(e, 10, 2); } catch (const WireError&) { refused = true; }
  check(refused, "enum: a rank >= C(n, K) is refused");
  // the big integers: enum of 64 rows of 2^31 - 1
  std::vector<int64_t> big;
  for (int i = 0; i < 64; ++i) big.push_back(int64_t(i) * 33554431 + 17);
  MaskField be = encode_mask_as(big, (int64_t(1) << 31) - 1, MaskField::Enum);
  check(decode_support(be, (int64_t(1) << 31) - 1, 64).rows == big, "enum: 64 rows of 2^31 - 1 round-trip");
  // a golomb mask claiming a huge n costs nothing: K rows only
  MaskField gb = encode_mask_as({5, 1000000}, (int64_t(1) << 31) - 1, MaskField::Golomb);
  check(decode_support(gb, (int64_t(1) << 31) - 1, 2).rows == std::vector<int64_t>({5, 1000000}), "golomb: 2 of 2^31 - 1");
}

static uint16_t f2_bits(double v) {
  std::mt19937_64 rng(0);
  WireArray a = encode_values({v}, {1}, "f2", rng);
  return uint16_t(a.data[0] | (a.data[1] << 8));
}
static uint16_t bf16_bits(double v) {
  std::mt19937_64 rng(0);
  WireArray a = encode_values({v}, {1}, "bf16", rng);
  return uint16_t(a.data[0] | (a.data[1] << 8));
}

static void value_checks() {
  // f2: ties to even, subnormals, saturation
  check(f2_bits(1.0) == 0x3C00, "f2 1.0");
  check(f2_bits(1.0 + std::ldexp(1.0, -11)) == 0x3C00, "f2 tie 1 + 2^-11 -> 1 (even)");
  check(f2_bits(1.0 + 3 * std::ldexp(1.0, -11)) == 0x3C02, "f2 tie 1 + 3 2^-11 -> 1 + 2^-9 (even)");
  check(f2_bits(1.0 + std::ldexp(1.0, -11) + std::ldexp(1.0, -30)) == 0x3C01, "f2 just above a tie rounds up");
  check(f2_bits(std::ldexp(1.0, -24)) == 0x0001, "f2 smallest subnormal");
  check(f2_bits(std::ldexp(1.0, -25)) == 0x0000, "f2 half the smallest subnormal -> 0 (even)");
  check(f2_bits(3 * std::ldexp(1.0, -25)) == 0x0002, "f2 1.5 subnormal units -> 2 (even)");
  check(f2_bits(std::ldexp(1023.5, -24)) == 0x0400, "f2 subnormal rounds up to the smallest normal");
  check(f2_bits(65504.0) == 0x7BFF, "f2 max");
  check(f2_bits(65519.0) == 0x7BFF && f2_bits(1e9) == 0x7BFF && f2_bits(-1e9) == 0xFBFF, "f2 saturates at 65504");
  check(f2_bits(-0.0) == 0x8000, "f2 -0");
  check(f2_bits(0.1) == 0x2E66, "f2 0.1");
  // bf16: nearest even, saturation
  check(bf16_bits(1.0) == 0x3F80, "bf16 1.0");
  check(bf16_bits(double(1.0f + std::ldexp(1.0f, -8))) == 0x3F80, "bf16 tie -> even");
  check(bf16_bits(double(1.0f + 3 * std::ldexp(1.0f, -8))) == 0x3F82, "bf16 tie -> even (up)");
  check(bf16_bits(3.3895313892515355e38) == 0x7F7F, "bf16 saturates instead of infinity");
  check(bf16_bits(-3.3895313892515355e38) == 0xFF7F, "bf16 saturates (negative)");
  // round trips of every format; q8 within a scale step; f2 decode widens exactly
  std::mt19937_64 rng(3);
  std::normal_distribution<double> nd(0, 1);
  std::vector<double> x(60);
  for (auto& v : x) v = nd(rng);
  for (std::string code : {"f4", "f2", "bf16", "q8", "q8r"}) {
    WireArray a = encode_values(x, {6, 10}, code, rng);
    check(int64_t(a.data.size()) == value_nbytes(code, {6, 10}), code + ": value_nbytes");
    Tensor t = decode_values(a);
    double tol = code == "f4" ? 1e-7 : code == "f2" ? 1e-3 : code == "bf16" ? 8e-3 : 0.05;
    double worst = 0;
    for (size_t i = 0; i < x.size(); ++i) worst = std::max(worst, std::fabs(t.data[i] - x[i]) / std::max(1.0, std::fabs(x[i])));
    check(worst <= tol, code + ": round trip within " + std::to_string(tol) + " (worst " + std::to_string(worst) + ")");
  }
  // q8 stochastic rounding is unbiased: the mean of many encodings is the value
  {
    std::vector<double> v = {0.3, -0.71, 0.05, 1.0};
    double sum = 0;
    const int reps = 20000;
    for (int r = 0; r < reps; ++r) sum += decode_values(encode_values(v, {4}, "q8", rng)).data[2];
    check(std::fabs(sum / reps - 0.05) < 2e-4, "q8 stochastic rounding is unbiased (mean " + std::to_string(sum / reps) + ")");
  }
  // decoder refusals
  WireArray q = encode_values(x, {6, 10}, "q8", rng);
  q.data[7] = 0x80;
  bool refused = false;
  try { decode_values(q); } catch (const WireError&) { refused = true; }
  check(refused, "q8: -128 refused");
  q = encode_values(x, {6, 10}, "q8r", rng);
  q.data[3] |= 0x80;  // negative scale
  refused = false;
  try { decode_values(q); } catch (const WireError&) { refused = true; }
  check(refused, "q8r: a negative scale refused");
  WireArray h;
  h.dtype = "f2";
  h.shape = {1};
  h.data = {0x00, 0x7C};
  refused = false;
  try { decode_values(h); } catch (const WireError&) { refused = true; }
  check(refused, "f2: infinity refused");
  h.data = {0x01, 0x00};
  check(decode_values(h).data[0] == std::ldexp(1.0f, -24), "f2: subnormal decodes exactly");
  h.data.push_back(0);
  refused = false;
  try { decode_values(h); } catch (const WireError&) { refused = true; }
  check(refused, "f2: wrong length refused");
}

static void update_checks() {
  // a dense FedAvg update in f4 is the trained weights; f2 delta is w - plan
  std::mt19937_64 rng(5);
  std::normal_distribution<double> nd(0, 1);
  Tensor w1{{40, 8}, {}}, b1{{8}, {}}, p1{{40, 8}, {}}, pb{{8}, {}};
  for (int i = 0; i < 320; ++i) {
    p1.data.push_back(float(nd(rng)));
    w1.data.push_back(p1.data.back() + float(0.01 * nd(rng) * (i / 8 % 3 == 0 ? 10 : 1)));
  }
  for (int i = 0; i < 8; ++i) {
    pb.data.push_back(float(nd(rng)));
    b1.data.push_back(pb.data.back() + 0.01f);
  }
  Tensors trained = {{"fc.weight", w1}, {"fc.bias", b1}}, plan = {{"fc.weight", p1}, {"fc.bias", pb}};
  auto rec = encode_update(trained, plan, {}, {{"dtype", Scalar::of_str("f4")}}, 1);
  check(rec.size() == 2 && rec[0].second.x.dtype == "f4" && rec[0].second.mask.format == MaskField::Dense &&
            decode_values(rec[0].second.x).data == w1.data,
        "encode_update: dense f4 is the trained weights");
  rec = encode_update(trained, plan, {}, {{"dtype", Scalar::of_str("f2")}, {"delta", Scalar::of_bool(true)}}, 1);
  {
    Tensor d = decode_values(rec[0].second.x);
    double worst = 0;
    for (size_t i = 0; i < d.data.size(); ++i) worst = std::max(worst, std::fabs(d.data[i] - (double(w1.data[i]) - p1.data[i])));
    check(rec[0].second.x.dtype == "f2" && worst < 1e-4, "encode_update: f2 deltas");
  }
  rec = encode_update(trained, plan, {{"fc.weight", {1, 5, 7}}},
                      {{"dtype", Scalar::of_str("q8r")}, {"dtype_1d", Scalar::of_str("f4")}}, 1);
  check(rec[0].second.x.dtype == "q8r" && rec[1].second.x.dtype == "f4" && rec[0].second.x.shape == std::vector<int64_t>({3, 8}) &&
            decode_mask(rec[0].second.mask, 40, 3) == std::vector<int64_t>({1, 5, 7}),
        "encode_update: masked rows, dtype_1d");
  bool threw = false;
  try { encode_update(trained, plan, {}, {{"dtype", Scalar::of_str("f3")}}, 1); } catch (const PlanError&) { threw = true; }
  check(threw, "encode_update: an unknown dtype is a PlanError");
  threw = false;
  try {
    encode_update(trained, plan, {}, {{"sample", Scalar::of_str("norm")}, {"keep", Scalar::of_float(0.5)}}, 1);
  } catch (const PlanError&) { threw = true; }
  check(threw, "encode_update: sampling without delta is a PlanError");
  threw = false;
  try {
    encode_update(trained, plan, {}, {{"sample", Scalar::of_str("best")}, {"delta", Scalar::of_bool(true)}}, 1);
  } catch (const PlanError&) { threw = true; }
  check(threw, "encode_update: an unknown sample design is a PlanError");
  // sampled uploads: every row's code >= 1, the update decodes strictly, the bytes come near keep
  for (std::string design : {"norm", "uniform"}) {
    for (std::string dtype : {"f4", "q8r"}) {
      double keep = 0.3, bytes = 0, dense = 0;
      const int reps = 200;
      bool ok = true;
      for (int r = 0; r < reps; ++r) {
        Scalars up = {{"dtype", Scalar::of_str(dtype)}, {"delta", Scalar::of_bool(true)}, {"sample", Scalar::of_str(design)},
                      {"keep", Scalar::of_float(keep)}, {"p_min", Scalar::of_float(0.02)}};
        auto u = encode_update(trained, plan, {}, up, uint64_t(r));
        const UpdateRecord& m = u[0].second;
        if (!m.h || u[1].second.h) { ok = false; break; }
        for (uint8_t c : m.h->p) ok = ok && c >= 1 && double(c) / 255 >= 0.02 - 1.0 / 255;
        Report rep;
        rep.task_id = "t";
        rep.device_id = "d";
        rep.n = 1;
        rep.tensors = u;
        try {
          Bytes b = encode(rep);
          Report back = std::get<Report>(decode(b));
          ok = ok && encode(back) == b;
        } catch (const WireError& e) {
          std::cout << "  sampled update refused: " << e.what() << "\n";
          ok = false;
        }
        for (const auto& kv : u) {
          bytes += double(kv.second.x.data.size() + kv.second.mask.bytes.size());
          if (kv.second.h) bytes += double(kv.second.h->p.size() + kv.second.h->mask.bytes.size());
        }
        dense += double(value_nbytes(dtype, {40, 8}) + value_nbytes(dtype, {8}));
      }
      double ratio = bytes / dense;
      check(ok, "encode_update sampled " + design + " " + dtype + ": codes >= 1 and >= p_min, strict decode round trip");
      check(ratio < keep * 1.15 && ratio > keep * 0.5,
            "encode_update sampled " + design + " " + dtype + ": bytes " + std::to_string(ratio) + " of dense, keep " + std::to_string(keep));
    }
  }
  // the coded downlink: held + decoded for tensors of the same name and shape
  Plan p;
  std::mt19937_64 r2(1);
  p.weights = {{"fc.weight", encode_values(std::vector<double>(320, 0.5), {40, 8}, "f4", r2)},
               {"fc.bias", encode_values(std::vector<double>(8, 0.25), {8}, "bf16", r2)}};
  p.base = "m1";
  Tensors held = {{"fc.weight", p1}, {"fc.bias", Tensor{{9}, std::vector<float>(9, 1.0f)}}};
  Tensors got = plan_weights(p, "m1", held);
  check(got[0].second.data[3] == p1.data[3] + 0.5f && got[1].second.data[0] == 0.25f, "plan_weights: held + decoded, shape-mismatched absolute");
  threw = false;
  try { plan_weights(p, "m0", held); } catch (const PlanError&) { threw = true; }
  check(threw, "plan_weights: an unheld base is a PlanError");
}

static Chunk chunk_of(const Bytes& b) { return std::get<Chunk>(decode(b)); }

static bool refuses(Reassembler& ra, const Chunk& c, double now = 0) {
  try {
    ra.add(c, now);
  } catch (const WireError&) {
    return true;
  }
  return false;
}

static void chunk_checks() {
  Ack a{"task-1", "dev-1", "rejected", std::string(900, 'x')};
  Bytes whole = encode(a);
  auto parts = split(whole, "a-task-1", 256);
  check(parts.size() == (whole.size() + 255) / 256, "split: ceil(len / chunk_bytes) chunks");
  check(split(whole, "x", whole.size()).size() == 1 && split(whole, "x", whole.size())[0] == whole, "split: a payload that fits goes as is");
  {  // in reverse order, with duplicates
    Reassembler ra;
    std::optional<Bytes> got;
    for (size_t i = parts.size(); i-- > 0;) {
      auto r = ra.add(chunk_of(parts[i]), 1.0);
      if (i == parts.size() - 1) ra.add(chunk_of(parts[i]), 1.0);  // a duplicate is ignored
      if (r) got = r;
    }
    check(got && *got == whole && ra.open() == 0, "reassembly out of order with a duplicate");
    check(!ra.add(chunk_of(parts[0]), 30.0) && ra.open() == 0, "the tail of a completed transfer is ignored");
    ra.expire(100.0);
    check(!ra.add(chunk_of(parts[0]), 100.0) && ra.open() == 1, "after 60 s the id is a new transfer");
    ra.expire(161.0);
    check(ra.open() == 0, "a transfer with no new chunk for 60 s is forgotten");
  }
  Chunk c0 = chunk_of(parts[0]);
  {
    Reassembler ra;
    ra.add(c0, 0);
    Chunk c = chunk_of(parts[1]);
    c.n += 1;
    check(refuses(ra, c) && ra.open() == 0, "chunks disagreeing on n: the transfer is dropped");
    ra.add(c0, 0);
    c = chunk_of(parts[1]);
    c.t += 1;
    check(refuses(ra, c) && ra.open() == 0, "chunks disagreeing on t: the transfer is dropped");
  }
  {
    Reassembler ra;
    Chunk c = c0;
    c.b.clear();
    check(refuses(ra, c), "an empty chunk is refused");
    c = c0;
    c.b.resize(255);
    check(refuses(ra, c), "a non-last chunk shorter than 256 bytes is refused");
    c = c0;
    c.n = int64_t((c.t + 255) / 256) + 1;
    check(refuses(ra, c), "n > max(1, ceil(t / 256)) is refused");
    c = c0;
    c.t = 0;
    check(refuses(ra, c), "t = 0 is refused");
    Reassembler small(size_t(c0.t - 1));
    check(refuses(small, c0), "t over the limit is refused");
  }
  {  // data over t
    Reassembler ra;
    Chunk c = c0;
    c.n = 2;
    c.t = 300;
    c.b.assign(256, 1);
    ra.add(c, 0);
    Chunk last = c;
    last.i = 1;
    last.b.assign(45, 1);
    check(refuses(ra, last) && ra.open() == 0, "data over t is refused");
    // and under t: all n in but fewer bytes than t
    ra.add(c, 0);
    last.b.assign(10, 1);
    check(refuses(ra, last), "a reassembled payload shorter than t is refused");
  }
  {  // at most max_open incomplete transfers
    Reassembler ra;
    Chunk a1 = c0, a2 = c0, a3 = c0;
    a2.id = "x2";
    a3.id = "x3";
    ra.add(a1, 0);
    ra.add(a2, 0);
    check(refuses(ra, a3) && ra.open() == 2, "a third incomplete transfer is refused (busy)");
  }
  {  // a chunk inside a chunk
    Bytes inner = parts[0];
    bool refused = false;
    try { decode_reassembled(inner); } catch (const WireError&) { refused = true; }
    check(refused, "a reassembled payload that is itself a chunk is refused");
  }
}

static void sha_checks(const fs::path& dir) {
  check(sha256_hex(Bytes{}) == "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855", "sha256 of empty");
  Bytes abc = {'a', 'b', 'c'};
  check(sha256_hex(abc) == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad", "sha256 of abc");
  std::string two = "abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq";
  check(sha256_hex(reinterpret_cast<const uint8_t*>(two.data()), two.size()) ==
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1",
        "sha256 of the two-block message");
  Bytes mil(1000000, 'a');
  check(sha256_hex(mil) == "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0", "sha256 of a million a");
  fs::path p = dir / "plan_with_program.msgpack";
  if (fs::exists(p)) {
    try {
      Plan plan = std::get<Plan>(decode(read_file(p)));
      check(plan.program && sha256_hex(*plan.program) == plan.program_hash, "sha256: plan_with_program's program hashes to program_hash");
    } catch (const std::exception& e) {
      check(false, std::string("sha256: plan_with_program: ") + e.what());
    }
  }
}

static void wire_checks() {
  // strictness beyond the vectors
  auto refused = [](Bytes b) {
    try {
      decode(b);
    } catch (const WireError&) {
      return true;
    }
    return false;
  };
  Pace p{"dev-1", 42.5};
  Bytes b = encode(p);
  check(!refused(b), "pace decodes");
  Bytes f32 = {0x83, 0xa1, 'v', 0x01, 0xa1, 'k', 0xa4, 'p', 'a', 'c', 'e', 0xa5, 'a', 'f', 't', 'e', 'r', 0xca, 0x42, 0x2a, 0x00, 0x00};
  // missing device_id
  check(refused(f32), "a missing field is refused");
  Bytes full = {0x84, 0xa1, 'v', 0x01, 0xa1, 'k', 0xa4, 'p', 'a', 'c', 'e', 0xa9, 'd', 'e', 'v', 'i', 'c', 'e', '_', 'i', 'd',
                0xa5, 'd', 'e', 'v', '-', '1', 0xa5, 'a', 'f', 't', 'e', 'r', 0xca, 0x42, 0x2a, 0x00, 0x00};
  check(!refused(full) && std::get<Pace>(decode(full)).after == 42.5, "a float 32 where a number belongs is accepted");
  Bytes asint = full;
  asint.resize(asint.size() - 5);
  asint.push_back(42);
  check(!refused(asint), "an int where a number belongs is accepted");
  Bytes v1f = full;
  v1f[3] = 0xc3;  // v = true
  check(refused(v1f), "v = true is refused");
  Bytes dup = full;
  dup[0] = 0x85;
  dup.insert(dup.end(), {0xa5, 'a', 'f', 't', 'e', 'r', 0x01});
  check(refused(dup), "a key twice is refused");
  Bytes ext = full;
  ext[0] = 0x85;
  ext.insert(ext.end(), {0xa1, 'x', 0xd4, 0x01, 0x00});
  check(refused(ext), "an ext type is refused");
  Bytes badutf = encode(Ack{"t", "d", "rejected", "ok"});
  badutf[badutf.size() - 1] = 0xff;
  check(refused(badutf), "invalid utf-8 is refused");
  check(refused(encode(Ack{"t", "d", "rejected", std::string(257, 'x')})), "a string of 257 characters is refused");
  std::string u256;
  for (int i = 0; i < 256; ++i) u256 += "\xc3\xa9";
  check(!refused(encode(Ack{"t", "d", "rejected", u256})), "256 two-byte characters are accepted (characters, not bytes)");
  check(refused(encode(Chunk{"c", 0, 1, -1, {1}})), "a chunk of negative t is refused");
  check(refused(encode(Chunk{"c", 1, 1, 5, {1}})), "a chunk index >= n is refused");
  check(refused(encode(Status{"dev 1", "online", 0})), "an id with a space is refused");
  check(valid_id(std::string(128, 'a')) && !valid_id(std::string(129, 'a')) && !valid_id("") && !valid_id("a\n"),
        "valid_id: 1..128 characters of the set");
  Plan pl;
  pl.task_id = "t";
  pl.device_id = "d";
  pl.program_hash = "h";
  pl.seed = uint64_t(1) << 63;
  check(refused(encode(pl)), "a seed of 2^63 is refused");
  pl.seed = 7;
  pl.tag = "m2";
  pl.base = "m1";
  Bytes pb = encode(pl);
  check(!refused(pb) && encode(decode(pb)) == pb, "a plan with tag and base round-trips");
  check(refused(Bytes{}) && refused(Bytes{0xc1}) && refused(Bytes{0x91, 0x01}), "garbage is refused");
}

int main(int argc, char** argv) {
  if (argc < 2) {
    std::cerr << "usage: vectors_test <vectors dir>\n";
    return 2;
  }
  fs::path dir = argv[1];
  std::vector<fs::path> jsons;
  for (const auto& e : fs::directory_iterator(dir))
    if (e.path().extension() == ".json") jsons.push_back(e.path());
  std::sort(jsons.begin(), jsons.end());
  check(!jsons.empty(), "vectors found in " + dir.string());
  for (const auto& j : jsons) {
    try {
      run_vector(j);
    } catch (const std::exception& e) {
      check(false, j.filename().string() + ": " + e.what());
    }
  }
  std::cout << jsons.size() << " vectors checked\n";
  mask_round_trips();
  value_checks();
  update_checks();
  chunk_checks();
  sha_checks(dir);
  wire_checks();
  std::cout << passed << " passed, " << failed << " failed\n";
  return failed ? 1 : 0;
}
