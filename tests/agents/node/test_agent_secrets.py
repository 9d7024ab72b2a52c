"""Agents take their tokens from a file or the environment, not the command line."""

from __future__ import annotations

import pytest

from agents.__main__ import agent_secrets, main


def test_the_token_comes_from_the_environment():
    got = agent_secrets({}, {"BATON_AGENT_TOKEN": "bnt_env", "BATON_DATA_TOKEN": "d" * 24})
    assert got == {"token": "bnt_env", "data_token": "d" * 24}


def test_a_token_file_wins_over_the_environment_and_is_stripped(tmp_path):
    path = tmp_path / "token"
    path.write_text("bnt_file\n")
    flags = {"token_file": str(path)}
    got = agent_secrets(flags, {"BATON_AGENT_TOKEN": "bnt_env"})
    assert got["token"] == "bnt_file"
    assert "token_file" not in flags
    env_file = agent_secrets({}, {"BATON_AGENT_TOKEN_FILE": str(path)})
    assert env_file["token"] == "bnt_file"


def test_the_data_token_can_come_from_a_file(tmp_path):
    path = tmp_path / "data"
    path.write_text("x" * 32)
    assert agent_secrets({"data_token_file": str(path)}, {})["data_token"] == "x" * 32
    assert agent_secrets({}, {"BATON_DATA_TOKEN_FILE": str(path)})["data_token"] == "x" * 32


def test_the_command_line_token_still_works_with_a_warning(capsys):
    assert agent_secrets({"token": "bnt_cli"}, {})["token"] == "bnt_cli"
    assert "ps" in capsys.readouterr().err


@pytest.mark.parametrize("content", [None, ""])
def test_a_missing_or_empty_token_file_is_a_one_line_error(tmp_path, capsys, content):
    path = tmp_path / "token"
    if content is not None:
        path.write_text(content)
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--control-plane", "http://127.0.0.1:1", "--token-file", str(path)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "agent token file" in err and str(path) in err


def test_nothing_set_leaves_the_token_to_the_config_file():
    assert agent_secrets({}, {}) == {"token": None, "data_token": None}
