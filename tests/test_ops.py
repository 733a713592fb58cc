"""Operations without a broker: the Prometheus exposition (parsed by the official parser), the status JSON and
page, `fedge status` on a state file, the `[metrics]` config, the per-round line."""
from __future__ import annotations

import json
import time
import types
import urllib.error
import urllib.request

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from coordinator.cli import main, round_line
from coordinator.config import load_fleet
from coordinator.metrics import REASON_KIND_NAMES, FleetMetrics, reason_kind
from coordinator.registry import Eligibility, Registry
from coordinator.status import from_state, render
from coordinator.store import Store
from coordinator.strategies.fedavg import FedAvg
from coordinator.web import StatusServer, page_html
from edge.model import mlp
from edge.protocol import wire
from edge.runtime.config import ConfigError

CAPS = {"runtime": "torch", "charging": True, "network": "wifi", "idle": True, "memory_mb": 1024}


def samples(text: str) -> dict[tuple, float]:
    """Every sample of an exposition, parsed by prometheus_client: {(name, sorted labels): value}."""
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def ack(status: str, dev: str = "d1") -> bytes:
    return wire.encode(wire.Ack("run-r1a1", dev, status, ""))


def summary(rnd: int, acc: float, down: int, up: int, **kw) -> dict:
    return {"round": rnd, "task_id": f"run-r{rnd}a1", "attempts": 1, "reports": 3, "selected": 4, "dropped": 1,
            "accepted": ["d1", "d2", "d3"], "bytes_down": down, "bytes_up": up, "wall_s": 1.5, "accuracy": acc,
            "loss": 1.0 - acc} | kw


def fed(clock) -> FleetMetrics:
    """A FleetMetrics fed what a daemon would tell it over two rounds (one retried), with a registry."""
    m = FleetMetrics(clock=clock)
    reg = Registry()
    for i in range(5):
        reg.checkin(f"d{i}", CAPS | ({"charging": False} if i == 4 else {}), [], 10, clock())
    reg.devices["d3"].online = False
    reg.devices["d2"].available = False
    for _ in range(3):
        reg.reject("d1", clock(), "report: r1a1: update norm 9e+09 is above the bound 12.5")
    m.registry, m.rules = reg, Eligibility()
    m.info |= {"fleet": "f", "run_id": "run", "strategy": "fedavg", "rounds_target": 5, "clients_per_round": 3}
    t = clock()
    m.persisted("open", {"round": 1, "attempt": 1, "task_id": "run-r1a1", "selected": ["d0", "d1", "d2", "d3"],
                         "deadline": t + 60, "opened_at": t})
    for d in ("d0", "d1", "d2"):
        m.message(f"fedge/v1/f/report/{d}", 1000, t)
        m.persisted("report", {"task_id": "run-r1a1", "device_id": d, "payload": b"x" * 1000, "n": 10})
        m.published(f"fedge/v1/f/ack/{d}", ack("accepted", d))
    m.message("fedge/v1/f/report/d3", 1000, t)
    m.published("fedge/v1/f/ack/d3", ack("late", "d3"))
    m.message("fedge/v1/f/checkin/d4", 200, t)
    m.message("fedge/v1/f/weird/d4", 7, t)
    m.published("fedge/v1/f/plan/d0", b"p" * 5000)
    m.persisted("rejection", {"device_id": "d1", "what": "report", "reason": "run-r1a1: update norm 9e+09 is above "
                              "the bound 12.5", "ts": t, "strike": True, "quarantined_until": t + 300,
                              "quarantines": 1})
    m.persisted("rejection", {"device_id": "zz", "what": "report", "reason": "unknown task old-r9a1", "ts": t,
                              "strike": False, "quarantined_until": 0.0, "quarantines": 0})
    m.published("fedge/v1/f/ack/zz", ack("rejected", "zz"))
    m.stage("receive", 0.002, 0.001)
    m.stage("receive", 0.004, 0.003)
    m.stage("evaluate", 0.5, 0.4)
    clock.t += 2.0
    m.committed(summary(1, 0.5, 5000, 3000))
    t = clock()
    m.persisted("open", {"round": 2, "attempt": 1, "task_id": "run-r2a1", "selected": ["d0"], "deadline": t + 60,
                         "opened_at": t})
    clock.t += 60.0
    m.persisted("abandon", {"round": 2, "attempt": 1, "task_id": "run-r2a1"})
    t = clock()
    m.persisted("open", {"round": 2, "attempt": 2, "task_id": "run-r2a2", "selected": ["d0", "d1"],
                         "deadline": t + 60, "opened_at": t})
    clock.t += 3.0
    m.committed(summary(2, 0.7, 4000, 2000, attempts=2, density=0.5, task_id="run-r2a2"))
    return m


class Clock:
    def __init__(self):
        self.t = 1_000_000.0

    def __call__(self):
        return self.t


def test_exposition_parses_with_the_prometheus_parser_and_counts_what_the_daemon_told_it():
    clock = Clock()
    m = fed(clock)
    text = m.exposition()
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    s = samples(text)
    assert fams["fedge_rounds_committed"].type == "counter"
    assert fams["fedge_round_duration_seconds"].type == "histogram"
    assert fams["fedge_devices"].type == "gauge"
    assert s[("fedge_rounds_committed_total", ())] == 2
    assert s[("fedge_rounds_abandoned_total", ())] == 1
    assert s[("fedge_round", ())] == 2 and s[("fedge_rounds_target", ())] == 5
    assert s[("fedge_accuracy", ())] == 0.7
    assert s[("fedge_reports_accepted_total", ())] == 3
    assert s[("fedge_reports_plain_path_total", ())] == 0  # no coordinator attached: none counted
    m.coord = types.SimpleNamespace(machine=types.SimpleNamespace(plain_reports=2))  # read off the machine
    assert samples(m.exposition())[("fedge_reports_plain_path_total", ())] == 2
    assert s[("fedge_report_acks_total", (("status", "accepted"),))] == 3
    assert s[("fedge_report_acks_total", (("status", "late"),))] == 1
    assert s[("fedge_report_acks_total", (("status", "rejected"),))] == 1
    assert s[("fedge_report_acks_total", (("status", "duplicate"),))] == 0
    assert s[("fedge_rejections_total", (("kind", "norm_bound"), ("what", "report")))] == 1
    assert s[("fedge_rejections_total", (("kind", "unknown_task"), ("what", "report")))] == 1
    assert s[("fedge_strikes_total", ())] == 1 and s[("fedge_quarantines_total", ())] == 1
    assert s[("fedge_received_bytes_total", (("kind", "report"),))] == 4000
    assert s[("fedge_received_bytes_total", (("kind", "checkin"),))] == 200
    assert s[("fedge_received_messages_total", (("kind", "other"),))] == 1
    assert s[("fedge_sent_bytes_total", (("kind", "plan"),))] == 5000
    assert s[("fedge_sent_messages_total", (("kind", "ack"),))] == 5
    assert s[("fedge_round_bytes_total", (("direction", "down"),))] == 9000
    assert s[("fedge_round_bytes_total", (("direction", "up"),))] == 5000
    # devices: d0..d4 registered, d3 offline, d2 busy, d1 quarantined, d4 not charging
    dev = {dict(k[1])["state"]: v for k, v in s.items() if k[0] == "fedge_devices"}
    assert dev == {"registered": 5, "online": 4, "available": 3, "eligible": 1, "quarantined": 1}
    # round 1: open -> commit 2 s; round 2: first attempt opened 63 s before its commit
    assert s[("fedge_round_duration_seconds_count", ())] == 2
    assert s[("fedge_round_duration_seconds_sum", ())] == pytest.approx(65.0)
    assert s[("fedge_round_duration_seconds_bucket", (("le", "2.5"),))] == 1
    assert s[("fedge_round_duration_seconds_bucket", (("le", "60.0"),))] == 1
    assert s[("fedge_round_duration_seconds_bucket", (("le", "120.0"),))] == 2
    assert s[("fedge_round_attempt_duration_seconds_count", (("outcome", "abandoned"),))] == 1
    assert s[("fedge_round_attempt_duration_seconds_sum", (("outcome", "abandoned"),))] == pytest.approx(60.0)
    assert s[("fedge_round_attempt_duration_seconds_sum", (("outcome", "committed"),))] == pytest.approx(5.0)
    assert s[("fedge_stage_seconds_total", (("stage", "receive"),))] == pytest.approx(0.006)
    assert s[("fedge_stage_cpu_seconds_total", (("stage", "evaluate"),))] == pytest.approx(0.4)
    assert s[("fedge_stage_duration_seconds_count", (("stage", "receive"),))] == 2
    assert s[("fedge_stage_duration_seconds_bucket", (("le", "0.005"), ("stage", "receive")))] == 2
    assert s[("fedge_stage_duration_seconds_bucket", (("le", "0.001"), ("stage", "receive")))] == 0
    assert s[("fedge_persisted_records_total", (("what", "report"),))] == 3
    assert s[("fedge_info", (("fleet", "f"), ("run_id", "run"), ("strategy", "fedavg")))] == 1
    assert s[("process_cpu_seconds_total", ())] > 0


def test_ingest_rate_is_reports_per_second_over_the_last_ten_seconds():
    clock = Clock()
    m = FleetMetrics(clock=clock)
    for i in range(50):  # 50 reports within one second, 5 s ago
        clock.t = 1_000_000.0 + i / 100
        m.persisted("report", {"task_id": "t", "device_id": f"d{i}", "payload": b"x" * 100, "n": 1})
    clock.t = 1_000_005.0
    assert m.ingest_rate() == (5.0, 500.0)
    clock.t = 1_000_011.5  # the second they arrived in has left the window
    assert m.ingest_rate() == (0.0, 0.0)


def test_label_values_are_escaped():
    m = FleetMetrics()
    m.info |= {"fleet": 'a"b\\c\nd'}
    fams = {f.name: f for f in text_string_to_metric_families(m.exposition())}
    assert fams["fedge_info"].samples[0].labels["fleet"] == 'a"b\\c\nd'


@pytest.mark.parametrize("reason, kind", [
    ("unknown task 1a2b-r3a1", "unknown_task"),
    ("not selected for 1a2b-r3a1", "not_selected"),
    ("a chunked message from a device with no plan", "no_plan"),
    ("message of 99999999 bytes exceeds the limit of 262144", "too_large"),
    ("chunked message of 5 bytes exceeds this sender's limit of 4", "too_large"),
    ("report: device 'x' wrote on the topic of 'y'", "wrong_topic"),
    ("internal error: KeyError: 'w'", "internal_error"),
    ("sample count 99 differs from the 10 it declared", "sample_count"),
    ("100000000 samples is more than max_samples = 1000000", "sample_count"),
    ("1a2b-r3a1: update norm 1e+09 is above the bound 12.5", "norm_bound"),
    ("r3a1: fc0.w: a value of magnitude above 1e+06", "value_bound"),
    ("capability battery = 'full': expected a number in [0, 1]", "capabilities"),
    ("1a2b-r3a1: fc0.w: shape (3, 4), the plan sent (64, 16)", "not_as_planned"),
    ("malformed msgpack: ExtraData: unpack(b) received extra data.", "malformed"),
    ("report: field 'n_samples' has type str", "malformed"),
])
def test_rejection_reasons_fall_into_a_few_kinds(reason, kind):
    assert reason_kind(reason) == kind
    assert kind in REASON_KIND_NAMES


def test_status_json_has_the_run_its_curve_devices_and_quarantines():
    clock = Clock()
    st = fed(clock).status()
    json.dumps(st)  # serialisable as it is
    assert st["source"] == "live" and st["phase"] == "between rounds"
    assert FleetMetrics().status()["phase"] == "waiting for devices"
    assert (st["round"], st["rounds_target"], st["rounds_committed"]) == (2, 5, 2)
    assert st["bytes"] == {"down": 9000, "up": 5000, "total": 14000}
    assert st["curve"] == [[0.008, 0.5, 1], [0.014, 0.7, 2]]
    assert [r["round"] for r in st["rounds"]] == [1, 2] and st["rounds"][1]["density"] == 0.5
    assert "accepted" not in st["rounds"][0]  # device lists stay out of the page
    assert st["accuracy"] == 0.7 and st["best_accuracy"] == 0.7
    assert st["devices"]["quarantined"] == 1
    assert st["quarantined"][0]["device_id"] == "d1" and "update norm" in st["quarantined"][0]["last_reason"]
    assert st["reports"] == {"accepted": 3, "late": 1, "rejected": 1, "duplicate": 0}
    assert st["rejections"]["by_kind"] == {"norm_bound": 1, "unknown_task": 1}
    assert st["rounds_abandoned"] == 1


def test_the_curve_is_thinned_but_keeps_its_last_point():
    m = FleetMetrics()
    for r in range(1, 2502):
        m.committed(summary(r, r / 3000, 1000, 1000))
    st = m.status(max_points=1000)
    assert len(st["curve"]) <= 1001 and st["curve"][-1][2] == 2501 and st["curve"][0][2] == 1
    assert len(st["rounds"]) == 20 and st["bytes"]["total"] == 2501 * 2000


def test_http_server_serves_metrics_status_and_the_page():
    clock = Clock()
    m = fed(clock)
    # a device's rejection reason is shown on the page: it must not be able to inject markup
    m.registry.reject("d0", clock(), "</script><script>alert(1)</script>")
    for _ in range(2):
        m.registry.reject("d0", clock(), "</script><script>alert(1)</script>")
    with StatusServer(m.exposition, m.status) as srv:
        with urllib.request.urlopen(srv.url + "metrics") as r:
            assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
            assert samples(r.read().decode())[("fedge_round", ())] == 2
        with urllib.request.urlopen(srv.url + "status.json") as r:
            assert r.headers["Content-Type"] == "application/json"
            assert json.loads(r.read())["round"] == 2
        with urllib.request.urlopen(srv.url) as r:
            html = r.read().decode()
            assert r.headers["Content-Type"].startswith("text/html")
            assert "default-src 'none'" in r.headers["Content-Security-Policy"]
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(srv.url + "nothing")
        assert e.value.code == 404
    assert "<svg" in html and "status.json" in html and "http://" not in html.split("<script>")[1].split("const INITIAL")[0]
    assert "<script>alert(1)" not in html and "\\u003c/script>\\u003cscript>alert(1)" in html
    assert "https://" not in html  # nothing fetched from the internet
    inline = html.split("const INITIAL = ", 1)[1].split(";\nconst $", 1)[0]
    assert json.loads(inline)["round"] == 2


def test_page_without_status_is_still_a_page():
    html = page_html(None).decode()
    assert "const INITIAL = null;" in html


def _state_file(tmp_path) -> str:
    """A state file as a coordinator leaves it: devices, two committed rounds, an open round, a quarantine."""
    path = str(tmp_path / "state.sqlite")
    strat = FedAvg(spec=mlp([4, 3]), lr=0.1, epochs=1, batch_size=4)
    st = Store(path)
    st.check_run({"strategy": "fedavg", "fleet": "lab", "seed": 0})
    st.run_id()
    now = time.time()
    for i in range(4):
        st.apply("device", {"device_id": f"d{i}", "caps": CAPS, "programs": [], "n": 10, "available": i != 2})
    st.apply("device_offline", {"device_id": "d3"})
    state = strat.init(0)
    st.save_initial_state(state)
    for r, acc in ((1, 0.41), (2, 0.63)):
        st.apply("open", {"round": r, "attempt": 1, "task_id": f"x-r{r}a1", "selected": ["d0", "d1"],
                          "deadline": now + 60, "opened_at": now - 10})
        state.round = r
        st.apply("commit", {"round": r, "task_id": f"x-r{r}a1", "state": state,
                            "summary": summary(r, acc, 2_000_000, 1_000_000) | {"task_id": f"x-r{r}a1"}})
        st.save_metrics(r, {"accuracy": acc, "loss": 1 - acc})
    st.apply("open", {"round": 3, "attempt": 1, "task_id": "x-r3a1", "selected": ["d0", "d1", "d2"],
                      "deadline": now + 45, "opened_at": now - 5})
    st.apply("report", {"task_id": "x-r3a1", "device_id": "d0", "payload": b"r" * 10, "n": 10})
    st.apply("rejection", {"device_id": "d1", "what": "report", "reason": "x-r2a1: update norm 1e9 is above the "
                           "bound 3\x1b[31m", "ts": now, "strike": True, "quarantined_until": now + 200,
                           "quarantines": 1})
    st.close()
    return path


def test_status_from_a_state_file(tmp_path):
    s = from_state(_state_file(tmp_path))
    json.dumps(s)
    assert s["source"] == "state" and s["coordinator_pid"] is None and s["phase"] == "round open"
    assert (s["fleet"], s["strategy"], s["round"], s["rounds_target"]) == ("lab", "fedavg", 2, None)
    assert s["bytes"]["total"] == 6_000_000 and s["accuracy"] == 0.63
    assert s["open_round"]["round"] == 3 and s["open_round"]["accepted"] == 1 and s["open_round"]["selected"] == 3
    assert s["devices"] == {"registered": 4, "online": 3, "available": 0, "eligible": None, "quarantined": 1}
    assert s["quarantined"][0]["device_id"] == "d1"
    assert s["rejections"] == {"total": 1, "by_kind": {"norm_bound": 1}, "strikes": 1}


def test_fedge_status_prints_progress_last_rounds_devices_and_quarantines(tmp_path, capsys):
    path = _state_file(tmp_path)
    assert main(["status", "--state", path]) == 0
    out = capsys.readouterr().out
    assert "fleet lab, run " in out and "no coordinator running" in out
    assert "round 2 committed; round 3 open (attempt 1): 1 of 3 selected reported" in out
    assert "accuracy 0.6300 (best 0.6300)" in out and "6.00 MB on the wire (4.00 down, 2.00 up)" in out
    assert "devices: 4 registered, 3 online, 0 available, 1 quarantined" in out
    assert "1 rejected messages (norm_bound 1), 1 strikes" in out
    lines = out.splitlines()
    head = next(i for i, ln in enumerate(lines) if ln.split()[:2] == ["round", "accuracy"])
    assert [ln.split()[0] for ln in lines[head + 1:head + 3]] == ["1", "2"]
    assert "quarantined:" in out and "d1" in out.split("quarantined:")[1]
    assert "\x1b" not in out  # a device's text cannot drive the terminal
    assert main(["status", "--state", path, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["round"] == 2


def test_fedge_status_mistakes_are_one_line(tmp_path, capsys):
    assert main(["status", "--state", str(tmp_path / "nope.sqlite")]) == 2
    assert capsys.readouterr().err.strip() == f"fedge status: {tmp_path / 'nope.sqlite'}: no such state file"
    (tmp_path / "junk.sqlite").write_bytes(b"not a database at all" * 100)
    assert main(["status", "--state", str(tmp_path / "junk.sqlite")]) == 2
    assert "not a coordinator state file" in capsys.readouterr().err
    assert main(["status", "--url", "http://127.0.0.1:9/"]) == 2  # nothing listens on the discard port
    err = capsys.readouterr().err
    assert err.startswith("fedge status: http://127.0.0.1:9/status.json:") and err.count("\n") == 1


def test_render_of_a_live_status_shows_progress_against_the_target():
    out = render(fed(Clock()).status())
    assert "round 2 of 5 committed [############..................] 40%" in out
    assert "reports since start: 3 accepted, 1 late, 1 rejected, 0 duplicate" in out
    assert "eligible" in out and "(2 attempts)" in out


def test_metrics_section_of_fleet_toml(tmp_path):
    p = tmp_path / "fleet.toml"
    p.write_text("[metrics]\nport = 9108\nhost = '0.0.0.0'\n")
    fc = load_fleet(str(p))
    assert (fc.metrics.port, fc.metrics.host) == (9108, "0.0.0.0")
    assert load_fleet(str(p), metrics_port=0).metrics.port == 0
    assert load_fleet(None).metrics.port == 0  # off by default
    for text, says in (("[metrics]\nport = 70000\n", "[metrics] port = 70000: must be at most 65535"),
                       ("[metrics]\nport = 'x'\n", "[metrics] port = 'x': expected an integer"),
                       ("[metrics]\nprot = 1\n", "did you mean 'port'?")):
        p.write_text(text)
        with pytest.raises(ConfigError) as e:
            load_fleet(str(p))
        assert says in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="--metrics-port = -1"):
        load_fleet(None, metrics_port=-1)


def test_the_round_line():
    s = summary(3, 0.81234, 521_000, 413_000) | {"wall_s": 1.234}
    assert round_line(s, 30, 2_800_000) == ("round 3/30: accuracy 0.8123, 3 reports, 1 unused, 0.521 MB down + "
                                            "0.413 MB up (2.80 MB in all), 1.23 s")
    assert round_line(s | {"attempts": 2, "accuracy": None}, 30, 0).endswith(", 2 attempts")
    assert "accuracy -," in round_line(s | {"accuracy": None}, 30, 0)
    assert round_line(s | {"export_s": 2.5, "passed_over": 3}, 30, 0).endswith(
        "1.23 s (+2.50 s waiting for program exports), 3 passed over while their programs exported")


def test_a_busy_metrics_port_is_one_line(tmp_path, capsys):
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        rc = main(["coordinator", "--state", str(tmp_path / "s.sqlite"), "--metrics-port", str(port)])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith(f"fedge coordinator: [metrics] port = {port}: cannot listen on 127.0.0.1")
    assert err.count("\n") == 1
    assert not (tmp_path / "s.sqlite").exists()  # refused before anything was created


def test_np_types_in_summaries_are_serialisable():
    m = FleetMetrics()
    m.committed(summary(1, float(np.float32(0.5)), 10, 10))
    json.dumps(m.status())


def test_fedge_devices_reads_the_state_without_touching_it(tmp_path, capsys):
    path = _state_file(tmp_path)
    reports = tmp_path / "state.sqlite.reports"
    before = sorted(p.relative_to(reports) for p in reports.rglob("*"))
    stray = reports / "x-r1a1"  # a committed task's leftovers: a coordinator would tidy them, a reader must not
    stray.mkdir()
    assert main(["devices", "--state", path]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split()[:3] == ["device", "online", "free"]
    assert "d1" in out and "s more (#1)" in out
    assert stray.is_dir() and sorted(p.relative_to(reports) for p in reports.rglob("*")) == sorted(
        before + [stray.relative_to(reports)])
