// fedge-native: a fedge device with no Python. The agent core (agent.hpp) wired to MQTT (mqtt_link.hpp), a
// program store by hash, and the ExecuTorch trainer (trainer.hpp) on a worker thread.
//
//   fedge-native --id pi-1 --data pi-1.npz --broker mqtt://127.0.0.1:1883 [--fleet default] [--state-dir DIR]
//
// Bad input from a person is one line on stderr and exit status 2.
#include <dirent.h>
#include <sys/stat.h>

#include <atomic>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <thread>

#include "agent.hpp"
#include "algorithms.hpp"
#include "codec.hpp"
#include "mqtt_link.hpp"
#include "sha256.hpp"
#include "trainer.hpp"
#include "wire.hpp"

using namespace fedge;

namespace {

std::atomic<bool> g_stop{false};
int g_level = 1;  // 0 debug, 1 info, 2 warning, 3 error
std::mutex g_log_mu;

void log_line(int level, const std::string& s) {
  if (level < g_level) return;
  static const char* names[] = {"DEBUG", "INFO", "WARNING", "ERROR"};
  char ts[32];
  std::time_t t = std::time(nullptr);
  std::strftime(ts, sizeof ts, "%H:%M:%S", std::localtime(&t));
  std::lock_guard<std::mutex> lk(g_log_mu);
  std::fprintf(stderr, "%s %s fedge.native: %s\n", ts, names[level < 0 ? 0 : level > 3 ? 3 : level], s.c_str());
}

[[noreturn]] void usage_error(const std::string& what) {
  std::fprintf(stderr, "fedge-native: %s\n", what.c_str());
  std::exit(2);
}

bool is_hash(const std::string& s) {
  if (s.size() != 64) return false;
  for (char c : s)
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  return true;
}

Bytes read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw std::runtime_error(path + ": cannot read");
  return Bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
}

void make_dirs(const std::string& path) {
  std::string cur;
  std::stringstream ss(path);
  std::string part;
  if (!path.empty() && path[0] == '/') cur = "/";
  while (std::getline(ss, part, '/')) {
    if (part.empty()) continue;
    cur += part + "/";
    if (mkdir(cur.c_str(), 0755) != 0 && errno != EEXIST) throw std::runtime_error(cur + ": " + std::strerror(errno));
  }
}

// Programs by the hex SHA-256 of their bytes (docs/protocol.md section 14); a file whose bytes do not hash to
// its name is not listed (a torn write, or a damaged card).
class ProgramStore {
 public:
  explicit ProgramStore(std::string dir) : dir_(std::move(dir)) { make_dirs(dir_); }
  std::set<std::string> hashes() const {
    std::set<std::string> out;
    if (DIR* d = opendir(dir_.c_str())) {
      while (dirent* e = readdir(d)) {
        std::string name = e->d_name;
        if (!is_hash(name)) continue;
        try {
          if (sha256_hex(read_file(dir_ + "/" + name)) == name) out.insert(name);
        } catch (const std::exception&) {
        }
      }
      closedir(d);
    }
    return out;
  }
  void put(const Bytes& program) {
    std::string h = sha256_hex(program), tmp = dir_ + "/." + h + ".tmp";
    {
      std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
      f.write(reinterpret_cast<const char*>(program.data()), static_cast<std::streamsize>(program.size()));
      if (!f) throw std::runtime_error(tmp + ": cannot write");
    }
    if (std::rename(tmp.c_str(), (dir_ + "/" + h).c_str()) != 0) throw std::runtime_error("cannot store program " + h);
  }
  Bytes get(const std::string& hash) const { return read_file(dir_ + "/" + hash); }

 private:
  std::string dir_;
};

struct Options {
  std::string id, data, broker = "mqtt://127.0.0.1:1883", fleet = "default", state_dir, ca_file, cert_file, key_file;
  double heartbeat_s = 15.0, ack_timeout_s = 5.0, report_grace_s = 30.0;
  size_t chunk_bytes = 1020 * 1024;
  int64_t memory_mb = 2048;
};

const char* kHelp =
    "usage: fedge-native --id ID --data FILE.npz [--broker mqtt://[user:password@]host:port] [--fleet NAME]\n"
    "                    [--state-dir DIR] [--ca-file CA.pem [--cert-file C --key-file K]] [--heartbeat S]\n"
    "                    [--ack-timeout S] [--report-grace S] [--chunk-bytes N] [--memory-mb N] [-v|-q]\n"
    "A fedge device on the ExecuTorch runtime: trains fedge-executorch/2 programs (docs/protocol.md).\n";

double parse_num(const std::string& flag, const std::string& v, double lo) {
  char* end = nullptr;
  double x = std::strtod(v.c_str(), &end);
  if (v.empty() || *end || !(x >= lo) || !std::isfinite(x)) usage_error(flag + " wants a number >= " + std::to_string(lo) + ", got '" + v + "'");
  return x;
}

Options parse_args(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "-h" || a == "--help") {
      std::fputs(kHelp, stdout);
      std::exit(0);
    }
    if (a == "-v") { g_level = 0; continue; }
    if (a == "-q") { g_level = 2; continue; }
    if (i + 1 >= argc) usage_error("missing value for " + a + " (see --help)");
    std::string v = argv[++i];
    if (a == "--id") o.id = v;
    else if (a == "--data") o.data = v;
    else if (a == "--broker") o.broker = v;
    else if (a == "--fleet") o.fleet = v;
    else if (a == "--state-dir") o.state_dir = v;
    else if (a == "--ca-file") o.ca_file = v;
    else if (a == "--cert-file") o.cert_file = v;
    else if (a == "--key-file") o.key_file = v;
    else if (a == "--heartbeat") o.heartbeat_s = parse_num(a, v, 0.01);
    else if (a == "--ack-timeout") o.ack_timeout_s = parse_num(a, v, 0.01);
    else if (a == "--report-grace") o.report_grace_s = parse_num(a, v, 0.0);
    else if (a == "--chunk-bytes") o.chunk_bytes = static_cast<size_t>(parse_num(a, v, 4096));
    else if (a == "--memory-mb") o.memory_mb = static_cast<int64_t>(parse_num(a, v, 0));
    else usage_error("unknown option " + a + " (see --help)");
  }
  if (o.id.empty()) usage_error("--id is required");
  if (!valid_id(o.id)) usage_error("--id '" + o.id + "' is not a valid id (1-128 of A-Z a-z 0-9 _ . : -)");
  if (!valid_id(o.fleet)) usage_error("--fleet '" + o.fleet + "' is not a valid id");
  if (o.data.empty()) usage_error("--data is required (an .npz with x and y)");
  if (o.state_dir.empty()) o.state_dir = "fedge-native-state/" + o.id;
  return o;
}

// What the worker thread hands back to the network thread.
struct Done {
  std::optional<Report> report;
  std::string error;
};

class Device {
 public:
  Device(const Options& o, Dataset data, const BrokerAddress& broker)
      : data_(std::move(data)), store_(o.state_dir + "/programs") {
    AgentConfig cfg;
    cfg.device_id = o.id;
    cfg.fleet = o.fleet;
    cfg.chunk_bytes = o.chunk_bytes;
    cfg.heartbeat_s = o.heartbeat_s;
    cfg.ack_timeout_s = o.ack_timeout_s;
    cfg.report_grace_s = o.report_grace_s;
    cfg.capabilities = {{"runtime", Scalar::of_str("executorch")},
                        {"memory_mb", Scalar::of_int(o.memory_mb)},
                        {"battery", Scalar::of_float(1.0)},
                        {"charging", Scalar::of_bool(true)},
                        {"network", Scalar::of_str("wifi")},
                        {"idle", Scalar::of_bool(true)},
                        // the protocol extensions this device implements (docs/protocol.md 5 and 6.1)
                        {"sampled_upload", Scalar::of_bool(true)},
                        {"coded_downlink", Scalar::of_bool(true)}};
    agent_ = std::make_unique<Agent>(cfg, data_.n, store_.hashes(), log_line);
    LinkEvents ev;
    ev.connected = [this] { run(agent_->connected(wall_now())); };
    ev.disconnected = [this] { run(agent_->disconnected(wall_now())); };
    ev.message = [this](const std::string& t, const Bytes& p) { run(agent_->received(t, p, wall_now())); };
    link_ = std::make_unique<MqttLink>(broker, "dev-" + o.id, agent_->subscriptions(), agent_->topic("status"),
                                       agent_->last_will(), ev);
    link_->log_to(log_line);
  }

  ~Device() {
    if (worker_.joinable()) worker_.join();
  }

  void loop() {
    double next_tick = 0;
    while (!g_stop) {
      link_->poll(50);
      std::optional<Done> done;
      {
        std::lock_guard<std::mutex> lk(mu_);
        done.swap(done_);
      }
      if (done) {
        if (worker_.joinable()) worker_.join();
        run(agent_->training_done(std::move(done->report), wall_now(), done->error));
      }
      double now = wall_now();
      if (now >= next_tick) {  // the device's clock: every 0.2 s, as the Python device
        run(agent_->tick(now));
        next_tick = now + 0.2;
      }
    }
    link_->disconnect();
  }

 private:
  void run(const Actions& actions) {
    for (const auto& a : actions) {
      switch (a.kind) {
        case Action::Publish: link_->publish(a.topic, a.payload, a.retain); break;
        case Action::StoreProgram:
          try {
            store_.put(a.payload);
          } catch (const std::exception& e) {
            log_line(3, e.what());
          }
          break;
        case Action::StartTraining:
          if (worker_.joinable()) worker_.join();
          worker_ = std::thread([this, plan = *a.plan] { train(plan); });
          break;
      }
    }
  }

  // On the worker thread: one plan, start to report. Nothing here may throw out.
  void train(const Plan& plan) {
    Done d;
    try {
      d.report = run_plan(plan);
    } catch (const std::exception& e) {
      d.error = e.what();
    }
    std::lock_guard<std::mutex> lk(mu_);
    done_ = std::move(d);
  }

  Report run_plan(const Plan& plan) {
    if (plan.runtime != "executorch")
      throw PlanError("runtime '" + plan.runtime + "' is not one this device runs (executorch)");
    Trainer& t = trainer_for(plan.program_hash);
    Tensors weights = plan_weights(plan, held_tag_, held_);
    if (!plan.tag.empty()) {  // the model this plan makes: what a later plan's base refers to (section 6.1)
      held_tag_ = plan.tag;
      held_ = weights;
    }
    TrainResult r = train_plan(plan.strategy, plan.hparams, weights, plan.seed, t, data_);
    Report rep;
    rep.task_id = plan.task_id;
    rep.device_id = plan.device_id;
    rep.n = data_.n;
    rep.metrics = r.metrics;
    Tensors base;  // what differences are taken from: the plan's weights, same names
    for (const auto& kv : r.weights) {
      const Tensor* w = find(weights, kv.first);
      if (!w) throw PlanError("trained tensor " + kv.first + " is not in the plan");
      base.emplace_back(kv.first, *w);
    }
    rep.tensors = encode_update(r.weights, base, r.masks, plan.upload, plan.seed);
    return rep;
  }

  Trainer& trainer_for(const std::string& hash) {
    if (!trainer_ || trainer_hash_ != hash) {
      trainer_.reset();  // a device holds one program at a time
      auto t = std::make_unique<Trainer>();
      t->load(store_.get(hash));
      trainer_ = std::move(t);
      trainer_hash_ = hash;
    }
    return *trainer_;
  }

  Dataset data_;
  ProgramStore store_;
  std::unique_ptr<Agent> agent_;
  std::unique_ptr<MqttLink> link_;
  std::thread worker_;
  std::mutex mu_;
  std::optional<Done> done_;
  std::unique_ptr<Trainer> trainer_;
  std::string trainer_hash_;
  std::string held_tag_;  // the coded downlink's held model (in memory: a restarted device holds none)
  Tensors held_;
};

}  // namespace

int main(int argc, char** argv) {
  Options o = parse_args(argc, argv);
  BrokerAddress broker;
  try {
    broker = BrokerAddress::parse(o.broker);
  } catch (const std::invalid_argument& e) {
    usage_error(e.what());
  }
  if (!o.ca_file.empty() && !broker.tls) usage_error("--ca-file needs an mqtts:// broker address, not '" + o.broker + "'");
  if (o.cert_file.empty() != o.key_file.empty()) usage_error("a client certificate needs both --cert-file and --key-file");
  for (const auto* f : {&o.ca_file, &o.cert_file, &o.key_file}) {
    struct stat st;
    if (!f->empty() && stat(f->c_str(), &st) != 0) usage_error(*f + ": no such file");
  }
  broker.ca_file = o.ca_file;
  broker.cert_file = o.cert_file;
  broker.key_file = o.key_file;
  Dataset data;
  try {
    data = load_npz(o.data);
  } catch (const std::exception& e) {
    usage_error(e.what());
  }
  std::signal(SIGINT, [](int) { g_stop = true; });
  std::signal(SIGTERM, [](int) { g_stop = true; });
  const int64_t d_samples = data.n;
  try {
    Device d(o, std::move(data), broker);
    log_line(1, o.id + ": " + std::to_string(d_samples) + " samples; broker " + broker.host + ":" + std::to_string(broker.port));
    d.loop();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fedge-native: %s\n", e.what());
    return 1;
  }
  return 0;
}
