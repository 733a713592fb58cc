#include "mqtt_link.hpp"

#include <mosquitto.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <stdexcept>
#include <thread>

namespace fedge {

namespace {
constexpr double kBackoffBase = 0.2, kBackoffCap = 30.0;  // seconds, as the Python device (docs/protocol.md 1)

struct LibInit {
  LibInit() { mosquitto_lib_init(); }
  ~LibInit() { mosquitto_lib_cleanup(); }
};
}  // namespace

double wall_now() {
  using namespace std::chrono;
  return duration<double>(system_clock::now().time_since_epoch()).count();
}

BrokerAddress BrokerAddress::parse(const std::string& url) {
  BrokerAddress b;
  std::string rest = url;
  auto scheme_end = url.find("://");
  std::string scheme = "mqtt";
  if (scheme_end != std::string::npos) {
    scheme = url.substr(0, scheme_end);
    rest = url.substr(scheme_end + 3);
  }
  if (scheme == "mqtts" || scheme == "ssl")
    b.tls = true;
  else if (scheme != "mqtt" && scheme != "tcp")
    throw std::invalid_argument("unsupported broker scheme '" + scheme + "' in '" + url +
                                "' (use mqtt://host:port or mqtts://host:port)");
  if (!rest.empty() && rest.back() == '/') rest.pop_back();
  if (rest.find('/') != std::string::npos) throw std::invalid_argument("a broker address has no path: '" + url + "'");
  auto at = rest.rfind('@');
  if (at != std::string::npos) {
    std::string cred = rest.substr(0, at);
    rest = rest.substr(at + 1);
    auto colon = cred.find(':');
    b.user = cred.substr(0, colon);
    if (colon != std::string::npos) b.password = cred.substr(colon + 1);
  }
  b.port = b.tls ? 8883 : 1883;
  auto colon = rest.rfind(':');
  std::string host = rest;
  if (colon != std::string::npos) {
    host = rest.substr(0, colon);
    std::string port = rest.substr(colon + 1);
    char* end = nullptr;
    long p = std::strtol(port.c_str(), &end, 10);
    if (port.empty() || *end || p < 1 || p > 65535) throw std::invalid_argument("bad port in broker address '" + url + "'");
    b.port = static_cast<int>(p);
  }
  if (host.empty()) throw std::invalid_argument("no host in broker address '" + url + "'");
  b.host = host;
  return b;
}

MqttLink::MqttLink(const BrokerAddress& broker, const std::string& client_id, std::vector<std::string> subscriptions,
                   const std::string& will_topic, const Bytes& will_payload, LinkEvents events, int keepalive_s)
    : broker_(broker), subs_(std::move(subscriptions)), ev_(std::move(events)), keepalive_(keepalive_s),
      rng_(std::random_device{}()) {
  static LibInit init;
  // a persistent session (clean_session = false) with a stable id: plans and acks sent while the device was
  // away are delivered when it returns
  m_ = mosquitto_new(client_id.c_str(), false, this);
  if (!m_) throw std::runtime_error("mosquitto_new failed");
  mosquitto_int_option(m_, MOSQ_OPT_PROTOCOL_VERSION, MQTT_PROTOCOL_V311);
  // Nagle off: an ack or a check-in after a large report would wait for a delayed ACK, up to 40 ms
  mosquitto_int_option(m_, MOSQ_OPT_TCP_NODELAY, 1);
  mosquitto_will_set(m_, will_topic.c_str(), static_cast<int>(will_payload.size()), will_payload.data(), 1, true);
  if (!broker_.user.empty())
    mosquitto_username_pw_set(m_, broker_.user.c_str(), broker_.password.empty() ? nullptr : broker_.password.c_str());
  if (broker_.tls) {
    int rc = mosquitto_tls_set(m_, broker_.ca_file.empty() ? nullptr : broker_.ca_file.c_str(), nullptr,
                               broker_.cert_file.empty() ? nullptr : broker_.cert_file.c_str(),
                               broker_.key_file.empty() ? nullptr : broker_.key_file.c_str(), nullptr);
    if (rc != MOSQ_ERR_SUCCESS) throw std::runtime_error(std::string("TLS setup: ") + mosquitto_strerror(rc));
    mosquitto_tls_opts_set(m_, 1, nullptr, nullptr);  // verify the broker's certificate
  }
  mosquitto_connect_callback_set(m_, &MqttLink::on_connect);
  mosquitto_disconnect_callback_set(m_, &MqttLink::on_disconnect);
  mosquitto_message_callback_set(m_, &MqttLink::on_message);
}

MqttLink::~MqttLink() {
  if (m_) mosquitto_destroy(m_);
}

void MqttLink::on_connect(struct mosquitto* m, void* self, int rc) {
  auto* l = static_cast<MqttLink*>(self);
  if (rc != 0) {
    l->lost(std::string("broker refused the connection: ") + mosquitto_connack_string(rc));
    return;
  }
  l->connected_ = true;
  l->failures_ = 0;
  // re-subscribe on every connection: a broker may have lost the session
  for (const auto& t : l->subs_) mosquitto_subscribe(m, nullptr, t.c_str(), 1);
  if (l->log_) l->log_(1, "connected to " + l->broker_.host + ":" + std::to_string(l->broker_.port));
  if (l->ev_.connected) l->ev_.connected();
}

void MqttLink::on_disconnect(struct mosquitto*, void* self, int rc) {
  static_cast<MqttLink*>(self)->lost(rc == 0 ? "disconnected" : std::string("connection lost: ") + mosquitto_strerror(rc));
}

void MqttLink::on_message(struct mosquitto*, void* self, const struct mosquitto_message* msg) {
  auto* l = static_cast<MqttLink*>(self);
  const auto* p = static_cast<const uint8_t*>(msg->payload);
  Bytes payload(p, p + msg->payloadlen);
  if (l->ev_.message) l->ev_.message(msg->topic, payload);
}

void MqttLink::lost(const std::string& why) {
  bool was = connected_;
  connected_ = false;
  socket_ = false;
  ++failures_;
  // exponential backoff with full jitter: uniform in [0, min(cap, base * 2^n))
  double span = std::min(kBackoffCap, kBackoffBase * std::pow(2.0, std::min(failures_ - 1, 30)));
  next_try_ = wall_now() + std::uniform_real_distribution<double>(0.0, span)(rng_);
  if (log_ && (was || failures_ == 1)) log_(2, why + "; reconnecting");
  if (was && ev_.disconnected) ev_.disconnected();
}

void MqttLink::try_connect() {
  int rc = ever_ ? mosquitto_reconnect(m_) : mosquitto_connect(m_, broker_.host.c_str(), broker_.port, keepalive_);
  if (rc == MOSQ_ERR_SUCCESS) {
    ever_ = true;
    socket_ = true;  // CONNACK comes through poll -> on_connect
  } else {
    lost(std::string("cannot reach the broker: ") + mosquitto_strerror(rc));
  }
}

void MqttLink::poll(int timeout_ms) {
  if (!socket_) {
    if (wall_now() >= next_try_) try_connect();
    if (!socket_) {
      std::this_thread::sleep_for(std::chrono::milliseconds(timeout_ms));
      return;
    }
  }
  int rc = mosquitto_loop(m_, timeout_ms, 1);
  if (rc != MOSQ_ERR_SUCCESS && socket_) lost(std::string("connection lost: ") + mosquitto_strerror(rc));
}

bool MqttLink::publish(const std::string& topic, const Bytes& payload, bool retain) {
  int rc = mosquitto_publish(m_, nullptr, topic.c_str(), static_cast<int>(payload.size()), payload.data(), 1, retain);
  if (rc != MOSQ_ERR_SUCCESS && log_) log_(2, "publish on " + topic + ": " + mosquitto_strerror(rc));
  return rc == MOSQ_ERR_SUCCESS;
}

void MqttLink::disconnect() {
  if (socket_) mosquitto_disconnect(m_);
  socket_ = connected_ = false;
}

}  // namespace fedge
