"""Settings: precedence, validation messages, and .env.example kept in sync with the code."""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest

from inference_server.config import Settings, SettingsError, env_name, load_settings

REPO = Path(__file__).resolve().parents[1]


def test_defaults_without_any_source() -> None:
    assert load_settings(environ={}, dotenv_path=None) == Settings()


def test_precedence_dotenv_then_environment_then_overrides(tmp_path: Path) -> None:
    dotenv = tmp_path / ".env"
    dotenv.write_text("MAX_BATCH_SIZE=8\nPORT=9000\nDTYPE=float16\n")
    settings = load_settings(overrides={"PORT": "9100"}, environ={"MAX_BATCH_SIZE": "16"}, dotenv_path=dotenv)
    assert (settings.max_batch_size, settings.port, settings.dtype) == (16, 9100, "float16")


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("DEVICE", "tpu", "DEVICE='tpu' is invalid: accepted values are auto, cuda, mps, cpu"),
        ("PREFILL_MODE", "eager", "accepted values are monolithic, chunked, batched"),
        ("MAX_BATCH_SIZE", "0", "MAX_BATCH_SIZE='0' is invalid: must be >= 1"),
        ("MAX_BATCH_SIZE", "many", "expected an integer"),
        ("DUMMY_WEIGHTS", "maybe", "expected true or false"),
        ("ADMISSION_TIMEOUT", "nan", "expected a finite number"),
        ("QUANTIZATION", "int4", "QUANTIZATION='int4' is invalid: accepted values are auto, none, int8"),
        ("INT8_EMBEDDINGS", "yes", "INT8_EMBEDDINGS='yes' is invalid: accepted values are auto, on, off"),
    ],
)
def test_invalid_values_name_the_setting_and_accepted_values(key: str, value: str, message: str) -> None:
    with pytest.raises(SettingsError, match=message.replace("(", r"\(")):
        load_settings(environ={key: value}, dotenv_path=None)


def test_unknown_override_is_rejected() -> None:
    with pytest.raises(SettingsError, match="unknown setting"):
        load_settings(overrides={"MAX_BATCHSIZE": "3"}, environ={}, dotenv_path=None)


def test_a_dotenv_setting_in_another_case_is_an_error_other_keys_are_ignored(tmp_path: Path) -> None:
    """``max_batch_size=5`` in ``.env`` was ignored silently (names are case-sensitive): it names the setting's
    real spelling instead; a key that is no setting (another program's variable) stays ignored."""
    dotenv = tmp_path / ".env"
    dotenv.write_text("HF_TOKEN=x\nmax_batch_size=5\nPort=9000\n")
    with pytest.raises(SettingsError, match=r"Port, max_batch_size would be ignored.*\(PORT, MAX_BATCH_SIZE\)"):
        load_settings(environ={}, dotenv_path=dotenv)
    dotenv.write_text("HF_TOKEN=x\nMAX_BATCH_SIZE=5\n")
    assert load_settings(environ={}, dotenv_path=dotenv).max_batch_size == 5


def settings_help() -> list[tuple[str, str, str]]:
    """(environment name, default, help) for every setting, in declaration order: what .env.example documents."""
    rows = []
    for field in attrs.fields(Settings):
        help_text = field.metadata["help"]
        if field.metadata["choices"]:
            help_text += f" One of: {', '.join(field.metadata['choices'])}."
        default = field.default
        rows.append((env_name(field), str(default).lower() if isinstance(default, bool) else str(default),
                     help_text))
    return rows


def test_env_example_documents_every_setting_with_its_default() -> None:
    text = (REPO / ".env.example").read_text()
    for name, default, _ in settings_help():
        assert f"\n{name}={default}\n" in text, name
    documented = {line.split("=")[0] for line in text.splitlines() if line and not line.startswith("#")}
    assert documented == {name for name, _, _ in settings_help()}
