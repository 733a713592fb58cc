// fedge-native-train: the native trainer and client halves from the command line, for tests and timing.
//
//   fedge-native-train --program P.pte --weights W.npz --data D.npz --strategy S --hparams JSON --seed N
//                      --out OUT.npz [--trace T.npz] [--steps-only] [--threads K]
//     trains one plan; OUT.npz gets the trained weights and `mask.<name>` (int64 active rows); stdout one
//     JSON line of the metrics (plus "seconds" and "ms_per_step"). --trace writes the draws the run used:
//     `batch.<s>` (rows of step s), `noise.<s>.u<i>` (FedSparse's noise) and `r.<layer>` (mask uniforms).
//     --steps-only trains and prints without writing OUT.
//   fedge-native-train --grads --program P.pte --weights W.npz --data D.npz --out OUT.npz
//     loss and gradients at W on all of D as one batch: OUT.npz gets `loss` and `grad.<name>` (and
//     `aux.<name>`); arrays of D other than x and y named like program inputs are fed as they are.
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>

#include "algorithms.hpp"
#include "npz.hpp"
#include "trainer.hpp"

using namespace fedge;

namespace {

[[noreturn]] void usage(const std::string& why) {
  std::cerr << "fedge-native-train: " << why << "\n"
            << "usage: fedge-native-train --program P.pte --weights W.npz --data D.npz (--strategy S --hparams JSON "
               "--seed N | --grads) [--out OUT.npz] [--trace T.npz] [--steps-only] [--threads K]\n";
  std::exit(2);
}

Bytes read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw std::runtime_error("cannot open " + path);
  return Bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
}

Scalars scalars_of(const nlohmann::json& j) {
  if (!j.is_object()) throw std::runtime_error("--hparams must be a JSON object");
  Scalars out;
  for (auto it = j.begin(); it != j.end(); ++it) {
    const auto& v = it.value();
    Scalar s;
    if (v.is_boolean()) s = Scalar::of_bool(v.get<bool>());
    else if (v.is_number_integer()) s = Scalar::of_int(v.get<int64_t>());
    else if (v.is_number_float()) s = Scalar::of_float(v.get<double>());
    else if (v.is_string()) s = Scalar::of_str(v.get<std::string>());
    else if (v.is_null()) s = Scalar::nil();
    else throw std::runtime_error("--hparams " + it.key() + ": not a scalar");
    out.emplace_back(it.key(), s);
  }
  return out;
}

nlohmann::json json_of(const Scalars& s) {
  nlohmann::json j = nlohmann::json::object();
  for (const auto& kv : s) {
    const Scalar& v = kv.second;
    switch (v.kind) {
      case Scalar::Nil: j[kv.first] = nullptr; break;
      case Scalar::Bool: j[kv.first] = v.b; break;
      case Scalar::Int: j[kv.first] = v.i; break;
      case Scalar::Float: j[kv.first] = v.f; break;
      case Scalar::Str: j[kv.first] = v.s; break;
    }
  }
  return j;
}

}  // namespace

int main(int argc, char** argv) {
  std::map<std::string, std::string> a;
  bool grads = false, steps_only = false;
  for (int i = 1; i < argc; ++i) {
    std::string k = argv[i];
    if (k == "--grads") grads = true;
    else if (k == "--steps-only") steps_only = true;
    else if (k.rfind("--", 0) == 0 && i + 1 < argc) a[k.substr(2)] = argv[++i];
    else usage("bad argument " + k);
  }
  for (const char* need : {"program", "weights", "data"})
    if (!a.count(need)) usage(std::string("--") + need + " is required");
  if (!grads && (!a.count("strategy") || !a.count("seed"))) usage("--strategy and --seed are required");
  if (!steps_only && !a.count("out")) usage("--out is required");
  try {
    Trainer::set_threads(a.count("threads") ? static_cast<uint32_t>(std::stoul(a["threads"])) : 1);
    Trainer t;
    t.load(read_file(a["program"]));
    Tensors w;
    for (const auto& kv : read_npz(a["weights"])) {
      Tensor x;
      x.shape = kv.second.shape;
      x.data = npy_floats(kv.second, kv.first);
      w.emplace_back(kv.first, std::move(x));
    }
    if (grads) {
      const auto arrays = read_npz(a["data"]);
      Dataset d = load_npz(a["data"]);
      Ordered<Feed> in;
      Feed x, y;
      x.shape = {d.n, d.features};
      x.f = d.x;
      y.shape = {d.n};
      y.i = d.y;
      in.emplace_back("x", std::move(x));
      in.emplace_back("y", std::move(y));
      for (const auto& kv : arrays) {
        if (kv.first == "x" || kv.first == "y") continue;
        Feed f;
        f.shape = kv.second.shape;
        f.f = npy_floats(kv.second, kv.first);
        in.emplace_back(kv.first, std::move(f));
      }
      // weights in the program's order
      Tensors ordered;
      for (const auto& name : t.meta().params) {
        const Tensor* p = find(w, name);
        if (!p) throw std::runtime_error("weights have no " + name);
        ordered.emplace_back(name, *p);
      }
      t.set_weights(ordered);
      Tensors g, aux;
      const double loss = t.loss_and_grads(in, &g, &aux);
      Ordered<NpyArray> out;
      out.emplace_back("loss", npy_scalar(loss));
      for (const auto& kv : g) out.emplace_back("grad." + kv.first, npy_of(kv.second));
      for (const auto& kv : aux) out.emplace_back("aux." + kv.first, npy_of(kv.second));
      write_npz(a["out"], out);
      std::cout << nlohmann::json{{"loss", loss}}.dump() << std::endl;
      return 0;
    }
    Dataset d = load_npz(a["data"]);
    const Scalars hp = scalars_of(nlohmann::json::parse(a.count("hparams") ? a["hparams"] : "{}"));
    TrainTrace trace;
    const auto t0 = std::chrono::steady_clock::now();
    TrainResult r = train_plan(a["strategy"], hp, w, std::stoull(a["seed"]), t, d, a.count("trace") ? &trace : nullptr);
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (!steps_only) {
      Ordered<NpyArray> out;
      for (const auto& kv : r.weights) out.emplace_back(kv.first, npy_of(kv.second));
      for (const auto& kv : r.masks)
        out.emplace_back("mask." + kv.first, npy_of({static_cast<int64_t>(kv.second.size())}, kv.second));
      write_npz(a["out"], out);
    }
    if (a.count("trace")) {
      Ordered<NpyArray> tr;
      for (size_t s = 0; s < trace.batches.size(); ++s)
        tr.emplace_back("batch." + std::to_string(s),
                        npy_of({static_cast<int64_t>(trace.batches[s].size())}, trace.batches[s]));
      for (size_t s = 0; s < trace.noise.size(); ++s)
        for (const auto& kv : trace.noise[s]) {
          Tensor u;
          u.shape = {static_cast<int64_t>(kv.second.size())};
          u.data = kv.second;
          tr.emplace_back("noise." + std::to_string(s) + "." + kv.first, npy_of(u));
        }
      for (const auto& kv : trace.mask_uniforms) {
        NpyArray x;
        x.dtype = "<f8";
        x.shape = {static_cast<int64_t>(kv.second.size())};
        x.data.resize(kv.second.size() * 8);
        std::memcpy(x.data.data(), kv.second.data(), x.data.size());
        tr.emplace_back("r." + kv.first, std::move(x));
      }
      write_npz(a["trace"], tr);
    }
    nlohmann::json j = json_of(r.metrics);
    j["seconds"] = secs;
    const Scalar* steps = find(r.metrics, std::string("steps"));
    if (steps && steps->i > 0) j["ms_per_step"] = 1000.0 * secs / static_cast<double>(steps->i);
    std::cout << j.dump() << std::endl;
    return 0;
  } catch (const PlanError& e) {
    std::cerr << "plan refused: " << e.what() << std::endl;
    std::cout << nlohmann::json{{"error", "plan"}, {"message", e.what()}}.dump() << std::endl;
    return 3;
  } catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << std::endl;
    return 1;
  }
}
