"""The command line: settings errors, request errors and engine failures give clear exits."""

from __future__ import annotations

import pytest

from inference_server.__main__ import main


def test_invalid_setting_flag_exits_2_naming_the_setting(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "hi", "--device", "tpu"]) == 2
    assert "DEVICE='tpu' is invalid: accepted values are auto, cuda, mps, cpu" in capsys.readouterr().err


def test_invalid_sampling_flag_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "hi", "--temperature", "-1", "--model", "gemma-4-31b-tiny"]) == 2
    assert "temperature" in capsys.readouterr().err


def test_preset_without_dummy_weights_is_a_settings_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "hi", "--model", "gemma-4-31b-tiny", "--device", "cpu"]) == 2
    assert "presets need DUMMY_WEIGHTS=true" in capsys.readouterr().err


def test_text_prompt_on_a_model_without_tokenizer_reports_the_request_error(
        capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["generate", "hi", "--model", "gemma-4-31b-tiny", "--dummy-weights", "--device", "cpu",
                 "--kv-cache-tokens", "1024"])
    assert code == 1
    assert "this model has no tokenizer" in capsys.readouterr().err


def test_engine_failure_exits_1(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from inference_server import offline

    def crash(self, *args, **kwargs):
        raise ExceptionGroup("engine", [RuntimeError("injected actor crash")])

    monkeypatch.setattr(offline.LLM, "generate", crash)
    code = main(["generate", "hi", "--model", "gemma-4-31b-tiny", "--dummy-weights", "--device", "cpu",
                 "--kv-cache-tokens", "1024"])
    assert code == 1
    assert "the engine failed: RuntimeError('injected actor crash')" in capsys.readouterr().err


def test_an_invalid_faults_flag_stops_serve_before_anything_loads(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--faults", "step_error=0.1,alloc_refuse"]) == 2
    assert "FAULTS='step_error=0.1,alloc_refuse' is invalid: item 'alloc_refuse' is not name=value" \
        in capsys.readouterr().err


def test_ctrl_c_during_generate_exits_130(monkeypatch: pytest.MonkeyPatch) -> None:
    from inference_server import offline

    def interrupted(self, *args, **kwargs):
        raise KeyboardInterrupt  # what LLM.generate raises on Ctrl-C

    monkeypatch.setattr(offline.LLM, "generate", interrupted)
    assert main(["generate", "hi", "--model", "gemma-4-31b-tiny", "--dummy-weights", "--device", "cpu",
                 "--kv-cache-tokens", "1024"]) == 130
