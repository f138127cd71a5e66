"""jaxckpt.Config: defaults, TOML files, JAXCKPT_* overrides, and ConfigError naming the offending key."""
import dataclasses
import os

import pytest

from jaxckpt import Config
from jaxckpt.errors import ConfigError


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for key in list(os.environ):
        if key.startswith("JAXCKPT_"):
            monkeypatch.delenv(key)


def write(tmp_path, text, name="jaxckpt.toml"):
    p = tmp_path / name
    p.write_text(text)
    return p


def test_defaults():
    c = Config()
    assert (c.store, c.protection, c.keep, c.memory_budget_bytes, c.workers, c.max_pending_saves) == \
        ("memory", "none", 1, 0, 2, 2)
    assert c.inflight_bytes == 256 << 20 and c.chunk_bytes == 64 << 20
    assert (c.job_id, c.commit_timeout_s, c.persistent_dir, c.persistent_interval, c.verify_on_restore) == \
        ("default", 120.0, "", 0, True)


def test_frozen_and_replace():
    c = Config()
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.keep = 3
    d = c.replace(keep=3, job_id="run-7")
    assert (d.keep, d.job_id, c.keep) == (3, "run-7", 1)
    with pytest.raises(ConfigError, match="kep"):
        c.replace(kep=3)
    with pytest.raises(ConfigError, match="keep"):
        c.replace(keep=0)


@pytest.mark.parametrize("changes, key", [
    ({"keep": "3"}, "keep"), ({"keep": True}, "keep"), ({"keep": 2.0}, "keep"), ({"keep": 0}, "keep"),
    ({"workers": -1}, "workers"), ({"memory_budget_bytes": -5}, "memory_budget_bytes"),
    ({"verify_on_restore": 1}, "verify_on_restore"), ({"commit_timeout_s": "5"}, "commit_timeout_s"),
    ({"commit_timeout_s": 0}, "commit_timeout_s"), ({"store": "s3"}, "store"), ({"store": 3}, "store"),
    ({"protection": "raid5"}, "protection"), ({"job_id": "a/b"}, "job_id"), ({"job_id": ""}, "job_id"),
    ({"persistent_interval": -1}, "persistent_interval"), ({"chunk_bytes": 0}, "chunk_bytes"),
    ({"replicas": "all"}, "replicas"), ({"replicas": 2}, "replicas"),
])
def test_bad_values_name_the_field(changes, key):
    with pytest.raises(ConfigError, match=f"Config.{key}="):
        Config(**changes)


def _known_stores(message: str) -> list[str]:
    return message.split("(known: ", 1)[1].split(";", 1)[0].split(", ")


@pytest.mark.parametrize("name", ["peer", "s3"])
def test_a_store_no_one_registered_is_refused_at_config_time(name):
    """Not at first use with BackendNotFoundError: Config() itself says what is wrong and what exists."""
    with pytest.raises(ConfigError) as e:
        Config(store=name)
    msg = str(e.value)
    assert type(e.value) is ConfigError and msg.startswith(f"Config.store={name!r}: unknown store (known: "), msg
    known = _known_stores(msg)
    assert {"memory", "shm"} <= set(known) and name not in known, msg
    assert ("peers are not a store" in msg) == (name == "peer"), msg
    with pytest.raises(ConfigError, match=rf"environment: Config.store={name!r}: unknown store"):
        Config().with_env({"JAXCKPT_STORE": name})


def test_registered_and_module_class_stores_pass_validation():
    from jaxckpt.registry import register_store

    register_store("test-config-store", "jaxckpt.backends.memory:MemoryStore", clobber=True)
    assert Config(store="test-config-store").store == "test-config-store"
    assert Config(store="jaxckpt.backends.memory:MemoryStore").store == "jaxckpt.backends.memory:MemoryStore"
    with pytest.raises(ConfigError) as e:
        Config(store="peer")
    assert "test-config-store" in _known_stores(str(e.value))


def test_float_field_accepts_an_int():
    assert Config(commit_timeout_s=5).commit_timeout_s == 5


def test_from_file_top_level_keys(tmp_path):
    p = write(tmp_path, 'keep = 3\nmemory_budget_bytes = 1_000_000\nprotection = "parity"\n'
                        'commit_timeout_s = 2.5\nverify_on_restore = false\njob_id = "exp.1"\n')
    c = Config.from_file(p)
    assert (c.keep, c.memory_budget_bytes, c.protection, c.commit_timeout_s, c.verify_on_restore, c.job_id) == \
        (3, 1_000_000, "parity", 2.5, False, "exp.1")
    assert c.store == "memory"


def test_from_file_jaxckpt_table(tmp_path):
    p = write(tmp_path, '[jaxckpt]\nkeep = 4\nstore = "memory"\n')
    assert Config.from_file(p).keep == 4


def test_from_file_unknown_key_names_key_and_file(tmp_path):
    p = write(tmp_path, 'keep = 2\nkeeep = 3\n')
    with pytest.raises(ConfigError, match=r"jaxckpt.toml: unknown Config key\(s\): keeep"):
        Config.from_file(p)
    q = write(tmp_path, '[jaxckpt]\nkeep = 2\nbudget = 3\n', name="t.toml")
    with pytest.raises(ConfigError, match="budget"):
        Config.from_file(q)


def test_from_file_ill_typed_value_names_key_and_file(tmp_path):
    p = write(tmp_path, 'keep = "three"\n')
    with pytest.raises(ConfigError, match=r"jaxckpt.toml: Config.keep='three': expected int, got str"):
        Config.from_file(p)
    q = write(tmp_path, '[jaxckpt]\nverify_on_restore = "yes"\n', name="t.toml")
    with pytest.raises(ConfigError, match="verify_on_restore"):
        Config.from_file(q)


def test_from_file_bad_toml_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="not valid TOML"):
        Config.from_file(write(tmp_path, "keep = = 3\n"))
    with pytest.raises(ConfigError, match="cannot read config file"):
        Config.from_file(tmp_path / "absent.toml")


def test_from_file_applies_env_unless_told(tmp_path, monkeypatch):
    p = write(tmp_path, "keep = 3\n")
    monkeypatch.setenv("JAXCKPT_KEEP", "5")
    assert Config.from_file(p).keep == 5
    assert Config.from_file(p, env=False).keep == 3


def test_from_dict():
    assert Config.from_dict({"keep": 2}).keep == 2
    with pytest.raises(ConfigError, match=r"mine: unknown Config key\(s\): a, b"):
        Config.from_dict({"b": 1, "a": 2}, source="mine")


@pytest.mark.parametrize("var, raw, field, want", [
    ("JAXCKPT_KEEP", "3", "keep", 3),
    ("JAXCKPT_MEMORY_BUDGET_BYTES", "1_048_576", "memory_budget_bytes", 1 << 20),
    ("JAXCKPT_COMMIT_TIMEOUT_S", "2.5", "commit_timeout_s", 2.5),
    ("JAXCKPT_VERIFY_ON_RESTORE", "off", "verify_on_restore", False),
    ("JAXCKPT_VERIFY_ON_RESTORE", "Yes", "verify_on_restore", True),
    ("JAXCKPT_PROTECTION", "hybrid", "protection", "hybrid"),
    ("JAXCKPT_PERSISTENT_DIR", "/tmp/ck", "persistent_dir", "/tmp/ck"),
])
def test_env_overrides(var, raw, field, want):
    c = Config(keep=2).with_env({var: raw, "PATH": "/bin"})
    assert getattr(c, field) == want


def test_env_reads_os_environ(monkeypatch):
    monkeypatch.setenv("JAXCKPT_WORKERS", "4")
    assert Config().with_env().workers == 4
    assert Config().workers == 2  # only with_env() (and from_file, Checkpointer) read the environment


def test_env_without_overrides_returns_the_same_config():
    c = Config(keep=2)
    assert c.with_env({"HOME": "/root", "JAXCKPT_LOG_LEVEL": "DEBUG", "JAXCKPT_LAUNCH_SPEC": "x"}) is c


@pytest.mark.parametrize("var, raw", [
    ("JAXCKPT_KEEP", "three"), ("JAXCKPT_KEEP", "2.0"), ("JAXCKPT_VERIFY_ON_RESTORE", "maybe"),
    ("JAXCKPT_COMMIT_TIMEOUT_S", "soon"),
])
def test_env_ill_typed_value_names_the_variable(var, raw):
    with pytest.raises(ConfigError, match=f"environment variable {var}="):
        Config().with_env({var: raw})


@pytest.mark.parametrize("var, raw, field", [
    ("JAXCKPT_KEEP", "0", "keep"), ("JAXCKPT_STORE", "tape", "store"), ("JAXCKPT_JOB_ID", "a b", "job_id"),
    ("JAXCKPT_REPLICAS", "both", "replicas"),
])
def test_env_invalid_value_names_the_field(var, raw, field):
    with pytest.raises(ConfigError, match=f"environment: Config.{field}="):
        Config().with_env({var: raw})


def test_env_unknown_variable_is_an_error():
    with pytest.raises(ConfigError, match="JAXCKPT_KEPP: no Config field 'kepp'"):
        Config().with_env({"JAXCKPT_KEPP": "3"})


def test_replicas_choice_and_its_message():
    assert Config().replicas == "whole" and Config().with_env({"JAXCKPT_REPLICAS": "split"}).replicas == "split"
    with pytest.raises(ConfigError) as e:
        Config(replicas="copies")
    assert str(e.value).startswith("Config.replicas='copies': expected one of split, whole (split: each replica ")
