"""A person's mistakes (config typos, wrong types, bad ranges, missing files) give one line that names the key,
never a traceback and never silence; what defines a run is fixed by its state, where the broker is is not."""
from __future__ import annotations

import pytest

from coordinator.cli import main
from coordinator.config import load_fleet
from coordinator.credentials import check_username
from coordinator.store import OtherRun, Store
from edge.runtime.config import ConfigError


def fleet(tmp_path, text: str) -> str:
    p = tmp_path / "fleet.toml"
    p.write_text(text)
    return str(p)


@pytest.mark.parametrize("text, says", [
    ("[round]\nrounds = 2\n", "unknown section 'round'"),
    ("[round]\nrounds = 2\n", "did you mean 'rounds'?"),
    ("[broker]\nurll = 'mqtt://x'\n", "[broker]: unknown key 'urll'"),
    ("[rounds]\nrounds = \"two\"\n", "[rounds] rounds = 'two': expected an integer"),
    ("[rounds]\nclients_per_round = 0\n", "[rounds] clients_per_round = 0: must be at least 1"),
    ("[rounds]\nclients_per_round = -3\n", "[rounds] clients_per_round = -3: must be at least 1"),
    ("[rounds]\nover_selection = 0.5\n", "over_selection = 0.5: must be at least 1.0"),
    ("[rounds]\nclients_per_round = 4\nmin_reports = 9\n", "min_reports = 9 is more than clients_per_round = 4"),
    ("[rounds]\nfleet = 'a/b'\n", "fleet 'a/b' is not a valid topic level"),
    ("[eligibility]\nrequire_charging = 'yes'\n", "require_charging = 'yes': expected true or false"),
    ("[eligibility]\nruntimes = ['tflite']\n", "each must be one of torch, ort, executorch"),
    ("[strategy]\nname = 'fedavgg'\n", "name = 'fedavgg': unknown strategy"),
    ("[strategy]\nname = 'fedavgg'\n", "did you mean 'fedavg'?"),
    ("[strategy]\nname = 'fedsparse'\npreset = 'hgh'\n", "[strategy] fedsparse: unknown preset 'hgh'"),
    ("[strategy]\nname = 'fedsparse'\nlambda_0 = 0.1\n", "did you mean 'lambda0'?"),
    ("[strategy]\nname = 'fedavg'\nlr = 'fast'\n", "[strategy] lr = 'fast': expected a number"),
    ("[strategy]\nname = 'fedavg'\naggregate = 'mode'\n", "aggregate = 'mode': must be one of mean, median"),
    ("[strategy]\nsizes = [64, 0, 10]\n", "sizes = [64, 0, 10]: expected a list of at least two positive"),
    ("[admission]\nnorm_bound = 'big'\n", "norm_bound must be 'auto', a number or none"),
    ("[admission]\nmax_accuracy_drop = 2\n", "max_accuracy_drop = 2.0: must be at most 1.0"),
    ("[data]\ntest = 'nowhere.npz'\n", "[data] test = 'nowhere.npz': no such file"),
    ("[broker]\nurl = 'http://x'\n", "unsupported broker scheme 'http'"),
    ("[broker]\nurl = 'mqtt://x'\nca_file = 'ca.pem'\n", "a CA or client certificate needs an mqtts://"),
    ("rounds = [\n", "not valid TOML"),
])
def test_config_mistakes_are_one_line_naming_the_key(tmp_path, text, says):
    with pytest.raises(ConfigError) as e:
        load_fleet(fleet(tmp_path, text))
    assert says in str(e.value) and "\n" not in str(e.value)


def test_the_coordinator_command_prints_one_line_and_exits_2(tmp_path, capsys):
    rc = main(["coordinator", "--config", fleet(tmp_path, "[rounds]\nclients_per_round = 0\n")])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("fedge coordinator: [rounds] clients_per_round = 0")
    assert main(["coordinator", "--config", str(tmp_path / "missing.toml")]) == 2
    assert "missing.toml: no such file" in capsys.readouterr().err
    assert main(["coordinator", "-v", "--config", str(tmp_path / "missing.toml")]) == 2  # -v after the subcommand
    assert "missing.toml: no such file" in capsys.readouterr().err


def test_broker_on_a_busy_port_is_one_line(capsys):
    import socket
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        assert main(["broker", "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"fedge broker: --host 127.0.0.1 --port {port}: cannot listen there") and err.count("\n") == 1


def test_simulate_and_device_commands_check_their_arguments(tmp_path, capsys):
    assert main(["simulate", "--clients-per-round", "0", "--no-progress"]) == 2
    assert "--clients-per-round = 0: must be at least 1" in capsys.readouterr().err
    assert main(["simulate", "--strategy", "fedsparse", "-S", "presett=high", "--no-progress"]) == 2
    assert "did you mean 'preset'?" in capsys.readouterr().err
    assert main(["device", "--id", "a/b", "--data", "x.npz"]) == 2
    assert "becomes a topic level" in capsys.readouterr().err
    assert main(["device", "--id", "d1", "--data", str(tmp_path / "none.npz")]) == 2
    assert "none.npz" in capsys.readouterr().err
    cfg = tmp_path / "device.toml"
    cfg.write_text("[device]\nid = 'd1'\ndata = 'x.npz'\n[capabilities]\nbattery = 'full'\n")
    assert main(["device", "--config", str(cfg)]) == 2
    assert "capability battery = 'full'" in capsys.readouterr().err
    cfg.write_text("[device]\nid = 'd1'\ndata = 'x.npz'\n[capabilities]\nnetwrok = 'wifi'\n")
    assert main(["device", "--config", str(cfg)]) == 2  # a typo left the permissive default (wifi) in force
    err = capsys.readouterr().err
    assert "unknown key 'netwrok'" in err and "did you mean 'network'?" in err and err.count("\n") == 1


def test_valid_config_loads_and_only_the_run_defining_part_is_fixed(tmp_path):
    base = "[rounds]\nrounds = 5\nclients_per_round = 3\n[strategy]\nname = 'fedavg'\nlr = 0.1\n"
    fc = load_fleet(fleet(tmp_path, "[broker]\nurl = 'mqtt://a:1883'\n" + base))
    assert fc.rounds.clients_per_round == 3 and fc.strategy_options == {"lr": 0.1}
    store = Store(tmp_path / "s.sqlite")
    store.check_run(fc.run())
    moved = load_fleet(fleet(tmp_path, "[broker]\nurl = 'mqtt://b:1884'\n" + base.replace("rounds = 5", "rounds = 9")))
    store.check_run(moved.run())  # another broker and more rounds: the same run
    other = load_fleet(fleet(tmp_path, base.replace("lr = 0.1", "lr = 0.2")))
    with pytest.raises(OtherRun, match="another options"):
        store.check_run(other.run())


@pytest.mark.parametrize("user, says", [
    ("d:x", "cannot contain ':'"), ("a+b", "topic level"), ("a#", "topic level"), ("a/b", "topic level"),
    ("", "topic level"), ("x" * 129, "topic level"),
])
def test_credentials_refuse_ids_that_cannot_be_topics_or_mosquitto_users(user, says):
    with pytest.raises(ConfigError, match=says):
        check_username(user)


def test_credentials_command_is_one_line_on_a_bad_id(tmp_path, capsys):
    assert main(["credentials", "--devices", "d1,d:x", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "d:x" in err


# ---- configs that start but could never train (issue #30): refused at start, one line naming the key, exit 2
def _npz(path, features: int, classes: int) -> str:
    import numpy as np
    rng = np.random.default_rng(0)
    np.savez(path, x=rng.normal(size=(40, features)).astype(np.float32), y=np.arange(40) % classes)
    return str(path)


@pytest.mark.parametrize("text, says", [
    ("[strategy]\nepochs = 0\n", "[strategy] epochs = 0: must be at least 1"),
    ("[strategy]\nbatch_size = 0\n", "[strategy] batch_size = 0: must be at least 1"),
    ("[strategy]\nname = 'fedprox'\nepochs = -1\n", "[strategy] epochs = -1: must be at least 1"),
    ("[strategy]\nlr = -0.1\n", "[strategy] lr = -0.1: a learning rate must be at least 0"),
    ("[strategy]\nname = 'fedsparse'\nserver_lr = -1\n", "[strategy] server_lr = -1.0: a learning rate"),
    ("[strategy]\nupload_dtype = 'f16'\n", "[strategy] upload_dtype = 'f16': must be one of f4, f2, bf16, q8, q8r"),
    ("[strategy]\nupload_dtype_1d = 'i8'\n", "[strategy] upload_dtype_1d = 'i8': must be one of"),
    ("[strategy]\ndown_dtype = 'float16'\n", "[strategy] down_dtype = 'float16': must be one of"),
    ("[strategy]\nname = 'fedmix'\nupload_dtype = 'f16'\n", "[strategy] upload_dtype = 'f16': must be one of"),
    ("[strategy]\nupload_sample = 'random'\n", "[strategy] upload_sample = 'random': must be one of norm, uniform"),
    ("[strategy]\nsizes = [64, 32, 5]\n[data]\ntest = '{t10}'\n",
     "[strategy] sizes = [64, 32, 5]: the model has 5 classes, the [data] test labels go up to 9"),
    ("[strategy]\nsizes = [32, 10]\n[data]\ntest = '{t10}'\n",
     "[strategy] sizes = [32, 10]: the model takes 32 inputs, the [data] test examples have 64 features"),
    ("[data]\ntest = '{t32}'\n", "the model takes 64 inputs, the [data] test examples have 32 features"),
    ("[model]\nname = 'mlp'\ninput = [32]\n[data]\ntest = '{t10}'\n", "[model] input = [32]: the [data] test"),
    ("[state]\npath = ''\n", "[state] path = '': give the path of the state file"),
    ("[state]\npath = ':memory:'\n", "[state] path = ':memory:': give the path of the state file"),
    ("[state]\npath = '{dir}'\n", "is a directory"),
    ("[broker]\nurl = 'mqtt//host:1883'\n", "[broker] url: a broker address has no path: 'mqtt//host:1883'"),
    ("[broker]\nurl = 'mqtt://:1883'\n", "[broker] url: no host in broker address 'mqtt://:1883'"),
    ("[broker]\nurl = 'mqtt://host:1883/fleet'\n", "[broker] url: a broker address has no path"),
    ("[broker]\nurl = 'mqtt://host:'\n", "[broker] url: bad port in broker address"),
    ("[broker]\nurl = 'mqtt://host:0'\n", "[broker] url: bad port in broker address"),
    ("[broker]\nurl = 'mqtt://host:70000'\n", "[broker] url: bad port in broker address"),
])
def test_configs_that_could_never_train_are_refused_at_start(tmp_path, capsys, text, says):
    text = text.format(t10=_npz(tmp_path / "t10.npz", 64, 10), t32=_npz(tmp_path / "t32.npz", 32, 10),
                       dir=tmp_path)
    rc = main(["coordinator", "--config", fleet(tmp_path, text)])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith("fedge coordinator: ") and says in err, err


def test_command_line_overrides_are_checked_too(tmp_path, capsys):
    assert main(["coordinator", "--state", ""]) == 2
    assert "--state = '': give the path of the state file" in capsys.readouterr().err
    assert main(["coordinator", "--broker", "mqtt//h:1883"]) == 2
    assert "--broker: a broker address has no path" in capsys.readouterr().err
    assert main(["-v", "coordinator", "--config", fleet(tmp_path, "[strategy]\nepochs = 0\n")]) == 2


def test_a_binary_or_unreadable_config_is_one_line(tmp_path, capsys):
    p = tmp_path / "fleet.toml"
    p.write_bytes(bytes(range(256)) * 8)
    assert main(["coordinator", "--config", str(p)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "fleet.toml: not valid TOML: not UTF-8 text" in err


def test_good_configs_still_load(tmp_path):
    t10 = _npz(tmp_path / "t10.npz", 64, 10)
    fc = load_fleet(fleet(tmp_path, f"[strategy]\nsizes = [64, 32, 10]\nepochs = 2\nbatch_size = 8\nlr = 0\n"
                                    f"upload_dtype = 'q8r'\nupload_dtype_1d = 'f2'\ndown_dtype = 'bf16'\n"
                                    f"[data]\ntest = '{t10}'\n[state]\npath = '{tmp_path / 's.sqlite'}'\n"
                                    "[broker]\nurl = 'mqtts://u:p@broker.example:8883/'\n"))
    assert fc.strategy_options["upload_dtype"] == "q8r" and fc.broker.host == "broker.example"
    assert load_fleet(fleet(tmp_path, "[broker]\nurl = 'broker:1884'\n")).broker.url() == "mqtt://broker:1884"
    # more outputs than the test labels use is fine (a class the test split happens not to hold)
    load_fleet(fleet(tmp_path, f"[strategy]\nsizes = [64, 12]\n[data]\ntest = '{_npz(tmp_path / 't5.npz', 64, 5)}'\n"))
