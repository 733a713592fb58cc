// Client halves on the native trainer (edge/algorithms/{driver,fedavg,fedprox,fedsparse}.py): strict
// hyperparameters, batches from a fresh permutation per epoch (last batch short), the algorithm's steps,
// metrics. The random draws come from a small deterministic generator seeded from (plan seed, stream):
// stream 0 orders the batches, 1 is FedSparse's noise, 2 its masks (the Python device's streams; the
// values differ from numpy's, which the protocol allows).
#include "algorithms.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>

namespace fedge {

namespace {

// ------------------------------------------------------------------------------------------- random draws
// splitmix64-seeded xoshiro256** (public-domain algorithms by Vigna and Blackman).
class Rng {
 public:
  Rng(uint64_t seed, uint64_t stream) {
    uint64_t x = seed ^ (0x9E3779B97F4A7C15ull * (stream + 1));
    for (auto& s : s_) s = splitmix(x);
  }
  uint64_t next() {
    const uint64_t r = rotl(s_[1] * 5, 7) * 9, t = s_[1] << 17;
    s_[2] ^= s_[0];
    s_[3] ^= s_[1];
    s_[1] ^= s_[2];
    s_[0] ^= s_[3];
    s_[2] ^= t;
    s_[3] = rotl(s_[3], 45);
    return r;
  }
  double uniform() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }  // [0, 1)
  uint64_t below(uint64_t n) {                                                // [0, n), unbiased
    const uint64_t lim = std::numeric_limits<uint64_t>::max() - std::numeric_limits<uint64_t>::max() % n;
    uint64_t r;
    do r = next();
    while (r >= lim);
    return r % n;
  }
  std::vector<int64_t> permutation(int64_t n) {
    std::vector<int64_t> p(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) p[static_cast<size_t>(i)] = i;
    for (int64_t i = n - 1; i > 0; --i) std::swap(p[static_cast<size_t>(i)], p[below(static_cast<uint64_t>(i + 1))]);
    return p;
  }

 private:
  static uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }
  static uint64_t splitmix(uint64_t& x) {
    uint64_t z = (x += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  uint64_t s_[4];
};

// ------------------------------------------------------------------------------------------ hyperparameters
struct Field {
  enum Kind { F, I, B } kind;
  const char* name;
  double def;
  double min = -std::numeric_limits<double>::infinity();
  double max = std::numeric_limits<double>::infinity();
};

const std::map<std::string, std::vector<Field>>& fields() {
  static const std::vector<Field> base = {{Field::F, "lr", 0.05, 0.0},
                                          {Field::I, "epochs", 1, 1, 10000},
                                          {Field::I, "batch_size", 20, 1, double(1 << 20)}};
  static const std::map<std::string, std::vector<Field>> f = [] {
    std::map<std::string, std::vector<Field>> m;
    m["fedavg"] = base;
    m["fedprox"] = base;
    m["fedprox"].push_back({Field::F, "mu", 0.01, 0.0});
    m["fedsparse"] = base;
    for (Field x : {Field{Field::F, "v_lr", 1e-3, 0.0}, Field{Field::F, "lambda0", 1e-2, 0.0},
                    Field{Field::F, "ce_scale", 1e-4, 0.0}, Field{Field::F, "T", 1e-3, 1e-9},
                    Field{Field::B, "relative", 0.0}})
      m["fedsparse"].push_back(x);
    return m;
  }();
  return f;
}

std::string show(const Scalar& v) {
  std::ostringstream s;
  switch (v.kind) {
    case Scalar::Nil: return "None";
    case Scalar::Bool: return v.b ? "True" : "False";
    case Scalar::Int: return std::to_string(v.i);
    case Scalar::Float: s << v.f; return s.str();
    case Scalar::Str: return "'" + v.s + "'";
  }
  return "?";
}

std::map<std::string, double> parse_hparams(const std::string& strategy, const Scalars& hp) {
  const auto& fs = fields().at(strategy);
  std::map<std::string, double> out;
  for (const auto& f : fs) out[f.name] = f.def;
  std::vector<std::string> unknown;
  for (const auto& kv : hp)
    if (std::none_of(fs.begin(), fs.end(), [&](const Field& f) { return kv.first == f.name; }))
      unknown.push_back(kv.first);
  if (!unknown.empty()) {
    std::sort(unknown.begin(), unknown.end());
    std::string s;
    for (size_t i = 0; i < unknown.size() && i < 5; ++i) s += (i ? ", '" : "'") + unknown[i] + "'";
    throw PlanError("unknown hyperparameters [" + s + "] for " + strategy);
  }
  for (const auto& kv : hp) {
    const Field& f = *std::find_if(fs.begin(), fs.end(), [&](const Field& f) { return kv.first == f.name; });
    const Scalar& v = kv.second;
    const std::string what = "hparams " + kv.first + " = " + show(v);
    double x = 0;
    if (f.kind == Field::B) {
      if (v.kind != Scalar::Bool) throw PlanError(what + ": expected bool");
      x = v.b ? 1 : 0;
    } else if (f.kind == Field::I) {
      if (v.kind != Scalar::Int) throw PlanError(what + ": expected int");
      x = static_cast<double>(v.i);
    } else {
      if (!v.is_number() || !std::isfinite(v.number())) throw PlanError(what + ": expected float");
      x = v.number();
    }
    if (f.kind != Field::B) {
      std::ostringstream lim;
      if (x < f.min) {
        lim << f.min;
        throw PlanError(what + ": must be at least " + lim.str());
      }
      if (x > f.max) {
        lim << f.max;
        throw PlanError(what + ": must be at most " + lim.str());
      }
    }
    out[kv.first] = x;
  }
  return out;
}

// --------------------------------------------------------------------------------------------- the steps
using Params = std::map<std::string, Tensor>;

Feed fvec(std::vector<int64_t> shape, std::vector<float> v) {
  Feed f;
  f.shape = std::move(shape);
  f.f = std::move(v);
  return f;
}
Feed fscalar(double v) { return fvec({}, {static_cast<float>(v)}); }

// x, y (and w for chunks) of a batch.
void batch_feeds(const Dataset& d, const std::vector<int64_t>& idx, Ordered<Feed>& out) {
  Feed x, y;
  const size_t nb = idx.size(), F = static_cast<size_t>(d.features);
  x.shape = {static_cast<int64_t>(nb), d.features};
  x.f.resize(nb * F);
  y.shape = {static_cast<int64_t>(nb)};
  y.i.resize(nb);
  for (size_t r = 0; r < nb; ++r) {
    std::copy_n(d.x.begin() + static_cast<std::ptrdiff_t>(static_cast<size_t>(idx[r]) * F), F, x.f.begin() + static_cast<std::ptrdiff_t>(r * F));
    y.i[r] = d.y[static_cast<size_t>(idx[r])];
  }
  out.emplace_back("x", std::move(x));
  out.emplace_back("y", std::move(y));
}

void sgd(Tensor& p, const Tensor& g, double lr) {
  const float lr32 = static_cast<float>(lr);
  for (size_t i = 0; i < p.data.size(); ++i) p.data[i] -= lr32 * g.data[i];
}

// Torch's Adamax (edge/optim.py), float64 state.
struct Adamax {
  double lr = 2e-3, b1 = 0.9, b2 = 0.999, eps = 1e-8;
  int64_t t = 0;
  std::map<std::string, std::vector<double>> m, u;
  void begin_step() { ++t; }
  void update(const std::string& k, Tensor& p, const Tensor& g) {
    const double c1 = 1 - std::pow(b1, static_cast<double>(t));
    auto& mk = m[k];
    auto& uk = u[k];
    mk.resize(g.data.size(), 0.0);
    uk.resize(g.data.size(), 0.0);
    for (size_t i = 0; i < g.data.size(); ++i) {
      const double gi = g.data[i];
      mk[i] = mk[i] * b1 + (1 - b1) * gi;
      uk[i] = std::max(b2 * uk[i], std::abs(gi) + eps);
      p.data[i] -= static_cast<float>(lr / c1 * mk[i] / uk[i]);
    }
  }
};

double softplus(double v) { return std::max(v, 0.0) + std::log1p(std::exp(-std::abs(v))); }
double sigmoid(double a) { return 0.5 * (1 + std::tanh(0.5 * a)); }

constexpr double U_EPS = 1e-6;

// The MLP's gated layers: fc{i} for the hidden layers whose threshold `fc{i}.v` the weights carry.
std::vector<std::string> gated_layers(const ProgramMeta& m, const Params& p) {
  nlohmann::json spec = nlohmann::json::parse(m.model_json);
  if (spec.value("arch", std::string()) != "mlp")
    throw PlanError("fedsparse on the native device supports MLP specs, not " + spec.value("arch", std::string("?")));
  const size_t hidden = spec.at("sizes").size() - 2;
  std::vector<std::string> out;
  for (size_t i = 0; i < hidden; ++i) {
    std::string L = "fc" + std::to_string(i);
    if (p.count(L + ".v")) out.push_back(L);
  }
  return out;
}

// ||w_g|| over row g of L.weight and L.bias[g] (float64), relative to the layer's mean with `relative`.
std::vector<double> norms(const Params& p, const std::string& L, bool relative) {
  const Tensor& w = p.at(L + ".weight");
  const Tensor& b = p.at(L + ".bias");
  const int64_t rows = w.rows(), rs = w.row_size();
  std::vector<double> n(static_cast<size_t>(rows));
  for (int64_t g = 0; g < rows; ++g) {
    double s = 0;
    for (int64_t j = 0; j < rs; ++j) {
      const double v = w.data[static_cast<size_t>(g * rs + j)];
      s += v * v;
    }
    const double bv = b.data[static_cast<size_t>(g)];
    n[static_cast<size_t>(g)] = std::sqrt(s + bv * bv);
  }
  if (relative) {
    double mean = 0;
    for (double v : n) mean += v;
    mean = n.empty() ? 0 : mean / static_cast<double>(n.size());
    if (mean > 0)
      for (double& v : n) v /= mean;
  }
  return n;
}

std::vector<double> gate_logits(const Params& p, const std::string& L, double T, bool relative) {
  std::vector<double> n = norms(p, L, relative);
  const Tensor& v = p.at(L + ".v");
  for (size_t g = 0; g < n.size(); ++g) n[g] = (n[g] - softplus(v.data[g])) / T;
  return n;
}

const char* objective_of(const std::string& strategy) {
  if (strategy == "fedavg") return "ce";
  if (strategy == "fedprox") return "fedprox";
  if (strategy == "fedsparse") return "fedsparse";
  return nullptr;
}

}  // namespace

const std::vector<std::string>& known_strategies() {
  static const std::vector<std::string> s = {"fedavg", "fedprox", "fedsparse"};
  return s;
}

TrainResult train_plan(const std::string& strategy, const Scalars& hparams, const Tensors& weights,
                       uint64_t seed, Trainer& trainer, const Dataset& data) {
  return train_plan(strategy, hparams, weights, seed, trainer, data, nullptr);
}

TrainResult train_plan(const std::string& strategy, const Scalars& hparams, const Tensors& weights,
                       uint64_t seed, Trainer& trainer, const Dataset& data, TrainTrace* trace) {
  const char* objective = objective_of(strategy);
  if (!objective) throw PlanError("unknown strategy '" + strategy + "'");
  const auto hp = parse_hparams(strategy, hparams);
  const ProgramMeta& meta = trainer.meta();
  if (meta.objective != objective)
    throw PlanError(strategy + " needs a '" + objective + "' program, the plan's is '" + meta.objective + "'");
  const double lr = hp.at("lr");
  const int64_t epochs = static_cast<int64_t>(hp.at("epochs")), bs = static_cast<int64_t>(hp.at("batch_size"));
  // the program's x must take the data's rows
  int64_t feat = 1;
  for (auto d : meta.inputs[0].shape)
    if (d != -1) feat *= d;
  if (data.n && feat != data.features)
    throw PlanError("the data has " + std::to_string(data.features) + " features, the program takes " +
                    std::to_string(feat));

  Params p;
  for (const auto& kv : weights) p[kv.first] = kv.second;
  auto set = [&] {
    Tensors t;
    for (const auto& name : meta.params) {
      auto it = p.find(name);
      if (it == p.end()) throw PlanError("the plan has no weight " + name + " the program needs");
      t.emplace_back(name, it->second);
    }
    if (t.size() != weights.size()) throw PlanError("the plan's weights are not the program's parameters");
    try {
      trainer.set_weights(t);
    } catch (const std::runtime_error& e) {
      throw PlanError(e.what());
    }
  };
  set();

  // fixed inputs and per-step producers, by name; anything else the program asks for is refused
  Ordered<Feed> fixed;
  std::vector<std::string> layers;
  std::map<std::string, std::vector<float>> theta;
  const bool relative = strategy == "fedsparse" && hp.at("relative") != 0;
  const double T = strategy == "fedsparse" ? hp.at("T") : 1.0;
  if (strategy == "fedprox") {
    fixed.emplace_back("mu", fscalar(hp.at("mu")));
    for (const auto& kv : weights) fixed.emplace_back("g." + kv.first, fvec(kv.second.shape, kv.second.data));
  } else if (strategy == "fedsparse") {
    layers = gated_layers(meta, p);
    for (const auto& L : layers) {
      auto lg = gate_logits(p, L, T, relative);
      theta[L].assign(lg.begin(), lg.end());
    }
    for (const char* k : {"lambda0", "ce_scale", "T"}) fixed.emplace_back(k, fscalar(hp.at(k)));
  }
  std::vector<std::string> per_step = {"x", "y", "w"};
  for (size_t i = 0; i < layers.size(); ++i)
    for (const char* k : {"u", "theta_logit", "norm"}) per_step.push_back(k + std::to_string(i));
  for (const auto& in : meta.inputs) {
    const bool known = std::count(per_step.begin(), per_step.end(), in.name) || find(fixed, in.name);
    if (!known) throw PlanError("the program needs input '" + in.name + "', which " + strategy + " does not produce");
  }
  Ordered<Feed> fixed_used;  // exactly the program's inputs
  for (const auto& kv : fixed)
    if (std::any_of(meta.inputs.begin(), meta.inputs.end(), [&](const ProgramInput& i) { return i.name == kv.first; }))
      fixed_used.push_back(kv);
  const bool plain = meta.inputs.size() == 3;  // x, y, w: batches longer than the program are split

  Rng rng_batches(seed, 0), rng_u(seed, 1), rng_z(seed, 2);
  Adamax vopt;
  vopt.lr = hp.count("v_lr") ? hp.at("v_lr") : 0.0;
  std::vector<double> losses;
  for (int64_t e = 0; e < epochs && data.n > 0; ++e) {
    const std::vector<int64_t> perm = rng_batches.permutation(data.n);
    for (int64_t s = 0; s < data.n; s += bs) {
      std::vector<int64_t> idx(perm.begin() + s, perm.begin() + std::min(data.n, s + bs));
      if (trace) trace->batches.push_back(idx);
      const int64_t N = static_cast<int64_t>(idx.size());
      if (N > meta.max_batch && !plain)
        throw PlanError("batch_size " + std::to_string(bs) + " is more than the program's " +
                        std::to_string(meta.max_batch) + " rows");
      set();
      double loss = 0;
      Tensors g;
      if (plain) {  // cross-entropy: chunks of the program's batch, rows weighted 1/N, gradients summed
        for (int64_t c = 0; c < N; c += meta.max_batch) {
          std::vector<int64_t> part(idx.begin() + c, idx.begin() + std::min(N, c + meta.max_batch));
          Ordered<Feed> in;
          batch_feeds(data, part, in);
          in.emplace_back("w", fvec({static_cast<int64_t>(part.size())},
                                    std::vector<float>(part.size(), 1.0f / static_cast<float>(N))));
          Tensors gc;
          loss += trainer.loss_and_grads(in, &gc);
          if (g.empty()) {
            g = std::move(gc);
          } else {
            for (size_t k = 0; k < g.size(); ++k)
              for (size_t i = 0; i < g[k].second.data.size(); ++i) g[k].second.data[i] += gc[k].second.data[i];
          }
        }
      } else {
        Ordered<Feed> in;
        batch_feeds(data, idx, in);
        Ordered<std::vector<float>> drawn;
        for (size_t i = 0; i < layers.size(); ++i) {
          const std::string& L = layers[i];
          const size_t units = p.at(L + ".v").data.size();
          std::vector<float> u(units);
          for (auto& v : u) v = static_cast<float>(U_EPS + (1 - 2 * U_EPS) * rng_u.uniform());
          if (trace) drawn.emplace_back("u" + std::to_string(i), u);
          in.emplace_back("u" + std::to_string(i), fvec({static_cast<int64_t>(units)}, std::move(u)));
          in.emplace_back("theta_logit" + std::to_string(i), fvec({static_cast<int64_t>(units)}, theta[L]));
          auto nm = norms(p, L, relative);
          in.emplace_back("norm" + std::to_string(i),
                          fvec({static_cast<int64_t>(units)}, std::vector<float>(nm.begin(), nm.end())));
        }
        if (trace) trace->noise.push_back(std::move(drawn));
        for (const auto& kv : fixed_used) in.push_back(kv);
        loss = trainer.loss_and_grads(in, &g);
      }
      if (!std::isfinite(loss)) throw std::runtime_error("the loss is not finite (" + std::to_string(loss) + ")");
      vopt.begin_step();
      for (auto& kv : g) {
        const std::string& k = kv.first;
        const bool is_v = strategy == "fedsparse" && k.size() > 2 && k.compare(k.size() - 2, 2, ".v") == 0;
        if (is_v)
          vopt.update(k, p.at(k), kv.second);
        else
          sgd(p.at(k), kv.second, lr);
      }
      losses.push_back(loss);
    }
  }

  TrainResult out;
  double kept_sum = 0;
  for (const auto& L : layers) {
    const auto lg = gate_logits(p, L, T, relative);
    std::vector<int64_t> active;
    std::vector<double> r(lg.size());
    for (size_t gidx = 0; gidx < lg.size(); ++gidx) {
      r[gidx] = rng_z.uniform();
      if (r[gidx] < sigmoid(lg[gidx])) active.push_back(static_cast<int64_t>(gidx));
    }
    if (trace) trace->mask_uniforms.emplace_back(L, r);
    kept_sum += lg.empty() ? 0.0 : static_cast<double>(active.size()) / static_cast<double>(lg.size());
    out.masks.emplace_back(L + ".weight", active);
    out.masks.emplace_back(L + ".bias", active);
  }
  for (const auto& kv : weights) {
    const std::string& k = kv.first;
    if (strategy == "fedsparse" && k.size() > 2 && k.compare(k.size() - 2, 2, ".v") == 0) continue;
    out.weights.emplace_back(k, p.at(k));
  }
  double mean = 0;
  for (double l : losses) mean += l;
  mean = losses.empty() ? 0.0 : mean / static_cast<double>(losses.size());
  out.metrics.emplace_back("train_loss", Scalar::of_float(mean));
  out.metrics.emplace_back("steps", Scalar::of_int(static_cast<int64_t>(losses.size())));
  if (strategy == "fedsparse")
    out.metrics.emplace_back("kept", Scalar::of_float(layers.empty() ? 1.0 : kept_sum / static_cast<double>(layers.size())));
  return out;
}

}  // namespace fedge
