import pytest

from mpifl.config import apply_overrides, config_to_dict, load_config, parse_config
from mpifl.schema import ConfigError


def test_defaults_parse_and_round_trip():
    cfg = parse_config({})
    assert cfg.algorithm == "fedavg" and cfg.data.dataset == "digits"
    assert parse_config(config_to_dict(cfg)) == cfg


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"roundz": 3}, "unknown key 'roundz' (did you mean 'rounds'?)"),
        ({"client": {"lrr": 0.1}}, "client: unknown key 'lrr' (did you mean 'lr'?)"),
        ({"client": {"lr": -0.1}}, "client.lr: must be > 0"),
        ({"rounds": "ten"}, "rounds: expected an integer"),
        ({"rounds": 2.5}, "rounds: expected an integer"),
        ({"client": {"lr": float("nan")}}, "client.lr: expected a finite number"),
        ({"data": {"partition": "dirichlett"}}, "did you mean 'dirichlet'?"),
        ({"algorithm": "fedavgg"}, "did you mean 'fedavg'?"),
        ({"clients_per_round": 20, "data": {"num_clients": 10}}, "clients_per_round: 20 exceeds data.num_clients"),
        ({"data": {"test_fraction": 0.6, "val_fraction": 0.5}}, "test_fraction + val_fraction"),
        ({"data": "digits"}, "data: expected a mapping"),
        ({"network": {"up_mbps": 0}}, "network.up_mbps: must be > 0"),
        ({"eval_every": 5, "rounds": 2}, "eval_every: 5 exceeds rounds"),
        ({"local": {"x": 1}}, "local: unknown key 'x'"),  # another algorithm's section is validated too
        ({"pefll": {"lambda_h": 0.1}}, "pefll.lambda_h: applies to Alg. 2's step (optimizer: paper) only"),
        ({"fedavg": {"x": 1}}, "fedavg: unknown key 'x'"),
        ({"checkpoint_every": -1}, "checkpoint_every: must be >= 0"),
        ({"device": "gpu"}, "device: 'gpu' is not one of"),
    ],
)
def test_bad_configs_give_one_clear_error(raw, message):
    with pytest.raises(ConfigError) as info:
        parse_config(raw)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_exponent_notation_is_a_number():
    assert parse_config({"client": {"lr": "1e-3", "weight_decay": "5E-4"}}).client.lr == 1e-3
    with pytest.raises(ConfigError, match="expected a number"):
        parse_config({"client": {"lr": "fast"}})


def test_set_overrides_use_yaml_types():
    raw = apply_overrides({"client": {"lr": 0.1}}, ["client.lr=0.5", "data.num_clients=20", "model.hidden=[3, 4]"])
    cfg = parse_config(raw)
    assert cfg.client.lr == 0.5 and cfg.data.num_clients == 20 and cfg.model.hidden == (3, 4)


@pytest.mark.parametrize("item", ["client.lr", "=3", "a..b=1"])
def test_malformed_overrides(item):
    with pytest.raises(ConfigError):
        apply_overrides({}, [item])


def test_load_config_errors_name_the_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("rounds: [1,\n")
    with pytest.raises(ConfigError, match="bad.yaml is not valid YAML"):
        load_config(bad)
    bad.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(bad)


def test_sections_of_other_algorithms_are_kept_out_of_the_run():
    """A paper config holds every compared method's options; --set algorithm=X picks X's section only."""
    raw = {"algorithm": "pfedhn", "pfedhn": {"server_steps": "averaged"}, "local": {"mode": "all"}}
    cfg = parse_config(raw)
    assert cfg.algorithm_options.server_steps == "averaged"
    assert "local" not in config_to_dict(cfg) and config_to_dict(cfg)["pfedhn"]["server_steps"] == "averaged"
    assert parse_config({**raw, "algorithm": "local"}).algorithm_options.mode == "all"
