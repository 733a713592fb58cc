// The ExecuTorch trainer on the C++ runtime of the executorch wheel (docs/protocol.md section 14).
//
// A program is loaded straight from its bytes (kept alive here: the runtime does not copy them) with the
// low-level Program/Method API. `fedge_meta` gives the metadata; the three `__et_training_*` methods give
// where the gradients and the parameters start in `forward`'s outputs and the parameter names.
// External-weights programs get their parameter storage from ZeroDataMap, a NamedDataMap of zeroed buffers
// named and shaped from the metadata (what the Python backend writes as a zero .ptd), so no .ptd and no
// Python is needed. After one forward-backward on a dummy batch the parameter outputs are the method's own
// parameter tensors (memory-planned, stable across runs): set_weights/get_weights copy into/out of them.
#include "trainer.hpp"

#include <executorch/extension/data_loader/buffer_data_loader.h>
#include <executorch/extension/memory_allocator/malloc_memory_allocator.h>
#include <executorch/runtime/core/evalue.h>
#include <executorch/runtime/core/named_data_map.h>
#include <executorch/runtime/core/tensor_layout.h>
#include <executorch/runtime/executor/method.h>
#include <executorch/runtime/executor/program.h>
#include <executorch/runtime/platform/platform.h>
#include <executorch/runtime/platform/runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>

#include "fedge_et_threadpool.hpp"

namespace fedge {

namespace et = ::executorch::runtime;
namespace etr = ::executorch::ET_RUNTIME_NAMESPACE;
using ::executorch::aten::ScalarType;
using ETensor = ::executorch::aten::Tensor;
using ::executorch::aten::TensorImpl;
using ::executorch::extension::BufferDataLoader;
using ::executorch::extension::MallocMemoryAllocator;

namespace {

constexpr const char* kFormat = "fedge-executorch/2";
constexpr const char* kMeta = "fedge_meta";
constexpr const char* kGradIdx = "__et_training_gradients_index_forward";
constexpr const char* kParamIdx = "__et_training_parameters_index_forward";
constexpr const char* kFqn = "__et_training_fqn_forward";

std::string err(et::Error e) {
  std::ostringstream s;
  s << "0x" << std::hex << static_cast<int>(e);
  return s.str();
}

void check(et::Error e, const std::string& what) {
  if (e != et::Error::Ok) throw std::runtime_error(what + " failed (ExecuTorch error " + err(e) + ")");
}

// 64-byte aligned zeroed bytes (XNNPACK and the planned tensors want aligned memory).
struct Aligned {
  uint8_t* p = nullptr;
  size_t n = 0;
  explicit Aligned(size_t size) : n(size) {
    size_t rounded = ((size ? size : 1) + 63) / 64 * 64;
    p = static_cast<uint8_t*>(std::aligned_alloc(64, rounded));
    if (!p) throw std::bad_alloc();
    std::memset(p, 0, rounded);
  }
  ~Aligned() { std::free(p); }
  Aligned(const Aligned&) = delete;
  Aligned& operator=(const Aligned&) = delete;
};

// Zeroed float32 storage for every parameter of an external-weights program, by name.
class ZeroDataMap final : public etr::NamedDataMap {
 public:
  void add(const std::string& name, const std::vector<int64_t>& shape) {
    auto e = std::make_unique<Entry>();
    e->name = name;
    size_t numel = 1;
    for (size_t d = 0; d < shape.size(); ++d) {
      if (shape[d] < 0 || shape[d] > INT32_MAX) throw std::runtime_error("bad shape for " + name);
      e->sizes.push_back(static_cast<int32_t>(shape[d]));
      e->dim_order.push_back(static_cast<uint8_t>(d));
      numel *= static_cast<size_t>(shape[d]);
    }
    e->data = std::make_unique<Aligned>(numel * sizeof(float));
    entries_.push_back(std::move(e));
  }

  et::Result<const etr::TensorLayout> get_tensor_layout(std::string_view key) const override {
    const Entry* e = find(key);
    if (!e) return et::Error::NotFound;
    return etr::TensorLayout::create(et::Span<const int32_t>(e->sizes.data(), e->sizes.size()),
                                     et::Span<const uint8_t>(e->dim_order.data(), e->dim_order.size()),
                                     ScalarType::Float);
  }
  et::Result<et::FreeableBuffer> get_data(std::string_view key) const override {
    const Entry* e = find(key);
    if (!e) return et::Error::NotFound;
    return et::FreeableBuffer(e->data->p, e->data->n, nullptr);
  }
  et::Error load_data_into(std::string_view key, void* buffer, size_t size) const override {
    const Entry* e = find(key);
    if (!e) return et::Error::NotFound;
    if (size > e->data->n) return et::Error::InvalidArgument;
    std::memcpy(buffer, e->data->p, size);
    return et::Error::Ok;
  }
  et::Result<uint32_t> get_num_keys() const override { return static_cast<uint32_t>(entries_.size()); }
  et::Result<const char*> get_key(uint32_t index) const override {
    if (index >= entries_.size()) return et::Error::InvalidArgument;
    return entries_[index]->name.c_str();
  }

 private:
  struct Entry {
    std::string name;
    std::vector<int32_t> sizes;
    std::vector<uint8_t> dim_order;
    std::unique_ptr<Aligned> data;
  };
  const Entry* find(std::string_view key) const {
    for (const auto& e : entries_)
      if (e->name == key) return e.get();
    return nullptr;
  }
  std::vector<std::unique_ptr<Entry>> entries_;
};

// A loaded method with its memory (planned buffers, method and temp allocators).
struct LoadedMethod {
  MallocMemoryAllocator method_alloc, temp_alloc;
  std::vector<std::unique_ptr<Aligned>> buffers;
  std::vector<et::Span<uint8_t>> spans;
  std::unique_ptr<et::HierarchicalAllocator> planned;
  std::unique_ptr<et::MemoryManager> mm;
  std::optional<et::Method> method;

  LoadedMethod(const et::Program& prog, const char* name, const etr::NamedDataMap* data) {
    auto meta = prog.method_meta(name);
    if (!meta.ok()) throw std::runtime_error(std::string("program has no method ") + name);
    for (size_t i = 0; i < meta->num_memory_planned_buffers(); ++i) {
      auto size = meta->memory_planned_buffer_size(i);
      check(size.error(), "planned buffer size");
      buffers.push_back(std::make_unique<Aligned>(static_cast<size_t>(*size)));
      spans.emplace_back(buffers.back()->p, buffers.back()->n);
    }
    planned = std::make_unique<et::HierarchicalAllocator>(et::Span<et::Span<uint8_t>>(spans.data(), spans.size()));
    mm = std::make_unique<et::MemoryManager>(&method_alloc, planned.get(), &temp_alloc);
    auto m = prog.load_method(name, mm.get(), nullptr, data);
    check(m.error(), std::string("loading method ") + name);
    method.emplace(std::move(*m));
  }
  ~LoadedMethod() { method.reset(); }
};

std::once_flag g_init;
uint32_t g_threads = 1;

// The runtime's log, without its Info/Debug lines (cpuinfo probing, "Resetting threadpool" on every start)
// unless FEDGE_ET_LOG is set; errors always go to stderr.
void emit_log(et_timestamp_t, et_pal_log_level_t level, const char* filename, const char*, size_t line,
              const char* message, size_t length) {
  static const bool all = std::getenv("FEDGE_ET_LOG") != nullptr;
  if (!all && (level == kInfo || level == kDebug)) return;
  std::fprintf(stderr, "%c executorch:%s:%zu] %.*s\n", static_cast<char>(level), filename ? filename : "?", line,
               static_cast<int>(length), message);
}

void init_runtime() {
  std::call_once(g_init, [] {
    et::register_pal(et::PalImpl::create(emit_log, __FILE__));
    et::runtime_init();
    auto* tp = ::executorch::extension::threadpool::get_threadpool();
    if (tp && tp->get_thread_count() != g_threads) tp->_unsafe_reset_threadpool(g_threads);
  });
}

std::vector<int64_t> shape_of(const nlohmann::json& j, const std::string& what) {
  std::vector<int64_t> out;
  for (const auto& d : j) {
    if (d.is_string() && d.get<std::string>() == "B")
      out.push_back(-1);
    else if (d.is_number_integer())
      out.push_back(d.get<int64_t>());
    else
      throw std::runtime_error("bad shape in the metadata of " + what);
  }
  return out;
}

}  // namespace

bool ProgramInput::batched() const { return std::find(shape.begin(), shape.end(), -1) != shape.end(); }

struct Trainer::Impl {
  Bytes bytes;
  std::unique_ptr<BufferDataLoader> loader;
  std::optional<et::Program> program;
  std::unique_ptr<ZeroDataMap> data;
  ProgramMeta meta;
  std::unique_ptr<LoadedMethod> fwd;
  bool fixed = false;
  size_t gi = 0, pi = 0;
  std::vector<std::string> fqn;       // output order of parameters/gradients
  std::vector<size_t> param_pos;      // params order -> position in fqn
  std::vector<float*> param_ptr;      // params order -> the method's parameter memory
  std::vector<int64_t> param_numel;

  ~Impl() {
    fwd.reset();  // the method before the program, the data map and the bytes it points into
    program.reset();
  }

  void run_const(const char* name, std::vector<std::string>* strings) {
    LoadedMethod m(*program, name, nullptr);
    check(m.method->execute(), std::string("running ") + name);
    std::vector<et::EValue> out(m.method->outputs_size());
    check(m.method->get_outputs(out.data(), out.size()), std::string("outputs of ") + name);
    if (strings)
      for (auto& v : out) {
        if (!v.isString()) throw std::runtime_error(std::string(name) + " returned a non-string");
        strings->emplace_back(v.toString());
      }
  }

  int64_t const_int(const char* name) {
    LoadedMethod m(*program, name, nullptr);
    check(m.method->execute(), std::string("running ") + name);
    const et::EValue& v = m.method->get_output(0);
    if (!v.isInt()) throw std::runtime_error(std::string(name) + " did not return an int");
    return v.toInt();
  }

  // Runs forward on the inputs by name (padding batched inputs to the program's batch with rows of w = 0);
  // returns the real row count.
  int64_t run(const Ordered<Feed>& given) {
    const Feed* x = find(given, std::string("x"));
    if (!x) throw std::runtime_error("the program needs input 'x'");
    if (x->shape.empty()) throw std::runtime_error("input x has no batch dimension");
    const int64_t n = x->shape[0];
    if (n <= 0) throw std::runtime_error("empty batch");
    if (n > meta.max_batch)
      throw std::runtime_error("batch of " + std::to_string(n) + " rows, the program takes at most " +
                               std::to_string(meta.max_batch));
    const int64_t size = fixed ? meta.max_batch : std::max(n, meta.min_batch);
    for (const auto& kv : given) {
      bool known = false;
      for (const auto& in : meta.inputs) known = known || in.name == kv.first;
      if (!known) throw std::runtime_error("input '" + kv.first + "' is not an input of this program");
    }
    struct Buf {
      std::vector<int32_t> sizes;
      std::vector<uint8_t> order;
      std::vector<float> f;
      std::vector<int64_t> i;
      std::unique_ptr<TensorImpl> impl;
    };
    std::vector<Buf> bufs(meta.inputs.size());
    for (size_t k = 0; k < meta.inputs.size(); ++k) {
      const ProgramInput& in = meta.inputs[k];
      Buf& b = bufs[k];
      int64_t want = 1, got_rows = 1;  // elements wanted of the real rows
      std::vector<int64_t> shape = in.shape;
      for (auto& d : shape) d = d == -1 ? n : d;
      for (auto d : shape) want *= d;
      const Feed* f = find(given, in.name);
      const bool is_int = in.dtype == "i8";
      std::vector<float> wdef;
      if (!f && in.name == "w") {
        wdef.assign(static_cast<size_t>(n), 1.0f / static_cast<float>(n));
      } else if (!f) {
        throw std::runtime_error("the program needs input '" + in.name + "'");
      }
      if (f) {
        size_t have = is_int ? f->i.size() : f->f.size();
        bool ok = have == static_cast<size_t>(want);
        if (in.name == "x") {
          ok = ok && !f->shape.empty() && f->shape[0] == n;
        } else {
          ok = ok && f->shape == shape;
        }
        if (!ok) {
          std::ostringstream s;
          s << "input " << in.name << ": shape [";
          for (size_t d = 0; d < f->shape.size(); ++d) s << (d ? "," : "") << f->shape[d];
          s << "] with " << have << " " << (is_int ? "int64" : "float32") << " values, the program wants [";
          for (size_t d = 0; d < shape.size(); ++d) s << (d ? "," : "") << shape[d];
          s << "]";
          throw std::runtime_error(s.str());
        }
      }
      (void)got_rows;
      // padded shape
      std::vector<int64_t> pshape = in.shape;
      for (auto& d : pshape) d = d == -1 ? size : d;
      int64_t pnumel = 1;
      for (auto d : pshape) pnumel *= d;
      for (auto d : pshape) b.sizes.push_back(static_cast<int32_t>(d));
      for (size_t d = 0; d < pshape.size(); ++d) b.order.push_back(static_cast<uint8_t>(d));
      void* ptr;
      if (is_int) {
        b.i.assign(static_cast<size_t>(pnumel), 0);
        std::copy(f->i.begin(), f->i.end(), b.i.begin());
        ptr = b.i.data();
      } else {
        b.f.assign(static_cast<size_t>(pnumel), 0.0f);
        const std::vector<float>& src = f ? f->f : wdef;
        std::copy(src.begin(), src.end(), b.f.begin());
        ptr = b.f.data();
      }
      b.impl = std::make_unique<TensorImpl>(is_int ? ScalarType::Long : ScalarType::Float,
                                            static_cast<ssize_t>(b.sizes.size()), b.sizes.data(), ptr,
                                            b.order.data());
      check(fwd->method->set_input(et::EValue(ETensor(b.impl.get())), k), "setting input " + in.name);
    }
    check(fwd->method->execute(), "running forward");
    return n;
  }

  const ETensor& out_tensor(size_t i) const {
    const et::EValue& v = fwd->method->get_output(i);
    if (!v.isTensor()) throw std::runtime_error("output " + std::to_string(i) + " is not a tensor");
    return v.toTensor();
  }
};

Trainer::Trainer() : impl_(std::make_unique<Impl>()) {}
Trainer::~Trainer() = default;

void Trainer::set_threads(uint32_t n) {
  g_threads = n ? n : 1;
  init_runtime();
  auto* tp = ::executorch::extension::threadpool::get_threadpool();
  if (tp && tp->get_thread_count() != g_threads) tp->_unsafe_reset_threadpool(g_threads);
}

void Trainer::load(const Bytes& program) {
  init_runtime();
  if (program.size() < 8 || program[4] != 'E' || program[5] != 'T')
    throw std::runtime_error("not an ExecuTorch program");
  auto im = std::make_unique<Impl>();
  im->bytes = program;  // kept alive: the loaded program points into these bytes
  im->loader = std::make_unique<BufferDataLoader>(im->bytes.data(), im->bytes.size());
  auto prog = et::Program::load(im->loader.get(), et::Program::Verification::Minimal);
  check(prog.error(), "loading the program");
  im->program.emplace(std::move(*prog));

  std::vector<std::string> strs;
  im->run_const(kMeta, &strs);
  if (strs.size() != 1) throw std::runtime_error("fedge_meta returned no single string");
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(strs[0]);
  } catch (const std::exception& e) {
    throw std::runtime_error(std::string("fedge_meta is not JSON: ") + e.what());
  }
  ProgramMeta& m = im->meta;
  try {
    if (j.value("format", std::string()) != kFormat)
      throw std::runtime_error("not a fedge ExecuTorch program (or one of another format version)");
    m.objective = j.at("objective").get<std::string>();
    m.batch = j.at("batch").get<std::string>();
    m.weights = j.value("weights", std::string("embedded"));
    m.model_json = j.at("model").dump();
    m.layout_json = j.contains("layout") ? j.at("layout").dump() : "{}";
    for (const auto& p : j.at("params")) m.params.push_back(p.get<std::string>());
    for (const auto& p : m.params) m.shapes.emplace_back(p, shape_of(j.at("shapes").at(p), p));
    for (const auto& in : j.at("inputs")) {
      ProgramInput pi;
      pi.name = in.at("name").get<std::string>();
      pi.shape = shape_of(in.at("shape"), pi.name);
      pi.dtype = in.at("dtype").get<std::string>();
      if (pi.dtype != "f4" && pi.dtype != "i8")
        throw std::runtime_error("input " + pi.name + " has dtype " + pi.dtype);
      m.inputs.push_back(std::move(pi));
    }
    for (const auto& o : j.at("outputs")) m.outputs.push_back(o.get<std::string>());
    m.min_batch = j.at("min_batch").get<int64_t>();
    m.max_batch = j.at("max_batch").get<int64_t>();
  } catch (const nlohmann::json::exception& e) {
    throw std::runtime_error(std::string("bad fedge_meta: ") + e.what());
  }
  if (m.batch != "fixed" && m.batch != "dynamic") throw std::runtime_error("bad batch policy " + m.batch);
  if (m.inputs.empty() || m.inputs[0].name != "x") throw std::runtime_error("the program's first input is not x");
  if (m.outputs.empty() || m.outputs[0] != "loss") throw std::runtime_error("the program's first output is not loss");
  im->fixed = m.batch == "fixed";

  im->gi = static_cast<size_t>(im->const_int(kGradIdx));
  im->pi = static_cast<size_t>(im->const_int(kParamIdx));
  im->run_const(kFqn, &im->fqn);
  {
    auto a = im->fqn, b = m.params;
    std::sort(a.begin(), a.end());
    std::sort(b.begin(), b.end());
    if (a != b) throw std::runtime_error("program parameters do not match its metadata");
  }
  for (const auto& p : m.params)
    im->param_pos.push_back(static_cast<size_t>(std::find(im->fqn.begin(), im->fqn.end(), p) - im->fqn.begin()));

  if (m.weights == "external") {
    im->data = std::make_unique<ZeroDataMap>();
    for (const auto& kv : m.shapes) im->data->add(kv.first, kv.second);
  } else if (m.weights != "embedded") {
    throw std::runtime_error("unknown weights policy " + m.weights);
  }
  im->fwd = std::make_unique<LoadedMethod>(*im->program, "forward", im->data.get());
  const size_t nout = im->fwd->method->outputs_size();
  if (im->fwd->method->inputs_size() != m.inputs.size())
    throw std::runtime_error("forward takes " + std::to_string(im->fwd->method->inputs_size()) +
                             " inputs, the metadata lists " + std::to_string(m.inputs.size()));
  if (im->gi != m.outputs.size() || im->pi != im->gi + m.params.size() || nout != im->pi + m.params.size())
    throw std::runtime_error("forward's outputs are not [loss, aux..., gradients..., parameters...]");

  // One forward-backward on a dummy batch (noise 0.5, T = 1, w = 1/n) exposes the parameter tensors.
  const int64_t n = m.min_batch;
  Ordered<Feed> dummy;
  for (const auto& in : m.inputs) {
    Feed f;
    int64_t numel = 1;
    for (auto d : in.shape) {
      f.shape.push_back(d == -1 ? n : d);
      numel *= d == -1 ? n : d;
    }
    if (in.dtype == "i8") {
      f.i.assign(static_cast<size_t>(numel), 0);
    } else {
      float fill = in.name == "w" ? 1.0f / static_cast<float>(n)
                   : in.name.rfind("u", 0) == 0 ? 0.5f
                   : in.name == "T"             ? 1.0f
                                                : 0.0f;
      f.f.assign(static_cast<size_t>(numel), fill);
    }
    dummy.emplace_back(in.name, std::move(f));
  }
  im->run(dummy);
  for (size_t k = 0; k < m.params.size(); ++k) {
    const ETensor& t = im->out_tensor(im->pi + im->param_pos[k]);
    const auto& want = m.shapes[k].second;
    bool ok = t.scalar_type() == ScalarType::Float && static_cast<size_t>(t.dim()) == want.size();
    for (size_t d = 0; ok && d < want.size(); ++d) ok = t.size(static_cast<ssize_t>(d)) == want[d];
    if (!ok) throw std::runtime_error("parameter " + m.params[k] + " has not the shape of the metadata");
    im->param_ptr.push_back(const_cast<float*>(t.const_data_ptr<float>()));
    im->param_numel.push_back(t.numel());
  }
  impl_ = std::move(im);
}

const ProgramMeta& Trainer::meta() const {
  if (!impl_->fwd) throw std::runtime_error("load a program first");
  return impl_->meta;
}

void Trainer::set_weights(const Tensors& w) {
  const ProgramMeta& m = meta();
  if (w.size() != m.params.size()) throw std::runtime_error("weights do not match the program's parameters");
  std::vector<const fedge::Tensor*> src(m.params.size(), nullptr);
  for (const auto& kv : w) {
    size_t k = static_cast<size_t>(std::find(m.params.begin(), m.params.end(), kv.first) - m.params.begin());
    if (k == m.params.size()) throw std::runtime_error("weight " + kv.first + " is not a parameter of the program");
    if (src[k]) throw std::runtime_error("weight " + kv.first + " given twice");
    if (kv.second.shape != m.shapes[k].second ||
        static_cast<int64_t>(kv.second.data.size()) != impl_->param_numel[k])
      throw std::runtime_error("weight " + kv.first + ": shape does not match the program's");
    src[k] = &kv.second;
  }
  for (size_t k = 0; k < src.size(); ++k)
    std::memcpy(impl_->param_ptr[k], src[k]->data.data(), src[k]->data.size() * sizeof(float));
}

Tensors Trainer::get_weights() const {
  const ProgramMeta& m = meta();
  Tensors out;
  for (size_t k = 0; k < m.params.size(); ++k) {
    fedge::Tensor t;
    t.shape = m.shapes[k].second;
    t.data.assign(impl_->param_ptr[k], impl_->param_ptr[k] + impl_->param_numel[k]);
    out.emplace_back(m.params[k], std::move(t));
  }
  return out;
}

double Trainer::loss_and_grads(const Ordered<Feed>& inputs, Tensors* grads, Tensors* aux) {
  const ProgramMeta& m = meta();
  const int64_t n = impl_->run(inputs);
  const ETensor& loss = impl_->out_tensor(0);
  const double value = static_cast<double>(loss.const_data_ptr<float>()[0]);
  if (grads) {
    grads->clear();
    for (size_t k = 0; k < m.params.size(); ++k) {
      const ETensor& g = impl_->out_tensor(impl_->gi + impl_->param_pos[k]);
      if (g.numel() != impl_->param_numel[k]) throw std::runtime_error("gradient of " + m.params[k] + " has a bad size");
      fedge::Tensor t;
      t.shape = m.shapes[k].second;
      t.data.assign(g.const_data_ptr<float>(), g.const_data_ptr<float>() + g.numel());
      grads->emplace_back(m.params[k], std::move(t));
    }
  }
  if (aux) {
    aux->clear();
    for (size_t j = 1; j < m.outputs.size(); ++j) {
      const ETensor& a = impl_->out_tensor(j);
      fedge::Tensor t;
      for (ssize_t d = 0; d < a.dim(); ++d) t.shape.push_back(a.size(d));
      if (a.scalar_type() != ScalarType::Float) throw std::runtime_error("aux output " + m.outputs[j] + " is not float32");
      int64_t rows = t.shape.empty() ? 1 : t.shape[0];
      int64_t keep = a.numel();
      if (!t.shape.empty() && rows > n) {  // the real rows only
        keep = a.numel() / rows * n;
        t.shape[0] = n;
      }
      t.data.assign(a.const_data_ptr<float>(), a.const_data_ptr<float>() + keep);
      aux->emplace_back(m.outputs[j], std::move(t));
    }
  }
  return value;
}

}  // namespace fedge
