#include "agent.hpp"

#include <algorithm>
#include <cmath>

#include "sha256.hpp"
#include "wire.hpp"

namespace fedge {

const char* state_name(State s) {
  switch (s) {
    case State::Offline: return "offline";
    case State::Idle: return "idle";
    case State::Training: return "training";
    case State::Reporting: return "reporting";
  }
  return "?";
}

Agent::Agent(AgentConfig cfg, int64_t n_samples, std::set<std::string> programs, Logger log)
    : cfg_(std::move(cfg)), n_(n_samples), programs_(std::move(programs)), log_(std::move(log)),
      plans_(cfg_.max_message_bytes), acks_(cfg_.max_message_bytes) {
  if (!valid_id(cfg_.device_id)) throw std::invalid_argument("device id '" + cfg_.device_id + "' is not valid in a topic");
  if (!valid_id(cfg_.fleet)) throw std::invalid_argument("fleet '" + cfg_.fleet + "' is not valid in a topic");
}

void Agent::log(int level, const std::string& s) const {
  if (log_) log_(level, cfg_.device_id + ": " + s);
}

std::string Agent::topic(const std::string& kind) const {
  return "fedge/v1/" + cfg_.fleet + "/" + kind + "/" + cfg_.device_id;
}

std::vector<std::string> Agent::subscriptions() const { return {topic("plan"), topic("ack"), topic("pace")}; }

Bytes Agent::last_will() const { return encode(Status{cfg_.device_id, "offline", 0.0}); }

Actions Agent::pub(const std::string& kind, const Message& m, bool retain) {
  Bytes payload = encode(m);
  // a chunked message's id names its content, so a receiver can tell a resend from a new message
  std::string id = kind + "-" + sha256_hex(payload).substr(0, 16);
  Actions out;
  for (auto& part : split(payload, id, cfg_.chunk_bytes)) {
    bytes_sent_ += part.size();
    out.push_back(Action{Action::Publish, topic(kind), std::move(part), retain, std::nullopt});
  }
  return out;
}

Actions Agent::status(const char* state, double now) {
  return pub("status", Status{cfg_.device_id, state, now}, true);
}

Actions Agent::checkin(std::optional<double> now) {
  if (now) next_checkin_ = *now + cfg_.heartbeat_s;
  CheckIn c;
  c.device_id = cfg_.device_id;
  c.caps = cfg_.capabilities;
  c.programs.assign(programs_.begin(), programs_.end());  // std::set: sorted, as the Python device sends them
  c.n = n_;
  c.last = last_task_;
  return pub("checkin", c);
}

static void append(Actions& a, Actions b) {
  for (auto& x : b) a.push_back(std::move(x));
}

// ---- adapter events

Actions Agent::connected(double now) {
  // Every connection says `online` (retained). Only an offline or idle device checks in: a training device
  // checks in when its plan ends, and a reporting one resends its report at the next tick, since the old
  // connection may have lost it (docs/protocol.md 9.1).
  Actions out = status("online", now);
  switch (state_) {
    case State::Offline:
    case State::Idle:
      append(out, checkin(now));
      state_ = State::Idle;
      break;
    case State::Training: break;
    case State::Reporting: retry_at_ = now; break;
  }
  return out;
}

Actions Agent::disconnected(double) {
  if (state_ == State::Idle) state_ = State::Offline;
  return {};
}

Actions Agent::tick(double now) {
  plans_.expire(now);
  acks_.expire(now);
  if (state_ == State::Idle) return now >= next_checkin_ ? checkin(now) : Actions{};
  if (state_ == State::Reporting) {
    if (now < retry_at_) return {};
    if (now >= give_up_at_) {
      log(2, "no ack for " + task_->task_id + "; giving up");
      return finish(now);
    }
    return send_report(now);
  }
  return {};
}

Actions Agent::update_capabilities(const Scalars& caps) {
  for (const auto& kv : caps) {
    auto it = std::find_if(cfg_.capabilities.begin(), cfg_.capabilities.end(),
                           [&](const auto& c) { return c.first == kv.first; });
    if (it == cfg_.capabilities.end())
      cfg_.capabilities.push_back(kv);
    else
      it->second = kv.second;
  }
  return state_ == State::Idle ? checkin(std::nullopt) : Actions{};
}

Actions Agent::training_done(std::optional<Report> report, double now, const std::string& error) {
  if (state_ != State::Training) throw IllegalEvent(std::string("training_done in state ") + state_name(state_));
  if (!report) {
    log(3, "training for " + task_->task_id + " failed: " + error);
    return finish(now);
  }
  Bytes payload = encode(*report);
  report_msgs_ = split(payload, "r-" + task_->task_id, cfg_.chunk_bytes);
  state_ = State::Reporting;
  retry_n_ = 0;
  give_up_at_ = task_->deadline + cfg_.report_grace_s;
  return send_report(now);
}

// ---- network input

static std::string topic_kind(const std::string& topic, const std::string& prefix, const std::string& device) {
  // fedge/v1/<fleet>/<kind>/<device>, exactly five levels
  if (topic.compare(0, prefix.size(), prefix) != 0) return "";
  std::string rest = topic.substr(prefix.size());
  auto slash = rest.find('/');
  if (slash == std::string::npos || rest.substr(slash + 1) != device) return "";
  return rest.substr(0, slash);
}

Actions Agent::received(const std::string& t, const Bytes& payload, double now) {
  bytes_received_ += payload.size();
  Message m;
  std::string kind;
  try {
    kind = topic_kind(t, "fedge/v1/" + cfg_.fleet + "/", cfg_.device_id);
    if (kind != "plan" && kind != "ack" && kind != "pace") throw WireError("not a topic this device reads: " + t);
    m = decode(payload, cfg_.max_message_bytes);
    if (auto* c = std::get_if<Chunk>(&m)) {
      if (kind == "pace") throw WireError("a chunk on the pace topic");
      auto whole = (kind == "plan" ? plans_ : acks_).add(*c, now);
      if (!whole) return {};
      m = decode(*whole, cfg_.max_message_bytes);
      if (std::holds_alternative<Chunk>(m)) throw WireError("a chunked transfer whose payload is itself a chunk");
    }
    if (kind != kind_of(m)) throw WireError(std::string("a ") + kind_of(m) + " on the " + kind + " topic");
  } catch (const WireError& e) {
    log(3, "dropped message on " + t + ": " + e.what());
    return {};
  }
  if (auto* p = std::get_if<Plan>(&m)) return on_plan(*p, now);
  if (auto* a = std::get_if<Ack>(&m)) return on_ack(*a, now);
  return on_pace(std::get<Pace>(m), now);
}

bool Agent::new_plan(const Plan& p) {
  if (p.device_id != cfg_.device_id) {
    log(3, "dropped plan addressed to " + p.device_id);
    return false;
  }
  if (std::find(done_tasks_.begin(), done_tasks_.end(), p.task_id) != done_tasks_.end() ||
      (task_ && task_->task_id == p.task_id)) {
    log(1, "plan " + p.task_id + " delivered again; ignored");
    return false;
  }
  last_task_ = p.task_id;  // from here on the plan is either trained or refused
  return true;
}

Actions Agent::on_plan(const Plan& p, double now) {
  if (state_ == State::Training || state_ == State::Reporting) {
    if (new_plan(p)) log(2, "plan " + p.task_id + " arrived while busy with " + task_->task_id + "; ignored");
    return {};
  }
  if (!new_plan(p)) return {};
  if (p.deadline <= now) {
    log(2, "plan " + p.task_id + " arrived after its deadline; ignored");
    return {};
  }
  Actions out;
  if (p.program) {
    if (sha256_hex(*p.program) != p.program_hash) {
      log(3, "program in plan " + p.task_id + " does not match its hash; ignored");
      return {};
    }
    programs_.insert(p.program_hash);
    out.push_back(Action{Action::StoreProgram, "", *p.program, false, std::nullopt});
  } else if (!programs_.count(p.program_hash)) {
    log(3, "plan " + p.task_id + " needs program " + p.program_hash.substr(0, 12) + " which this device lacks");
    return checkin(std::nullopt);
  }
  state_ = State::Training;
  task_ = p;
  task_->program.reset();  // stored; the worker reads it from the store
  append(out, status("training", now));
  out.push_back(Action{Action::StartTraining, "", {}, false, task_});
  return out;
}

Actions Agent::on_ack(const Ack& a, double now) {
  if (state_ != State::Reporting || a.task_id != task_->task_id) {
    log(0, "stale ack for " + a.task_id);
    return {};
  }
  bool fine = a.status == "accepted" || a.status == "duplicate" || a.status == "late";
  log(fine ? 1 : 2, "report " + a.task_id + " " + a.status + (a.reason.empty() ? "" : " " + a.reason));
  return finish(now);
}

Actions Agent::on_pace(const Pace& p, double now) {
  if (p.device_id != cfg_.device_id) {
    log(3, "dropped pace addressed to " + p.device_id);
    return {};
  }
  next_checkin_ = now + std::min(p.after, cfg_.max_pace_s);
  return {};
}

Actions Agent::send_report(double now) {
  retry_at_ = now + cfg_.ack_timeout_s * std::pow(2.0, std::min(retry_n_, 5));
  ++retry_n_;
  Actions out;
  for (const auto& part : report_msgs_) {
    bytes_sent_ += part.size();
    out.push_back(Action{Action::Publish, topic("report"), part, false, std::nullopt});
  }
  return out;
}

Actions Agent::finish(double now) {
  if (task_) {
    done_tasks_.push_back(task_->task_id);
    if (done_tasks_.size() > 64) done_tasks_.pop_front();
  }
  task_.reset();
  report_msgs_.clear();
  state_ = State::Idle;
  Actions out = status("idle", now);
  append(out, checkin(now));
  return out;
}

}  // namespace fedge
