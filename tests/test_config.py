"""One settings model from environment variables and a YAML file, checked at
start-up with errors that name the setting."""

import os

import pytest

from conftest import kvsieve_cli
from kvsieve.service.config import CONFIG_ENV, ConfigError, load_settings


@pytest.fixture(autouse=True)
def _clean_env():
    # load_settings(file) exports the file in $KVSIEVE_CONFIG (for the
    # processes the CLI starts); remove it after each test, or every later
    # test's server reads this module's YAML files. (monkeypatch.delenv of an
    # unset variable records nothing to undo.)
    saved = os.environ.pop(CONFIG_ENV, None)
    yield
    os.environ.pop(CONFIG_ENV, None)
    if saved is not None:
        os.environ[CONFIG_ENV] = saved


def test_precedence_overrides_env_file_defaults(tmp_path, monkeypatch):
    config = tmp_path / "k.yaml"
    config.write_text("server:\n  port: 9001\n  host: 0.0.0.0\nlimits:\n  max_tokens: 64\n"
                      "ray:\n  autoscaling:\n    min_replicas: 1\n    max_replicas: 3\n")
    monkeypatch.setenv("KVSIEVE_LIMITS__MAX_TOKENS", "32")
    monkeypatch.setenv("KVSIEVE_REGION_SHARE", "0.5")  # the engine's own knob: not a setting, ignored
    s = load_settings(str(config), server={"port": 9002})
    assert s.server.port == 9002            # flag over file
    assert s.server.host == "0.0.0.0"       # file over default
    assert s.limits.max_tokens == 32        # environment over file
    assert s.limits.max_body_bytes == 1 << 20
    assert s.ray.enabled and s.ray.autoscaling.max_replicas == 3
    assert s.store.url.startswith("file://")


def test_errors_name_the_setting(tmp_path, monkeypatch):
    config = tmp_path / "bad.yaml"
    config.write_text("limits:\n  max_tokens: 0\nray:\n  replicas: 2\n  autoscaling: {min_replicas: 3, max_replicas: 2}\n"
                      "store:\n  url: postgres://x\n  typo_field: 1\n")
    monkeypatch.setenv("KVSIEVE_AUTH__ENABLED", "perhaps")
    with pytest.raises(ConfigError) as err:
        load_settings(str(config))
    text = str(err.value)
    for name in ("limits.max_tokens", "auth.enabled", "store.url", "store.typo_field", "ray.autoscaling"):
        assert name in text, (name, text)
    assert "KVSIEVE_LIMITS__MAX_TOKENS" in text and str(config) in text


def test_replicas_and_autoscaling_exclusive():
    with pytest.raises(ConfigError, match="either replicas or autoscaling"):
        load_settings(ray={"replicas": 2, "autoscaling": {"max_replicas": 2}})


def test_serve_refuses_bad_settings_before_starting(tmp_path):
    config = tmp_path / "bad.yaml"
    config.write_text("engine:\n  model: /no/such/dir\nserver:\n  port: 70000\n")
    done = kvsieve_cli("serve", "--config", str(config), timeout=60)
    assert done.returncode == 2
    assert "engine.model" in done.stderr and "server.port" in done.stderr
    missing = kvsieve_cli("serve", "--config", str(tmp_path / "absent.yaml"), timeout=60)
    assert missing.returncode == 2 and "does not exist" in missing.stderr


def test_sglang_arguments_pass_through_as_one_json_object(monkeypatch):
    from kvsieve.service.engine import SGLANG_ARGS_ENV, sglang_overrides

    monkeypatch.delenv(SGLANG_ARGS_ENV, raising=False)
    assert sglang_overrides() == {}
    monkeypatch.setenv(SGLANG_ARGS_ENV, '{"cuda_graph_backend_prefill": "disabled", "mem_fraction_static": 0.5}')
    assert sglang_overrides() == {"cuda_graph_backend_prefill": "disabled", "mem_fraction_static": 0.5}
    for bad in ("[1]", "{not json"):
        monkeypatch.setenv(SGLANG_ARGS_ENV, bad)
        with pytest.raises(SystemExit, match=SGLANG_ARGS_ENV):
            sglang_overrides()
