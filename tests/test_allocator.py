"""edge/runtime/allocator.py: large message buffers are reused, not mapped afresh (counted in page faults,
which the kernel counts exactly; no timing)."""
from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                                reason="the thresholds are glibc's")

# What paho does with an 800 KB message on its network thread: socket reads appended to a packet, then
# the payload copied out. Prints whether the thresholds were set, then the page faults of the second pass.
WORKLOAD = """
import resource, sys, threading
sys.path.insert(0, {root!r})
{setup}
def work():
    for _ in range(50):
        packet = bytearray()
        while len(packet) < 800 * 1024:
            packet += b"\\x01" * (64 * 1024)
        payload = bytes(packet[5:])
        del packet, payload
def run():
    t = threading.Thread(target=work)
    t.start()
    t.join()
run()
f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
run()
print(tuned, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
"""
TUNE = "from edge.runtime.allocator import keep_large_buffers\ntuned = keep_large_buffers()"
VIA_LINK = """from edge.runtime import allocator
from edge.runtime.mqtt import BrokerAddress, MqttLink
MqttLink(BrokerAddress(), "t", None, subscriptions=[])
tuned = allocator._done"""


def _run(setup: str, **env: str) -> tuple[bool, int]:
    e = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "FEDGE_MALLOC_TUNE"}
    r = subprocess.run([sys.executable, "-c", WORKLOAD.format(root=str(ROOT), setup=setup)], env=e | env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    tuned, faults = r.stdout.split()
    return tuned == "True", int(faults)


def test_thresholds_keep_message_buffers_mapped():
    """Without the thresholds each 800 KB pass maps fresh pages (over 100 faults a message: a page per 8 KB);
    with them, the second pass reuses the first one's memory."""
    untuned, f_default = _run("tuned = False")
    tuned, f_tuned = _run(TUNE)
    assert not untuned and tuned
    assert f_default > 50 * 100, f_default
    assert f_tuned < 200 and f_tuned * 20 < f_default, (f_tuned, f_default)


def test_every_mqtt_link_sets_them():
    """The coordinator and the devices get them by making their MQTT link, whatever their entry point."""
    tuned, faults = _run(VIA_LINK)
    assert tuned and faults < 200


@pytest.mark.parametrize("env", [{"FEDGE_MALLOC_TUNE": "0"}, {"MALLOC_MMAP_THRESHOLD_": "1048576"},
                                 {"MALLOC_TRIM_THRESHOLD_": "1048576"}])
def test_a_person_s_settings_win(env):
    tuned, _ = _run(TUNE, **env)
    assert not tuned
