import pytest

import spillover
from spillover.config import Config, parse_size
from spillover.errors import ConfigError


@pytest.mark.parametrize(
    "text,expected",
    [("0", 0), ("1048576", 1 << 20), ("512MiB", 512 << 20), ("8GiB", 8 << 30),
     ("1.5GB", 1_500_000_000), (" 4 kib ", 4096), (123, 123)],
)
def test_sizes(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["", "abc", "12XB", "-5", "1e9", True])
def test_bad_sizes(bad):
    with pytest.raises(spillover.ConfigError):
        parse_size(bad, "SPILLOVER_HOST_POOL_BYTES")


def test_env_and_keyword_precedence():
    env = {"SPILLOVER_TIER": "host", "SPILLOVER_MIN_OFFLOAD_BYTES": "64KiB"}
    c = Config.load(env)
    assert c.tier == "host" and c.min_offload_bytes == 64 << 10
    assert c.sources["tier"] == "env" and c.sources["io_engine"] == "default"
    c = Config.load(env, min_offload_bytes="1MiB", tier=None)
    assert c.min_offload_bytes == 1 << 20 and c.sources["min_offload_bytes"] == "keyword"
    assert c.tier == "host"  # None keywords fall through to the environment


def test_bad_value_names_variable_and_value():
    with pytest.raises(spillover.ConfigError) as e:
        Config.load({"SPILLOVER_HOST_POOL_BYTES": "lots"})
    assert "SPILLOVER_HOST_POOL_BYTES" in str(e.value) and "'lots'" in str(e.value)
    assert isinstance(e.value, ValueError) and isinstance(e.value, spillover.SpilloverError)
    with pytest.raises(spillover.ConfigError, match="SPILLOVER_TIER='disk'"):
        Config.load({"SPILLOVER_TIER": "disk"})
    with pytest.raises(spillover.ConfigError, match="SPILLOVER_VERIFY"):
        Config.load({"SPILLOVER_VERIFY": "maybe"})
    with pytest.raises(spillover.ConfigError, match="SPILLOVER_IO_QUEUE_DEPTH"):
        Config.load({"SPILLOVER_IO_QUEUE_DEPTH": "0"})


def test_unknown_variable_lists_valid_names():
    with pytest.raises(spillover.ConfigError) as e:
        Config.load({"SPILLOVER_HOST_POOL_BYTE": "1GiB"})  # typo: missing S
    msg = str(e.value)
    assert "SPILLOVER_HOST_POOL_BYTE" in msg and "SPILLOVER_HOST_POOL_BYTES" in msg


def test_unknown_keyword():
    with pytest.raises(spillover.ConfigError, match="host_pool"):
        spillover.offload_context("host", host_pool="1GiB")


def test_offload_context_reads_the_environment(monkeypatch):
    monkeypatch.setenv("SPILLOVER_MIN_OFFLOAD_BYTES", "nonsense")
    with pytest.raises(spillover.ConfigError, match="SPILLOVER_MIN_OFFLOAD_BYTES"):
        spillover.offload_context("host")
    monkeypatch.setenv("SPILLOVER_MIN_OFFLOAD_BYTES", "2MiB")
    assert spillover.offload_context("host").config.min_offload_bytes == 2 << 20


def test_describe_covers_every_variable():
    d = Config.load({}).describe()
    assert set(d) == set(spillover.config.ENV_NAMES)
    assert all(src == "default" for (_f, _v, src, _h) in d.values())


@pytest.mark.parametrize("field", ["host_pool_bytes", "optim_pool_bytes", "io_block_bytes",
                                   "sim_link_bandwidth"])
def test_a_size_of_zero_names_the_setting_and_the_fix(field, monkeypatch):
    """A pool (or request, or link) of 0 bytes: a ConfigError naming the setting as it was
    given, never a bare ValueError from deep inside (host_pool_bytes=0 once was)."""
    for value in (0, "0", "0MiB"):
        with pytest.raises(ConfigError, match=f"^{field}={value!r}: .* more than 0 bytes; "):
            Config.load(**{field: value})
    monkeypatch.setenv(f"SPILLOVER_{field.upper()}", "0")
    with pytest.raises(ConfigError, match=f"^SPILLOVER_{field.upper()}='0': "):
        Config.load()


def test_host_pool_of_zero_refused_when_the_context_is_made():
    import spillover

    with pytest.raises(ConfigError, match="host_pool_bytes=0: the host pool must be more "
                       "than 0 bytes; leave it unset for the default pool"):
        spillover.offload_context("host", host_pool_bytes=0)


def test_doctor_prints_the_values_it_will_use(capsys):
    """Each setting left unset shows what it resolves to here, never ``None``."""
    from spillover import doctor

    assert doctor.main(["--probe-seconds", "0"]) in (0, 1)
    out = capsys.readouterr().out.split("effective configuration", 1)[1]
    rows = {line.split()[0]: line for line in out.splitlines() if line.startswith("  SPILLOVER_")}
    assert len(rows) == len(Config.load().describe())
    assert not [r for r in rows.values() if " None " in r], rows
    assert "at first, grown to what steps hold, at most" in rows["SPILLOVER_HOST_POOL_BYTES"]
    assert "a quarter of the pool" in rows["SPILLOVER_PREFETCH_BYTES"]
    assert rows["SPILLOVER_DEVICE_BUDGET_BYTES"].split()[1] == "none;"
