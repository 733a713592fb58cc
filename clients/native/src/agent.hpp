// The device's sans-I/O core (docs/protocol.md section 9; the Python twin is edge/protocol/agent.py): fed
// events (connected, disconnected, tick, a message, training done), it returns what to do. It never touches
// a socket, a clock or a thread, so every protocol decision is testable without a broker.
//
// States: offline -> idle (checked in, waiting for a plan) -> training -> reporting (report sent, waiting for
// its ack, resending with backoff) -> idle. Network input never throws: what does not decode, or what the
// state cannot use, is logged and dropped.
#pragma once

#include <deque>
#include <functional>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "chunks.hpp"
#include "messages.hpp"

namespace fedge {

struct AgentConfig {
  std::string device_id;
  std::string fleet = "default";
  Scalars capabilities;
  size_t chunk_bytes = 1020 * 1024;  // fits a 1 MiB MQTT packet with its framing (docs/protocol.md section 8)
  size_t max_message_bytes = 64u << 20;
  double ack_timeout_s = 5.0;    // first resend after this; then doubling, capped at 2^5 times it
  double report_grace_s = 30.0;  // keep resending this long past the plan's deadline, then give up
  double heartbeat_s = 15.0;     // an idle device checks in again this often
  double max_pace_s = 3600.0;    // a pace message cannot hold the next heartbeat back longer
};

// What the adapter carries out.
struct Action {
  enum Kind { Publish, StoreProgram, StartTraining } kind = Publish;
  std::string topic;  // Publish
  Bytes payload;      // Publish; StoreProgram: the program
  bool retain = false;
  std::optional<Plan> plan;  // StartTraining
};
using Actions = std::vector<Action>;

enum class State { Offline, Idle, Training, Reporting };
const char* state_name(State s);

// Thrown for an adapter event the device's own code cannot produce in this state (a bug, not input).
struct IllegalEvent : std::logic_error {
  using std::logic_error::logic_error;
};

class Agent {
 public:
  using Logger = std::function<void(int level, const std::string&)>;  // 0 debug, 1 info, 2 warning, 3 error
  Agent(AgentConfig cfg, int64_t n_samples, std::set<std::string> programs, Logger log = nullptr);

  std::string topic(const std::string& kind) const;
  std::vector<std::string> subscriptions() const;  // plan, ack, pace of this device
  Bytes last_will() const;                         // retained `offline` status, ts 0

  Actions connected(double now);
  Actions disconnected(double now);
  Actions tick(double now);
  Actions update_capabilities(const Scalars& caps);
  // The worker finished the current plan: a report, or nullopt with the error (then the device checks in).
  Actions training_done(std::optional<Report> report, double now, const std::string& error = "");
  Actions received(const std::string& topic, const Bytes& payload, double now);

  State state() const { return state_; }
  const std::optional<Plan>& task() const { return task_; }
  uint64_t bytes_sent() const { return bytes_sent_; }
  uint64_t bytes_received() const { return bytes_received_; }

 private:
  Actions pub(const std::string& kind, const Message& m, bool retain = false);
  Actions checkin(std::optional<double> now);
  Actions status(const char* state, double now);
  Actions on_plan(const Plan& p, double now);
  Actions on_ack(const Ack& a, double now);
  Actions on_pace(const Pace& p, double now);
  Actions send_report(double now);
  Actions finish(double now);
  bool new_plan(const Plan& p);
  void log(int level, const std::string& s) const;

  AgentConfig cfg_;
  int64_t n_;
  std::set<std::string> programs_;
  Logger log_;
  State state_ = State::Offline;
  std::optional<Plan> task_;
  std::vector<Bytes> report_msgs_;
  double retry_at_ = 0, give_up_at_ = 0, next_checkin_ = 0;
  int retry_n_ = 0;
  std::string last_task_;
  std::deque<std::string> done_tasks_;  // the last 64, so a redelivered plan is not trained twice
  Reassembler plans_, acks_;
  uint64_t bytes_sent_ = 0, bytes_received_ = 0;
};

}  // namespace fedge
