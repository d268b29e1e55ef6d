from dataclasses import dataclass, field
from pathlib import Path

import pytest

from torchpass import config
from torchpass.errors import ConfigError


@dataclass(frozen=True)
class Inner:
    threshold: int = 3
    window_s: float = 60.0


@dataclass(frozen=True)
class Settings:
    interval_s: float = 1.0
    name: str = "x"
    enabled: bool = True
    state_dir: Path = Path("/var/lib/torchpass")
    inner: Inner = field(default_factory=Inner)

    def validate(self):
        if self.interval_s <= 0:
            raise ConfigError(f"interval_s must be > 0, got {self.interval_s}")


def write(tmp_path, text):
    p = tmp_path / "c.toml"
    p.write_text(text)
    return p


def test_precedence_defaults_file_env_flags(tmp_path):
    p = write(tmp_path, 'interval_s = 2\nname = "file"\n[inner]\nthreshold = 5\n')
    s = config.load(Settings, path=p, env_prefix="TP", environ={"TP_NAME": "env", "TP_ENABLED": "false"},
                    flags={"interval_s": 0.5, "name": None})
    assert s.interval_s == 0.5  # flag beats file
    assert s.name == "env"  # env beats file; a None flag means "not given"
    assert s.enabled is False
    assert s.inner == Inner(threshold=5, window_s=60.0)  # file merged into nested defaults


def test_unknown_keys_are_named(tmp_path):
    p = write(tmp_path, "intervall_s = 2\n")
    with pytest.raises(ConfigError, match=r"unknown key\(s\) intervall_s; known keys: enabled, inner"):
        config.load(Settings, path=p)
    p = write(tmp_path, "[inner]\nthreshhold = 1\n")
    with pytest.raises(ConfigError, match=r"inner: unknown key\(s\) threshhold"):
        config.load(Settings, path=p)


@pytest.mark.parametrize("text, fragment", [
    ('interval_s = "fast"', "interval_s: expected a number, got 'fast'"),
    ("enabled = 1", "enabled: expected true or false, got 1"),
    ("[inner]\nthreshold = 2.5", "inner.threshold: expected an integer, got 2.5"),
    ("interval_s = -1", "interval_s must be > 0"),
    ("inner = 3", "inner: expected a table"),
    ("interval_s = [", "is not valid TOML"),
])
def test_bad_values_are_rejected_naming_the_key(tmp_path, text, fragment):
    with pytest.raises(ConfigError) as exc:
        config.load(Settings, path=write(tmp_path, text))
    assert fragment in str(exc.value)


def test_env_values_are_validated_as_strictly_as_the_file():
    with pytest.raises(ConfigError, match="interval_s: expected a number, got 'soon'"):
        config.load(Settings, env_prefix="TP", environ={"TP_INTERVAL_S": "soon"})


def test_missing_file_is_fine_unless_required(tmp_path):
    assert config.load(Settings, path=tmp_path / "absent.toml") == Settings()
    with pytest.raises(ConfigError, match="does not exist"):
        config.load(Settings, path=tmp_path / "absent.toml", required_file=True)
