// Masks and value formats (edge/protocol/codec.py, whose module docstring gives the byte layouts) and the update a
// device sends (edge/algorithms/driver.py: encode_update), and the coded downlink (edge/protocol/downlink.py).
#include "codec.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <tuple>

namespace fedge {

namespace {

[[noreturn]] void fail(const std::string& what) { throw WireError(what); }

constexpr int64_t kMaxRows = (int64_t(1) << 31) - 1;
constexpr int64_t kMaxElements = int64_t(1) << 40;
constexpr int kEnumMaxK = 64;
constexpr int64_t kLn2Q31 = 1488522236;  // round(ln 2 * 2^31)
constexpr int kMaxGammaZeros = 40;

int64_t prod(const std::vector<int64_t>& s) {
  int64_t c = 1;
  for (auto d : s) c *= d;
  return c;
}

float f32_of_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
uint32_t bits_of_f32(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
void put_u32(Bytes& b, uint32_t u) {
  for (int i = 0; i < 4; ++i) b.push_back(uint8_t(u >> (8 * i)));
}
uint32_t get_u32(const uint8_t* p) { return uint32_t(p[0]) | uint32_t(p[1]) << 8 | uint32_t(p[2]) << 16 | uint32_t(p[3]) << 24; }

// ---------------------------------------------------------------- binary16

float half_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000) << 16;
  const int exp = (h >> 10) & 0x1F;
  const uint32_t man = h & 0x3FF;
  if (exp == 0) {  // zero or subnormal: man * 2^-24, exact in binary32
    float v = std::ldexp(float(man), -24);
    return sign ? -v : v;
  }
  if (exp == 31) return f32_of_bits(sign | 0x7F800000u | (man << 13));
  return f32_of_bits(sign | uint32_t(exp - 15 + 127) << 23 | man << 13);
}

// float64 -> binary16, round to nearest even directly from the double (numpy's npy_double_to_half: no double
// rounding through binary32). Magnitudes that round past 65504 become infinity (the caller saturates first).
uint16_t double_to_half(double x) {
  uint16_t sign = std::signbit(x) ? 0x8000 : 0;
  double a = std::fabs(x);
  if (std::isnan(a)) return sign | 0x7E00;
  if (a < std::ldexp(1.0, -14)) {  // subnormal (or rounds up to the smallest normal, which the bits encode too)
    double m = std::nearbyint(std::ldexp(a, 24));  // exact scaling; nearbyint rounds half to even
    return uint16_t(sign | uint16_t(m));
  }
  int e;
  double f = std::frexp(a, &e);  // a = f 2^e, f in [0.5, 1)
  int E = e - 1;                  // a = (2 f) 2^E
  double q = std::nearbyint((2.0 * f - 1.0) * 1024.0);  // exact product, rounded half to even
  if (q >= 1024.0) {
    q = 0;
    ++E;
  }
  if (E + 15 >= 31) return sign | 0x7C00;
  return uint16_t(sign | uint16_t((E + 15) << 10) | uint16_t(q));
}

uint16_t bf16_nearest(float x) {
  uint32_t u = bits_of_f32(x);
  uint32_t add = 0x7FFF + ((u >> 16) & 1);
  uint32_t r = ((u & 0x7FFFFFFFu) + add) >> 16;
  return uint16_t(std::min<uint32_t>(r, 0x7F7F) | ((u >> 16) & 0x8000));
}

uint16_t bf16_stochastic(float x, std::mt19937_64& rng) {
  uint32_t u = bits_of_f32(x);
  uint32_t add = uint32_t(rng() >> 48);  // uniform in 0 .. 2^16 - 1
  uint32_t r = ((u & 0x7FFFFFFFu) + add) >> 16;
  return uint16_t(std::min<uint32_t>(r, 0x7F7F) | ((u >> 16) & 0x8000));
}

double uniform01(std::mt19937_64& rng) { return double(rng() >> 11) * 0x1.0p-53; }  // [0, 1)

// float32 scale >= v (float64) with at most 17 significant bits, so q * s is exact in binary32 (codec.py _scale_up)
float scale_up(double v) {
  float s = float(v);
  if (double(s) < v) s = std::nextafter(s, std::numeric_limits<float>::infinity());
  uint32_t u = bits_of_f32(s);
  if (u & 0x7F) u = (u | 0x7F) + 1;
  return f32_of_bits(u);
}

// ---------------------------------------------------------------- big unsigned integers (enum masks)

// Little-endian base 2^32 limbs, no leading zero limbs. Enough for C(n, K) with n < 2^31 and K <= 64 (< 2^1984).
struct Big {
  std::vector<uint32_t> d;
  static Big of(uint64_t v) {
    Big b;
    while (v) {
      b.d.push_back(uint32_t(v));
      v >>= 32;
    }
    return b;
  }
  bool zero() const { return d.empty(); }
  void trim() {
    while (!d.empty() && !d.back()) d.pop_back();
  }
  void mul(uint32_t m) {
    uint64_t carry = 0;
    for (auto& x : d) {
      uint64_t t = uint64_t(x) * m + carry;
      x = uint32_t(t);
      carry = t >> 32;
    }
    if (carry) d.push_back(uint32_t(carry));
    trim();
  }
  void div(uint32_t m) {  // exact or floor division by a small integer
    uint64_t rem = 0;
    for (size_t i = d.size(); i-- > 0;) {
      uint64_t cur = (rem << 32) | d[i];
      d[i] = uint32_t(cur / m);
      rem = cur % m;
    }
    trim();
  }
  void add(const Big& o) {
    if (o.d.size() > d.size()) d.resize(o.d.size(), 0);
    uint64_t carry = 0;
    for (size_t i = 0; i < d.size(); ++i) {
      uint64_t t = uint64_t(d[i]) + (i < o.d.size() ? o.d[i] : 0) + carry;
      d[i] = uint32_t(t);
      carry = t >> 32;
    }
    if (carry) d.push_back(uint32_t(carry));
  }
  void sub(const Big& o) {  // requires *this >= o
    int64_t borrow = 0;
    for (size_t i = 0; i < d.size(); ++i) {
      int64_t t = int64_t(d[i]) - (i < o.d.size() ? int64_t(o.d[i]) : 0) - borrow;
      borrow = t < 0;
      d[i] = uint32_t(t + (borrow ? (int64_t(1) << 32) : 0));
    }
    trim();
  }
  int cmp(const Big& o) const {
    if (d.size() != o.d.size()) return d.size() < o.d.size() ? -1 : 1;
    for (size_t i = d.size(); i-- > 0;)
      if (d[i] != o.d[i]) return d[i] < o.d[i] ? -1 : 1;
    return 0;
  }
  size_t bit_length() const {
    if (d.empty()) return 0;
    size_t b = 32 * (d.size() - 1);
    for (uint32_t top = d.back(); top; top >>= 1) ++b;
    return b;
  }
  static Big from_be(const uint8_t* p, size_t n) {
    Big b;
    b.d.assign((n + 3) / 4, 0);
    for (size_t i = 0; i < n; ++i) {
      size_t bit = 8 * (n - 1 - i);
      b.d[bit / 32] |= uint32_t(p[i]) << (bit % 32);
    }
    b.trim();
    return b;
  }
  Bytes to_be(size_t n) const {
    Bytes out(n, 0);
    for (size_t i = 0; i < n; ++i) {
      size_t bit = 8 * (n - 1 - i);
      if (bit / 32 < d.size()) out[i] = uint8_t(d[bit / 32] >> (bit % 32));
    }
    return out;
  }
};

// C(c, j) exactly, 0 when c < j: each partial product C(c - j + i, i) is an integer.
Big comb(int64_t c, int64_t j) {
  if (c < j || c < 0) return Big{};
  Big r = Big::of(1);
  for (int64_t i = 1; i <= j; ++i) {
    r.mul(uint32_t(c - j + i));
    r.div(uint32_t(i));
  }
  return r;
}

Big minus_one(Big b) {
  if (!b.zero()) b.sub(Big::of(1));
  return b;
}

size_t enum_bytes(int64_t n, int64_t K) { return (minus_one(comb(n, K)).bit_length() + 7) / 8; }

// ---------------------------------------------------------------- bit streams (MSB first)

struct BitWriter {
  Bytes out;
  uint64_t nbits = 0;
  void put(int bit) {
    if ((nbits & 7) == 0) out.push_back(0);
    if (bit) out.back() |= uint8_t(0x80 >> (nbits & 7));
    ++nbits;
  }
  void put_bits(uint64_t v, int n) {
    for (int i = n - 1; i >= 0; --i) put(int((v >> i) & 1));
  }
};

inline int bit_at(const Bytes& b, uint64_t j) { return (b[j >> 3] >> (7 - (j & 7))) & 1; }

int bitlen(uint64_t v) {
  int n = 0;
  while (v) {
    ++n;
    v >>= 1;
  }
  return n;
}

// ---------------------------------------------------------------- golomb

int64_t golomb_estimate(int64_t n, int64_t K) {
  if (K <= 0) return 1;
  return std::max<int64_t>(1, (n * kLn2Q31 + K * (int64_t(1) << 30)) / (K * (int64_t(1) << 31)));
}

uint64_t zigzag(int64_t d) { return d >= 0 ? uint64_t(2 * d) : uint64_t(-2 * d - 1); }
int64_t unzigzag(uint64_t z) { return z % 2 == 0 ? int64_t(z / 2) : -int64_t((z + 1) / 2); }

uint64_t gamma_bits(uint64_t v) { return 2 * uint64_t(bitlen(v)) - 1; }

uint64_t golomb_body_bits(const std::vector<int64_t>& gaps, int64_t M) {
  uint64_t K = gaps.size(), bits = 0;
  if (M == 1) {
    for (auto g : gaps) bits += uint64_t(g);
    return bits + K;
  }
  int b = bitlen(uint64_t(M - 1));
  int64_t u = (int64_t(1) << b) - M;
  for (auto g : gaps) bits += uint64_t(g / M) + 1 + uint64_t(b - 1) + (g % M >= u ? 1 : 0);
  return bits;
}

std::vector<int64_t> gaps_of(const std::vector<int64_t>& rows) {
  std::vector<int64_t> g(rows.size());
  int64_t prev = -1;
  for (size_t i = 0; i < rows.size(); ++i) {
    g[i] = rows[i] - prev - 1;
    prev = rows[i];
  }
  return g;
}

// (M, bits): the cheapest candidate around the estimates (codec.py _golomb_choose)
std::pair<int64_t, uint64_t> golomb_choose(int64_t n, const std::vector<int64_t>& gaps) {
  const int64_t K = int64_t(gaps.size());
  const int64_t m0 = golomb_estimate(n, K);
  const double p = double(K) / double(n);
  const int64_t gvv = p >= 0.5 ? 1 : int64_t(std::ceil(std::log(2 - p) / -std::log1p(-p)));
  std::vector<int64_t> cands = {m0, gvv - 1, gvv, gvv + 1};
  std::sort(cands.begin(), cands.end());
  cands.erase(std::unique(cands.begin(), cands.end()), cands.end());
  std::pair<int64_t, uint64_t> best{0, 0};
  for (int64_t M : cands) {
    if (M < 1 || M > std::max<int64_t>(1, n)) continue;
    uint64_t bits = gamma_bits(zigzag(M - m0) + 1) + golomb_body_bits(gaps, M);
    if (best.first == 0 || bits < best.second) best = {M, bits};
  }
  return best;
}

Bytes golomb_encode(int64_t n, const std::vector<int64_t>& rows, int64_t M) {
  const int64_t K = int64_t(rows.size());
  if (K == 0) return {};
  BitWriter w;
  uint64_t v = zigzag(M - golomb_estimate(n, K)) + 1;
  int nb = bitlen(v);
  for (int i = 0; i < nb - 1; ++i) w.put(0);
  w.put_bits(v, nb);
  auto gaps = gaps_of(rows);
  if (M > 1) {
    int b = bitlen(uint64_t(M - 1));
    int64_t u = (int64_t(1) << b) - M;
    for (auto g : gaps) {  // section A
      int64_t r = g % M;
      int64_t h = r < u ? r : (r + u) >> 1;
      w.put_bits(uint64_t(h), b - 1);
    }
    for (auto g : gaps) {  // section B
      int64_t r = g % M;
      if (r >= u) w.put(int((r + u) & 1));
    }
  }
  for (auto g : gaps) {  // section C
    for (int64_t q = g / M; q > 0; --q) w.put(1);
    w.put(0);
  }
  return std::move(w.out);
}

void check_padding(const Bytes& data, uint64_t end, const char* what) {
  if ((end + 7) / 8 != data.size()) fail(std::string(what) + ": length and code bits disagree");
  for (uint64_t j = end; j < 8 * uint64_t(data.size()); ++j)
    if (bit_at(data, j)) fail(std::string(what) + ": nonzero padding");
}

std::vector<int64_t> golomb_decode(const Bytes& data, int64_t n, int64_t K) {
  const char* what = "golomb mask";
  if (K == 0) {
    if (!data.empty()) fail("golomb mask: bytes for an empty support");
    return {};
  }
  const uint64_t nbits = 8 * uint64_t(data.size());
  if (uint64_t(K) > nbits) fail("golomb mask: rows cannot fit");
  uint64_t lz = 0;
  while (lz < nbits && lz <= uint64_t(kMaxGammaZeros) && !bit_at(data, lz)) ++lz;
  if (lz > uint64_t(kMaxGammaZeros) || lz >= nbits) fail("golomb mask: bad parameter code");
  if (2 * lz + 1 > nbits) fail("golomb mask: truncated parameter code");
  uint64_t v = 0;
  for (uint64_t j = lz; j < 2 * lz + 1; ++j) v = (v << 1) | uint64_t(bit_at(data, j));
  const int64_t M = golomb_estimate(n, K) + unzigzag(v - 1);
  if (M < 1 || M > std::max<int64_t>(1, n)) fail("golomb mask: parameter outside 1..n");
  uint64_t pos = 2 * lz + 1;
  const int b = bitlen(uint64_t(M - 1));
  const int64_t u = (int64_t(1) << b) - M;
  const uint64_t width = b >= 1 ? uint64_t(b - 1) : 0;
  if (pos + uint64_t(K) * width + uint64_t(K) > nbits) fail("golomb mask: rows cannot fit");
  std::vector<int64_t> h(size_t(K), 0), r;
  for (int64_t i = 0; i < K; ++i)
    for (uint64_t j = 0; j < width; ++j) h[size_t(i)] = (h[size_t(i)] << 1) | bit_at(data, pos++);
  if (b >= 1) {
    uint64_t e = 0;
    for (auto x : h) e += x >= u;
    if (pos + e + uint64_t(K) > nbits) fail("golomb mask: truncated remainders");
    r = h;
    for (size_t i = 0; i < h.size(); ++i)
      if (h[i] >= u) r[i] = 2 * h[i] + bit_at(data, pos++) - u;
  } else {
    r = h;
  }
  // section C: K unary quotients
  std::vector<int64_t> rows(static_cast<size_t>(K));
  int64_t last = -1;
  for (int64_t i = 0; i < K; ++i) {
    uint64_t q = 0;
    while (pos < nbits && bit_at(data, pos)) {
      ++q;
      ++pos;
    }
    if (pos >= nbits) fail("golomb mask: fewer terminators than rows");
    ++pos;  // the zero
    // row = last + 1 + q M + r, checked against n without overflow (q < 2^29, M < 2^31)
    int64_t row = last + 1 + int64_t(q) * M + r[size_t(i)];
    if (row > n - 1) fail("golomb mask: rows run past n");
    rows[size_t(i)] = last = row;
  }
  check_padding(data, pos, what);
  return rows;
}

// ---------------------------------------------------------------- enum

Bytes enum_encode(int64_t n, const std::vector<int64_t>& rows) {
  const int64_t K = int64_t(rows.size());
  if (K > kEnumMaxK) throw std::invalid_argument("enum codes at most 64 rows");
  Big rank;
  for (int64_t j = 0; j < K; ++j) rank.add(comb(rows[size_t(j)], j + 1));
  return rank.to_be(enum_bytes(n, K));
}

std::vector<int64_t> enum_decode(const Bytes& data, int64_t n, int64_t K) {
  if (K > kEnumMaxK) fail("enum mask: more than 64 rows");
  Big total = comb(n, K);
  if (data.size() != (minus_one(total).bit_length() + 7) / 8) fail("enum mask: wrong length for C(n, K)");
  Big rank = Big::from_be(data.data(), data.size());
  if (rank.cmp(total) >= 0) fail("enum mask: rank out of range");
  std::vector<int64_t> rows(static_cast<size_t>(K));
  int64_t hi = n - 1;
  for (int64_t j = K; j >= 1; --j) {
    // the largest c in [j - 1, hi] with C(c, j) <= rank (C(j - 1, j) = 0 always qualifies): binary search
    int64_t lo = j - 1, top = std::max(hi, lo);
    while (lo < top) {
      int64_t mid = lo + (top - lo + 1) / 2;
      if (comb(mid, j).cmp(rank) <= 0) lo = mid;
      else top = mid - 1;
    }
    rows[size_t(j - 1)] = lo;
    rank.sub(comb(lo, j));
    hi = lo - 1;
  }
  return rows;
}

std::vector<int64_t> complement(int64_t n, const std::vector<int64_t>& rows) {
  std::vector<int64_t> out;
  out.reserve(size_t(n) - rows.size());
  size_t j = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (j < rows.size() && rows[j] == i) ++j;
    else out.push_back(i);
  }
  return out;
}

void check_rows(const std::vector<int64_t>& active, int64_t n) {
  if (n < 0 || n > kMaxRows) throw std::invalid_argument("a mask covers 0 .. 2^31 - 1 rows");
  int64_t prev = -1;
  for (auto r : active) {
    if (r <= prev || r >= n) throw std::invalid_argument("active rows must be strictly increasing and within 0..n-1");
    prev = r;
  }
}

// The minority rows (ties: the active rows) and whether they are the inactive ones.
std::pair<std::vector<int64_t>, bool> minority(const std::vector<int64_t>& active, int64_t n) {
  int64_t k = int64_t(active.size());
  if (k <= n - k) return {active, false};
  return {complement(n, active), true};
}

// ---------------------------------------------------------------- the driver's sampling

// upload.keep and upload.p_min: numbers (int or float); a bool or a string is refused, as the Python device does
double pnum(const Scalar* s, double dflt, const char* what) {
  if (!s) return dflt;
  if (s->kind == Scalar::Int) return double(s->i);
  if (s->kind == Scalar::Float) return s->f;
  throw PlanError(std::string("upload ") + what + " must be a number");
}

std::string value_format(const Scalars& up, size_t ndim) {
  const Scalar* s = nullptr;
  if (ndim <= 1) s = find(up, std::string("dtype_1d"));
  if (!s) s = find(up, std::string("dtype"));
  if (!s) return "f4";
  if (s->kind != Scalar::Str) throw PlanError("upload value format is not a string");
  return s->s;
}

bool value_kind(const std::string& c) { return c == "f4" || c == "f2" || c == "bf16" || c == "q8" || c == "q8r"; }

std::vector<std::vector<double>> inclusion_probabilities(const std::vector<std::vector<double>>& norms,
                                                         const std::vector<double>& row_bytes, double keep,
                                                         double p_min, bool uniform) {
  std::vector<double> byt, score;
  for (size_t t = 0; t < norms.size(); ++t)
    for (double nv : norms[t]) {
      byt.push_back(row_bytes[t]);
      score.push_back(nv / std::sqrt(row_bytes[t]));
    }
  double total = 0;
  for (double b : byt) total += b;
  const double target = keep * total;
  std::vector<double> flat(byt.size());
  auto clip = [&](double x) { return std::min(std::max(x, p_min), 1.0); };
  if (uniform || total == 0) {
    std::fill(flat.begin(), flat.end(), std::max(keep, p_min));
  } else {
    auto spent = [&](double c) {
      double s = 0;
      for (size_t i = 0; i < byt.size(); ++i) s += clip(c * score[i]) * byt[i];
      return s;
    };
    double c;
    double all = 0;
    for (size_t i = 0; i < byt.size(); ++i) all += (score[i] > 0 ? 1.0 : std::min(p_min, 1.0)) * byt[i];
    if (spent(0.0) >= target) {
      c = 0.0;
    } else if (all <= target) {
      c = std::numeric_limits<double>::infinity();
    } else {
      double mx = 0, mn = std::numeric_limits<double>::infinity();
      for (double s : score)
        if (s > 0) {
          mx = std::max(mx, s);
          mn = std::min(mn, s);
        }
      double lo = std::log(std::max(p_min, 1e-12) / mx) - 1.0, hi = std::log(1.0 / mn) + 1.0;
      for (int it = 0; it < 60; ++it) {
        double mid = 0.5 * (lo + hi);
        if (spent(std::exp(mid)) < target) lo = mid;
        else hi = mid;
      }
      c = std::exp(hi);
    }
    for (size_t i = 0; i < byt.size(); ++i) flat[i] = clip(score[i] > 0 ? c * score[i] : 0.0);
  }
  std::vector<std::vector<double>> out;
  size_t at = 0;
  for (const auto& nv : norms) {
    std::vector<double> p(nv.size());
    for (auto& x : p) x = std::min(std::max(std::ceil(flat[at++] * 255.0 - 1e-9), 1.0), 255.0) / 255.0;
    out.push_back(std::move(p));
  }
  return out;
}

double row_keep(double keep, double dense, double whole, double rows) {
  if (rows <= 0) return 1.0;
  double fit = (keep * dense - whole) / rows - 0.5 / 255.0;
  return std::min(1.0, std::max(fit, 1.0 / 255.0));
}

// Systematic sampling over a random order (Madow 1949): row j with probability p[j], floor or ceil of sum(p) rows.
std::vector<bool> systematic_sample(const std::vector<double>& p, std::mt19937_64& rng) {
  const size_t n = p.size();
  std::vector<size_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  for (size_t i = n; i > 1; --i) {  // Fisher-Yates
    size_t j = size_t(rng() % i);
    std::swap(order[i - 1], order[j]);
  }
  const double u = uniform01(rng);
  std::vector<bool> out(n, false);
  double cum = 0;
  for (size_t i = 0; i < n; ++i) {
    double pi = p[order[i]];
    cum += pi;
    out[order[i]] = std::ceil(cum - u) - std::ceil(cum - pi - u) > 0;
  }
  return out;
}

// A stream of the plan's seed (the driver's default_rng([seed, stream]); not numpy's bits, the same role).
std::mt19937_64 stream(uint64_t seed, uint32_t id) {
  std::seed_seq seq{uint32_t(seed), uint32_t(seed >> 32), id};
  return std::mt19937_64(seq);
}

constexpr uint32_t kStreamRounding = 100, kStreamSample = 101;

Tensor to_float(const WireArray& a) {
  if (a.dtype == "u1" || a.dtype == "i4" || a.dtype == "i8") {
    Tensor t;
    t.shape = a.shape;
    const int64_t c = prod(a.shape);
    const size_t w = a.dtype == "u1" ? 1 : a.dtype == "i4" ? 4 : 8;
    if (a.data.size() != size_t(c) * w) fail(a.dtype + " values: wrong length");
    t.data.resize(size_t(c));
    for (int64_t i = 0; i < c; ++i) {
      const uint8_t* p = a.data.data() + size_t(i) * w;
      if (w == 1) t.data[size_t(i)] = float(p[0]);
      else if (w == 4) t.data[size_t(i)] = float(int32_t(get_u32(p)));
      else t.data[size_t(i)] = float(int64_t(uint64_t(get_u32(p)) | uint64_t(get_u32(p + 4)) << 32));
    }
    return t;
  }
  return decode_values(a);
}

}  // namespace

// ================================================================ values

int64_t value_nbytes(const std::string& code, const std::vector<int64_t>& shape) {
  const int64_t count = prod(shape);
  if (code == "f4") return 4 * count;
  if (code == "f8") return 8 * count;
  if (code == "f2" || code == "bf16") return 2 * count;
  if (code == "q8") return 4 + count;
  if (code == "q8r") return 4 * (shape.empty() ? 1 : shape[0]) + count;
  throw PlanError("unknown value format '" + code + "'");
}

Tensor decode_values(const WireArray& a) {
  const std::string& c = a.dtype;
  if (c != "f4" && c != "f2" && c != "f8" && c != "bf16" && c != "q8" && c != "q8r")
    fail("unknown value format '" + c.substr(0, 40) + "'");
  int64_t nz = 1;
  for (auto d : a.shape) {
    if (d < 0 || d > kMaxRows) fail(c + " values: bad shape");
    if (d) nz *= d;
    if (nz > kMaxElements) fail(c + " values: bad shape");
  }
  if (c == "q8r" && a.shape.empty()) fail("q8r values: no rows");
  const int64_t want = value_nbytes(c, a.shape);
  if (int64_t(a.data.size()) != want)
    fail(c + " values: " + std::to_string(a.data.size()) + " bytes, the shape needs " + std::to_string(want));
  Tensor t;
  t.shape = a.shape;
  const size_t count = size_t(prod(a.shape));
  t.data.resize(count);
  const uint8_t* p = a.data.data();
  if (c == "f4") {
    for (size_t i = 0; i < count; ++i) t.data[i] = f32_of_bits(get_u32(p + 4 * i));
  } else if (c == "f8") {
    for (size_t i = 0; i < count; ++i) {
      uint64_t u = uint64_t(get_u32(p + 8 * i)) | uint64_t(get_u32(p + 8 * i + 4)) << 32;
      double d;
      std::memcpy(&d, &u, 8);
      if (!std::isfinite(d)) fail("f8 values: not finite");
      t.data[i] = float(d);
    }
  } else if (c == "f2") {
    for (size_t i = 0; i < count; ++i) t.data[i] = half_to_float(uint16_t(p[2 * i] | (p[2 * i + 1] << 8)));
  } else if (c == "bf16") {
    for (size_t i = 0; i < count; ++i) t.data[i] = f32_of_bits(uint32_t(p[2 * i] | (p[2 * i + 1] << 8)) << 16);
  } else {
    const size_t rows = c == "q8" ? 1 : size_t(a.shape[0]);
    const size_t per = rows ? count / rows : 0;
    std::vector<float> s(rows);
    for (size_t r = 0; r < rows; ++r) {
      s[r] = f32_of_bits(get_u32(p + 4 * r));
      if (!std::isfinite(s[r]) || !(s[r] >= 0)) fail(c + " values: scale not finite or negative");
    }
    const auto* q = reinterpret_cast<const int8_t*>(p + 4 * rows);
    for (size_t i = 0; i < count; ++i)
      if (q[i] == -128) fail(c + " values: int8 -128 is not a value");
    for (size_t i = 0; i < count; ++i) t.data[i] = float(q[i]) * s[per ? i / per : 0];
  }
  for (float v : t.data)
    if (!std::isfinite(v)) fail(c + " values: not finite");
  return t;
}

WireArray encode_values(const std::vector<double>& values, const std::vector<int64_t>& shape, const std::string& code,
                        std::mt19937_64& rng) {
  return encode_values(values, shape, code, rng, Rounding::Default);
}

WireArray encode_values(const std::vector<double>& x, const std::vector<int64_t>& shape, const std::string& code,
                        std::mt19937_64& rng, Rounding bf16_rounding) {
  if (int64_t(x.size()) != prod(shape)) throw std::invalid_argument("values and shape disagree");
  WireArray a;
  a.dtype = code;
  a.shape = shape;
  if (code == "f4" || code == "bf16") {
    for (double v : x)
      if (!std::isfinite(float(v))) throw PlanError("non-finite values (or beyond float32) cannot be encoded");
  } else {
    for (double v : x)
      if (!std::isfinite(v)) throw PlanError("non-finite values cannot be encoded");
  }
  if (code == "f4") {
    for (double v : x) put_u32(a.data, bits_of_f32(float(v)));
  } else if (code == "f2") {
    for (double v : x) {
      uint16_t h = double_to_half(std::min(std::max(v, -65504.0), 65504.0));
      a.data.push_back(uint8_t(h));
      a.data.push_back(uint8_t(h >> 8));
    }
  } else if (code == "bf16") {
    for (double v : x) {
      uint16_t h = bf16_rounding == Rounding::Stochastic ? bf16_stochastic(float(v), rng) : bf16_nearest(float(v));
      a.data.push_back(uint8_t(h));
      a.data.push_back(uint8_t(h >> 8));
    }
  } else if (code == "q8" || code == "q8r") {
    if (code == "q8r" && shape.empty()) throw PlanError("q8r needs at least one dimension");
    const bool nearest = bf16_rounding == Rounding::Nearest;  // the downlink's deterministic choice
    const size_t rows = code == "q8" ? 1 : size_t(shape[0]);
    const size_t per = rows ? x.size() / rows : 0;
    std::vector<float> s(rows);
    for (size_t r = 0; r < rows; ++r) {
      double m = 0;
      for (size_t j = 0; j < per; ++j) m = std::max(m, std::fabs(x[r * per + j]));
      s[r] = scale_up(m / 127.0);
      if (!std::isfinite(s[r])) throw PlanError("values too large for a float32 scale");
      put_u32(a.data, bits_of_f32(s[r]));
    }
    for (size_t r = 0; r < rows; ++r)
      for (size_t j = 0; j < per; ++j) {
        const double sd = s[r];
        double t = sd > 0 ? x[r * per + j] / sd : 0.0;
        t = std::min(std::max(t, -127.0), 127.0);
        double q = nearest ? std::nearbyint(t) : std::floor(t + uniform01(rng));
        q = std::min(std::max(q, -127.0), 127.0);
        a.data.push_back(uint8_t(int8_t(q)));
      }
  } else {
    throw PlanError("upload value format '" + code + "' is not one this device encodes");
  }
  return a;
}

// ================================================================ masks

std::vector<int64_t> Support::active() const { return inactive ? complement(n, rows) : rows; }

Support decode_support(const MaskField& m, int64_t n, int64_t k, bool bitmask_padding) {
  if (n < 0 || n > kMaxRows || k < 0 || k > n) fail("mask: " + std::to_string(k) + " of " + std::to_string(n) + " rows");
  const int64_t K = std::min(k, n - k);
  const bool inactive = k > n - k;
  Support s;
  s.n = n;
  switch (m.format) {
    case MaskField::Dense:
      if (k != n) fail("dense: " + std::to_string(k) + " of " + std::to_string(n) + " rows");
      s.inactive = true;  // no inactive rows
      return s;
    case MaskField::Golomb:
      s.rows = golomb_decode(m.bytes, n, K);
      s.inactive = inactive;
      return s;
    case MaskField::Enum:
      s.rows = enum_decode(m.bytes, n, K);
      s.inactive = inactive;
      return s;
    case MaskField::Bitmask: {
      if (int64_t(m.bytes.size()) != (n + 7) / 8) fail("bitmask: wrong length for the rows");
      if (bitmask_padding)
        for (int64_t j = n; j < 8 * int64_t(m.bytes.size()); ++j)
          if (bit_at(m.bytes, uint64_t(j))) fail("bitmask: nonzero padding");
      int64_t c = 0;
      for (uint8_t b : m.bytes) c += __builtin_popcount(b);
      if (!bitmask_padding)
        for (int64_t j = n; j < 8 * int64_t(m.bytes.size()); ++j) c -= bit_at(m.bytes, uint64_t(j));
      if (c != k) fail("bitmask: " + std::to_string(c) + " rows set, " + std::to_string(k) + " expected");
      s.inactive = inactive;
      for (int64_t i = 0; i < n; ++i)
        if (bit_at(m.bytes, uint64_t(i)) != int(inactive)) s.rows.push_back(i);
      return s;
    }
    case MaskField::Index: {
      const int w = m.width;
      if (w != 2 && w != 4) fail("index mask: width must be 2 or 4");
      if (int64_t(m.bytes.size()) != w * k) fail("index" + std::to_string(8 * w) + ": wrong length for the rows");
      int64_t prev = -1;
      for (int64_t i = 0; i < k; ++i) {
        const uint8_t* p = m.bytes.data() + i * w;
        int64_t v = w == 2 ? int64_t(p[0] | (p[1] << 8)) : int64_t(get_u32(p));
        if (v >= n || v <= prev) fail("index" + std::to_string(8 * w) + ": rows out of range or not increasing");
        s.rows.push_back(prev = v);
      }
      return s;
    }
  }
  fail("unknown mask format");
}

std::vector<int64_t> decode_mask(const MaskField& m, int64_t n, int64_t k) { return decode_support(m, n, k).active(); }

MaskField encode_mask_as(const std::vector<int64_t>& active, int64_t n, MaskField::Format f, int width) {
  check_rows(active, n);
  MaskField m;
  m.format = f;
  switch (f) {
    case MaskField::Bitmask: {
      m.bytes.assign(size_t((n + 7) / 8), 0);
      for (auto r : active) m.bytes[size_t(r >> 3)] |= uint8_t(0x80 >> (r & 7));
      return m;
    }
    case MaskField::Index: {
      if (width != 2 && width != 4) throw std::invalid_argument("index width is 2 or 4");
      if (width == 2 && n > 65536) throw std::invalid_argument("index16 needs n <= 65536");
      m.width = width;
      for (auto r : active)
        for (int i = 0; i < width; ++i) m.bytes.push_back(uint8_t(uint64_t(r) >> (8 * i)));
      return m;
    }
    case MaskField::Golomb: {
      auto mino = minority(active, n);
      if (mino.first.empty()) return m;
      m.bytes = golomb_encode(n, mino.first, golomb_choose(n, gaps_of(mino.first)).first);
      return m;
    }
    case MaskField::Enum: {
      auto mino = minority(active, n);
      if (mino.first.size() > size_t(kEnumMaxK)) throw std::invalid_argument("enum codes at most 64 rows");
      m.bytes = enum_encode(n, mino.first);
      return m;
    }
    case MaskField::Dense:
      break;
  }
  throw std::invalid_argument("not a mask format");
}

MaskField encode_mask(const std::vector<int64_t>& active, int64_t n, bool coded) {
  check_rows(active, n);
  const int64_t k = int64_t(active.size());
  auto mino = minority(active, n);
  const int64_t K = int64_t(mino.first.size());
  // (bytes, bits) of each applicable format, in codec.py's order: bitmask, index16, index32, golomb, enum
  struct Cand { MaskField::Format f; int width; uint64_t bits; };
  std::vector<Cand> cands = {{MaskField::Bitmask, 0, uint64_t(n)}};
  if (n <= 65536) cands.push_back({MaskField::Index, 2, 16 * uint64_t(k)});
  cands.push_back({MaskField::Index, 4, 32 * uint64_t(k)});
  int64_t M = 0;
  if (coded) {
    uint64_t gbits = 0;
    if (K) std::tie(M, gbits) = golomb_choose(n, gaps_of(mino.first));
    cands.push_back({MaskField::Golomb, 0, gbits});
    if (K <= kEnumMaxK) cands.push_back({MaskField::Enum, 0, minus_one(comb(n, K)).bit_length()});
  }
  const Cand* best = nullptr;
  for (const auto& c : cands) {
    if (!best) { best = &c; continue; }
    uint64_t cb = (c.bits + 7) / 8, bb = (best->bits + 7) / 8;
    if (cb < bb || (cb == bb && c.bits < best->bits)) best = &c;  // ties: the earlier format
  }
  if (best->f == MaskField::Golomb) {
    MaskField m;
    m.format = MaskField::Golomb;
    if (K) m.bytes = golomb_encode(n, mino.first, M);
    return m;
  }
  return encode_mask_as(active, n, best->f, best->width);
}

MaskField encode_mask(const std::vector<int64_t>& active, int64_t n) { return encode_mask(active, n, true); }

// ================================================================ the update

Ordered<UpdateRecord> encode_update(const Tensors& trained, const Tensors& plan_weights,
                                    const Ordered<std::vector<int64_t>>& masks, const Scalars& upload, uint64_t seed) {
  // _upload_options
  const Scalar* dv = find(upload, std::string("delta"));
  if (dv && dv->kind != Scalar::Bool) throw PlanError("upload delta must be true or false");
  const bool delta = dv && dv->b;
  const Scalar* design_s = find(upload, std::string("sample"));
  std::string design;
  if (design_s && design_s->kind != Scalar::Nil) {
    if (design_s->kind != Scalar::Str || (design_s->s != "norm" && design_s->s != "uniform"))
      throw PlanError("upload sample is not one of norm, uniform");
    design = design_s->s;
  }
  const double keep = pnum(find(upload, std::string("keep")), 1.0, "keep");
  const double p_min = pnum(find(upload, std::string("p_min")), 0.0, "p_min");
  if (!design.empty()) {
    if (!delta) throw PlanError("sampled uploads send differences (upload.delta)");
    if (!(keep > 0.0 && keep <= 1.0 && p_min >= 0.0 && p_min <= 1.0))
      throw PlanError("upload keep must be in (0, 1] and p_min in [0, 1]");
  }
  std::mt19937_64 rng_q = stream(seed, kStreamRounding);

  struct Work {
    std::string code;
    std::vector<int64_t> rows;    // the active rows (all when no mask)
    bool masked = false;
    std::vector<double> v;        // the active rows' values (delta or not), row-major
    std::vector<int64_t> vshape;  // [active rows, *shape[1:]]
    int64_t width = 1;            // values per row
  };
  std::vector<Work> work;
  for (const auto& kv : trained) {
    const Tensor& w = kv.second;
    Work x;
    x.code = value_format(upload, w.shape.size());
    if (!value_kind(x.code)) throw PlanError("upload value format '" + x.code + "' is not one this device encodes");
    if (int64_t(w.data.size()) != w.numel()) throw PlanError(kv.first + ": data and shape disagree");
    const Tensor* base = nullptr;
    if (delta) {
      base = find(plan_weights, kv.first);
      if (!base || base->shape != w.shape || base->data.size() != w.data.size())
        throw PlanError(kv.first + ": no plan weight of the same shape to take the difference from");
    }
    const auto* m = find(masks, kv.first);
    const int64_t nrows = w.shape.empty() ? 1 : w.shape[0];
    x.width = w.shape.empty() ? 1 : w.row_size();
    if (m) {
      if (w.shape.empty()) throw PlanError(kv.first + ": a mask on a tensor without rows");
      try {
        check_rows(*m, nrows);
      } catch (const std::invalid_argument& e) {
        throw PlanError(kv.first + ": " + e.what());
      }
      x.rows = *m;
      x.masked = true;
    } else {
      x.rows.resize(size_t(nrows));
      std::iota(x.rows.begin(), x.rows.end(), 0);
    }
    x.v.reserve(x.rows.size() * size_t(x.width));
    for (auto r : x.rows)
      for (int64_t j = 0; j < x.width; ++j) {
        size_t i = size_t(r * x.width + j);
        x.v.push_back(delta ? double(w.data[i]) - double(base->data[i]) : double(w.data[i]));
      }
    x.vshape = w.shape;
    if (!x.vshape.empty()) x.vshape[0] = int64_t(x.rows.size());
    work.push_back(std::move(x));
  }

  // which tensors are sampled, and their rows' inclusion probabilities
  std::vector<size_t> sampled;
  for (size_t t = 0; t < work.size(); ++t)
    if (!design.empty() && keep < 1.0 && trained[t].second.shape.size() >= 2 && !work[t].rows.empty())
      sampled.push_back(t);
  std::vector<std::vector<double>> probs(work.size());
  if (!sampled.empty()) {
    std::vector<std::vector<double>> norms;
    std::vector<double> nb;
    double dense = 0, whole = 0, rows_cost = 0;
    for (size_t t : sampled) {
      const Work& x = work[t];
      std::vector<double> nv(x.rows.size());
      for (size_t r = 0; r < x.rows.size(); ++r) {
        double s = 0;
        for (int64_t j = 0; j < x.width; ++j) s += x.v[r * size_t(x.width) + size_t(j)] * x.v[r * size_t(x.width) + size_t(j)];
        nv[r] = std::sqrt(s);
      }
      std::vector<int64_t> one = trained[t].second.shape;
      one[0] = 1;
      nb.push_back(double(value_nbytes(value_format(upload, 2), one) + 1));
      rows_cost += double(nv.size()) * nb.back();
      norms.push_back(std::move(nv));
    }
    for (size_t t = 0; t < work.size(); ++t) {
      double b = double(value_nbytes(work[t].code, work[t].vshape));
      dense += b;
      if (std::find(sampled.begin(), sampled.end(), t) == sampled.end()) whole += b;
      else whole += double((work[t].rows.size() + 7) / 8);
    }
    const double fit = row_keep(keep, dense, whole, rows_cost);
    auto ps = inclusion_probabilities(norms, nb, fit, p_min, design == "uniform");
    for (size_t i = 0; i < sampled.size(); ++i) probs[sampled[i]] = std::move(ps[i]);
  }

  std::mt19937_64 rng_s = stream(seed, kStreamSample);
  Ordered<UpdateRecord> out;
  for (size_t t = 0; t < work.size(); ++t) {
    Work& x = work[t];
    const Tensor& w = trained[t].second;
    UpdateRecord rec;
    rec.shape = w.shape;
    std::vector<double> vals;
    std::vector<int64_t> vshape = x.vshape;
    if (!probs[t].empty()) {
      auto s = systematic_sample(probs[t], rng_s);
      Sample h;
      h.k = int64_t(x.rows.size());
      std::vector<int64_t> picked;
      for (size_t r = 0; r < s.size(); ++r)
        if (s[r]) {
          picked.push_back(int64_t(r));
          h.p.push_back(uint8_t(std::nearbyint(probs[t][r] * 255.0)));
          vals.insert(vals.end(), x.v.begin() + long(r * size_t(x.width)), x.v.begin() + long((r + 1) * size_t(x.width)));
        }
      h.mask = encode_mask(picked, h.k, true);
      vshape[0] = int64_t(picked.size());
      rec.h = std::move(h);
    } else {
      vals = std::move(x.v);
    }
    rec.x = encode_values(vals, vshape, x.code, rng_q, Rounding::Default);
    if (x.masked) {
      int64_t inner = 1;
      for (size_t i = 1; i < w.shape.size(); ++i) inner *= w.shape[i];
      // golomb and enum are valid only on rows with values (protocol section 5)
      rec.mask = encode_mask(x.rows, w.shape[0], inner > 0);
    }
    out.emplace_back(trained[t].first, std::move(rec));
  }
  return out;
}

// ================================================================ the coded downlink

Tensors plan_weights(const Plan& p, const std::string& held_tag, const Tensors& held) {
  if (!p.base.empty() && p.base != held_tag)
    throw PlanError("the plan's weights are differences from model '" + p.base + "', which this device does not hold (" +
                    (held_tag.empty() ? std::string("none") : "'" + held_tag + "'") + ")");
  Tensors out;
  for (const auto& kv : p.weights) {
    Tensor t;
    try {
      t = to_float(kv.second);
    } catch (const WireError& e) {
      throw PlanError(kv.first + ": " + e.what());
    }
    if (!p.base.empty()) {
      const Tensor* h = find(held, kv.first);
      if (h && h->shape == t.shape && h->data.size() == t.data.size())
        for (size_t i = 0; i < t.data.size(); ++i) t.data[i] = h->data[i] + t.data[i];  // binary32 arithmetic
    }
    out.emplace_back(kv.first, std::move(t));
  }
  return out;
}

}  // namespace fedge
