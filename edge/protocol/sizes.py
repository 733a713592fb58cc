"""Sizes every fedge client agrees on by default, in a module that imports nothing (the CLI reads them to
build its parser, before any command needs numpy)."""

# A payload longer than this is sent as chunks (section 8 of docs/protocol.md). 1020 KiB plus a chunk's framing
# (under 1 KiB: msgpack keys, an id, a topic of at most two 128-character levels) fits a 1 MiB MQTT packet, EMQX's
# default max_packet_size. Every message costs paho, the broker and the receiver a fixed share: a 200k-parameter
# model's plan and report went as 4 chunks each at 256 KiB, and as 1 message each at this size took 9-18% less
# CPU per round of the 50-device FedAvg fleet (benchmarks/round_overhead.py, docs/operations.md).
DEFAULT_CHUNK_BYTES = 1020 * 1024
