"""Config precedence (YAML < env < CLI) and validation errors (ocache/config.py)."""

from __future__ import annotations

import argparse

import pytest

from ocache import config as cfg
from ocache.commands import serve as serve_cmd
from ocache.config import Config


def test_defaults_bind_loopback():
    c = cfg.load(path=None, env={})
    assert c.host == "127.0.0.1"
    assert c.upstream == "http://127.0.0.1:8080"
    assert c.admin_token is None
    assert c.disk_budget_gb == 50 and c.disk_ttl_days == 7 and c.disk_min_tokens == 4096
    assert c.spill_budget_gb == 40 and c.spill_min_tokens == 256


def test_precedence_yaml_env_cli(tmp_path):
    f = tmp_path / "ocache.yaml"
    f.write_text("port: 9000\nupstream: http://127.0.0.1:9999\nadmin_token: fromyaml\n"
                 "allowed_hosts: [box.lan]\ntiers: {disk: {grid: 512}}\n")
    c = cfg.load(f, env={})
    assert (c.port, c.upstream, c.admin_token, c.allowed_hosts) == (
        9000, "http://127.0.0.1:9999", "fromyaml", ["box.lan"])
    assert c.tiers == {"disk": {"grid": 512}}
    env = {"OCACHE_PORT": "9100", "OCACHE_ADMIN_TOKEN": "fromenv",
           "OCACHE_ALLOWED_HOSTS": "a.lan, b.lan", "OCACHE_NO_CACHE": "yes",
           "OCACHE_SHARED": "/not/a/config/key"}
    c = cfg.load(f, env=env)
    assert (c.port, c.admin_token, c.allowed_hosts, c.no_cache) == (
        9100, "fromenv", ["a.lan", "b.lan"], True)
    assert c.upstream == "http://127.0.0.1:9999"  # from YAML, untouched by env
    c = cfg.load(f, env=env, overrides={"port": 9200, "admin_token": None})
    assert c.port == 9200 and c.admin_token == "fromenv"  # None override = flag not given


def test_config_file_from_env(tmp_path):
    f = tmp_path / "x.yaml"
    f.write_text("port: 9300\n")
    assert cfg.load(env={"OCACHE_CONFIG": str(f)}).port == 9300


@pytest.mark.parametrize("text, needle", [
    ("prot: 9000\n", "unknown key(s) prot"),
    ("port: -1\n", "below the minimum"),
    ("port: high\n", "port"),
    ("port: 1.5\n", "expected an integer"),
    ("log_level: loud\n", "not one of"),
    ("upstream: localhost:8080\n", "http(s)://host:port"),
    ("upstream: http://127.0.0.1:8080/v1\n", "without a path"),
    ("allowed_hosts: {a: 1}\n", "list of strings"),
    ("no_cache: maybe\n", "boolean"),
    ("- a\n- b\n", "top level must be a mapping"),
    ("port: [\n", "not valid YAML"),
])
def test_bad_yaml_values(tmp_path, text, needle):
    f = tmp_path / "ocache.yaml"
    f.write_text(text)
    with pytest.raises(cfg.ConfigError) as err:
        cfg.load(f, env={})
    assert needle in str(err.value)
    assert str(f) in str(err.value) or "YAML" in str(err.value) or "mapping" in str(err.value)


def test_bad_env_value_names_the_variable():
    with pytest.raises(cfg.ConfigError, match="env OCACHE_PORT"):
        cfg.load(path=None, env={"OCACHE_PORT": "eighty"})


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(cfg.ConfigError, match="cannot read"):
        cfg.load(tmp_path / "nope.yaml", env={})


def test_launch_args_from_cli_and_env():
    c = cfg.load(path=None, env={"OCACHE_LAUNCH": "[-m, /m.gguf, -np, '2']"})
    assert c.launch == ["-m", "/m.gguf", "-np", "2"]
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    serve_cmd.register(sub)
    args = parser.parse_args(["serve", "--port", "9400", "--launch", "--", "-m", "x.gguf",
                              "--port", "9"])
    c = serve_cmd.build_config(args)
    assert c.port == 9400 and c.launch == ["-m", "x.gguf", "--port", "9"]


def test_serve_upstream_with_args_takes_them_as_the_servers_flags(tmp_path, monkeypatch):
    """``ocache serve --upstream URL -- ARGS`` (a server ocache does not launch, e.g. the stock
    build, which does not report its flags): ARGS are that server's flags, as
    ``tiers.resident.server_args`` (the fix every "unknown" / "tiers OFF" line gives). The old code
    refused it ("llama-server arguments given without --launch")."""
    from ocache.cache.wiring import layer_options

    monkeypatch.chdir(tmp_path)       # no ./ocache.yaml
    monkeypatch.delenv("OCACHE_CONFIG", raising=False)
    parser = argparse.ArgumentParser()
    serve_cmd.register(parser.add_subparsers())
    flags = ["-np", "2", "--slot-save-path", str(tmp_path), "--cache-ram", "0"]
    c = serve_cmd.build_config(parser.parse_args(["serve", "--upstream", "http://127.0.0.1:9", "--", *flags]))
    assert not c.launch and c.upstream == "http://127.0.0.1:9"
    assert c.tiers["resident"]["server_args"] == flags
    assert layer_options(c).argv == tuple(flags)
    assert cfg.slot_save_path(c) == tmp_path
    # the flag wins over the YAML's server_args; the YAML's other tier keys stay
    (tmp_path / "ocache.yaml").write_text("tiers: {resident: {server_args: [-np, '4'], warm: false}, "
                                          "disk: {grid: 512}}\n")
    c = serve_cmd.build_config(parser.parse_args(["serve", "--", *flags]))
    assert c.tiers == {"resident": {"server_args": flags, "warm": False}, "disk": {"grid": 512}}
    # a config that launches the server: `-- ARGS` without --launch would be ignored, so refused
    monkeypatch.setenv("OCACHE_LAUNCH", "[-m, x.gguf]")
    with pytest.raises(cfg.ConfigError, match="--launch -- ARGS"):
        serve_cmd.build_config(parser.parse_args(["serve", "--", *flags]))


def test_describe_documents_every_key():
    text = cfg.describe()
    for name in cfg.FIELDS:
        assert name in text
    assert all(f.metadata.get("doc") for f in cfg.FIELDS.values())


def test_bind_names_and_redaction():
    c = cfg.Config(host="0.0.0.0", allowed_hosts=["Box.LAN"], admin_token="s3cret")
    assert {"localhost", "127.0.0.1", "[::1]", "box.lan", "0.0.0.0"} <= c.bind_names
    assert c.to_dict()["admin_token"] == "***"


@pytest.mark.parametrize("tiers, bad", [
    ("{resident: {server_arg: [-np, '2']}}", "server_arg"),   # a typo of server_args
    ("{disc: {slot_save_path: /x}}", "disc"),                  # a typo of disk
])
def test_typos_under_tiers_are_rejected(tmp_path, tiers, bad):
    f = tmp_path / "ocache.yaml"
    f.write_text(f"tiers: {tiers}\n")
    with pytest.raises(cfg.ConfigError, match=bad):
        cfg.load(f, env={})


def test_slot_save_path_expands_home_and_refuses_a_directory_it_cannot_see(tmp_path, monkeypatch, caplog):
    """A YAML list is not a shell: ``~/slots`` means the home directory. A directory ocache cannot
    see here turns the tiers off (one error) instead of leaking every saved file."""
    from ocache.config import slot_save_path
    from ocache.llama.checks import check
    from ocache.llama.flags import params_from_argv

    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "slots").mkdir()
    cfg = Config(tiers={"resident": {"server_args": ["-np", "2", "--slot-save-path", "~/slots"]}})
    assert slot_save_path(cfg) == tmp_path / "slots"
    missing = Config(tiers={"resident": {"server_args": ["--slot-save-path", str(tmp_path / "nope")]}})
    with caplog.at_level("ERROR"):
        assert slot_save_path(missing) is None
    assert "not a directory here" in caplog.text
    argv = ["-np", "2", "--slot-save-path", str(tmp_path / "nope")]
    f = {x.flag: x for x in check(params_from_argv(argv), None, argv=argv)}
    assert f["--slot-save-path"].level == "error"
    argv = ["-np", "2", "--slot-save-path", "~/slots"]
    assert {x.flag: x for x in check(params_from_argv(argv), None, argv=argv)}["--slot-save-path"].level == "ok"
