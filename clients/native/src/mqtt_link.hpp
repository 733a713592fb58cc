// The thin MQTT adapter (libmosquitto, MQTT 3.1.1): one connection with a persistent session, a retained
// last will, QoS 1 everywhere, re-subscription on every connection, and reconnection with exponential
// backoff and full jitter (docs/protocol.md section 1). Single-threaded: callbacks run inside poll().
#pragma once

#include <functional>
#include <random>
#include <string>
#include <vector>

#include "messages.hpp"

struct mosquitto;
struct mosquitto_message;

namespace fedge {

struct BrokerAddress {
  std::string host = "127.0.0.1";
  int port = 1883;
  std::string user, password;
  bool tls = false;
  std::string ca_file, cert_file, key_file;
  // mqtt://[user[:password]@]host[:port] or mqtts://...; std::invalid_argument saying what is wrong.
  static BrokerAddress parse(const std::string& url);
};

struct LinkEvents {
  std::function<void()> connected;
  std::function<void()> disconnected;
  std::function<void(const std::string& topic, const Bytes& payload)> message;
};

class MqttLink {
 public:
  MqttLink(const BrokerAddress& broker, const std::string& client_id, std::vector<std::string> subscriptions,
           const std::string& will_topic, const Bytes& will_payload, LinkEvents events, int keepalive_s = 30);
  ~MqttLink();
  MqttLink(const MqttLink&) = delete;
  MqttLink& operator=(const MqttLink&) = delete;

  // Runs the network for up to timeout_ms: reads, writes, keep-alive, and reconnects when the backoff
  // allows. Never throws for network trouble.
  void poll(int timeout_ms);
  bool publish(const std::string& topic, const Bytes& payload, bool retain);
  bool is_connected() const { return connected_; }
  void disconnect();
  void log_to(std::function<void(int, const std::string&)> log) { log_ = std::move(log); }

 private:
  static void on_connect(struct mosquitto*, void* self, int rc);
  static void on_disconnect(struct mosquitto*, void* self, int rc);
  static void on_message(struct mosquitto*, void* self, const struct mosquitto_message* m);
  void lost(const std::string& why);
  void try_connect();

  BrokerAddress broker_;
  std::vector<std::string> subs_;
  LinkEvents ev_;
  int keepalive_;
  struct mosquitto* m_ = nullptr;
  bool connected_ = false, ever_ = false, socket_ = false;
  int failures_ = 0;
  double next_try_ = 0.0;
  std::mt19937_64 rng_;
  std::function<void(int, const std::string&)> log_;
};

double wall_now();  // Unix seconds

}  // namespace fedge
