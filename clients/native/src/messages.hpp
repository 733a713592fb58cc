// The messages of docs/protocol.md (section 7), as plain structs. No I/O and no msgpack here: wire.hpp
// decodes and encodes them, codec.hpp turns their byte fields into numbers.
//
// Maps keep their order (vector of pairs): the Python encoder writes fields and map entries in a fixed
// order, and the golden vectors in firmware_tests/protocol/ are byte-for-byte that order.
#pragma once

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <variant>
#include <vector>

namespace fedge {

using Bytes = std::vector<uint8_t>;

// A message that must be dropped (protocol section 3, "strict decoding"); what() says why.
struct WireError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// A plan this device cannot run (unknown strategy, hyperparameter, upload format...): training fails and
// the device checks in (section 9.3 step 6); what() is logged.
struct PlanError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// One value of a *scalars* map (caps, hparams, upload, metrics): nil, bool, int, float or str. Int and
// float stay distinct: a bool is never a number, and 1.0 is not an int.
struct Scalar {
  enum Kind { Nil, Bool, Int, Float, Str } kind = Nil;
  bool b = false;
  int64_t i = 0;
  double f = 0.0;
  std::string s;

  static Scalar nil() { return Scalar{}; }
  static Scalar of_bool(bool v) { Scalar x; x.kind = Bool; x.b = v; return x; }
  static Scalar of_int(int64_t v) { Scalar x; x.kind = Int; x.i = v; return x; }
  static Scalar of_float(double v) { Scalar x; x.kind = Float; x.f = v; return x; }
  static Scalar of_str(std::string v) { Scalar x; x.kind = Str; x.s = std::move(v); return x; }
  bool is_number() const { return kind == Int || kind == Float; }
  double number() const { return kind == Int ? static_cast<double>(i) : f; }
};

template <class T>
using Ordered = std::vector<std::pair<std::string, T>>;
using Scalars = Ordered<Scalar>;

// Lookup in an ordered map; nullptr when absent.
template <class T>
const T* find(const Ordered<T>& m, const std::string& key) {
  for (const auto& kv : m)
    if (kv.first == key) return &kv.second;
  return nullptr;
}

// An array as on the wire (section 4): dtype code, shape, the raw little-endian bytes. codec.hpp decodes
// the values; the wire layer only checks that the length fits the dtype and shape (and finiteness).
struct WireArray {
  std::string dtype;  // f4 f2 f8 u1 i4 i8 bf16 q8 q8r
  std::vector<int64_t> shape;
  Bytes data;
};

// A row mask of an update record (section 5), still coded.
struct MaskField {
  enum Format { Dense, Bitmask, Index, Golomb, Enum } format = Dense;
  Bytes bytes;
  int width = 0;  // 2 or 4 for Index
};

// A sampled update's `h` (section 5).
struct Sample {
  int64_t k = 0;  // active rows
  Bytes p;        // one uint8 probability code per sampled row
  MaskField mask; // which of the k active rows were sent (never Dense)
};

// An update record (section 5).
struct UpdateRecord {
  std::vector<int64_t> shape;  // the tensor's full shape
  WireArray x;                 // the rows sent
  MaskField mask;
  std::optional<Sample> h;
};

struct CheckIn {
  std::string device_id;
  Scalars caps;
  std::vector<std::string> programs;
  int64_t n = 0;
  std::string last;  // omitted on the wire when empty
};

struct Plan {
  std::string task_id;
  int64_t round = 0;
  std::string device_id;
  double deadline = 0.0;
  std::string strategy, runtime, program_hash;
  Ordered<WireArray> weights;
  Scalars hparams;
  uint64_t seed = 0;
  Scalars upload;
  std::optional<Bytes> program;  // nil on the wire when absent
  std::string tag, base;         // omitted on the wire when empty
};

struct Report {
  std::string task_id, device_id;
  int64_t n = 0;
  Scalars metrics;
  Ordered<UpdateRecord> tensors;
  Ordered<WireArray> extras;
};

struct Ack {
  std::string task_id, device_id, status, reason;
};

struct Status {
  std::string device_id, state;
  double ts = 0.0;
};

struct Pace {
  std::string device_id;
  double after = 0.0;
};

struct Chunk {
  std::string id;
  int64_t i = 0, n = 0, t = 0;
  Bytes b;
};

using Message = std::variant<CheckIn, Plan, Report, Ack, Status, Pace, Chunk>;

// The kind string of a message ("checkin", "plan", ...).
const char* kind_of(const Message& m);

// A float32 tensor in C order: what the trainer and the algorithms work on.
struct Tensor {
  std::vector<int64_t> shape;
  std::vector<float> data;
  int64_t rows() const { return shape.empty() ? 1 : shape[0]; }
  int64_t numel() const {
    int64_t c = 1;
    for (auto d : shape) c *= d;
    return c;
  }
  int64_t row_size() const { return rows() ? numel() / rows() : 0; }
};
using Tensors = Ordered<Tensor>;

}  // namespace fedge
