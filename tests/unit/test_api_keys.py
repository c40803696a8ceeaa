"""`tandem api-keys --new FILE --name NAME`: a keys file the gateway reads, made and added to."""

import json
import stat

import pytest

from services.gateway.clients import ClientKeys, ClientPolicy, Unauthenticated
from shared.cli.api_keys import first_key
from shared.cli.client import key_metadata
from shared.cli.main import main


def _new(path, name: str, capsys) -> tuple[int, str, str]:
    code = main(["api-keys", "--new", str(path), "--name", name])
    out, err = capsys.readouterr()
    return code, out.strip(), err


def _identify(path, key: str) -> str:
    keys = ClientKeys.load(str(path), ClientPolicy())
    return keys.identify([("authorization", f"Bearer {key}")], "", "10.0.0.1").name


def test_a_new_keys_file_is_private_and_its_key_opens_the_gateway(tmp_path, capsys):
    path = tmp_path / "keys.json"
    code, key, err = _new(path, "team-a", capsys)
    assert code == 0 and len(key) >= 43 and "not shown again" in err and key not in err
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert json.loads(path.read_text()) == {"clients": [{"name": "team-a", "key": key}]}
    assert _identify(path, key) == "key:team-a"
    with pytest.raises(Unauthenticated):
        _identify(path, "x" * 43)
    assert first_key(str(path)) == key


def test_a_second_key_is_added_beside_the_first(tmp_path, capsys):
    path = tmp_path / "keys.json"
    _, first, _ = _new(path, "team-a", capsys)
    path.chmod(0o644)  # made readable by everyone: added to, it is no longer
    code, second, _ = _new(path, "team-b", capsys)
    assert code == 0 and second != first
    assert [_identify(path, first), _identify(path, second)] == ["key:team-a", "key:team-b"]
    assert stat.S_IMODE(path.stat().st_mode) == 0o640
    assert first_key(str(path)) == first
    assert [p.name for p in tmp_path.iterdir()] == ["keys.json"]  # no temporary file left


@pytest.mark.parametrize("name", ["team-a", "", "a b", "x" * 65, "ünï"])
def test_a_name_taken_or_malformed_is_refused_and_the_file_kept(tmp_path, capsys, name):
    path = tmp_path / "keys.json"
    _new(path, "team-a", capsys)
    before = path.read_text()
    code, out, err = _new(path, name, capsys)
    assert code == 1 and out == "" and "error:" in err
    assert path.read_text() == before


def test_a_file_of_another_shape_is_refused_not_overwritten(tmp_path, capsys):
    path = tmp_path / "keys.json"
    for text in ("not json", '{"clients": {"a": 1}}', '[{"name": "a", "key": "b"}]'):
        path.write_text(text)
        code, _, err = _new(path, "team-a", capsys)
        assert code == 1 and str(path) in err and path.read_text() == text


def test_first_key_of_an_empty_file_says_how_to_make_one(tmp_path):
    path = tmp_path / "keys.json"
    path.write_text('{"clients": []}')
    with pytest.raises(ValueError, match="tandem api-keys --new"):
        first_key(str(path))


@pytest.mark.parametrize("content", [None, '{"clients": []}', "{"])
def test_tandem_up_refuses_a_keys_file_it_cannot_use_before_starting_anything(
    tmp_path, capsys, content
):
    path = tmp_path / "keys.json"
    if content is not None:
        path.write_text(content)
    socket = tmp_path / "control.sock"
    argv = ["up", "--api-keys-file", str(path), "--control-socket", str(socket)]
    assert main(argv) == 2
    assert "error: --api-keys-file:" in capsys.readouterr().err
    assert not socket.exists()


def test_the_command_line_clients_send_the_key_from_the_environment(monkeypatch):
    """`tandem generate`, `status` and `scale --wait` read TANDEM_API_KEY (never a flag: ps)."""
    monkeypatch.delenv("TANDEM_API_KEY", raising=False)
    assert key_metadata() == ()
    monkeypatch.setenv("TANDEM_API_KEY", "k" * 43)
    assert key_metadata() == (("authorization", "Bearer " + "k" * 43),)
    assert key_metadata("") == ()  # the launcher's, without a keys file: none
