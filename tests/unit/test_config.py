"""The settings table: every KILN_* variable, its parsing, its refusals, its docs."""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import fields
from pathlib import Path

import pytest

import kiln
from kiln import config
from kiln.api import create_app
from kiln.config import VARIABLES, Settings, Variable
from kiln.config_values import text_of
from kiln.errors import ConfigError, KilnError

ROOT = Path(__file__).resolve().parents[2]
#: The parsers that take any text but blanks: no value of theirs is refused.
FREE_TEXT = (
    "some text",
    "some text (whsec_ followed by base64, or any other text)",
    "a path",
    "comma-separated names",
    "a key of printable characters without spaces",
)
#: A unit and the suffix a variable's name ends with when it has that unit.
UNIT_SUFFIXES = {
    "s": "_S",
    "bytes": "_BYTES",
    "per s": "_PER_S",
    "steps": "_STEPS",
    "pixels": "_PIXELS",
}
#: The README shows these groups; docs/configuration.md shows them all.
README_GROUPS = (config.DATA, config.API, config.RETRIES)

refusable = [var for var in VARIABLES if var.parse.expected not in FREE_TEXT]
with_default = [var for var in VARIABLES if text_of(var.default) != "unset"]
renamed = [var for var in VARIABLES if var.old]


def _ids(var: Variable) -> str:
    return var.name


# the table


def test_the_table_sets_every_settings_field_once() -> None:
    assert sorted(var.field for var in VARIABLES) == sorted(f.name for f in fields(Settings))
    names = [var.name for var in VARIABLES] + [var.old for var in renamed]
    assert len(names) == len(set(names))
    assert all(re.fullmatch(r"KILN_[A-Z0-9_]+", str(name)) for name in names)


def test_an_empty_environment_gives_the_settings_defaults() -> None:
    assert Settings.from_env({}) == Settings()


@pytest.mark.parametrize("var", with_default, ids=_ids)
def test_every_variable_parses_its_default(var: Variable) -> None:
    # Given the default as the docs and `kiln settings` write it
    default = text_of(var.default)

    # When it is set to that text / Then it reads back as the default
    assert getattr(Settings.from_env({var.name: default}), var.field) == var.default


@pytest.mark.parametrize("var", VARIABLES, ids=_ids)
def test_every_name_carries_its_unit(var: Variable) -> None:
    if "a number of seconds" in var.parse.expected:
        assert var.unit == "s"
    suffix = UNIT_SUFFIXES.get(var.unit)
    if suffix is not None:
        assert var.name.endswith(suffix), f"{var.name} is in {var.unit} but does not say so"


def test_a_value_of_blanks_is_unset() -> None:
    assert Settings.from_env({"KILN_LEASE_TTL_S": "  ", "KILN_PORT": ""}) == Settings()


# refusals


@pytest.mark.parametrize("var", refusable, ids=_ids)
def test_a_bad_value_is_a_config_error_naming_the_variable(var: Variable) -> None:
    # Given a value no parser of the table takes
    with pytest.raises(ConfigError) as refused:
        Settings.from_env({var.name: "bad"})

    # Then the error names the variable, its value and what it should be, on one line
    shown = "(hidden)" if var.secret else "'bad'"
    assert refused.value.message.startswith(f"{var.name}={shown}: expected {var.parse.expected}")
    assert "\n" not in refused.value.message
    assert refused.value.variable == var.name
    assert refused.value.code == "config_error"
    assert isinstance(refused.value, KilnError)


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"KILN_LEASE_TTL_S": "abc"}, "KILN_LEASE_TTL_S='abc': expected a number of seconds > 0"),
        ({"KILN_LEASE_TTL": "0"}, "KILN_LEASE_TTL='0': expected a number of seconds > 0"),
        ({"KILN_PORT": "80.5"}, "KILN_PORT='80.5': expected a port number >= 0 and <= 65535"),
        ({"KILN_PORT": "+80"}, "KILN_PORT='+80': expected a port number >= 0 and <= 65535"),
        ({"KILN_PORT": "80.0"}, "KILN_PORT='80.0': expected a port number >= 0 and <= 65535"),
        ({"KILN_METRICS_PORT": "8e1"}, "KILN_METRICS_PORT='8e1': expected a port number >= 0 "
         "and <= 65535"),
        ({"KILN_OUTPUT_URLS": "redirect"}, "KILN_OUTPUT_URLS='redirect': expected proxy or "
         "presigned"),
        ({"KILN_PRESIGN_TTL_S": "604801"}, "KILN_PRESIGN_TTL_S='604801': expected a number of "
         "seconds > 0 and <= 604800"),
        ({"KILN_RECONCILE_INTERVAL_S": "-1"}, "KILN_RECONCILE_INTERVAL_S='-1': expected a "
         "number of seconds >= 0 (0: off)"),
        ({"KILN_LOG_LEVEL": "loud"}, "KILN_LOG_LEVEL='loud': expected DEBUG, INFO, WARNING, "
         "WARN, ERROR or CRITICAL"),
        ({"KILN_RETENTION_TENANTS": "acme"}, "KILN_RETENTION_TENANTS='acme': expected "
         "tenant:seconds pairs, comma-separated (entry 'acme' is not of that form)"),
        ({"KILN_BREAKER_POLICY": "a=retry"}, "KILN_BREAKER_POLICY='a=retry': expected "
         "kind=pause or kind=fail_fast, comma-separated (entry 'a=retry' names no policy)"),
        ({"KILN_GENERATE_MEMORY": "gpu-mem:4+2"}, "KILN_GENERATE_MEMORY='gpu-mem:4+2': "
         "expected pool:base or pool:base+per/mpx, in GiB (the per-picture part must end in "
         "/mpx)"),
        ({"KILN_GENERATE_MEMORY": "gpu-mem:-1"}, "KILN_GENERATE_MEMORY='gpu-mem:-1': "
         "expected pool:base or pool:base+per/mpx, in GiB (amounts must be finite and not "
         "negative)"),
    ],
)  # fmt: skip
def test_the_refusal_says_what_the_value_should_be(env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError) as refused:
        Settings.from_env(env)
    assert refused.value.message == message


def test_a_refused_secret_is_never_repeated() -> None:
    with pytest.raises(ConfigError) as refused:
        Settings.from_env({"KILN_API_KEYS": "acme:sekrit,admin:sekrit2"})
    assert refused.value.message == (
        "KILN_API_KEYS=(hidden): expected tenant:key pairs, comma-separated, tenant not "
        "`admin` ('admin' is a reserved tenant)"
    )


def test_whole_numbers_may_be_written_as_floats_but_not_as_fractions() -> None:
    assert Settings.from_env({"KILN_MAX_BODY_BYTES": "2e6"}).max_body_bytes == 2_000_000
    with pytest.raises(ConfigError, match="expected a whole number >= 1"):
        Settings.from_env({"KILN_MAX_BODY_BYTES": "1.5"})


# renamed variables


@pytest.mark.parametrize("var", renamed, ids=_ids)
def test_an_old_name_still_works_and_logs_one_deprecation_line(
    var: Variable, caplog: pytest.LogCaptureFixture
) -> None:
    # Given a value only the new name was read with so far
    value = _a_good_value(var)
    expected = getattr(Settings.from_env({var.name: value}), var.field)
    assert not _deprecations(caplog)

    # When it is set under the old name
    settings = Settings.from_env({str(var.old): value})

    # Then it is read the same, and one line names the old and the new name
    assert getattr(settings, var.field) == expected != var.default
    [line] = _deprecations(caplog)
    assert str(var.old) in line and var.name in line


def test_the_new_name_wins_over_the_old_one(caplog: pytest.LogCaptureFixture) -> None:
    settings = Settings.from_env({"KILN_LEASE_TTL_S": "5", "KILN_LEASE_TTL": "7"})
    assert settings.lease_ttl_s == 5.0
    assert not _deprecations(caplog)


def _a_good_value(var: Variable) -> str:
    samples = {"KILN_TENANT_RATE_PER_S": "5/20", "KILN_DIFFUSERS_PREVIEW_EVERY_STEPS": "3"}
    return samples.get(var.name, "7")


def _deprecations(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "kiln.config"]


# reading


class _RecordingEnv(Mapping[str, str]):
    """An empty environment that remembers the names looked up in it."""

    def __init__(self) -> None:
        self.names: set[str] = set()

    def __getitem__(self, name: str) -> str:
        self.names.add(name)
        raise KeyError(name)

    def __iter__(self) -> Iterator[str]:
        return iter(())

    def __len__(self) -> int:
        return 0


def test_only_reads_just_the_named_fields() -> None:
    env = _RecordingEnv()
    Settings.from_env(env, only=("server", "api_key"))
    assert env.names == {"KILN_SERVER", "KILN_API_KEY"}


def test_every_variable_and_old_name_is_looked_up() -> None:
    env = _RecordingEnv()
    Settings.from_env(env)
    assert env.names == {var.name for var in VARIABLES} | {str(var.old) for var in renamed}


def test_secrets_stay_out_of_repr_and_the_shown_values() -> None:
    settings = Settings.from_env(
        {"KILN_ADMIN_KEY": "adm1n", "KILN_DATABASE_URL": "postgresql://kiln:pw@db/kiln"}
    )
    assert "adm1n" not in repr(settings)
    assert config.variable("admin_key").shown_value(settings.admin_key) == "(set)"
    shown = config.variable("database_url").shown_value(settings.database_url)
    assert shown == "postgresql://kiln:***@db/kiln"


def test_outputs_are_proxied_for_fifteen_minutes_unless_configured() -> None:
    settings = Settings.from_env({"KILN_OUTPUT_URLS": "Presigned", "KILN_PRESIGN_TTL_S": "60"})
    assert (settings.output_urls, settings.presign_ttl_s) == ("presigned", 60.0)
    assert (Settings().output_urls, Settings().presign_ttl_s) == ("proxy", 900.0)


def test_the_api_refuses_to_start_with_an_unknown_output_url_mode(settings: Settings) -> None:
    with pytest.raises(ValueError, match="KILN_OUTPUT_URLS must be proxy or presigned"):
        create_app(kiln.App(settings=settings.with_(output_urls="redirect")))


# docs


def _block(path: Path) -> str:
    text = path.read_text()
    match = re.search(r"<!-- settings:start -->\n(.*?)<!-- settings:end -->", text, re.S)
    assert match is not None, f"{path.name} has no settings block"
    return match[1]


def test_the_configuration_doc_is_the_table() -> None:
    assert _block(ROOT / "docs" / "configuration.md") == config.markdown(), (
        "docs/configuration.md is stale: paste `kiln settings --markdown` between its markers"
    )


def test_the_readme_shows_the_main_groups_of_the_table() -> None:
    assert _block(ROOT / "README.md") == config.markdown(README_GROUPS), (
        "README.md is stale: regenerate its block with kiln.config.markdown(README_GROUPS)"
    )
